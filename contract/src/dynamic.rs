//! `DynModel`: the contract with handles instead of owned KV values, object safe.
//!
//! [`KvModel`] has an associated `Kv` type, so code that picks a backend at run time (JNI, the
//! CLI, fuzzers) cannot hold "some `KvModel`" directly. [`Session`] wraps any `KvModel` with a
//! [`HandleTable`] of its KV states and implements [`DynModel`], which is object safe:
//! `Box<dyn DynModel>` serves every backend through `u64` handles.
//!
//! # KV budget
//! A session counts the bytes of its live KV states ([`KvModel::kv_bytes`]) and may cap them
//! ([`Session::with_kv_budget`]). An operation that would go past the cap fails with
//! [`Error::KvBudget`] before it runs and changes nothing. The growth of an operation is
//! predicted before it runs: a new state of `n` tokens costs [`ModelConfig::kv_bytes`]`(n)`, an
//! extend the part of `ModelConfig::kv_bytes(len + n)` the state does not hold yet (0 for
//! backends that allocate the whole capacity up front), a snapshot the bytes of its source.
//! After the operation the count follows the state's real size. A new state that turns out
//! larger than predicted (a preallocating backend) is freed again when it does not fit; a grown
//! state cannot be shrunk back, so a backend whose states grow past the prediction may overshoot
//! the cap by one extend (the in-tree backends never do). Input errors take precedence over the
//! budget: the inputs are checked first.

use std::sync::{Arc, Mutex};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::handles::HandleTable;
use crate::model::{check, KvModel, Logits, Next};

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

    /// [`KvModel::decode`] on the state of `kv`.
    fn decode(&self, kv: u64, id: u32, steps: usize) -> Result<Vec<u32>>;

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

/// A [`KvModel`] with a handle table of its KV states: the generic [`DynModel`], with an
/// optional cap on the bytes of its live KV states (see the module documentation in `dynamic.rs`).
pub struct Session<M: KvModel> {
    model: Arc<M>,
    states: HandleTable<M::Kv>,
    budget: Budget,
}

/// Bytes of live KV states, reservations of operations in flight included, against a cap.
#[derive(Default)]
struct Budget(Mutex<Count>);

#[derive(Default)]
struct Count {
    live: u64,
    cap: Option<u64>,
}

impl Budget {
    fn lock(&self) -> std::sync::MutexGuard<'_, Count> {
        // Only arithmetic runs under this lock, so a poisoned lock still holds a consistent count.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts `adding` bytes, or fails with [`Error::KvBudget`] when they do not fit.
    fn reserve(&self, op: &'static str, adding: u64) -> Result<()> {
        let mut count = self.lock();
        if let Some(cap) = count.cap {
            if count.live.saturating_add(adding) > cap {
                return Err(Error::KvBudget {
                    op,
                    live: count.live,
                    adding,
                    cap,
                });
            }
        }
        count.live += adding;
        Ok(())
    }

    /// Replaces `counted` bytes by `actual` ones, whatever the cap (the memory exists).
    fn settle(&self, counted: u64, actual: u64) {
        let mut count = self.lock();
        count.live = (count.live + actual).saturating_sub(counted);
    }
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
            budget: Budget::default(),
        }
    }

    /// Caps the bytes of the live KV states at `cap`: an operation that would exceed it fails
    /// with [`Error::KvBudget`] and changes nothing.
    pub fn with_kv_budget(self, cap: u64) -> Self {
        self.set_kv_budget(Some(cap));
        self
    }

    /// Changes the cap at run time (e.g. lowered under memory pressure); `None` removes it. A cap
    /// below the live bytes frees nothing: it refuses growth until states are released.
    pub fn set_kv_budget(&self, cap: Option<u64>) {
        self.budget.lock().cap = cap;
    }

    /// The current cap, if any.
    pub fn kv_budget(&self) -> Option<u64> {
        self.budget.lock().cap
    }

    /// Bytes of the live KV states (and of operations in flight).
    pub fn live_kv_bytes(&self) -> u64 {
        self.budget.lock().live
    }

    /// The wrapped model.
    pub fn model(&self) -> &Arc<M> {
        &self.model
    }

    /// Stores a state produced outside the session (e.g. by [`Session::model`]) and returns
    /// its handle.
    ///
    /// # Errors
    /// [`Error::KvBudget`] when the state does not fit the budget (it is dropped).
    pub fn adopt(&self, kv: M::Kv) -> Result<u64> {
        let bytes = self.model.kv_bytes(&kv);
        self.budget.reserve("adopt", bytes)?;
        self.insert("adopt", kv, bytes)
    }

    /// Stores a new state whose `bytes` are already counted.
    fn insert(&self, op: &'static str, kv: M::Kv, bytes: u64) -> Result<u64> {
        self.states.insert(op, kv).inspect_err(|_| {
            // The table dropped the state it refused.
            self.budget.settle(bytes, 0);
        })
    }

    /// A new state from `make`, counted against the budget: `predicted` bytes are reserved
    /// before it runs; a state larger than predicted that does not fit is freed again.
    fn new_state(
        &self,
        op: &'static str,
        predicted: u64,
        make: impl FnOnce() -> Result<(M::Kv, Next)>,
    ) -> Result<(u64, Next)> {
        self.budget.reserve(op, predicted)?;
        let (kv, next) = make().inspect_err(|_| self.budget.settle(predicted, 0))?;
        let actual = self.model.kv_bytes(&kv);
        if actual > predicted {
            self.budget.settle(predicted, 0);
            if let Err(e) = self.budget.reserve(op, actual) {
                let _ = self.model.release(kv);
                return Err(e);
            }
        } else {
            self.budget.settle(predicted, actual);
        }
        Ok((self.insert(op, kv, actual)?, next))
    }

    /// Runs `f` (an extend of `ids`) on the state of `kv`, counting its growth.
    fn grow(
        &self,
        op: &'static str,
        kv: u64,
        ids: &[u32],
        f: impl FnOnce(&mut M::Kv) -> Result<Next>,
    ) -> Result<Next> {
        let cfg = self.model.config();
        self.grow_by(op, kv, ids.len(), |len| check::tokens(cfg, op, len, ids), f)
    }

    /// Runs `f`, which appends `n` tokens, on the state of `kv` once `check` (given the
    /// state's length) accepts them, counting its growth.
    fn grow_by<T>(
        &self,
        op: &'static str,
        kv: u64,
        n: usize,
        check: impl FnOnce(usize) -> Result<()>,
        f: impl FnOnce(&mut M::Kv) -> Result<T>,
    ) -> Result<T> {
        self.states.with_mut(op, kv, |s| {
            let len = self.model.len(s);
            check(len)?;
            let before = self.model.kv_bytes(s);
            let predicted = self.model.config().kv_bytes(len + n).saturating_sub(before);
            self.budget.reserve(op, predicted)?;
            // Settle on failure too: a failure midway may have grown the (now poisoned) state,
            // and its release uncounts what it holds then.
            let result = f(s);
            self.budget
                .settle(before + predicted, self.model.kv_bytes(s));
            result
        })
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
        let op = "prefill";
        if self.states.is_closed() {
            return Err(Error::Closed { op });
        }
        check::tokens(self.model.config(), op, 0, ids)?;
        let predicted = self.model.config().kv_bytes(ids.len());
        self.new_state(op, predicted, || self.model.prefill(ids, logits))
    }

    fn prefill_embeddings(
        &self,
        ids: &[u32],
        embeddings: &[f32],
        logits: Logits,
    ) -> Result<(u64, Next)> {
        let op = "prefill_embeddings";
        if self.states.is_closed() {
            return Err(Error::Closed { op });
        }
        check::tokens(self.model.config(), op, 0, ids)?;
        check::embeddings(self.model.config(), op, ids.len(), embeddings)?;
        let predicted = self.model.config().kv_bytes(ids.len());
        self.new_state(op, predicted, || {
            self.model.prefill_embeddings(ids, embeddings, logits)
        })
    }

    fn extend(&self, kv: u64, ids: &[u32], logits: Logits) -> Result<Next> {
        self.grow("extend", kv, ids, |s| self.model.extend(s, ids, logits))
    }

    fn step(&self, kv: u64, id: u32, logits: Logits) -> Result<Next> {
        self.grow("step", kv, &[id], |s| self.model.step(s, id, logits))
    }

    fn decode(&self, kv: u64, id: u32, steps: usize) -> Result<Vec<u32>> {
        let cfg = self.model.config();
        self.grow_by(
            "decode",
            kv,
            steps,
            |len| check::decode(cfg, len, id, steps),
            |s| self.model.decode(s, id, steps),
        )
    }

    fn snapshot(&self, kv: u64) -> Result<u64> {
        let op = "snapshot";
        let (copy, bytes) = self.states.with_ref(op, kv, |s| {
            let bytes = self.model.kv_bytes(s);
            self.budget.reserve(op, bytes)?;
            let copy = self
                .model
                .snapshot(s)
                .inspect_err(|_| self.budget.settle(bytes, 0))?;
            let actual = self.model.kv_bytes(&copy);
            self.budget.settle(bytes, actual);
            Ok((copy, actual))
        })?;
        self.insert(op, copy, bytes)
    }

    fn release(&self, kv: u64) -> Result<()> {
        let state = self.states.remove("release", kv)?;
        self.budget.settle(self.model.kv_bytes(&state), 0);
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
            self.budget.settle(self.model.kv_bytes(&state), 0);
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

    /// `decode` is a loop of steps, each fed the token before (the trait's default), and
    /// its input errors (bad id, no steps, no room, past the budget) change nothing.
    #[test]
    fn decode_feeds_each_token_to_the_next_step_and_refuses_bad_input_first() {
        let bytes = |n| Sum::new().cfg.kv_bytes(n);
        let m = Session::new(Sum::new()).with_kv_budget(bytes(8));
        let (h, first) = m.prefill(&[1, 2], Logits::Skip).unwrap();
        // Sums: [1, 2, 3] = 6, + 6 = 12 -> 2, + 2 = 14 -> 4.
        assert_eq!(m.decode(h, first.token, 3).unwrap(), vec![6, 2, 4]);
        assert_eq!(m.len(h).unwrap(), 5);
        assert_eq!(m.live_kv_bytes(), bytes(5));
        for (result, kind) in [
            (m.decode(h, 10, 1), "token_out_of_range"),
            (m.decode(h, 4, 0), "empty_input"),
            (m.decode(h, 4, 12), "context_overflow"),
            (m.decode(h, 4, 4), "kv_budget"),
        ] {
            let e = result.unwrap_err();
            assert_eq!(e.kind(), kind, "{e}");
            assert!(e.to_string().starts_with("decode: "), "{e}");
        }
        assert_eq!((m.len(h).unwrap(), m.live_kv_bytes()), (5, bytes(5)));
        assert_eq!(m.decode(h, 4, 3).unwrap(), vec![8, 6, 2]);
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
    fn the_kv_budget_refuses_growth_past_the_cap_and_changes_nothing() {
        // Sum's states cost the config's formula: 16 bytes per cached row (2 layers, window 3).
        let m = Session::new(Sum::new()).with_kv_budget(150);
        let (a, _) = m.prefill(&[1, 2, 3], Logits::Skip).unwrap();
        assert_eq!(m.live_kv_bytes(), 96);
        match m.snapshot(a) {
            Err(Error::KvBudget {
                op: "snapshot",
                live: 96,
                adding: 96,
                cap: 150,
            }) => {}
            other => panic!("expected a budget error, got {other:?}"),
        }
        assert_eq!((m.live(), m.live_kv_bytes()), (1, 96));
        m.step(a, 1, Logits::Skip).unwrap();
        assert_eq!(m.live_kv_bytes(), 112);
        let e = m.extend(a, &[1, 1, 1], Logits::Skip).unwrap_err();
        assert!(
            matches!(
                e,
                Error::KvBudget {
                    live: 112,
                    adding: 48,
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("112 bytes live + 48 new > cap 150"),
            "{e}"
        );
        assert_eq!(m.len(a).unwrap(), 4, "the refused extend changed nothing");
        assert_eq!(m.step(a, 0, Logits::Skip).unwrap().token, 7);
        m.release(a).unwrap();
        assert_eq!(m.live_kv_bytes(), 0);
        m.prefill(&[1; 6], Logits::Skip).unwrap();
        assert_eq!(m.live_kv_bytes(), 144);
        m.close().unwrap();
        assert_eq!(m.live_kv_bytes(), 0);
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
