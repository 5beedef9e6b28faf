//! Property-test parity: every property of `kvsnap_parity::props` as a named test per backend
//! (`reference::snapshot_independence`, ...), on the tiny model with 256 scripts each (52 of up
//! to 6 ops with the lean truths on `iree_vulkan`: 256 sequences per backend), plus
//! `#[ignore]`d heavy runs on the real model (`<backend>::real_model::...`).
//!
//! A failing property prints its shrunk script as a `#[test]` calling `<backend>::replay`:
//! paste it below to keep it as a regression test.

use std::path::Path;

use kvsnap_contract::{Error, Result};
use kvsnap_iree::compile::{Compiler, Target};
use kvsnap_iree::{IreeModel, IreeOptions};
use kvsnap_parity::props::{Checks, SLOW_CASES, SLOW_MAX_OPS};
use kvsnap_reference::ReferenceModel;

kvsnap_parity::backend_props!(
    reference,
    ReferenceModel,
    ReferenceModel::load_with_capacity
);
kvsnap_parity::backend_props!(iree_cpu, IreeModel, |dir, cap| load_iree(
    dir,
    cap,
    Target::LlvmCpu
));
// Vulkan on lavapipe (CI) is slow: 5 x 52 scripts (256 sequences per backend) of up to 6 ops,
// with the lean truths (bit-exact replays of forked slots only, the reference's one-shot as the
// truth).
kvsnap_parity::backend_props!(
    iree_vulkan,
    IreeModel,
    |dir, cap| load_iree(dir, cap, Target::VulkanSpirv),
    cases = SLOW_CASES,
    checks = Checks::Lean,
    max_ops = SLOW_MAX_OPS
);

/// `IreeModel` on `target` with `capacity`; `Unsupported` (the tests skip) without a 3.13
/// `iree-compile` or, for Vulkan, without a device.
fn load_iree(dir: &Path, capacity: usize, target: Target) -> Result<IreeModel> {
    if let Err(e) = Compiler::discover() {
        eprintln!("iree-compile: {e}");
        return Err(Error::Unsupported {
            backend: "iree",
            op: "compiling graphs (no iree-compile 3.13: scripts/setup-iree.sh)",
        });
    }
    let opts = IreeOptions {
        target,
        capacity: Some(capacity),
        ..IreeOptions::cpu()
    };
    IreeModel::load(dir, &opts)
}

/// A hand-written script through the same helper a shrunk failure prints: a fork, both sides
/// past the 6-token window, one side filled to the capacity (40) and refused past it, a double
/// release.
#[test]
fn replay_fork_window_capacity_and_double_release() {
    use kvsnap_parity::props::Op;
    reference::replay(&[
        Op::Prefill {
            ids: vec![2, 17, 300, 5, 9],
        },
        Op::Snapshot { h: 0 },
        Op::Extend {
            h: 0,
            ids: vec![1, 2, 3, 4, 5, 6, 7],
        },
        Op::Extend {
            h: 1,
            ids: (100..134).collect(),
        },
        Op::Step { h: 1, id: 7 },
        Op::Step { h: 0, id: 511 },
        Op::Release { h: 0 },
        Op::Release { h: 0 },
        Op::Extend { h: 0, ids: vec![1] },
    ]);
}
