//! An IREE tuning spec for the llvm-cpu module: a lowering configuration for the one dispatch
//! whose default configuration leaves bandwidth behind, passed to `iree-compile` with
//! `--iree-codegen-tuning-spec-path` (see docs/IREE.md, "Tuning the head").

use kvsnap_contract::ModelConfig;

use super::manifest::EmbedLayout;

/// The tuning spec of a module taking the embedding table in `embed`'s layout, if it has one.
///
/// With [`EmbedLayout::Panels`] the head is a `linalg.generic` reducing the middle dim of the
/// `[panels, hidden, 16]` table (its first operand, matched by type: no other op takes the
/// table as an operand; the gathers read it inside their bodies). IREE's default tiles one panel
/// at a time: one chain of `hidden` FMAs over one stream, about 18 GB/s on a 2-core AVX-512
/// host. Four panels per tile (four accumulators, four streams) read at the machine's bandwidth:
/// the head alone 35.7 -> 30.9 ms, a `[16384, 640, 16]` reduction 36 -> 28 ms.
pub fn llvm_cpu_tuning_spec(cfg: &ModelConfig, embed: EmbedLayout) -> Option<String> {
    if embed != EmbedLayout::Panels {
        return None;
    }
    let dims = embed.dims(cfg.vocab_size, cfg.hidden_size);
    let table = format!("tensor<{}x{}x{}xf32>", dims[0], dims[1], dims[2]);
    Some(format!(
        r#"module attributes {{iree_codegen.tuning_spec_with_default_entrypoint, transform.with_named_sequence}} {{
  transform.named_sequence @apply_op_config(%op: !transform.any_op {{transform.readonly}}, %config: !transform.any_param {{transform.readonly}}) {{
    transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param
    transform.yield
  }}
  transform.named_sequence @match_head(%op: !transform.any_op {{transform.readonly}}) -> (!transform.any_op, !transform.any_param) {{
    transform.match.operation_name %op ["linalg.generic"] : !transform.any_op
    %table = transform.get_operand %op[0] : (!transform.any_op) -> !transform.any_value
    transform.iree.match.cast_compatible_type %table = {table} : !transform.any_value
    %config = transform.param.constant #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<distribution = [64, 16, 0], vector_common_parallel = [4, 16, 0], vector_reduction = [0, 0, 16]>, translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>> -> !transform.any_param
    transform.yield %op, %config : !transform.any_op, !transform.any_param
  }}
  transform.named_sequence @__kernel_config(%variant_op: !transform.any_op {{transform.consumed}}) -> !transform.any_op attributes {{iree_codegen.tuning_spec_entrypoint}} {{
    %res = transform.foreach_match in %variant_op
        @match_head -> @apply_op_config
      : (!transform.any_op) -> !transform.any_op
    transform.yield %res : !transform.any_op
  }}
}}
"#
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsnap_reference::tiny::{config, Preset};

    #[test]
    fn only_the_panel_layout_is_tuned_and_the_spec_matches_its_table() {
        let cfg = config(Preset::RealShapes);
        assert_eq!(llvm_cpu_tuning_spec(&cfg, EmbedLayout::Rows), None);
        let spec = llvm_cpu_tuning_spec(&cfg, EmbedLayout::Panels).unwrap();
        assert!(spec.contains("cast_compatible_type %table = tensor<16384x640x16xf32>"));
        assert!(spec.contains("vector_common_parallel = [4, 16, 0]"));
    }
}
