//! kvsnap's reliability tests, written once and instantiated per backend.
//!
//! [`reliability_tests!`] expands to one `#[test]` per row of the bad-input matrix, the failure
//! atomicity, KV budget, concurrency and leak checks, for one backend (`tests/backends.rs` holds
//! one line per backend). Every row runs beside two live "witness" KV states and checks that they
//! produce bit-for-bit the tokens and logits of a run without the bad call ([`witness`]).
//!
//! [`fuzz`] holds the bodies of the cargo-fuzz targets (`fuzz/`), so that `cargo test` replays
//! the kept corpus (`tests/fuzz_corpus/`) without cargo-fuzz. See `docs/RELIABILITY.md`.

pub mod fixtures;
pub mod fuzz;
pub mod rows;
pub mod rss;
pub mod witness;

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static EXCLUSIVE: RwLock<()> = RwLock::new(());

/// Held by ordinary rows: they may run in parallel with each other. Like [`exclusive`], it first
/// sets up the process for the leak rows' RSS measurement ([`rss::prepare_process`]), so every
/// test calls one of the two before it loads a model.
pub fn shared() -> RwLockReadGuard<'static, ()> {
    rss::prepare_process();
    EXCLUSIVE.read().unwrap_or_else(|p| p.into_inner())
}

/// Held by rows that must run alone in their process: RSS measurements, and fault injection
/// (the hook is armed on the model every row shares).
pub fn exclusive() -> RwLockWriteGuard<'static, ()> {
    rss::prepare_process();
    EXCLUSIVE.write().unwrap_or_else(|p| p.into_inner())
}

/// One `#[test]` per reliability row for a backend.
///
/// ```ignore
/// kvsnap_reliability::reliability_tests!(reference, ReferenceModel,
///     ReferenceModel::load_with_capacity,
///     fault = |m: &ReferenceModel, layer| m.set_fault_after_layer(layer));
/// ```
/// - `$module`: the test module's name (`reference::empty_ids`, ...);
/// - `$model`: the [`kvsnap_contract::KvModel`] type;
/// - `$load`: `Fn(&Path, usize) -> Result<$model>`, loading a model directory with a context
///   capacity (it is also what the bad-model-directory rows call);
/// - `fault = ...` (optional): `Fn(&$model, Option<usize>)` arming a one-shot failure after
///   that decoder layer of the next forward pass. Without it the atomicity rows report
///   `SKIPPED` on stderr;
/// - `live_bytes = ...` (optional): `Fn(&$model) -> u64`, the bytes the backend's own
///   allocator holds live; the leak rows then check it next to RSS;
/// - `cycles = ...` (optional): the leak rows' [`rows::Cycles`] (default
///   [`rows::Cycles::FULL`]).
///
/// The generated module's `backend()` is `pub(crate)`, for a backend's own rows beside it.
#[macro_export]
macro_rules! reliability_tests {
    ($module:ident, $model:ty, $load:expr
        $(, fault = $fault:expr)? $(, live_bytes = $live:expr)? $(, cycles = $cycles:expr)? $(,)?) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            use $crate::rows::{self, Backend};

            pub(crate) fn backend() -> &'static Backend<$model> {
                static B: ::std::sync::OnceLock<Backend<$model>> = ::std::sync::OnceLock::new();
                B.get_or_init(|| {
                    let root = ::std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                        .join("reliability")
                        .join(stringify!($module));
                    #[allow(unused_mut)]
                    let mut b = Backend::new(root, Box::new($load))
                        .unwrap_or_else(|e| panic!("loading {}: {e}", stringify!($module)));
                    $( b.fault = Some(Box::new($fault)); )?
                    $( b.live_bytes = Some(Box::new($live)); )?
                    $( b.cycles = $cycles; )?
                    b
                })
            }

            $crate::reliability_tests!(@tests shared:
                empty_ids, token_id_out_of_range, embeddings_wrong_row_count,
                embeddings_wrong_width, nan_embeddings, inf_embeddings, extend_past_capacity,
                step_past_capacity, prefill_past_capacity, released_handle,
                never_issued_handle, double_release, missing_tensor, wrong_tensor_shape,
                wrong_tensor_dtype, truncated_safetensors, config_mismatching_weights,
                missing_or_invalid_config, kv_budget_refuses_new_states,
                kv_budget_refuses_growth, parallel_handles_match_serial,
                one_handle_from_two_threads_is_serialised, release_racing_calls);
            $crate::reliability_tests!(@tests exclusive:
                mid_operation_failure_poisons, failed_prefill_changes_nothing,
                no_leak_over_snapshot_release_cycles, no_leak_over_open_close_cycles);
        }
    };
    (@tests $lock:ident: $($row:ident),* $(,)?) => {
        $(
            #[test]
            fn $row() {
                let _guard = $crate::$lock();
                rows::$row(backend());
            }
        )*
    };
}
