//! Properties, the suite that runs them on one backend, and what a failure reports.

use std::cell::RefCell;
use std::fmt;
use std::path::{Path, PathBuf};

use kvsnap_contract::{Error, KvModel, Tolerance};
use kvsnap_reference::tiny::{self, Preset, DEFAULT_SEED};
use kvsnap_reference::ReferenceModel;
use proptest::strategy::BoxedStrategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

use super::compare::Divergence;
use super::driver::{Checks, Driver, Stats, Truths};
use super::op::{Op, Script};
use super::strategy::{self, Shape};
use crate::golden::{Case, GoldenSet};

/// Context capacity of the tiny model in the property suite: small enough that scripts cross it
/// (and its 6-token sliding window) all the time.
pub const TINY_CAPACITY: usize = 40;

/// Scripts per property per backend unless `KVSNAP_PROPS_CASES` says otherwise.
pub const TINY_CASES: u32 = 256;

/// Context capacity of the real model in the heavy run: past its 512-token window.
pub const REAL_CAPACITY: usize = 600;

/// Scripts per property in the heavy run unless `KVSNAP_PROPS_CASES` says otherwise.
pub const REAL_CASES: u32 = 4;

/// Scripts per property on a slow backend (Vulkan on lavapipe): 5 properties of 52 make the
/// issue's 256 sequences per backend.
pub const SLOW_CASES: u32 = 52;

/// Most ops after the opening of a script on a slow backend (the tiny default is 12): a
/// result's replay costs one call per chunk of its slot, so shorter scripts cost less than
/// linearly less.
pub const SLOW_MAX_OPS: usize = 6;

/// Runs of fewer scripts (the heavy run's few long ones, a quick `KVSNAP_PROPS_CASES=8`) are
/// not expected to cover every target of their property, so coverage is only asserted from here
/// (a slow backend's [`SLOW_CASES`] included).
pub const MIN_CASES_FOR_COVERAGE: u32 = 48;

/// The seed of every run unless `KVSNAP_PROPS_SEED` says otherwise (each property mixes in its
/// own name).
pub const DEFAULT_PROPS_SEED: u64 = 0x6b76_736e_6170;

/// One property of the contract: a script generator plus what a passing run must have covered.
/// Every property checks every result the same way (see [`crate::props::Driver`]); they differ
/// in the scripts they generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Property {
    /// Mixed scripts; on other backends every result also agrees with the reference's one-shot
    /// prefill (tokens equal, logits within tolerance).
    TokensAndLogitsAgree,
    /// One prompt split into a prefill and extend/step chunks: every prefix agrees with a
    /// one-shot prefill of it.
    ChunkingInvariance,
    /// Snapshots, divergence on the original and the copies, releases: every result is
    /// bit-exact with the run that never forked.
    SnapshotIndependence,
    /// Mostly invalid ops (stale handle, empty input, token out of range, past capacity, wrong
    /// embeddings shape): the right error, and no slot changes.
    InvalidOpsAreTypedErrorsAndChangeNothing,
    /// Golden sequences fed in random chunks with forks, across the sliding window and up to
    /// and past the context capacity: the oracle's logits within tolerance up to the capacity,
    /// a context overflow after it.
    WindowAndCapacityCrossing,
}

impl Property {
    /// Every property, in the order the tests list them.
    pub const ALL: [Property; 5] = [
        Property::TokensAndLogitsAgree,
        Property::ChunkingInvariance,
        Property::SnapshotIndependence,
        Property::InvalidOpsAreTypedErrorsAndChangeNothing,
        Property::WindowAndCapacityCrossing,
    ];

    /// The test name.
    pub fn name(self) -> &'static str {
        match self {
            Property::TokensAndLogitsAgree => "tokens_and_logits_agree",
            Property::ChunkingInvariance => "chunking_invariance",
            Property::SnapshotIndependence => "snapshot_independence",
            Property::InvalidOpsAreTypedErrorsAndChangeNothing => {
                "invalid_ops_are_typed_errors_and_change_nothing"
            }
            Property::WindowAndCapacityCrossing => "window_and_capacity_crossing",
        }
    }

    fn strategy<M: KvModel>(self, suite: &Suite<M>) -> BoxedStrategy<Script> {
        let shape = &suite.shape;
        match self {
            Property::TokensAndLogitsAgree => strategy::mixed(shape),
            Property::ChunkingInvariance => strategy::chunked_prompt(shape),
            Property::SnapshotIndependence => strategy::forks(shape),
            Property::InvalidOpsAreTypedErrorsAndChangeNothing => strategy::invalid_heavy(shape),
            Property::WindowAndCapacityCrossing => {
                strategy::golden_walk(shape, suite.golden_sequences())
            }
        }
    }

    /// What a passing run must have exercised, so that a generator that stopped reaching its
    /// target fails instead of passing vacuously.
    fn coverage<M: KvModel>(self, suite: &Suite<M>, s: &Stats) -> Result<(), String> {
        let need = |ok: bool, what: &str| if ok { Ok(()) } else { Err(what.to_string()) };
        need(
            s.valid_ops >= s.scripts,
            "fewer checked results than scripts",
        )?;
        need(s.past_window > 0, "no result past the sliding window")?;
        match self {
            Property::TokensAndLogitsAgree => need(
                s.snapshots > 0 && s.after_snapshot > 0,
                "no snapshot used in mixed scripts",
            ),
            Property::ChunkingInvariance => need(s.at_capacity > 0, "no prompt reached capacity"),
            Property::SnapshotIndependence => need(
                s.snapshots >= s.scripts
                    && s.after_snapshot >= s.scripts
                    && s.replayed >= s.after_snapshot,
                "fewer snapshots (or results after one, or bit-exact replays of them) than scripts",
            ),
            Property::InvalidOpsAreTypedErrorsAndChangeNothing => {
                for kind in [
                    "empty_input",
                    "token_out_of_range",
                    "context_overflow",
                    "shape_mismatch",
                    "stale_handle",
                ] {
                    need(
                        s.errors_of(kind) > 0,
                        &format!("no `{kind}` error exercised"),
                    )?;
                }
                Ok(())
            }
            Property::WindowAndCapacityCrossing => {
                need(s.golden > 0, "no result checked against the goldens")?;
                let crosses = suite
                    .golden_sequences()
                    .iter()
                    .any(|q| q.len() > suite.shape.capacity);
                need(
                    !crosses || (s.at_capacity > 0 && s.errors_of("context_overflow") > 0),
                    "no golden walk reached the capacity and was refused past it",
                )
            }
        }
    }
}

impl fmt::Display for Property {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A property that failed: the backend, the shrunk script, the first divergence, and how to
/// replay it.
#[derive(Debug)]
pub struct PropertyFailure {
    /// The property.
    pub property: Property,
    /// The backend.
    pub backend: &'static str,
    /// The test module that instantiates the backend (its `replay` helper runs a script).
    pub module: &'static str,
    /// The seed of the run.
    pub seed: u64,
    /// The minimal failing script (empty for a coverage failure).
    pub script: Script,
    /// The first divergence of the minimal script (`None` for a coverage failure).
    pub divergence: Option<Divergence>,
    /// What went wrong, when there is no divergence.
    pub message: String,
}

impl fmt::Display for PropertyFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "property `{}` failed on backend `{}` (seed {:#x}):",
            self.property, self.backend, self.seed
        )?;
        let Some(divergence) = &self.divergence else {
            return write!(f, "{}", self.message);
        };
        writeln!(f, "{divergence}")?;
        writeln!(
            f,
            "minimal failing op sequence ({} ops; the driver then probes and releases every live \
             slot). Replay it in parity-tests/tests/props.rs:\n",
            self.script.0.len()
        )?;
        let script = format!("{:?}", self.script).replace('\n', "\n    ");
        write!(
            f,
            "#[test]\nfn replay_{}_{}() {{\n    {}::replay({script});\n}}",
            self.module, self.property, self.module
        )
    }
}

/// One backend with everything its properties need: the reference and the goldens to check
/// against, the sizes to generate, how many scripts to run.
pub struct Suite<M: KvModel> {
    /// The test module that instantiates the backend, named in replay snippets.
    pub module: &'static str,
    /// The backend under test.
    pub model: M,
    /// The reference backend on the same weights and capacity.
    pub reference: ReferenceModel,
    /// Whether results are also compared with `reference` (off for the reference itself).
    pub cross: bool,
    /// The oracle's golden cases for these weights.
    pub goldens: Vec<Case>,
    /// Sizes of the generated scripts.
    pub shape: Shape,
    /// Tolerance of every non-bit-exact comparison.
    pub tolerance: Tolerance,
    /// Scripts per property.
    pub cases: u32,
    /// Which truths every result is checked against.
    pub checks: Checks,
    /// The run's seed.
    pub seed: u64,
}

/// The workspace root (this crate's parent).
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crate has a parent")
        .to_path_buf()
}

/// Writes the tiny model (`Preset::Tiny`, `DEFAULT_SEED`, the weights of `goldens/tiny.json`)
/// into a fresh temporary directory, runs `f` on it, and removes the directory. Whatever `f`
/// loads must not need the files afterwards (the reference maps them, which outlives removal on
/// Unix).
pub fn with_tiny_model<T>(f: impl FnOnce(&Path) -> T) -> Result<T, String> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvsnap-props-tiny-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    tiny::write_model(&dir, Preset::Tiny, DEFAULT_SEED)
        .map_err(|e| format!("writing the tiny model: {e}"))?;
    let out = f(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(out)
}

fn env_u64(var: &str) -> Option<u64> {
    let v = std::env::var(var).ok()?;
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{var}={v} is not a number")))
}

/// `KVSNAP_PROPS_CHECKS` (`full` or `lean`), when set.
fn env_checks() -> Option<Checks> {
    match std::env::var("KVSNAP_PROPS_CHECKS").ok()?.as_str() {
        "full" => Some(Checks::Full),
        "lean" => Some(Checks::Lean),
        v => panic!("KVSNAP_PROPS_CHECKS={v} is not `full` or `lean`"),
    }
}

impl<M: KvModel> Suite<M> {
    /// A suite over `model`, with scripts sized for `max_chunk` and `max_ops`, `cases` scripts
    /// per property (`KVSNAP_PROPS_CASES` and `KVSNAP_PROPS_SEED` override the count and seed).
    pub fn new(
        module: &'static str,
        model: M,
        reference: ReferenceModel,
        goldens: Vec<Case>,
        (max_chunk, max_ops, cases): (usize, usize, u32),
    ) -> Self {
        let cfg = model.config();
        let shape = Shape {
            vocab: cfg.vocab_size as u32,
            capacity: cfg.context_capacity,
            hidden: cfg.hidden_size,
            max_chunk,
            max_ops,
        };
        Suite {
            module,
            cross: model.backend() != reference.backend(),
            model,
            reference,
            goldens,
            shape,
            tolerance: Tolerance::LOGITS,
            cases: env_u64("KVSNAP_PROPS_CASES").map_or(cases, |n| n as u32),
            checks: env_checks().unwrap_or(Checks::Full),
            seed: env_u64("KVSNAP_PROPS_SEED").unwrap_or(DEFAULT_PROPS_SEED),
        }
    }

    /// The same suite with `cases` scripts per property (`KVSNAP_PROPS_CASES` still wins).
    pub fn with_cases(mut self, cases: u32) -> Self {
        self.cases = env_u64("KVSNAP_PROPS_CASES").map_or(cases, |n| n as u32);
        self
    }

    /// The same suite generating scripts of at most `max_ops` ops after their opening.
    pub fn with_max_ops(mut self, max_ops: usize) -> Self {
        self.shape.max_ops = max_ops;
        self
    }

    /// The same suite checking `checks` truths (`KVSNAP_PROPS_CHECKS=full` or `lean` still
    /// wins).
    pub fn with_checks(mut self, checks: Checks) -> Self {
        self.checks = env_checks().unwrap_or(checks);
        self
    }

    /// The suite on the tiny model with [`TINY_CAPACITY`] and `goldens/tiny.json`; `load`
    /// loads the backend from a model directory with a context capacity.
    ///
    /// `Ok(None)` (after printing `SKIPPED`) when `load` reports [`Error::Unsupported`]: the
    /// backend cannot run on this machine (no compiler, no device). `KVSNAP_REQUIRE_BACKENDS=1`
    /// makes that an error.
    pub fn tiny(
        module: &'static str,
        load: impl FnOnce(&Path, usize) -> kvsnap_contract::Result<M>,
    ) -> Result<Option<Self>, String> {
        let goldens_path = workspace().join("goldens/tiny.json");
        let goldens = GoldenSet::load(&goldens_path).map_err(|e| e.to_string())?;
        let loaded = with_tiny_model(|dir| {
            let model = match load(dir, TINY_CAPACITY) {
                Ok(model) => model,
                Err(e) => return Ok(Err(e)),
            };
            let reference = ReferenceModel::load_with_capacity(dir, TINY_CAPACITY)
                .map_err(|e| format!("loading the reference: {e}"))?;
            Ok::<_, String>(Ok((model, reference)))
        })??;
        let (model, reference) = match loaded {
            Ok(pair) => pair,
            Err(e) => return unavailable(module, e),
        };
        Ok(Some(Suite::new(
            module,
            model,
            reference,
            goldens.cases,
            (10, 12, TINY_CASES),
        )))
    }

    /// The heavy suite on a real checkpoint in `model_dir` with [`REAL_CAPACITY`] and the
    /// golden set at `goldens`; `Ok(None)` as in [`Suite::tiny`].
    pub fn real(
        module: &'static str,
        load: impl FnOnce(&Path, usize) -> kvsnap_contract::Result<M>,
        model_dir: &Path,
        goldens: &Path,
    ) -> Result<Option<Self>, String> {
        let set = GoldenSet::load(goldens).map_err(|e| e.to_string())?;
        let model = match load(model_dir, REAL_CAPACITY) {
            Ok(model) => model,
            Err(e) => return unavailable(module, e),
        };
        let reference = ReferenceModel::load_with_capacity(model_dir, REAL_CAPACITY)
            .map_err(|e| format!("loading the reference: {e}"))?;
        Ok(Some(Suite::new(
            module,
            model,
            reference,
            set.cases,
            (REAL_CAPACITY / 3, 6, REAL_CASES),
        )))
    }

    fn golden_sequences(&self) -> Vec<Vec<u32>> {
        self.goldens
            .iter()
            .map(|c| c.ids.iter().chain(&c.greedy).copied().collect())
            .collect()
    }

    fn truths(&self) -> Truths<'_, M> {
        Truths {
            model: &self.model,
            reference: &self.reference,
            cross: self.cross,
            goldens: &self.goldens,
            tolerance: self.tolerance,
            checks: self.checks,
        }
    }

    /// Runs `property`: [`Suite::cases`] generated scripts, shrinking the first failure to a
    /// minimal script. Returns what the passing scripts exercised.
    pub fn check(&self, property: Property) -> Result<Stats, Box<PropertyFailure>> {
        let seed = self.seed ^ fnv1a(property.name());
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        let config = Config {
            cases: self.cases,
            failure_persistence: None,
            max_shrink_iters: 4096,
            ..Config::default()
        };
        let mut runner =
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &key));
        let truths = self.truths();
        let stats = RefCell::new(Stats::default());
        let strategy = property.strategy(self);
        let result = runner.run(&strategy, |script| {
            let s = Driver::new(&truths)
                .run(&script.0)
                .map_err(|d| TestCaseError::fail(d.to_string()))?;
            stats.borrow_mut().merge(&s);
            Ok(())
        });
        let failure = |script: Script, divergence: Option<Box<Divergence>>, message| {
            Box::new(PropertyFailure {
                property,
                backend: self.model.backend(),
                module: self.module,
                seed: self.seed,
                script,
                divergence: divergence.map(|d| *d),
                message,
            })
        };
        match result {
            Ok(()) if self.cases < MIN_CASES_FOR_COVERAGE => Ok(stats.into_inner()),
            Ok(()) => {
                let stats = stats.into_inner();
                property.coverage(self, &stats).map_err(|gap| {
                    failure(
                        Script::default(),
                        None,
                        format!("the generated scripts did not cover the property: {gap}"),
                    )
                })?;
                Ok(stats)
            }
            Err(TestError::Fail(reason, script)) => {
                // The runner keeps the reason of the last failure it saw; the minimal script's
                // own divergence is recomputed (the backends are deterministic).
                match Driver::new(&truths).run(&script.0) {
                    Err(d) => Err(failure(script, Some(d), String::new())),
                    Ok(_) => Err(failure(
                        script,
                        None,
                        format!("nondeterministic: the minimal script passed on a rerun; {reason}"),
                    )),
                }
            }
            Err(TestError::Abort(reason)) => Err(failure(
                Script::default(),
                None,
                format!("aborted: {reason}"),
            )),
        }
    }

    /// Runs `property` and panics with the failure; prints what it covered.
    pub fn assert(&self, property: Property) {
        let started = std::time::Instant::now();
        match self.check(property) {
            Ok(s) => eprintln!(
                "{}::{property} ({:?} checks): {} scripts, {} results checked ({} replayed \
                 bit-exact, {} against the own one-shot, {} against the reference; {} past the \
                 window, {} at capacity, {} after a snapshot, {} against goldens), errors {:?}; \
                 max |d| one-shot {:.2e}, reference {:.2e}, goldens {:.2e}; {:.2} s",
                self.module,
                self.checks,
                s.scripts,
                s.valid_ops,
                s.replayed,
                s.one_shot,
                s.reference,
                s.past_window,
                s.at_capacity,
                s.after_snapshot,
                s.golden,
                s.errors,
                s.max_d_one_shot,
                s.max_d_reference,
                s.max_d_golden,
                started.elapsed().as_secs_f64()
            ),
            Err(f) => panic!("{f}"),
        }
    }

    /// Runs one script with every check, and panics with its first divergence.
    pub fn replay(&self, ops: &[Op]) -> Stats {
        let truths = self.truths();
        Driver::new(&truths)
            .run(ops)
            .unwrap_or_else(|d| panic!("{d}"))
    }
}

/// `Ok(None)` after printing `SKIPPED` for a backend that reports it cannot run here
/// ([`Error::Unsupported`]) unless `KVSNAP_REQUIRE_BACKENDS=1`; any other load error is an error.
pub(crate) fn unavailable<T>(module: &str, e: Error) -> Result<Option<T>, String> {
    let required = std::env::var("KVSNAP_REQUIRE_BACKENDS").is_ok_and(|v| v == "1");
    match e {
        Error::Unsupported { .. } if !required => {
            eprintln!("SKIPPED: {module}: {e}");
            Ok(None)
        }
        e => Err(format!("loading {module}: {e}")),
    }
}

/// 64-bit FNV-1a: a stable per-property seed.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}
