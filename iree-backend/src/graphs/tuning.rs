//! An IREE tuning spec for the llvm-cpu module: lowering configurations for the dispatches
//! whose default configuration leaves bandwidth behind (the panel matvecs), passed to
//! `iree-compile` with `--iree-codegen-tuning-spec-path` (see docs/IREE.md, "Tuning the panel
//! matvecs").

use std::fmt::Write;

use kvsnap_contract::ModelConfig;

use super::manifest::{weight_specs, WeightLayout};

/// Rows of `P` per workgroup in attention's second product, the largest that divides `M`.
const PV_ROW_TILES: [usize; 4] = [64, 32, 16, 8];

/// Workers a panel matvec's workgroups are balanced for ([`balanced`]): the 2-core hosts this
/// runs on, and 4.
const BALANCED_WORKERS: [usize; 2] = [2, 4];

/// Tiles IREE's local-task processor claims at a time from a dispatch of at least `8 x workers`
/// tiles (its `IREE_HAL_CMD_DISPATCH_MAX_TILES_PER_RESERVATION`); smaller ones are claimed one
/// at a time.
const TILES_PER_RESERVATION: usize = 8;

/// Whether `tiles` workgroups keep each of `workers` busy to the end: the claims (one tile
/// each, or [`TILES_PER_RESERVATION`] from a large dispatch) divide evenly among them.
///
/// A worker that runs out of tiles while another still works parks; the next dispatch starts
/// only once it has been woken, 40-50 us later on a 2-vCPU VM. A decode step's down and o
/// projections (20 panels, 5 workgroups of 4: 3 tiles on one worker, 2 on the other) waited
/// 0.95 ms a step so, and ran 10% slower (docs/BENCHMARKS.md, twenty-fifth pass).
pub fn balanced(tiles: usize, workers: usize) -> bool {
    let claim = if tiles < workers * TILES_PER_RESERVATION {
        1
    } else {
        TILES_PER_RESERVATION
    };
    tiles.is_multiple_of(claim) && (tiles / claim).is_multiple_of(workers)
}

/// Panels per workgroup and per register tile of a matvec over `panels` panels: the preferred
/// multiple of four (a quarter of an eighth of the panels, 4 to 64), or, where that leaves a
/// worker of [`BALANCED_WORKERS`] idle, the divisor of `panels` nearest to it whose workgroup
/// count is [`balanced`] (20 panels: 5 a workgroup, 4 workgroups). The register tile is 4
/// panels, or the whole workgroup where four do not divide it (at most 8: 16 accumulators).
pub fn panel_tiles(panels: usize) -> (usize, usize) {
    let preferred = (panels / 8 / 4 * 4).clamp(4, 64);
    let fits = |p: usize| {
        panels.is_multiple_of(p) && BALANCED_WORKERS.iter().all(|&w| balanced(panels / p, w))
    };
    // The preferred tile itself where it fits (distance 0).
    let per_workgroup = (1..=64)
        .filter(|&p| fits(p))
        .min_by_key(|&p| p.abs_diff(preferred))
        .unwrap_or(preferred);
    let vector = if per_workgroup.is_multiple_of(4) {
        4
    } else {
        (1..=8.min(per_workgroup))
            .rev()
            .find(|v| per_workgroup.is_multiple_of(*v))
            .unwrap_or(1)
    };
    (per_workgroup, vector)
}

/// The tuning spec of a module whose matrices come in `layout`, if it has one.
///
/// With [`WeightLayout::Panels`] each matvec of the decode step and the head is a
/// `linalg.generic` reducing the middle dim of a `[panels, in, lanes]` weight (its first operand,
/// matched by type: the prefill's `linalg.mmt4d`s are not generics, and the gathers read the
/// table inside their bodies). IREE's default tiles one panel at a time: one chain of `in` FMAs
/// over one stream, about 18 GB/s on a 2-core AVX-512 host. Four panels per tile (four
/// accumulators, four streams) read at the machine's bandwidth: the head alone 35.7 -> 30.9 ms,
/// a `[16384, 640, 16]` reduction 36 -> 28 ms (the projections' 32-lane panels: two vectors per
/// panel and position, eight accumulators). Each workgroup takes a multiple of four panels, at
/// most 64 and at least eight workgroups' worth where the weight has them, unless that count
/// of workgroups would leave a worker idle (`panel_tiles` below).
///
/// Attention's second product, `P [M, rows] . V [rows, head_dim]` (a `linalg.matmul` where
/// there is one KV head), gets 8 x 32 register tiles with the depth loop innermost: IREE's
/// default 8 x 16 tiles with a 16-deep reduction ran a `[256, 640] . [640, 256]` in 0.88 ms on
/// the 2-core AVX-512 host, these in 0.49 ms (docs/BENCHMARKS.md, ninth pass). A decode step's
/// few rows (`M` under 8: the query heads) get `M x 64` tiles, 64 columns a workgroup: each
/// row of `V` is then read as four 256-byte runs instead of sixteen 64-byte ones, and the
/// sliding layers' products took 0.73-0.78 ms a step instead of 1.26 (twenty-third pass).
/// `attention` lists each `(M, rows)` the module's chunks multiply; the first product, `q .
/// k^T`, is left to IREE (the same tiles ran it slower, and the decode step's other tiles
/// tried gained 5% at most), and so is any shape whose `rows` equals `head_dim`, where the two
/// products' operand types would be alike.
pub fn llvm_cpu_tuning_spec(
    cfg: &ModelConfig,
    table: WeightLayout,
    layout: WeightLayout,
    attention: &[(usize, usize)],
) -> Option<String> {
    if layout != WeightLayout::Panels {
        return None;
    }
    let mut types: Vec<Vec<usize>> = weight_specs(cfg, table, layout)
        .into_iter()
        .filter(|w| w.dims.len() == 3)
        .map(|w| w.dims)
        .collect();
    types.sort_unstable();
    types.dedup();

    let mut matchers = String::new();
    let mut entries = Vec::new();
    for (i, dims) in types.iter().enumerate() {
        let (per_workgroup, vector) = panel_tiles(dims[0]);
        writeln!(
            matchers,
            r#"  transform.named_sequence @match_panels_{i}(%op: !transform.any_op {{transform.readonly}}) -> (!transform.any_op, !transform.any_param) {{
    transform.match.operation_name %op ["linalg.generic"] : !transform.any_op
    %weight = transform.get_operand %op[0] : (!transform.any_op) -> !transform.any_value
    transform.iree.match.cast_compatible_type %weight = tensor<{}x{}x{}xf32> : !transform.any_value
    %config = transform.param.constant #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<distribution = [{per_workgroup}, {lanes}, 0], vector_common_parallel = [{vector}, {lanes}, 0], vector_reduction = [0, 0, 16]>, translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>> -> !transform.any_param
    transform.yield %op, %config : !transform.any_op, !transform.any_param
  }}"#,
            dims[0], dims[1], dims[2], lanes = dims[2]
        )
        .expect("writing to a String");
        entries.push(format!("@match_panels_{i} -> @apply_op_config"));
    }
    let hd = cfg.head_dim;
    for (i, &(m, rows)) in attention.iter().enumerate() {
        if rows == hd {
            continue;
        }
        // A decode step's rows (under 8): one register tile of all of them by 64 columns.
        let (m_tile, [vm, vn]) = if m < 8 {
            (m, [m, 64])
        } else {
            // Workgroups of whole tiles: a 64-row tile over a 96-row `P` left a 32-row
            // remainder that IREE ran as scalar code (24-row chunks: 8.7 ms of sliding-layer
            // products where the 32-row chunk's took 3.3).
            let m_tile = PV_ROW_TILES
                .into_iter()
                .find(|t| m.is_multiple_of(*t))
                .unwrap_or(m);
            (m_tile, [8, 32])
        };
        writeln!(
            matchers,
            r#"  transform.named_sequence @match_pv_{i}(%op: !transform.any_op {{transform.readonly}}) -> (!transform.any_op, !transform.any_param) {{
    transform.match.operation_name %op ["linalg.matmul"] : !transform.any_op
    %p = transform.get_operand %op[0] : (!transform.any_op) -> !transform.any_value
    transform.iree.match.cast_compatible_type %p = tensor<{m}x{rows}xf32> : !transform.any_value
    %v = transform.get_operand %op[1] : (!transform.any_op) -> !transform.any_value
    transform.iree.match.cast_compatible_type %v = tensor<{rows}x{hd}xf32> : !transform.any_value
    %config = transform.param.constant #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<distribution = [{m_tile}, 64, 0], vector_common_parallel = [{vm}, {vn}, 0], vector_reduction = [0, 0, 1]>, translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>> -> !transform.any_param
    transform.yield %op, %config : !transform.any_op, !transform.any_param
  }}"#
        )
        .expect("writing to a String");
        entries.push(format!("@match_pv_{i} -> @apply_op_config"));
    }
    Some(format!(
        r#"module attributes {{iree_codegen.tuning_spec_with_default_entrypoint, transform.with_named_sequence}} {{
  transform.named_sequence @apply_op_config(%op: !transform.any_op {{transform.readonly}}, %config: !transform.any_param {{transform.readonly}}) {{
    transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param
    transform.yield
  }}
{matchers}  transform.named_sequence @__kernel_config(%variant_op: !transform.any_op {{transform.consumed}}) -> !transform.any_op attributes {{iree_codegen.tuning_spec_entrypoint}} {{
    %res = transform.foreach_match in %variant_op
        {}
      : (!transform.any_op) -> !transform.any_op
    transform.yield %res : !transform.any_op
  }}
}}
"#,
        entries.join(",\n        ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsnap_reference::tiny::{config, Preset};

    #[test]
    fn only_the_panel_layout_is_tuned_and_the_spec_matches_each_panel_shape() {
        let cfg = config(Preset::RealShapes);
        let (rows, panels) = (WeightLayout::Rows, WeightLayout::Panels);
        assert_eq!(llvm_cpu_tuning_spec(&cfg, rows, rows, &[]), None);
        let spec = llvm_cpu_tuning_spec(&cfg, panels, panels, &[]).unwrap();
        // One matcher per panel shape: the table, q, k and v stacked, o, gate and up
        // stacked, down.
        // o and down have 20 panels: 5 a workgroup, so that 4 workgroups keep 2 or 4 workers
        // busy to the end.
        for (dims, per_workgroup, vector, lanes) in [
            ("16384x640x16", 64, 4, 16),
            ("48x640x32", 4, 4, 32),
            ("20x1024x32", 5, 5, 32),
            ("128x640x32", 16, 4, 32),
            ("20x2048x32", 5, 5, 32),
        ] {
            let matched = format!("%weight = tensor<{dims}xf32>");
            assert_eq!(spec.matches(&matched).count(), 1, "{dims}");
            let at = spec.find(&matched).unwrap();
            let config = &spec[at..at + spec[at..].find("translation_info").unwrap()];
            assert!(
                config.contains(&format!(
                    "distribution = [{per_workgroup}, {lanes}, 0], vector_common_parallel = [{vector}, {lanes}, 0]"
                )),
                "{dims}: {config}"
            );
        }
        assert_eq!(spec.matches("-> @apply_op_config").count(), 5);
        // A table in rows (a screened head's module) has no panel shape to match.
        let spec = llvm_cpu_tuning_spec(&cfg, rows, panels, &[]).unwrap();
        assert!(!spec.contains("16384x640x16"));
        assert_eq!(spec.matches("-> @apply_op_config").count(), 4);
    }

    #[test]
    fn balance_follows_the_processors_claims() {
        // Under 8 tiles a worker, one tile a claim: an even share or not.
        assert!(balanced(4, 2) && balanced(12, 2) && balanced(12, 4));
        assert!(!balanced(5, 2) && !balanced(10, 4) && !balanced(1, 2));
        // From 8 a worker, 8 a claim: 20 tiles on 2 workers are claims of 8, 8 and 4.
        assert!(!balanced(20, 2) && balanced(20, 4));
        assert!(balanced(256, 2) && balanced(256, 4) && balanced(32, 2));
        assert!(!balanced(24, 2) && !balanced(40, 4));
    }

    #[test]
    fn panel_tiles_keep_every_worker_busy() {
        for panels in [4, 8, 12, 20, 40, 48, 64, 80, 128, 160, 256, 1024, 16384] {
            let (per_workgroup, vector) = panel_tiles(panels);
            assert!(
                panels.is_multiple_of(per_workgroup),
                "{panels}: {per_workgroup}"
            );
            assert!(
                per_workgroup.is_multiple_of(vector) && vector <= 8,
                "{panels}"
            );
            for workers in BALANCED_WORKERS {
                assert!(
                    balanced(panels / per_workgroup, workers),
                    "{panels} panels in {} tiles on {workers} workers",
                    panels / per_workgroup
                );
            }
        }
        // Where the preferred tile is balanced it stays; 20 panels move to 5 a workgroup.
        assert_eq!(panel_tiles(128), (16, 4));
        assert_eq!(panel_tiles(48), (4, 4));
        assert_eq!(panel_tiles(20), (5, 5));
        // No divisor balances 7 panels: the preferred tile (one partial workgroup).
        assert_eq!(panel_tiles(7), (4, 4));
    }

    #[test]
    fn attention_products_get_8_x_32_tiles_except_where_rows_equal_head_dim() {
        let cfg = config(Preset::RealShapes);
        let hd = cfg.head_dim;
        let spec = llvm_cpu_tuning_spec(
            &cfg,
            WeightLayout::Panels,
            WeightLayout::Panels,
            &[(256, 640), (96, 640), (64, hd), (4, 640)],
        )
        .unwrap();
        // Five panel shapes and the three products whose operand types tell P . V from q . k^T.
        assert_eq!(spec.matches("-> @apply_op_config").count(), 8);
        let v = format!("%v = tensor<640x{hd}xf32>");
        // Workgroups of 64 rows of P where they divide M, else the largest tile that does.
        for (m, tile) in [(256, 64), (96, 32)] {
            let p = format!("%p = tensor<{m}x640xf32>");
            let at = spec.find(&p).expect("the product is matched");
            let matcher = &spec[at..at + spec[at..].find("transform.yield").unwrap()];
            assert!(matcher.contains(&v), "{matcher}");
            assert!(
                matcher.contains(&format!(
                    "distribution = [{tile}, 64, 0], vector_common_parallel = [8, 32, 0], vector_reduction = [0, 0, 1]"
                )),
                "{matcher}"
            );
        }
        assert!(!spec.contains(&format!("tensor<64x{hd}xf32>")));
        // A decode step's 4 rows: one 4 x 64 register tile a workgroup.
        let at = spec
            .find("%p = tensor<4x640xf32>")
            .expect("the decode product");
        let matcher = &spec[at..at + spec[at..].find("transform.yield").unwrap()];
        assert!(
            matcher.contains(
                "distribution = [4, 64, 0], vector_common_parallel = [4, 64, 0], vector_reduction = [0, 0, 1]"
            ),
            "{matcher}"
        );
    }
}
