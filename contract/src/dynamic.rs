//! `DynModel`: the contract with handles instead of owned KV values, object safe.
//!
//! [`KvModel`] has an associated `Kv` type, so code that picks a backend at run time (JNI, the
//! CLI, fuzzers) cannot hold "some `KvModel`" directly. [`Session`] wraps any `KvModel` with a
//! [`HandleTable`] of its KV states and implements [`DynModel`], which is object safe:
//! `Box<dyn DynModel>` serves every backend through `u64` handles.

use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::handles::HandleTable;
use crate::model::{KvModel, Logits, Next};

/// The [`KvModel`] contract over `u64` KV handles; see [`crate::handles`] for what makes a
/// handle invalid and for the locking.
///
/// Calls on distinct handles may run in parallel from any thread; calls on one handle are
/// serialised. After [`DynModel::close`] every call fails with [`Error::Closed`].
pub trait DynModel: Send + Sync {
    /// The config the model was loaded with.
    fn config(&self) -> &ModelConfig;

    /// Short backend name (`reference`, `iree-cpu`, ...).
    fn backend(&self) -> &'static str;

    /// [`KvModel::prefill`]; returns the new state's handle.
    fn prefill(&self, ids: &[u32], logits: Logits) -> Result<(u64, Next)>;

    /// [`KvModel::prefill_embeddings`]; returns the new state's handle.
    fn prefill_embeddings(
        &self,
        ids: &[u32],
        embeddings: &[f32],
        logits: Logits,
    ) -> Result<(u64, Next)>;

    /// [`KvModel::extend`] on the state of `kv`.
    fn extend(&self, kv: u64, ids: &[u32], logits: Logits) -> Result<Next>;

    /// [`KvModel::step`] on the state of `kv`.
    fn step(&self, kv: u64, id: u32, logits: Logits) -> Result<Next>;

    /// [`KvModel::snapshot`]; returns the copy's handle.
    fn snapshot(&self, kv: u64) -> Result<u64>;

    /// [`KvModel::release`]; `kv` is stale afterwards, even when the backend reports a failure
    /// to free.
    fn release(&self, kv: u64) -> Result<()>;

    /// [`KvModel::len`] of the state of `kv`.
    fn len(&self, kv: u64) -> Result<usize>;

    /// [`KvModel::kv_bytes`] of the state of `kv`.
    fn kv_bytes(&self, kv: u64) -> Result<u64>;

    /// Number of live KV states.
    fn live(&self) -> usize;

    /// Releases every live state and refuses every later call. Closing twice is a no-op.
    /// Returns the first failure to free a state, after trying all of them.
    fn close(&self) -> Result<()>;
}

/// A [`KvModel`] with a handle table of its KV states: the generic [`DynModel`].
pub struct Session<M: KvModel> {
    model: Arc<M>,
    states: HandleTable<M::Kv>,
}

impl<M: KvModel> Session<M> {
    /// Serves `model` through handles.
    pub fn new(model: M) -> Self {
        Self::from_arc(Arc::new(model))
    }

    /// Serves a shared `model` through handles (the caller may keep using it directly).
    pub fn from_arc(model: Arc<M>) -> Self {
        Session {
            model,
            states: HandleTable::new(),
        }
    }

    /// The wrapped model.
    pub fn model(&self) -> &Arc<M> {
        &self.model
    }

    /// Stores a state produced outside the session (e.g. by [`Session::model`]) and returns
    /// its handle.
    pub fn adopt(&self, kv: M::Kv) -> Result<u64> {
        self.states.insert("adopt", kv)
    }
}

impl<M: KvModel> DynModel for Session<M> {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn backend(&self) -> &'static str {
        self.model.backend()
    }

    fn prefill(&self, ids: &[u32], logits: Logits) -> Result<(u64, Next)> {
        if self.states.is_closed() {
            return Err(Error::Closed { op: "prefill" });
        }
        let (kv, next) = self.model.prefill(ids, logits)?;
        Ok((self.states.insert("prefill", kv)?, next))
    }

    fn prefill_embeddings(
        &self,
        ids: &[u32],
        embeddings: &[f32],
        logits: Logits,
    ) -> Result<(u64, Next)> {
        if self.states.is_closed() {
            return Err(Error::Closed {
                op: "prefill_embeddings",
            });
        }
        let (kv, next) = self.model.prefill_embeddings(ids, embeddings, logits)?;
        Ok((self.states.insert("prefill_embeddings", kv)?, next))
    }

    fn extend(&self, kv: u64, ids: &[u32], logits: Logits) -> Result<Next> {
        self.states
            .with_mut("extend", kv, |s| self.model.extend(s, ids, logits))
    }

    fn step(&self, kv: u64, id: u32, logits: Logits) -> Result<Next> {
        self.states
            .with_mut("step", kv, |s| self.model.step(s, id, logits))
    }

    fn snapshot(&self, kv: u64) -> Result<u64> {
        let copy = self
            .states
            .with_ref("snapshot", kv, |s| self.model.snapshot(s))?;
        self.states.insert("snapshot", copy)
    }

    fn release(&self, kv: u64) -> Result<()> {
        let state = self.states.remove("release", kv)?;
        self.model.release(state)
    }

    fn len(&self, kv: u64) -> Result<usize> {
        self.states.with_ref("len", kv, |s| Ok(self.model.len(s)))
    }

    fn kv_bytes(&self, kv: u64) -> Result<u64> {
        self.states
            .with_ref("kv_bytes", kv, |s| Ok(self.model.kv_bytes(s)))
    }

    fn live(&self) -> usize {
        self.states.live()
    }

    fn close(&self) -> Result<()> {
        let mut first_failure = None;
        for state in self.states.close() {
            if let Err(e) = self.model.release(state) {
                first_failure.get_or_insert(e);
            }
        }
        first_failure.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handles::reason;
    use crate::model::check;

    /// A model whose "KV" is the token list and whose next token is the sum of the tokens
    /// modulo the vocab: enough to check the plumbing exactly.
    struct Sum {
        cfg: ModelConfig,
    }

    impl Sum {
        fn new() -> Self {
            let json = r#"{"model_type": "gemma3_text", "hidden_size": 4, "num_hidden_layers": 2,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2,
                "intermediate_size": 8, "vocab_size": 10, "sliding_window": 3,
                "max_position_embeddings": 16,
                "layer_types": ["sliding_attention", "full_attention"]}"#;
            let cfg = ModelConfig::from_json(json, std::path::Path::new("config.json"))
                .expect("a valid config");
            Sum { cfg }
        }

        fn next(&self, kv: &[u32]) -> Next {
            Next {
                token: kv.iter().sum::<u32>() % self.cfg.vocab_size as u32,
                logits: None,
            }
        }
    }

    impl KvModel for Sum {
        type Kv = Vec<u32>;

        fn config(&self) -> &ModelConfig {
            &self.cfg
        }

        fn backend(&self) -> &'static str {
            "sum"
        }

        fn prefill(&self, ids: &[u32], _: Logits) -> Result<(Vec<u32>, Next)> {
            check::tokens(&self.cfg, "prefill", 0, ids)?;
            Ok((ids.to_vec(), self.next(ids)))
        }

        fn extend(&self, kv: &mut Vec<u32>, ids: &[u32], _: Logits) -> Result<Next> {
            check::tokens(&self.cfg, "extend", kv.len(), ids)?;
            kv.extend_from_slice(ids);
            Ok(self.next(kv))
        }

        fn snapshot(&self, kv: &Vec<u32>) -> Result<Vec<u32>> {
            Ok(kv.clone())
        }

        fn len(&self, kv: &Vec<u32>) -> usize {
            kv.len()
        }
    }

    #[test]
    fn session_serves_the_contract_through_handles() {
        let m: Box<dyn DynModel> = Box::new(Session::new(Sum::new()));
        let (a, next) = m.prefill(&[1, 2, 3], Logits::Skip).unwrap();
        assert_eq!(next.token, 6);
        let b = m.snapshot(a).unwrap();
        assert_eq!(m.step(a, 5, Logits::Skip).unwrap().token, 1);
        assert_eq!(m.extend(b, &[1, 1], Logits::Skip).unwrap().token, 8);
        assert_eq!((m.len(a).unwrap(), m.len(b).unwrap()), (4, 5));
        assert_eq!(m.live(), 2);
        m.release(a).unwrap();
        assert!(matches!(
            m.release(a),
            Err(Error::StaleHandle {
                reason: reason::RELEASED,
                ..
            })
        ));
        assert_eq!(m.live(), 1);
    }

    #[test]
    fn input_errors_leave_the_state_usable() {
        let m = Session::new(Sum::new());
        let (h, _) = m.prefill(&[1], Logits::Skip).unwrap();
        assert!(matches!(
            m.step(h, 10, Logits::Skip),
            Err(Error::TokenOutOfRange { token: 10, .. })
        ));
        assert!(matches!(
            m.extend(h, &[1; 16], Logits::Skip),
            Err(Error::ContextOverflow { have: 1, .. })
        ));
        assert!(matches!(
            m.prefill_embeddings(&[1], &[0.0; 4], Logits::Skip),
            Err(Error::Unsupported { backend: "sum", .. })
        ));
        assert_eq!(m.step(h, 2, Logits::Skip).unwrap().token, 3);
    }

    #[test]
    fn states_of_two_sessions_do_not_mix() {
        let (m1, m2) = (Session::new(Sum::new()), Session::new(Sum::new()));
        let (h1, _) = m1.prefill(&[1], Logits::Skip).unwrap();
        assert!(matches!(
            m2.step(h1, 1, Logits::Skip),
            Err(Error::StaleHandle {
                reason: reason::FOREIGN,
                ..
            })
        ));
    }

    #[test]
    fn close_frees_every_state_and_refuses_later_calls() {
        let m = Session::new(Sum::new());
        let (h, _) = m.prefill(&[1], Logits::Skip).unwrap();
        m.snapshot(h).unwrap();
        m.close().unwrap();
        assert_eq!(m.live(), 0);
        assert!(matches!(
            m.step(h, 1, Logits::Skip),
            Err(Error::Closed { op: "step" })
        ));
        assert!(matches!(
            m.prefill(&[1], Logits::Skip),
            Err(Error::Closed { op: "prefill" })
        ));
        m.close().unwrap();
    }
}
