//! Property-test parity: random operation scripts on a backend, every result checked against
//! ground truths, failures shrunk to a minimal script that prints as a replayable test.
//!
//! - [`Op`] / [`Script`]: prefill (ids or embeddings), extend, step, snapshot, release on the
//!   slots of the driver's handle table, valid or not.
//! - [`Driver`]: runs a script and checks each result bit-exactly against a replay of the slot's
//!   chunks without forks, within [`kvsnap_contract::Tolerance`] against a one-shot prefill of
//!   the slot's history (same backend, and the reference for other backends), and against the
//!   oracle's goldens when the history is a golden prefix; invalid inputs must return the typed
//!   error and change nothing.
//! - [`Property`]: the named properties (a script generator each); [`Suite`] runs them on one
//!   backend with a fixed seed; [`backend_props!`](crate::backend_props) instantiates every
//!   property as a test in a module named after the backend.
//!
//! # What is detectable
//! Same-backend results are compared bit for bit only where the contract promises identical
//! computations: a restored or forked state continued with the same chunks as a run that never
//! forked. Everything else (other chunkings, other backends, the oracle) is compared within
//! `Tolerance::LOGITS` (2e-3), so an error far below it (one ulp of a logit) is caught only
//! when it breaks that promise: an error that a snapshot introduces, or one that depends on
//! anything but the chunk sequence. An error that every run of a chunk sequence makes the same
//! way (say, one ulp added to every logit) is below any tolerance-based check by design. A
//! wrong window is self-consistent on one backend (every chunking agrees with itself), so it
//! is caught by the oracle's goldens and by the comparison with the reference.

mod compare;
mod driver;
mod op;
mod strategy;
mod suite;

pub use compare::Divergence;
pub use driver::{Checks, Driver, Stats, Truths};
pub use op::{Op, Script};
pub use strategy::Shape;
pub use suite::{
    with_tiny_model, workspace, Property, PropertyFailure, Suite, DEFAULT_PROPS_SEED,
    REAL_CAPACITY, REAL_CASES, SLOW_CASES, SLOW_MAX_OPS, TINY_CAPACITY, TINY_CASES,
};

/// Instantiates every [`Property`] as a `#[test]` in a module named after a backend, plus
/// `#[ignore]`d heavy runs on the real model in its `real_model` submodule and a `replay`
/// helper for shrunk failures.
///
/// `backend_props!(module, ModelType, load)` where `load: Fn(&Path, usize) -> Result<ModelType>`
/// loads the backend from a model directory with a context capacity; optionally
/// `cases = N` (scripts per property, default [`TINY_CASES`]), then `checks = Checks::Lean`
/// (default [`Checks::Full`]), then `max_ops = N` (ops per script, default 12):
///
/// ```ignore
/// kvsnap_parity::backend_props!(reference, ReferenceModel, ReferenceModel::load_with_capacity);
/// kvsnap_parity::backend_props!(iree_cpu, IreeModel, load_iree_cpu);
/// // A slow device: 5 x 52 scripts of up to 6 ops, the cheaper truths.
/// use kvsnap_parity::props::{Checks, SLOW_CASES, SLOW_MAX_OPS};
/// kvsnap_parity::backend_props!(
///     iree_vulkan, IreeModel, load_iree_vulkan,
///     cases = SLOW_CASES, checks = Checks::Lean, max_ops = SLOW_MAX_OPS
/// );
/// ```
///
/// A loader that returns `Error::Unsupported` (no compiler, no device) makes the tests print
/// `SKIPPED` and pass, unless `KVSNAP_REQUIRE_BACKENDS=1`.
///
/// The real-model runs read `models/gemma-3-270m` (`KVSNAP_MODEL_DIR`) and
/// `../shared/goldens/gemma-3-270m.visible.json` (`KVSNAP_GOLDENS`), and print `SKIPPED` when
/// the model is missing unless `KVSNAP_REQUIRE_MODEL=1`.
#[macro_export]
macro_rules! backend_props {
    ($module:ident, $model:ty, $load:expr) => {
        $crate::backend_props!($module, $model, $load, cases = $crate::props::TINY_CASES);
    };
    ($module:ident, $model:ty, $load:expr, cases = $cases:expr) => {
        $crate::backend_props!(
            $module,
            $model,
            $load,
            cases = $cases,
            checks = $crate::props::Checks::Full
        );
    };
    (
        $module:ident,
        $model:ty,
        $load:expr,
        cases = $cases:expr,
        checks = $checks:expr
        $(, max_ops = $max_ops:expr)?
    ) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            use $crate::props::{Property, Suite};

            /// The tiny suite, `None` when the backend cannot run here.
            fn suite() -> Option<&'static Suite<$model>> {
                static SUITE: ::std::sync::OnceLock<Option<Suite<$model>>> =
                    ::std::sync::OnceLock::new();
                SUITE
                    .get_or_init(|| {
                        Suite::tiny(stringify!($module), $load)
                            .unwrap_or_else(|e| panic!("{e}"))
                            .map(|suite| {
                                suite
                                    .with_cases($cases)
                                    .with_checks($checks)
                                    $(.with_max_ops($max_ops))?
                            })
                    })
                    .as_ref()
            }

            fn run(property: Property) {
                match suite() {
                    Some(suite) => suite.assert(property),
                    None => eprintln!("SKIPPED: {}::{property}", stringify!($module)),
                }
            }

            /// Runs one script on this backend's tiny suite with every check; panics with the
            /// first divergence. Failing properties print a call of this.
            #[allow(dead_code)]
            pub fn replay(ops: &[$crate::props::Op]) {
                match suite() {
                    Some(suite) => {
                        suite.replay(ops);
                    }
                    None => eprintln!("SKIPPED: {}::replay", stringify!($module)),
                }
            }

            #[test]
            fn tokens_and_logits_agree() {
                run(Property::TokensAndLogitsAgree);
            }

            #[test]
            fn chunking_invariance() {
                run(Property::ChunkingInvariance);
            }

            #[test]
            fn snapshot_independence() {
                run(Property::SnapshotIndependence);
            }

            #[test]
            fn invalid_ops_are_typed_errors_and_change_nothing() {
                run(Property::InvalidOpsAreTypedErrorsAndChangeNothing);
            }

            #[test]
            fn window_and_capacity_crossing() {
                run(Property::WindowAndCapacityCrossing);
            }

            mod real_model {
                use super::*;

                fn suite() -> Option<&'static Suite<$model>> {
                    static SUITE: ::std::sync::OnceLock<Option<Suite<$model>>> =
                        ::std::sync::OnceLock::new();
                    SUITE
                        .get_or_init(|| {
                            $crate::props::real_suite(stringify!($module), $load)
                                .unwrap_or_else(|e| panic!("{e}"))
                        })
                        .as_ref()
                }

                fn run(property: Property) {
                    match suite() {
                        Some(suite) => suite.assert(property),
                        None => eprintln!("SKIPPED: {property}: no real model"),
                    }
                }

                #[test]
                #[ignore = "heavy: the real model (cargo test --release -p kvsnap-parity -- --ignored)"]
                fn tokens_and_logits_agree() {
                    run(Property::TokensAndLogitsAgree);
                }

                #[test]
                #[ignore = "heavy: the real model (cargo test --release -p kvsnap-parity -- --ignored)"]
                fn chunking_invariance() {
                    run(Property::ChunkingInvariance);
                }

                #[test]
                #[ignore = "heavy: the real model (cargo test --release -p kvsnap-parity -- --ignored)"]
                fn snapshot_independence() {
                    run(Property::SnapshotIndependence);
                }

                #[test]
                #[ignore = "heavy: the real model (cargo test --release -p kvsnap-parity -- --ignored)"]
                fn invalid_ops_are_typed_errors_and_change_nothing() {
                    run(Property::InvalidOpsAreTypedErrorsAndChangeNothing);
                }

                #[test]
                #[ignore = "heavy: the real model (cargo test --release -p kvsnap-parity -- --ignored)"]
                fn window_and_capacity_crossing() {
                    run(Property::WindowAndCapacityCrossing);
                }
            }
        }
    };
}

/// The heavy suite for `backend_props!`: `None` (after saying why) when the real model is not
/// there and `KVSNAP_REQUIRE_MODEL` is not `1`.
#[doc(hidden)]
pub fn real_suite<M: kvsnap_contract::KvModel>(
    module: &'static str,
    load: impl FnOnce(&std::path::Path, usize) -> kvsnap_contract::Result<M>,
) -> Result<Option<Suite<M>>, String> {
    let path = |var: &str, default: &str| {
        std::env::var_os(var)
            .map(|p| workspace().join(p))
            .unwrap_or_else(|| workspace().join(default))
    };
    let model_dir = path("KVSNAP_MODEL_DIR", "models/gemma-3-270m");
    let goldens = path(
        "KVSNAP_GOLDENS",
        "../shared/goldens/gemma-3-270m.visible.json",
    );
    if !model_dir.join("model.safetensors").exists() || !goldens.exists() {
        let why = format!(
            "no model at {} or no goldens at {} (set KVSNAP_MODEL_DIR / KVSNAP_GOLDENS)",
            model_dir.display(),
            goldens.display()
        );
        if std::env::var("KVSNAP_REQUIRE_MODEL").is_ok_and(|v| v == "1") {
            return Err(format!("KVSNAP_REQUIRE_MODEL=1 but {why}"));
        }
        eprintln!("SKIPPED: {why}");
        return Ok(None);
    }
    Suite::real(module, load, &model_dir, &goldens)
}
