//! Property-test parity: every property of `kvsnap_parity::props` as a named test per backend
//! (`reference::snapshot_independence`, ...), on the tiny model with 256 scripts each, plus
//! `#[ignore]`d heavy runs on the real model (`<backend>::real_model::...`).
//!
//! A failing property prints its shrunk script as a `#[test]` calling `<backend>::replay`:
//! paste it below to keep it as a regression test.

use kvsnap_reference::ReferenceModel;

kvsnap_parity::backend_props!(
    reference,
    ReferenceModel,
    ReferenceModel::load_with_capacity
);
