//! `ModelConfig`: the Gemma 3 text architecture as described by a Hugging Face `config.json`.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

/// Default number of tokens a KV state may hold when the caller does not choose.
pub const DEFAULT_CONTEXT_CAPACITY: usize = 4096;

/// Most decoder layers a config may declare. Checked before anything is allocated per layer, so
/// a hostile config cannot make the parser allocate gigabytes (the largest Gemma 3 has 62).
pub const MAX_LAYERS: usize = 1024;

/// The attention kind of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Sliding-window attention: key `j` is visible to query `i` iff `i - window < j <= i`.
    Sliding,
    /// Global (full causal) attention up to the context capacity.
    Global,
}

/// Everything the forward pass needs to know about a Gemma 3 text model.
///
/// Parsed from a Hugging Face `config.json` ([`ModelConfig::from_json`]); vocab, layer kinds and
/// head counts always come from the file, never from constants, so fine-tunes with added tokens and
/// other Gemma 3 sizes load unchanged.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    /// One entry per decoder layer.
    pub layer_kinds: Vec<LayerKind>,
    /// Keys visible to a sliding layer's query, the current token included.
    pub sliding_window: usize,
    /// RoPE base of global layers.
    pub rope_theta_global: f64,
    /// RoPE base of sliding layers.
    pub rope_theta_local: f64,
    /// Linear RoPE scaling factor of global layers (1.0 when the config has none).
    pub rope_linear_factor_global: f64,
    pub rms_norm_eps: f64,
    /// Attention scores are multiplied by `query_pre_attn_scalar^-0.5`.
    pub query_pre_attn_scalar: f64,
    pub final_logit_softcapping: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// Tokens a KV state may hold; at most `max_position_embeddings`.
    pub context_capacity: usize,
    pub bos_token_id: u32,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Reads and parses `config.json` at `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json(&text, path)
    }

    /// The `config.json` of a model directory, with `capacity` tokens of context per KV state
    /// when given (else [`DEFAULT_CONTEXT_CAPACITY`]); a capacity the config cannot take is a
    /// [`Error::Config`] naming the file.
    pub fn from_dir(dir: &Path, capacity: Option<usize>) -> Result<Self> {
        let path = dir.join("config.json");
        let cfg = Self::from_file(&path)?;
        match capacity {
            Some(capacity) => cfg
                .with_context_capacity(capacity)
                .map_err(|problem| Error::Config { path, problem }),
            None => Ok(cfg),
        }
    }

    /// Parses a Hugging Face Gemma 3 text config (`model_type` `gemma3_text`, or a `gemma3`
    /// config whose `text_config` holds it). `path` is only used in error messages.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let bad = |problem: String| Error::Config {
            path: path.to_path_buf(),
            problem,
        };
        let root: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let cfg = root.get("text_config").unwrap_or(&root);
        if !cfg.is_object() {
            return Err(bad("top level is not a JSON object".into()));
        }
        let p = Parser { cfg, bad: &bad };

        let hidden_size = p.usize("hidden_size", None)?;
        let num_layers = p.usize("num_hidden_layers", None)?;
        if num_layers > MAX_LAYERS {
            return Err(bad(format!(
                "num_hidden_layers {num_layers} is more than kvsnap supports ({MAX_LAYERS})"
            )));
        }
        let num_attention_heads = p.usize("num_attention_heads", None)?;
        let num_key_value_heads = p.usize("num_key_value_heads", Some(num_attention_heads))?;
        let head_dim = p.usize("head_dim", Some(hidden_size / num_attention_heads.max(1)))?;
        let sliding_window = p.usize("sliding_window", Some(4096))?;
        let max_position_embeddings = p.usize("max_position_embeddings", Some(131072))?;

        let activation = cfg
            .get("hidden_activation")
            .or_else(|| cfg.get("hidden_act"))
            .and_then(Value::as_str)
            .unwrap_or("gelu_pytorch_tanh");
        if activation != "gelu_pytorch_tanh" {
            return Err(bad(format!(
                "hidden_activation `{activation}` is not supported (only gelu_pytorch_tanh)"
            )));
        }

        let layer_kinds = match cfg.get("layer_types") {
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("sliding_attention") => Ok(LayerKind::Sliding),
                    Some("full_attention") => Ok(LayerKind::Global),
                    other => Err(bad(format!("layer_types[{i}] is {other:?}"))),
                })
                .collect::<Result<Vec<_>>>()?,
            Some(_) => return Err(bad("layer_types is not an array".into())),
            None => {
                // Older configs: every `sliding_window_pattern`-th layer is global.
                let pattern = p.usize("sliding_window_pattern", Some(6))?.max(1);
                (0..num_layers)
                    .map(|i| {
                        if (i + 1) % pattern == 0 {
                            LayerKind::Global
                        } else {
                            LayerKind::Sliding
                        }
                    })
                    .collect()
            }
        };
        if layer_kinds.len() != num_layers {
            return Err(bad(format!(
                "layer_types has {} entries but num_hidden_layers is {num_layers}",
                layer_kinds.len()
            )));
        }

        let (rope_theta_global, rope_theta_local, rope_linear_factor_global) = p.rope()?;

        let eos_token_ids = match cfg.get("eos_token_id") {
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|v| v.as_u64().map(|x| x as u32))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("eos_token_id holds a non-integer".into()))?,
            Some(v) => vec![v
                .as_u64()
                .ok_or_else(|| bad("eos_token_id is not an integer".into()))?
                as u32],
            None => vec![1],
        };

        let config = ModelConfig {
            hidden_size,
            intermediate_size: p.usize("intermediate_size", None)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: p.usize("vocab_size", None)?,
            layer_kinds,
            sliding_window,
            rope_theta_global,
            rope_theta_local,
            rope_linear_factor_global,
            rms_norm_eps: p.f64("rms_norm_eps", Some(1e-6))?,
            query_pre_attn_scalar: p.f64("query_pre_attn_scalar", Some(head_dim as f64))?,
            final_logit_softcapping: p.opt_f64("final_logit_softcapping")?,
            attn_logit_softcapping: p.opt_f64("attn_logit_softcapping")?,
            tie_word_embeddings: cfg
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            max_position_embeddings,
            context_capacity: DEFAULT_CONTEXT_CAPACITY.min(max_position_embeddings),
            bos_token_id: p.usize("bos_token_id", Some(2))? as u32,
            eos_token_ids,
        };
        config.validate().map_err(bad)?;
        Ok(config)
    }

    /// Returns a copy with another context capacity, checked against `max_position_embeddings`.
    pub fn with_context_capacity(mut self, capacity: usize) -> std::result::Result<Self, String> {
        if capacity == 0 || capacity > self.max_position_embeddings {
            return Err(format!(
                "context capacity {capacity} must be in 1..={}",
                self.max_position_embeddings
            ));
        }
        self.context_capacity = capacity;
        Ok(self)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("num_hidden_layers", self.layer_kinds.len()),
            ("sliding_window", self.sliding_window),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be positive"));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        if !self.tie_word_embeddings {
            return Err("untied LM heads are not supported (Gemma 3 ties them)".into());
        }
        Ok(())
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layer_kinds.len()
    }

    /// Query heads that share one KV head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Floats in one K (or V) row of one layer: `num_key_value_heads * head_dim`.
    pub fn kv_row(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// RoPE base of layer `layer`.
    pub fn rope_theta(&self, layer: usize) -> f64 {
        match self.layer_kinds[layer] {
            LayerKind::Global => self.rope_theta_global,
            LayerKind::Sliding => self.rope_theta_local,
        }
    }

    /// The embedding scale `sqrt(hidden_size)`, rounded to f32 as transformers does.
    pub fn embed_scale(&self) -> f32 {
        (self.hidden_size as f64).sqrt() as f32
    }

    /// The attention score scale `query_pre_attn_scalar^-0.5`.
    pub fn attn_scale(&self) -> f32 {
        self.query_pre_attn_scalar.powf(-0.5) as f32
    }

    /// Bytes of live KV state (f32) for `tokens` cached tokens, sliding layers trimmed to their
    /// window.
    pub fn kv_bytes(&self, tokens: usize) -> u64 {
        let rows: usize = self
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Global => tokens,
                LayerKind::Sliding => tokens.min(self.sliding_window),
            })
            .sum();
        (rows * 2 * self.kv_row() * 4) as u64
    }
}

struct Parser<'a, F: Fn(String) -> Error> {
    cfg: &'a Value,
    bad: &'a F,
}

impl<F: Fn(String) -> Error> Parser<'_, F> {
    fn usize(&self, key: &str, default: Option<usize>) -> Result<usize> {
        match self.cfg.get(key) {
            Some(Value::Null) | None => {
                default.ok_or_else(|| (self.bad)(format!("missing `{key}`")))
            }
            Some(v) => v
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| (self.bad)(format!("`{key}` is not a non-negative integer: {v}"))),
        }
    }

    fn f64(&self, key: &str, default: Option<f64>) -> Result<f64> {
        match self.opt_f64(key)? {
            Some(x) => Ok(x),
            None => default.ok_or_else(|| (self.bad)(format!("missing `{key}`"))),
        }
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.cfg.get(key) {
            Some(Value::Null) | None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| (self.bad)(format!("`{key}` is not a number: {v}"))),
        }
    }

    /// (global theta, local theta, global linear factor) from either the transformers 4
    /// keys (`rope_theta`, `rope_local_base_freq`, `rope_scaling`) or the transformers 5
    /// `rope_parameters` map keyed by layer type.
    fn rope(&self) -> Result<(f64, f64, f64)> {
        let factor = |scaling: Option<&Value>, what: &str| -> Result<f64> {
            match scaling {
                None | Some(Value::Null) => Ok(1.0),
                Some(s) => {
                    let kind = s
                        .get("rope_type")
                        .or_else(|| s.get("type"))
                        .and_then(Value::as_str)
                        .unwrap_or("default");
                    match kind {
                        "default" => Ok(1.0),
                        "linear" => s.get("factor").and_then(Value::as_f64).ok_or_else(|| {
                            (self.bad)(format!("{what}: linear RoPE scaling without a factor"))
                        }),
                        other => Err((self.bad)(format!(
                            "{what}: RoPE scaling `{other}` is not supported"
                        ))),
                    }
                }
            }
        };
        if let Some(params) = self.cfg.get("rope_parameters").filter(|v| !v.is_null()) {
            let theta = |kind: &str| -> Result<f64> {
                params
                    .get(kind)
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Value::as_f64)
                    .ok_or_else(|| (self.bad)(format!("rope_parameters.{kind}.rope_theta missing")))
            };
            let global = theta("full_attention")?;
            let local = theta("sliding_attention")?;
            let f = factor(
                params.get("full_attention"),
                "rope_parameters.full_attention",
            )?;
            return Ok((global, local, f));
        }
        let global = self.f64("rope_theta", Some(1_000_000.0))?;
        let local = self.f64("rope_local_base_freq", Some(10_000.0))?;
        let f = factor(self.cfg.get("rope_scaling"), "rope_scaling")?;
        Ok((global, local, f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GEMMA_270M: &str = r#"{
      "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": null,
      "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": null,
      "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640,
      "intermediate_size": 2048,
      "layer_types": ["sliding_attention","sliding_attention","sliding_attention",
        "sliding_attention","sliding_attention","full_attention","sliding_attention",
        "sliding_attention","sliding_attention","sliding_attention","sliding_attention",
        "full_attention","sliding_attention","sliding_attention","sliding_attention",
        "sliding_attention","sliding_attention","full_attention"],
      "max_position_embeddings": 32768, "model_type": "gemma3_text",
      "num_attention_heads": 4, "num_hidden_layers": 18, "num_key_value_heads": 1,
      "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0,
      "rope_scaling": null, "rope_theta": 1000000.0, "sliding_window": 512,
      "tie_word_embeddings": true, "vocab_size": 262144
    }"#;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_json(text, Path::new("config.json"))
    }

    #[test]
    fn parses_gemma_3_270m() {
        let c = parse(GEMMA_270M).unwrap();
        assert_eq!(c.num_layers(), 18);
        let globals: Vec<usize> = (0..18)
            .filter(|&i| c.layer_kinds[i] == LayerKind::Global)
            .collect();
        assert_eq!(globals, [5, 11, 17]);
        assert_eq!(c.rope_theta(5), 1e6);
        assert_eq!(c.rope_theta(0), 1e4);
        assert_eq!(c.attn_scale(), 1.0 / 16.0);
        assert_eq!(c.eos_token_ids, [1, 106]);
        assert_eq!(c.context_capacity, 4096);
        // 36 KiB per token untrimmed (MISSION.md); 853 tokens trimmed: 3 global layers keep all,
        // 15 sliding layers keep 512.
        assert_eq!(c.kv_bytes(1), 36 * 1024);
        assert_eq!(c.kv_bytes(853), ((3 * 853 + 15 * 512) * 2 * 256 * 4) as u64);
    }

    #[test]
    fn transformers_5_rope_parameters() {
        let text = GEMMA_270M.replace(
            r#""rope_scaling": null, "rope_theta": 1000000.0,"#,
            r#""rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 500.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 7.0}},"#,
        );
        let c = parse(&text).unwrap();
        assert_eq!(
            (
                c.rope_theta_global,
                c.rope_theta_local,
                c.rope_linear_factor_global
            ),
            (500.0, 7.0, 8.0)
        );
    }

    #[test]
    fn errors_name_the_problem() {
        let e =
            parse(&GEMMA_270M.replace(r#""num_hidden_layers": 18"#, r#""num_hidden_layers": 17"#))
                .unwrap_err()
                .to_string();
        assert!(
            e.contains("layer_types has 18 entries but num_hidden_layers is 17"),
            "{e}"
        );
        let e = parse(&GEMMA_270M.replace(r#""vocab_size": 262144"#, r#""vocab_size": -3"#))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`vocab_size` is not a non-negative integer"),
            "{e}"
        );
        let e = parse(
            &GEMMA_270M.replace(r#""num_key_value_heads": 1"#, r#""num_key_value_heads": 3"#),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not a multiple of num_key_value_heads 3"), "{e}");
        assert!(matches!(parse("[1,2]"), Err(Error::Config { .. })));
        // Found by fuzzing: a huge layer count must be refused before anything is allocated.
        let e = parse(r#"{"hidden_size":8,"num_hidden_layers":4000000000,"num_attention_heads":1,"intermediate_size":1,"vocab_size":1}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("num_hidden_layers 4000000000 is more than kvsnap supports"),
            "{e}"
        );
        assert!(matches!(parse("{"), Err(Error::Config { .. })));
    }

    #[test]
    fn capacity_is_bounded_by_max_positions() {
        let c = parse(GEMMA_270M).unwrap();
        assert!(c.clone().with_context_capacity(32768).is_ok());
        assert!(c.clone().with_context_capacity(32769).is_err());
        assert!(c.with_context_capacity(0).is_err());
    }

    #[test]
    fn from_dir_applies_the_capacity_and_names_the_file() {
        let dir = std::env::temp_dir().join(format!("kvsnap-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), GEMMA_270M).unwrap();
        assert_eq!(
            ModelConfig::from_dir(&dir, None).unwrap().context_capacity,
            DEFAULT_CONTEXT_CAPACITY
        );
        assert_eq!(
            ModelConfig::from_dir(&dir, Some(48))
                .unwrap()
                .context_capacity,
            48
        );
        match ModelConfig::from_dir(&dir, Some(32769)) {
            Err(Error::Config { path, .. }) => assert_eq!(path, dir.join("config.json")),
            other => panic!("{other:?}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
