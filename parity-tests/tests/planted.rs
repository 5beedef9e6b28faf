//! The property suite must fail on a broken backend. Two test-only wrappers of the reference
//! plant a bug each; the suite's checker runs on them and must report it, naming the backend,
//! the shrunk op sequence and the first diverging position.
//!
//! What each bug shows about detectability:
//! - a one-ulp logit error is 1e-7 of a logit, far inside `Tolerance::LOGITS` (2e-3): no
//!   comparison with another chunking, backend or the oracle can see it. It is caught because
//!   it breaks a bit-exact promise: a state restored from a snapshot and continued must equal
//!   the run that never forked, bit for bit (`snapshot_independence`). Scripts without
//!   snapshots (`chunking_invariance`) pass, as they must.
//! - a window one token short is self-consistent: every chunking agrees with the one-shot
//!   prefill of the same wrong model (`chunking_invariance` passes). The oracle's goldens catch
//!   it (`window_and_capacity_crossing`), and so does the comparison with the reference
//!   (`tokens_and_logits_agree`).
//!
//! Both are also caught by the slow backends' configuration (`Checks::Lean`, `SLOW_CASES`
//! scripts of up to `SLOW_MAX_OPS` ops): the replays it keeps are those of forked slots, and the
//! reference's one-shot replaces the backend's own.

use std::path::Path;

use kvsnap_contract::{KvModel, Logits, ModelConfig, Next, Result};
use kvsnap_parity::props::{
    with_tiny_model, Checks, Property, PropertyFailure, Suite, SLOW_CASES, SLOW_MAX_OPS,
    TINY_CAPACITY,
};
use kvsnap_parity::GoldenSet;
use kvsnap_reference::{ReferenceKv, ReferenceModel};

/// The reference, except that a state made by `snapshot` (and any snapshot of it) returns its
/// argmax logit one ulp off: the kind of error a snapshot that reorders the ring buffer, or
/// copies through another precision, makes.
struct UlpOnRestore(ReferenceModel);

/// A reference state and whether a snapshot made it.
struct RestoredKv {
    inner: ReferenceKv,
    restored: bool,
}

impl UlpOnRestore {
    fn plant(&self, kv: &RestoredKv, mut next: Next) -> Next {
        if let (true, Some(logits)) = (kv.restored, next.logits.as_mut()) {
            let top = &mut logits[next.token as usize];
            *top = f32::from_bits(top.to_bits() + 1);
        }
        next
    }
}

impl KvModel for UlpOnRestore {
    type Kv = RestoredKv;

    fn config(&self) -> &ModelConfig {
        self.0.config()
    }

    fn backend(&self) -> &'static str {
        "planted-ulp-on-restore"
    }

    fn prefill(&self, ids: &[u32], logits: Logits) -> Result<(RestoredKv, Next)> {
        let (inner, next) = self.0.prefill(ids, logits)?;
        let kv = RestoredKv {
            inner,
            restored: false,
        };
        Ok((kv, next))
    }

    fn prefill_embeddings(
        &self,
        ids: &[u32],
        embeddings: &[f32],
        logits: Logits,
    ) -> Result<(RestoredKv, Next)> {
        let (inner, next) = self.0.prefill_embeddings(ids, embeddings, logits)?;
        let kv = RestoredKv {
            inner,
            restored: false,
        };
        Ok((kv, next))
    }

    fn extend(&self, kv: &mut RestoredKv, ids: &[u32], logits: Logits) -> Result<Next> {
        let next = self.0.extend(&mut kv.inner, ids, logits)?;
        Ok(self.plant(kv, next))
    }

    fn step(&self, kv: &mut RestoredKv, id: u32, logits: Logits) -> Result<Next> {
        let next = self.0.step(&mut kv.inner, id, logits)?;
        Ok(self.plant(kv, next))
    }

    fn snapshot(&self, kv: &RestoredKv) -> Result<RestoredKv> {
        Ok(RestoredKv {
            inner: self.0.snapshot(&kv.inner)?,
            restored: true,
        })
    }

    fn len(&self, kv: &RestoredKv) -> usize {
        self.0.len(&kv.inner)
    }
}

/// The reference computing with a sliding window one token shorter than its config says.
struct WindowOffByOne {
    inner: ReferenceModel,
    cfg: ModelConfig,
}

impl WindowOffByOne {
    fn load(dir: &Path, capacity: usize) -> Result<Self> {
        let cfg = ReferenceModel::load_with_capacity(dir, capacity)?
            .config()
            .clone();
        let short = ModelConfig {
            sliding_window: cfg.sliding_window - 1,
            ..cfg.clone()
        };
        let inner = ReferenceModel::load_config(dir, short)?;
        Ok(WindowOffByOne { inner, cfg })
    }
}

impl KvModel for WindowOffByOne {
    type Kv = ReferenceKv;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn backend(&self) -> &'static str {
        "planted-window-off-by-one"
    }

    fn prefill(&self, ids: &[u32], logits: Logits) -> Result<(ReferenceKv, Next)> {
        self.inner.prefill(ids, logits)
    }

    fn prefill_embeddings(
        &self,
        ids: &[u32],
        embeddings: &[f32],
        logits: Logits,
    ) -> Result<(ReferenceKv, Next)> {
        self.inner.prefill_embeddings(ids, embeddings, logits)
    }

    fn extend(&self, kv: &mut ReferenceKv, ids: &[u32], logits: Logits) -> Result<Next> {
        self.inner.extend(kv, ids, logits)
    }

    fn step(&self, kv: &mut ReferenceKv, id: u32, logits: Logits) -> Result<Next> {
        self.inner.step(kv, id, logits)
    }

    fn snapshot(&self, kv: &ReferenceKv) -> Result<ReferenceKv> {
        self.inner.snapshot(kv)
    }

    fn len(&self, kv: &ReferenceKv) -> usize {
        self.inner.len(kv)
    }
}

/// The tiny suite of a planted backend, as `backend_props!` builds it for real ones.
fn suite<M: KvModel>(load: impl FnOnce(&Path, usize) -> Result<M>) -> Suite<M> {
    let goldens = GoldenSet::load(&kvsnap_parity::props::workspace().join("goldens/tiny.json"))
        .unwrap()
        .cases;
    let (model, reference) = with_tiny_model(|dir| {
        (
            load(dir, TINY_CAPACITY).unwrap(),
            ReferenceModel::load_with_capacity(dir, TINY_CAPACITY).unwrap(),
        )
    })
    .unwrap();
    Suite::new("planted", model, reference, goldens, (10, 12, 256))
}

/// `suite` as a slow backend runs: the lean truths on fewer, shorter scripts.
fn slow<M: KvModel>(suite: Suite<M>) -> Suite<M> {
    suite
        .with_checks(Checks::Lean)
        .with_cases(SLOW_CASES)
        .with_max_ops(SLOW_MAX_OPS)
}

/// Asserts that `property` fails on `suite` against `truth`, with a message that names the
/// backend, the op sequence and the first diverging position; returns the failure.
fn assert_caught<M: KvModel>(
    suite: &Suite<M>,
    property: Property,
    truth: &str,
) -> Box<PropertyFailure> {
    let failure = match suite.check(property) {
        Ok(stats) => panic!(
            "{property} passed on the planted backend `{}`: {stats:?}",
            suite.model.backend()
        ),
        Err(f) => f,
    };
    let message = failure.to_string();
    eprintln!(
        "{property} on `{}` caught it:\n{message}\n",
        suite.model.backend()
    );
    let divergence = failure
        .divergence
        .as_ref()
        .expect("a divergence, not a gap");
    assert_eq!(divergence.backend, suite.model.backend());
    assert!(divergence.position.is_some(), "{message}");
    assert!(divergence.truth.contains(truth), "{message}");
    for part in [
        suite.model.backend(),
        "first diverging position",
        "Op::Prefill",
        "planted::replay(&[",
    ] {
        assert!(message.contains(part), "`{part}` missing from:\n{message}");
    }
    failure
}

#[test]
fn planted_logit_error_is_caught() {
    let suite =
        suite(|dir, capacity| ReferenceModel::load_with_capacity(dir, capacity).map(UlpOnRestore));
    let failure = assert_caught(&suite, Property::SnapshotIndependence, "bit-exact");
    // Shrunk to the essence: a prefill and a snapshot (the closing probe steps the copy).
    assert_eq!(failure.script.0.len(), 2, "{failure}");
    // Without snapshots the error is invisible: one ulp is far inside the tolerance.
    suite.assert(Property::ChunkingInvariance);
    // The lean truths keep the replays of forked slots, which is where it shows.
    let suite = slow(suite);
    let failure = assert_caught(&suite, Property::SnapshotIndependence, "bit-exact");
    assert_eq!(failure.script.0.len(), 2, "{failure}");
}

#[test]
fn planted_window_off_by_one_is_caught() {
    let mut suite = suite(WindowOffByOne::load);
    // Alone (no other backend to compare with), only the oracle can tell: the wrong window
    // agrees with itself under any chunking.
    suite.cross = false;
    suite.assert(Property::ChunkingInvariance);
    let failure = assert_caught(&suite, Property::WindowAndCapacityCrossing, "golden case");
    let position = failure.divergence.as_ref().unwrap().position.unwrap();
    let window = suite.model.config().sliding_window;
    assert!(
        position >= window - 1,
        "a window of {} keys cannot change position {position}",
        window - 1
    );
    // Next to the reference, any script past the window shows it.
    suite.cross = true;
    assert_caught(&suite, Property::TokensAndLogitsAgree, "reference");
    // So do the slow backends' lean truths: the reference's one-shot is their truth.
    let mut suite = slow(suite);
    assert_caught(&suite, Property::TokensAndLogitsAgree, "reference");
    suite.cross = false;
    assert_caught(&suite, Property::WindowAndCapacityCrossing, "golden case");
}
