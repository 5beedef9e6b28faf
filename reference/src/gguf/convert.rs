//! llama.cpp's Gemma 3 GGUF layout to a Hugging Face Gemma 3 text checkpoint: tensor names,
//! shapes, norm weights and `config.json`.

use std::collections::BTreeMap;

use kvsnap_contract::{Error, LayerKind, ModelConfig, Result};
use rayon::prelude::*;
use serde_json::{json, Value as Json};

use super::reader::GgufFile;
use crate::weights::TensorOut;

/// The only `general.architecture` this converter understands.
pub const ARCHITECTURE: &str = "gemma3";

/// Every `SLIDING_WINDOW_PATTERN`-th layer is global; GGUF does not record it for Gemma 3.
pub const SLIDING_WINDOW_PATTERN: usize = 6;

/// RoPE base of the sliding layers; GGUF records only the global one (`rope.freq_base`).
pub const ROPE_LOCAL_BASE_FREQ: f64 = 10_000.0;

/// Per-layer GGUF suffix -> HF suffix under `model.layers.N.`.
const LAYER_TENSORS: [(&str, &str); 13] = [
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("attn_norm.weight", "input_layernorm.weight"),
    (
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
    ),
    ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
    ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// The HF name of GGUF tensor `name`, if it is one of Gemma 3's.
pub fn hf_tensor_name(name: &str) -> Option<String> {
    match name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    // Only canonical decimal layer numbers: "01" or "+1" would alias another layer's name.
    let layer: usize = layer
        .parse()
        .ok()
        .filter(|n: &usize| n.to_string() == layer)?;
    let (_, hf) = LAYER_TENSORS.iter().find(|(g, _)| *g == suffix)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Whether the GGUF tensor is an RMSNorm weight, which llama.cpp stores as `1 + w`.
pub fn is_norm(name: &str) -> bool {
    name.ends_with("norm.weight")
}

/// The row-major shape of every tensor of an HF Gemma 3 text checkpoint with config `cfg`
/// (tied head: no `lm_head.weight`).
pub fn hf_shapes(cfg: &ModelConfig) -> BTreeMap<String, Vec<usize>> {
    let (h, hd, f) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let mut shapes = BTreeMap::new();
    shapes.insert("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h]);
    shapes.insert("model.norm.weight".into(), vec![h]);
    for l in 0..cfg.num_layers() {
        let layer: [(&str, Vec<usize>); 13] = [
            ("self_attn.q_proj.weight", vec![q, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.o_proj.weight", vec![h, q]),
            ("self_attn.q_norm.weight", vec![hd]),
            ("self_attn.k_norm.weight", vec![hd]),
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
            ("pre_feedforward_layernorm.weight", vec![h]),
            ("post_feedforward_layernorm.weight", vec![h]),
            ("mlp.gate_proj.weight", vec![f, h]),
            ("mlp.up_proj.weight", vec![f, h]),
            ("mlp.down_proj.weight", vec![h, f]),
        ];
        for (name, shape) in layer {
            shapes.insert(format!("model.layers.{l}.{name}"), shape);
        }
    }
    shapes
}

/// Reads metadata of a Gemma 3 GGUF.
struct Meta<'a> {
    gguf: &'a GgufFile,
}

impl Meta<'_> {
    fn bad(&self, problem: String) -> Error {
        Error::Format {
            path: self.gguf.path().to_path_buf(),
            format: "gguf",
            problem,
        }
    }

    fn key(name: &str) -> String {
        format!("{ARCHITECTURE}.{name}")
    }

    fn opt_usize(&self, name: &str) -> Result<Option<usize>> {
        let key = Self::key(name);
        match self.gguf.get(&key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.bad(format!("metadata `{key}` is {v:?}, expected a count"))),
        }
    }

    fn usize(&self, name: &str) -> Result<usize> {
        self.opt_usize(name)?
            .ok_or_else(|| self.bad(format!("missing metadata `{}`", Self::key(name))))
    }

    /// A positive float, as the shortest decimal that round-trips its stored width: an f32
    /// epsilon of 9.99999997e-7 becomes 1e-6 in config.json, as in the original HF config.
    fn positive_float(&self, name: &str) -> Result<f64> {
        let key = Self::key(name);
        let v = self
            .gguf
            .get(&key)
            .ok_or_else(|| self.bad(format!("missing metadata `{key}`")))?;
        let x = match v {
            super::Value::F32(x) => format!("{x}").parse::<f64>().ok(),
            other => other.as_f64(),
        };
        x.filter(|x| x.is_finite() && *x > 0.0).ok_or_else(|| {
            self.bad(format!(
                "metadata `{key}` is {v:?}, expected a positive float"
            ))
        })
    }
}

/// Builds the HF `config.json` (`Gemma3ForCausalLM`, `gemma3_text`) from GGUF metadata.
///
/// What GGUF does not record is taken from Gemma 3 itself: every 6th layer global, local RoPE
/// base 10000, `query_pre_attn_scalar` = head dim (true for every size but 27B), bos 2, eos
/// `[1, 106]` (`<eos>` and `<end_of_turn>`), tied embeddings. The vocabulary size is the row count
/// of `token_embd.weight`, so fine-tunes with added tokens keep theirs.
pub fn hf_config(gguf: &GgufFile) -> Result<Json> {
    let m = Meta { gguf };
    let arch = gguf
        .get("general.architecture")
        .ok_or_else(|| m.bad("missing metadata `general.architecture`".into()))?;
    if arch.as_str() != Some(ARCHITECTURE) {
        return Err(m.bad(format!(
            "general.architecture is {arch:?}; only `{ARCHITECTURE}` (Gemma 3) can be imported"
        )));
    }
    let hidden = m.usize("embedding_length")?;
    let layers = m.usize("block_count")?;
    if layers > kvsnap_contract::MAX_LAYERS {
        return Err(m.bad(format!(
            "block_count {layers} is more than kvsnap supports ({})",
            kvsnap_contract::MAX_LAYERS
        )));
    }
    let heads = m.usize("attention.head_count")?;
    let kv_heads = m.usize("attention.head_count_kv")?;
    let head_dim = m.usize("attention.key_length")?;
    if let Some(v) = m.opt_usize("attention.value_length")? {
        if v != head_dim {
            return Err(m.bad(format!(
                "attention.value_length {v} differs from key_length {head_dim}; Gemma 3 has one \
                 head_dim"
            )));
        }
    }
    let ffn = m.usize("feed_forward_length")?;
    let context = m.usize("context_length")?;
    let window = m.usize("attention.sliding_window")?;
    let rope_theta = m.positive_float("rope.freq_base")?;
    let eps = m.positive_float("attention.layer_norm_rms_epsilon")?;
    let rope_scaling = match gguf
        .get(&Meta::key("rope.scaling.type"))
        .map(|v| v.as_str())
    {
        None | Some(Some("none")) => Json::Null,
        Some(Some("linear")) => {
            json!({"rope_type": "linear", "factor": m.positive_float("rope.scaling.factor")?})
        }
        Some(other) => {
            return Err(m.bad(format!(
                "RoPE scaling {other:?} is not supported (none or linear)"
            )))
        }
    };
    let embd = gguf
        .tensor("token_embd.weight")
        .ok_or_else(|| Error::WeightsMismatch {
            path: gguf.path().to_path_buf(),
            tensor: "token_embd.weight".into(),
            problem: "missing".into(),
        })?;
    let vocab = match embd.row_major_shape()[..] {
        [rows, cols] if cols == hidden => rows,
        ref shape => {
            return Err(Error::WeightsMismatch {
                path: gguf.path().to_path_buf(),
                tensor: embd.name.clone(),
                problem: format!("shape {shape:?}, expected [vocab, {hidden}]"),
            })
        }
    };
    let layer_types: Vec<&str> = layer_kinds(layers)
        .into_iter()
        .map(|kind| match kind {
            LayerKind::Global => "full_attention",
            LayerKind::Sliding => "sliding_attention",
        })
        .collect();
    Ok(json!({
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": null,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "final_logit_softcapping": null,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": ffn,
        "layer_types": layer_types,
        "max_position_embeddings": context,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "pad_token_id": 0,
        "query_pre_attn_scalar": head_dim,
        "rms_norm_eps": eps,
        "rope_local_base_freq": ROPE_LOCAL_BASE_FREQ,
        "rope_scaling": rope_scaling,
        "rope_theta": rope_theta,
        "sliding_window": window,
        "_sliding_window_pattern": SLIDING_WINDOW_PATTERN,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
        "use_cache": true,
        "vocab_size": vocab,
    }))
}

/// Dequantizes every tensor of `gguf` into HF names and row-major shapes, checked against `cfg`.
///
/// GGUF dims are `ne0` first, so the HF shape is their reverse and the data needs no transpose.
/// Norm weights become `stored - 1` in f32 (what gguf-py's values give HF's `w`); every HF tensor
/// must be present exactly once and nothing else may be in the file.
pub fn hf_tensors(gguf: &GgufFile, cfg: &ModelConfig) -> Result<Vec<TensorOut>> {
    let mismatch = |tensor: &str, problem: String| Error::WeightsMismatch {
        path: gguf.path().to_path_buf(),
        tensor: tensor.to_string(),
        problem,
    };
    let mut expected = hf_shapes(cfg);
    let mut out = Vec::with_capacity(gguf.tensors().len());
    for t in gguf.tensors() {
        let Some(name) = hf_tensor_name(&t.name) else {
            let why = if t.name == "output.weight" {
                "an untied LM head; kvsnap's Gemma 3 ties it to token_embd".to_string()
            } else {
                "no Hugging Face Gemma 3 tensor corresponds to it".to_string()
            };
            return Err(mismatch(&t.name, why));
        };
        let Some(want) = expected.remove(&name) else {
            return Err(mismatch(
                &t.name,
                format!(
                    "maps to `{name}`, which a {}-layer model does not have",
                    cfg.num_layers()
                ),
            ));
        };
        let shape = t.row_major_shape();
        if shape != want {
            return Err(mismatch(
                &t.name,
                format!(
                    "shape {shape:?} (GGUF dims {:?}), expected {want:?}",
                    t.dims
                ),
            ));
        }
        let mut data = gguf.dequantize(t)?;
        if is_norm(&t.name) {
            data.par_iter_mut().for_each(|x| *x -= 1.0);
        }
        out.push(TensorOut { name, shape, data });
    }
    if let Some(name) = expected.keys().next() {
        return Err(mismatch(name, "missing from the GGUF".into()));
    }
    Ok(out)
}

/// The layer kinds written to `layer_types`: every [`SLIDING_WINDOW_PATTERN`]-th layer global.
pub fn layer_kinds(layers: usize) -> Vec<LayerKind> {
    (0..layers)
        .map(|i| {
            if (i + 1) % SLIDING_WINDOW_PATTERN == 0 {
                LayerKind::Global
            } else {
                LayerKind::Sliding
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hf() {
        assert_eq!(
            hf_tensor_name("blk.17.attn_output.weight").as_deref(),
            Some("model.layers.17.self_attn.o_proj.weight")
        );
        assert_eq!(
            hf_tensor_name("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.pre_feedforward_layernorm.weight")
        );
        assert_eq!(
            hf_tensor_name("token_embd.weight").as_deref(),
            Some("model.embed_tokens.weight")
        );
        assert_eq!(
            hf_tensor_name("output_norm.weight").as_deref(),
            Some("model.norm.weight")
        );
        for bad in [
            "blk.01.attn_q.weight",
            "blk.+1.attn_q.weight",
            "blk.x.attn_q.weight",
        ] {
            assert_eq!(hf_tensor_name(bad), None, "{bad}");
        }
        assert_eq!(hf_tensor_name("blk.0.attn_q.bias"), None);
        assert_eq!(hf_tensor_name("output.weight"), None);
    }

    #[test]
    fn every_norm_and_only_norms_are_shifted() {
        let norms: Vec<&str> = LAYER_TENSORS
            .iter()
            .map(|(g, _)| *g)
            .filter(|g| is_norm(g))
            .collect();
        assert_eq!(
            norms,
            [
                "attn_q_norm.weight",
                "attn_k_norm.weight",
                "attn_norm.weight",
                "post_attention_norm.weight",
                "ffn_norm.weight",
                "post_ffw_norm.weight"
            ]
        );
        assert!(is_norm("output_norm.weight"));
        assert!(!is_norm("token_embd.weight"));
    }

    #[test]
    fn every_sixth_layer_is_global() {
        let kinds = layer_kinds(18);
        let globals: Vec<usize> = (0..18).filter(|&i| kinds[i] == LayerKind::Global).collect();
        assert_eq!(globals, [5, 11, 17]);
    }
}
