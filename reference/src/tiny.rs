//! Deterministic random Gemma 3 models in Hugging Face format, for fast tests of every code path
//! and for timing without the real weights.
//!
//! [`write_model`] writes `config.json` and `model.safetensors` (f32, HF tensor names) that
//! transformers loads as `Gemma3ForCausalLM` and [`ModelConfig::from_file`] parses.
//!
//! The weights must stay byte-identical forever (golden sets record the sha256 of
//! `model.safetensors`), so they come from our own counter-based splitmix64 stream, not the `rand`
//! crate, and are shaped towards a normal distribution with additions and multiplications only
//! (a sum of uniforms): no `ln`/`cos`, whose last bit may differ between platforms' libm.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use kvsnap_contract::{Error, ModelConfig, Result};
use rayon::prelude::*;
use serde::Serialize;

use crate::weights::{write_safetensors, TensorOut};

/// `n` deterministic values in [-1, 1) from a xorshift stream seeded by `seed`: the operands of
/// the kernel tests, the criterion benches and the IREE screen test (not the models' weights,
/// which come from [`random_weights`]).
pub fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Seed used when the caller does not choose one (the committed tiny goldens use it).
pub const DEFAULT_SEED: u64 = 0;

/// The shapes of a random model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Preset {
    /// A few-layer model that runs in microseconds: 6 layers `[S, S, G, S, S, G]`, 4 query heads
    /// over 2 KV heads (GQA with more than one KV head), head_dim 32 (so `heads * head_dim`
    /// differs from `hidden`), hidden 64, FFN 128, vocab 512, a 6-token window and
    /// `query_pre_attn_scalar` 24 (not head_dim, so a wrong attention scale shows).
    #[default]
    Tiny,
    /// The shapes of Gemma 3 270M (268M parameters) with random weights, for timing on machines
    /// without the real weights.
    RealShapes,
}

impl Preset {
    /// Every preset, in CLI order.
    pub const ALL: [Preset; 2] = [Preset::Tiny, Preset::RealShapes];

    /// The CLI name (`tiny`, `real-shapes`).
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::RealShapes => "real-shapes",
        }
    }

    fn spec(self) -> Spec {
        match self {
            Preset::Tiny => Spec {
                hidden: 64,
                ffn: 128,
                heads: 4,
                kv_heads: 2,
                head_dim: 32,
                vocab: 512,
                globals: &[2, 5],
                layers: 6,
                window: 6,
                query_pre_attn_scalar: 24,
                max_positions: 128,
            },
            Preset::RealShapes => Spec {
                hidden: 640,
                ffn: 2048,
                heads: 4,
                kv_heads: 1,
                head_dim: 256,
                vocab: 262_144,
                globals: &[5, 11, 17],
                layers: 18,
                window: 512,
                query_pre_attn_scalar: 256,
                max_positions: 32_768,
            },
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Preset::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Preset::ALL.iter().map(|p| p.name()).collect();
                format!(
                    "unknown preset `{s}` (expected one of: {})",
                    names.join(", ")
                )
            })
    }
}

/// The numbers that differ between presets; everything else is Gemma 3's.
struct Spec {
    hidden: usize,
    ffn: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    /// Indices of the global (full attention) layers.
    globals: &'static [usize],
    layers: usize,
    window: usize,
    query_pre_attn_scalar: usize,
    max_positions: usize,
}

/// `config.json` as transformers 5's `Gemma3TextConfig` reads it. A struct rather than a JSON map
/// so that the key order (and so the file's bytes) never depends on serde_json features.
#[derive(Serialize)]
struct HfConfig {
    architectures: [&'static str; 1],
    model_type: &'static str,
    attention_bias: bool,
    attention_dropout: f64,
    attn_logit_softcapping: Option<f64>,
    bos_token_id: u32,
    dtype: &'static str,
    eos_token_id: u32,
    final_logit_softcapping: Option<f64>,
    head_dim: usize,
    hidden_activation: &'static str,
    hidden_size: usize,
    initializer_range: f64,
    intermediate_size: usize,
    layer_types: Vec<&'static str>,
    max_position_embeddings: usize,
    num_attention_heads: usize,
    num_hidden_layers: usize,
    num_key_value_heads: usize,
    pad_token_id: u32,
    query_pre_attn_scalar: usize,
    rms_norm_eps: f64,
    rope_parameters: RopeParameters,
    sliding_window: usize,
    tie_word_embeddings: bool,
    use_bidirectional_attention: bool,
    use_cache: bool,
    vocab_size: usize,
}

/// transformers 5's per-layer-type RoPE map.
#[derive(Serialize)]
struct RopeParameters {
    full_attention: Rope,
    sliding_attention: Rope,
}

#[derive(Serialize)]
struct Rope {
    rope_type: &'static str,
    rope_theta: f64,
}

/// The `config.json` text of `preset`.
pub fn config_json(preset: Preset) -> String {
    let s = preset.spec();
    let rope = |theta| Rope {
        rope_type: "default",
        rope_theta: theta,
    };
    let config = HfConfig {
        architectures: ["Gemma3ForCausalLM"],
        model_type: "gemma3_text",
        attention_bias: false,
        attention_dropout: 0.0,
        attn_logit_softcapping: None,
        bos_token_id: 2,
        dtype: "float32",
        eos_token_id: 1,
        final_logit_softcapping: None,
        head_dim: s.head_dim,
        hidden_activation: "gelu_pytorch_tanh",
        hidden_size: s.hidden,
        initializer_range: 0.02,
        intermediate_size: s.ffn,
        layer_types: (0..s.layers)
            .map(|i| {
                if s.globals.contains(&i) {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect(),
        max_position_embeddings: s.max_positions,
        num_attention_heads: s.heads,
        num_hidden_layers: s.layers,
        num_key_value_heads: s.kv_heads,
        pad_token_id: 0,
        query_pre_attn_scalar: s.query_pre_attn_scalar,
        rms_norm_eps: 1e-6,
        rope_parameters: RopeParameters {
            full_attention: rope(1_000_000.0),
            sliding_attention: rope(10_000.0),
        },
        sliding_window: s.window,
        tie_word_embeddings: true,
        use_bidirectional_attention: false,
        use_cache: true,
        vocab_size: s.vocab,
    };
    let mut text = serde_json::to_string_pretty(&config).expect("a plain struct serialises");
    text.push('\n');
    text
}

/// The parsed config of `preset` (what [`ModelConfig::from_file`] reads back from the written
/// `config.json`).
pub fn config(preset: Preset) -> ModelConfig {
    ModelConfig::from_json(&config_json(preset), Path::new("config.json"))
        .expect("the presets are valid Gemma 3 configs")
}

/// Spread (standard deviation) of the logits over the vocabulary, so greedy margins are rarely
/// near-ties.
const LOGIT_SPREAD: f64 = 3.0;
/// Relative spread of the norm weights' `1 + w` per channel, so an implementation that forgets
/// the `1 +` (or adds it twice) is caught.
const NORM_SPREAD: f64 = 0.3;

/// Mean and standard deviation of one tensor's values.
#[derive(Clone, Copy)]
struct Dist {
    mean: f64,
    std: f64,
}

/// Random weights for any Gemma 3 text config, as HF tensors (tied head: no `lm_head.weight`).
///
/// Every tensor has its own stream keyed by `seed` and its name, so the order tensors are
/// generated in does not matter. Scales, and why:
/// - linear weights: std `1 / sqrt(fan_in)`, so activations stay at unit scale;
/// - norm weights: `w = NORM_SPREAD * N(0, 1)`, so `1 + w` is about 1 and differs per channel;
/// - embeddings: with tied embeddings a random model's logits are dominated by the input token
///   itself (its embedding stays in the residual stream and meets itself in the head), so greedy
///   would repeat the last token. The embedding rows are kept small instead: the scaled input
///   (RMS `e = sqrt(2 * layers / hidden)`) is then about `1 / sqrt(hidden)` of the final residual
///   (2 * layers unit-RMS sandwich-norm outputs), which makes the token's self-logit comparable
///   to the spread of the others. The final norm's `1 + w` (about `LOGIT_SPREAD / e`) restores
///   the logit spread.
///
/// # Shapes
/// `embed_tokens [vocab, hidden]`; per layer `q_proj [heads * head_dim, hidden]`,
/// `k_proj`/`v_proj [kv_heads * head_dim, hidden]`, `o_proj [hidden, heads * head_dim]`,
/// `q_norm`/`k_norm [head_dim]`, `gate_proj`/`up_proj [ffn, hidden]`, `down_proj [hidden, ffn]`,
/// the four sandwich norms `[hidden]`; `model.norm [hidden]`.
pub fn random_weights(cfg: &ModelConfig, seed: u64) -> Vec<TensorOut> {
    let hidden = cfg.hidden_size;
    let q_dim = cfg.num_attention_heads * cfg.head_dim;
    let kv_dim = cfg.kv_row();
    let ffn = cfg.intermediate_size;
    let linear = |out: usize, fan_in: usize| {
        let std = 1.0 / (fan_in as f64).sqrt();
        (vec![out, fan_in], Dist { mean: 0.0, std })
    };
    let norm = |n: usize| {
        let dist = Dist {
            mean: 0.0,
            std: NORM_SPREAD,
        };
        (vec![n], dist)
    };
    let embed_rms = (2.0 * cfg.num_layers() as f64 / hidden as f64).sqrt();
    let head_gain = LOGIT_SPREAD / embed_rms;

    let mut specs: Vec<(String, (Vec<usize>, Dist))> = vec![(
        "model.embed_tokens.weight".into(),
        (
            vec![cfg.vocab_size, hidden],
            Dist {
                mean: 0.0,
                std: embed_rms / (hidden as f64).sqrt(),
            },
        ),
    )];
    for l in 0..cfg.num_layers() {
        let p = format!("model.layers.{l}");
        specs.extend([
            (format!("{p}.input_layernorm.weight"), norm(hidden)),
            (
                format!("{p}.self_attn.q_proj.weight"),
                linear(q_dim, hidden),
            ),
            (
                format!("{p}.self_attn.k_proj.weight"),
                linear(kv_dim, hidden),
            ),
            (
                format!("{p}.self_attn.v_proj.weight"),
                linear(kv_dim, hidden),
            ),
            (format!("{p}.self_attn.q_norm.weight"), norm(cfg.head_dim)),
            (format!("{p}.self_attn.k_norm.weight"), norm(cfg.head_dim)),
            (
                format!("{p}.self_attn.o_proj.weight"),
                linear(hidden, q_dim),
            ),
            (format!("{p}.post_attention_layernorm.weight"), norm(hidden)),
            (
                format!("{p}.pre_feedforward_layernorm.weight"),
                norm(hidden),
            ),
            (format!("{p}.mlp.gate_proj.weight"), linear(ffn, hidden)),
            (format!("{p}.mlp.up_proj.weight"), linear(ffn, hidden)),
            (format!("{p}.mlp.down_proj.weight"), linear(hidden, ffn)),
            (
                format!("{p}.post_feedforward_layernorm.weight"),
                norm(hidden),
            ),
        ]);
    }
    let final_norm = Dist {
        mean: head_gain - 1.0,
        std: head_gain * NORM_SPREAD,
    };
    specs.push(("model.norm.weight".into(), (vec![hidden], final_norm)));

    specs
        .into_iter()
        .map(|(name, (shape, dist))| {
            let data = random_tensor(stream_key(seed, &name), shape.iter().product(), dist);
            TensorOut { name, shape, data }
        })
        .collect()
}

/// Writes `config.json` and `model.safetensors` of `preset` with weights from `seed` into `dir`
/// (created if missing) and returns the config as [`ModelConfig::from_file`] reads it back.
pub fn write_model(dir: &Path, preset: Preset, seed: u64) -> Result<ModelConfig> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let config_path = dir.join("config.json");
    let partial = dir.join("config.json.partial");
    std::fs::write(&partial, config_json(preset)).map_err(|e| Error::io(&partial, e))?;
    std::fs::rename(&partial, &config_path).map_err(|e| Error::io(&config_path, e))?;
    let cfg = ModelConfig::from_file(&config_path)?;

    let tensors = random_weights(&cfg, seed);
    // One key only: safetensors keeps metadata in a HashMap, so several keys would be written in
    // a different order on every run. transformers wants `format`.
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors(&dir.join("model.safetensors"), &tensors, Some(metadata))?;
    Ok(cfg)
}

/// splitmix64's increment: state `k` of a stream is `key + k * GAMMA`.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The key of a tensor's stream: `seed` mixed with the FNV-1a hash of its name.
fn stream_key(seed: u64, name: &str) -> u64 {
    let fnv = name.bytes().fold(0xCBF2_9CE4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
    });
    mix64(seed ^ mix64(fnv))
}

/// Uniforms summed per value: 4 gives a bell shape bounded by `±2 sqrt(3)` standard deviations.
const UNIFORMS_PER_VALUE: u64 = 4;
/// Values per parallel chunk; any size gives the same values (the stream is counter-based).
const CHUNK: usize = 1 << 16;

/// `n` values distributed as `dist`. Value `i` is a function of `key` and `i` alone (splitmix64
/// is counter-based), so the tensor is filled in parallel without changing it.
fn random_tensor(key: u64, n: usize, dist: Dist) -> Vec<f32> {
    // The sum of 4 uniforms on [0, 1) has variance 4/12, hence the sqrt(3).
    let scale = dist.std * 3f64.sqrt();
    let mut out = vec![0f32; n];
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            for (j, v) in chunk.iter_mut().enumerate() {
                let i = (c * CHUNK + j) as u64;
                let sum: f64 = (1..=UNIFORMS_PER_VALUE)
                    .map(|u| {
                        let bits = mix64(
                            key.wrapping_add((i * UNIFORMS_PER_VALUE + u).wrapping_mul(GAMMA)),
                        );
                        (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
                    })
                    .sum();
                *v = ((sum - 2.0) * scale + dist.mean) as f32;
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsnap_contract::LayerKind;
    use sha2::Digest;

    fn tmp_dir(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kvsnap-tiny-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// sha256 of (config.json, model.safetensors) in `dir`.
    fn digests(dir: &Path) -> (String, String) {
        let sha = |name: &str| {
            let bytes = std::fs::read(dir.join(name)).unwrap();
            format!("{:x}", sha2::Sha256::digest(bytes))
        };
        (sha("config.json"), sha("model.safetensors"))
    }

    #[test]
    fn same_seed_writes_identical_bytes_and_other_seeds_differ() {
        let (a, b, c) = (tmp_dir("a"), tmp_dir("b"), tmp_dir("c"));
        write_model(&a, Preset::Tiny, 7).unwrap();
        write_model(&b, Preset::Tiny, 7).unwrap();
        write_model(&c, Preset::Tiny, 8).unwrap();
        let (ra, rb, rc) = (digests(&a), digests(&b), digests(&c));
        assert_eq!(ra, rb);
        assert_eq!(ra.0, rc.0, "the config does not depend on the seed");
        assert_ne!(ra.1, rc.1);
        for d in [a, b, c] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }

    #[test]
    fn tiny_config_round_trips() {
        let dir = tmp_dir("cfg");
        let written = write_model(&dir, Preset::Tiny, DEFAULT_SEED).unwrap();
        let read = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        assert_eq!(written, read);
        assert_eq!(read, config(Preset::Tiny));
        use LayerKind::{Global as G, Sliding as S};
        assert_eq!(read.layer_kinds, [S, S, G, S, S, G]);
        assert_eq!(
            (read.hidden_size, read.intermediate_size, read.vocab_size),
            (64, 128, 512)
        );
        assert_eq!(
            (
                read.num_attention_heads,
                read.num_key_value_heads,
                read.head_dim
            ),
            (4, 2, 32)
        );
        assert_eq!(
            (read.sliding_window, read.max_position_embeddings),
            (6, 128)
        );
        assert_eq!((read.rope_theta_global, read.rope_theta_local), (1e6, 1e4));
        assert_eq!(read.rope_linear_factor_global, 1.0);
        assert_eq!(read.query_pre_attn_scalar, 24.0);
        assert_ne!(read.query_pre_attn_scalar, read.head_dim as f64);
        assert_eq!(
            (read.bos_token_id, read.eos_token_ids.as_slice()),
            (2, &[1][..])
        );
        assert_eq!(read.rms_norm_eps, 1e-6);

        let weights = crate::Weights::open(&dir.join("model.safetensors")).unwrap();
        assert_eq!(weights.names().len(), 2 + 13 * 6);
        assert_eq!(
            weights.shape("model.layers.0.self_attn.q_proj.weight"),
            Some(vec![128, 64])
        );
        assert_eq!(
            weights.shape("model.layers.5.self_attn.o_proj.weight"),
            Some(vec![64, 128])
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn real_shapes_config_is_gemma_3_270m() {
        let c = config(Preset::RealShapes);
        let globals: Vec<usize> = (0..c.num_layers())
            .filter(|&l| c.layer_kinds[l] == LayerKind::Global)
            .collect();
        assert_eq!(globals, [5, 11, 17]);
        assert_eq!(
            (c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim),
            (640, 2048, 262_144, 256)
        );
        assert_eq!((c.num_attention_heads, c.num_key_value_heads), (4, 1));
        assert_eq!((c.sliding_window, c.max_position_embeddings), (512, 32_768));
        assert_eq!(c.attn_scale(), 1.0 / 16.0);
        let params: usize = [
            c.vocab_size * c.hidden_size,
            c.num_layers()
                * (4 * c.hidden_size
                    + 2 * c.head_dim
                    + 2 * c.hidden_size * c.num_attention_heads * c.head_dim
                    + 2 * c.hidden_size * c.kv_row()
                    + 3 * c.hidden_size * c.intermediate_size),
            c.hidden_size,
        ]
        .iter()
        .sum();
        assert_eq!(params, 268_098_176);
    }

    #[test]
    fn values_have_the_requested_spread_and_do_not_depend_on_chunking() {
        let n = 3 * CHUNK + 17;
        let dist = Dist {
            mean: 2.0,
            std: 0.5,
        };
        let v = random_tensor(stream_key(1, "x"), n, dist);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        assert!((mean - 2.0).abs() < 0.01, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.01, "std {}", var.sqrt());
        // A prefix is the same whatever the length (each value depends on its index only).
        assert_eq!(random_tensor(stream_key(1, "x"), 100, dist), v[..100]);
        assert_ne!(random_tensor(stream_key(1, "y"), 100, dist), v[..100]);
    }

    #[test]
    fn the_stream_is_pinned() {
        // splitmix64's published first output for state 0.
        assert_eq!(mix64(GAMMA), 0xE220_A839_7B1D_CDAF);
        let dist = Dist {
            mean: 0.0,
            std: 1.0,
        };
        let v = random_tensor(stream_key(DEFAULT_SEED, "model.norm.weight"), 3, dist);
        let bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, PINNED_BITS);
    }

    /// The first values of one stream, as f32 bits: any change to the generator shows here first.
    const PINNED_BITS: [u32; 3] = [0xBF56_2BDA, 0x3E68_7BEE, 0x3E87_4B77];

    /// sha256 of the default tiny model's model.safetensors (also in goldens/tiny.json).
    const TINY_SHA256: &str = "1dc77be95c9ae0afcd19fbd8db73f5543d229a7ec70cb41692e1403f06afd389";

    #[test]
    fn the_default_tiny_model_matches_the_committed_goldens() {
        let dir = tmp_dir("pinned");
        write_model(&dir, Preset::Tiny, DEFAULT_SEED).unwrap();
        let (_, weights) = digests(&dir);
        std::fs::remove_dir_all(dir).unwrap();
        let hint = "the tiny model's weights changed: if intended, regenerate goldens/tiny.json \
                    (goldens/README.md) and update TINY_SHA256";
        assert_eq!(weights, TINY_SHA256, "{hint}");
        let golden = concat!(env!("CARGO_MANIFEST_DIR"), "/../goldens/tiny.json");
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(golden).unwrap()).unwrap();
        assert_eq!(golden["model_sha256"], TINY_SHA256, "{hint}");
    }

    #[test]
    fn presets_parse_by_name() {
        for p in Preset::ALL {
            assert_eq!(p.name().parse::<Preset>(), Ok(p));
        }
        assert_eq!(Preset::default(), Preset::Tiny);
        let e = "huge".parse::<Preset>().unwrap_err();
        assert!(e.contains("tiny, real-shapes"), "{e}");
    }
}
