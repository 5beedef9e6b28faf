//! The `KvModel` trait: the stateful KV contract every backend implements.

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// Whether an operation should also return the last position's logits.
///
/// The device path asks for [`Logits::Skip`]: only the argmax token leaves the backend. Parity
/// checks and samplers ask for [`Logits::Return`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Logits {
    #[default]
    Skip,
    Return,
}

/// The outcome of a prefill, extend or step: the greedy next token, and the logits that
/// predicted it when asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Next {
    /// Argmax of the last position's logits (the lowest id wins a tie).
    pub token: u32,
    /// `[vocab]` logits of the last position, present iff [`Logits::Return`] was asked for.
    pub logits: Option<Vec<f32>>,
}

/// A model that keeps per-sequence KV state between calls.
///
/// # The contract
/// - `prefill(ids)` runs a fresh sequence and returns its KV state with the next token.
/// - `prefill_embeddings(ids, rows)` is the same with the raw (unscaled) embedding rows gathered
///   on the host, `[ids.len(), hidden]` row-major; the backend applies the `sqrt(hidden)` scale.
///   `ids` give the sequence length and are validated like any other input.
/// - `extend(kv, ids)` appends several tokens; `step(kv, id)` appends one.
/// - `snapshot(kv)` returns an independent copy: operations on either never change the other.
/// - `release(kv)` frees the state. Dropping a `Kv` frees it too; `release` exists so that a
///   backend can report a failure to free (and so FFI layers have an explicit call).
///
/// Every operation returns the next greedy token of the last position, and that position's
/// logits on request. Only the last position's logits are ever computed: no graph materialises
/// `seq x vocab`.
///
/// Inputs are checked before anything changes: an operation that returns an input error (token
/// out of range, empty input, context overflow, wrong shape, non-finite embeddings) leaves `kv`
/// exactly as it was. Any other error (a device failure) may strike midway and leave `kv` half
/// updated: it is not restored, only fit to be released. [`crate::Session`] marks such a state
/// poisoned, so every later call on its handle fails with [`Error::Poisoned`]
/// (docs/RELIABILITY.md).
///
/// `Kv` is owned and backend-specific, so using a released state is a compile error in Rust;
/// FFI layers keep states in a handle table and turn stale handles into
/// [`Error::StaleHandle`].
///
/// Optional capabilities have default bodies that return [`Error::Unsupported`].
pub trait KvModel: Send + Sync {
    /// Per-sequence KV state.
    type Kv: Send;

    /// The config the model was loaded with.
    fn config(&self) -> &ModelConfig;

    /// Short backend name for messages (`reference`, `iree-cpu`, ...).
    fn backend(&self) -> &'static str;

    /// Runs `ids` as a fresh sequence.
    fn prefill(&self, ids: &[u32], logits: Logits) -> Result<(Self::Kv, Next)>;

    /// Runs a fresh sequence from host-gathered raw embedding rows `[ids.len(), hidden]`.
    fn prefill_embeddings(
        &self,
        ids: &[u32],
        embeddings: &[f32],
        logits: Logits,
    ) -> Result<(Self::Kv, Next)> {
        let _ = (ids, embeddings, logits);
        Err(Error::Unsupported {
            backend: self.backend(),
            op: "prefill_embeddings",
        })
    }

    /// Appends `ids` to the sequence.
    fn extend(&self, kv: &mut Self::Kv, ids: &[u32], logits: Logits) -> Result<Next>;

    /// Appends one token.
    fn step(&self, kv: &mut Self::Kv, id: u32, logits: Logits) -> Result<Next> {
        self.extend(kv, &[id], logits)
    }

    /// Greedy-decodes `steps` tokens: appends `id`, then each token the step before returned,
    /// and returns the `steps` tokens in order: what `steps` calls of [`KvModel::step`] return,
    /// each fed the previous one's token (`kv` grows by `steps`; the last token is not
    /// appended). A backend may run the steps without a round trip to the host between them.
    ///
    /// Errors: as [`KvModel::step`] for `id`, [`Error::EmptyInput`] for no steps,
    /// [`Error::ContextOverflow`] where the steps do not fit, all before anything changes.
    fn decode(&self, kv: &mut Self::Kv, id: u32, steps: usize) -> Result<Vec<u32>> {
        decode_by_steps(self, kv, id, steps)
    }

    /// An independent copy of `kv`.
    fn snapshot(&self, kv: &Self::Kv) -> Result<Self::Kv>;

    /// Frees `kv`.
    fn release(&self, kv: Self::Kv) -> Result<()> {
        drop(kv);
        Ok(())
    }

    /// Number of tokens cached in `kv`.
    fn len(&self, kv: &Self::Kv) -> usize;

    /// Bytes of memory `kv` holds.
    fn kv_bytes(&self, kv: &Self::Kv) -> u64 {
        self.config().kv_bytes(self.len(kv))
    }
}

/// [`KvModel::decode`] as a loop of [`KvModel::step`], after [`check::decode`]: the trait's
/// default, for a backend that runs its own decode on some targets only.
pub fn decode_by_steps<M: KvModel + ?Sized>(
    model: &M,
    kv: &mut M::Kv,
    id: u32,
    steps: usize,
) -> Result<Vec<u32>> {
    check::decode(model.config(), model.len(kv), id, steps)?;
    let mut tokens = Vec::with_capacity(steps);
    let mut next = id;
    for _ in 0..steps {
        next = model.step(kv, next, Logits::Skip)?.token;
        tokens.push(next);
    }
    Ok(tokens)
}

/// Input checks shared by every backend, so that all of them reject the same inputs with the
/// same errors before touching any state.
pub mod check {
    use super::*;

    /// Checks `ids` are non-empty, in vocab range and fit after `have` cached tokens.
    pub fn tokens(cfg: &ModelConfig, op: &'static str, have: usize, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(Error::EmptyInput { op });
        }
        if let Some((index, &token)) = ids
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= cfg.vocab_size)
        {
            return Err(Error::TokenOutOfRange {
                op,
                token: token as i64,
                index,
                vocab: cfg.vocab_size,
            });
        }
        if have + ids.len() > cfg.context_capacity {
            return Err(Error::ContextOverflow {
                op,
                have,
                adding: ids.len(),
                capacity: cfg.context_capacity,
            });
        }
        Ok(())
    }

    /// Checks a greedy decode of `steps` steps from `id` after `have` cached tokens
    /// ([`KvModel::decode`]): `id` in vocab range, at least one step, and room for them all.
    pub fn decode(cfg: &ModelConfig, have: usize, id: u32, steps: usize) -> Result<()> {
        const OP: &str = "decode";
        tokens(cfg, OP, have, &[id])?;
        if steps == 0 {
            return Err(Error::EmptyInput { op: OP });
        }
        if have + steps > cfg.context_capacity {
            return Err(Error::ContextOverflow {
                op: OP,
                have,
                adding: steps,
                capacity: cfg.context_capacity,
            });
        }
        Ok(())
    }

    /// Checks raw embedding rows have shape `[n, hidden]` and are all finite.
    pub fn embeddings(cfg: &ModelConfig, op: &'static str, n: usize, rows: &[f32]) -> Result<()> {
        if rows.len() != n * cfg.hidden_size {
            let got = if rows.len().is_multiple_of(cfg.hidden_size) {
                vec![rows.len() / cfg.hidden_size, cfg.hidden_size]
            } else {
                vec![rows.len()]
            };
            return Err(Error::ShapeMismatch {
                op,
                what: "embeddings",
                expected: vec![n, cfg.hidden_size],
                got,
            });
        }
        if let Some((i, &value)) = rows.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::NonFinite {
                op,
                what: "embeddings",
                row: i / cfg.hidden_size,
                column: i % cfg.hidden_size,
                value,
            });
        }
        Ok(())
    }
}

/// Index of the largest value; the lowest index wins a tie, NaN never wins.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &v) in values.iter().enumerate() {
        if v > best_value {
            best = i;
            best_value = v;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_prefers_lowest_index_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN]), 1);
        assert_eq!(argmax(&[-5.0]), 0);
    }
}
