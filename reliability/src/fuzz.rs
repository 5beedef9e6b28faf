//! Bodies of the cargo-fuzz targets (`fuzz/fuzz_targets/*.rs` call these), kept here so that
//! `cargo test` replays the corpus in `tests/fuzz_corpus/<target>/` without cargo-fuzz.
//!
//! Every body must return normally on any input: a panic is a bug (parsers never panic; the
//! contract never panics and never diverges from the model it wraps).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kvsnap_contract::{DynModel, Error, KvModel, Logits, ModelConfig, Next, Session};
use kvsnap_reference::gguf::{self, GgufFile};
use kvsnap_reference::{tiny, write_safetensors, ReferenceKv, ReferenceModel, Weights};

/// A fuzz target's body.
pub type Target = fn(&[u8]);

/// Named seed inputs of one target.
pub type Seeds = Vec<(&'static str, Vec<u8>)>;

/// The fuzz targets, by name (the directory names under `tests/fuzz_corpus/` and `fuzz/`).
pub const TARGETS: [(&str, Target); 4] = [
    ("config_json", config_json),
    ("safetensors_model", safetensors_model),
    ("gguf", gguf_file),
    ("contract_ops", contract_ops),
];

/// A two-layer Gemma 3 (one sliding layer of window 2, one global), vocab 16, hidden 8: its
/// safetensors file is a few KiB, small enough to be a fuzzing seed.
pub const MICRO_CONFIG: &str = r#"{"model_type": "gemma3_text", "hidden_size": 8,
 "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
 "intermediate_size": 8, "vocab_size": 16, "sliding_window": 2, "max_position_embeddings": 32,
 "query_pre_attn_scalar": 4, "layer_types": ["sliding_attention", "full_attention"]}"#;

/// Context capacity of the micro model in [`contract_ops`].
pub const MICRO_CAPACITY: usize = 24;

/// The micro model's config.
pub fn micro_config() -> ModelConfig {
    ModelConfig::from_json(MICRO_CONFIG, Path::new("config.json")).expect("a valid config")
}

/// A per-process scratch directory.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvsnap-fuzz-{}", std::process::id()));
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir).expect("creating the fuzz scratch directory");
    dir
}

/// Writes the micro model (random weights, seed 0) into `dir`.
pub fn write_micro(dir: &Path) -> kvsnap_contract::Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    std::fs::write(dir.join("config.json"), MICRO_CONFIG).map_err(|e| Error::io(dir, e))?;
    let tensors = tiny::random_weights(&micro_config(), 0);
    write_safetensors(&dir.join("model.safetensors"), &tensors, None)
}

// ---------------------------------------------------------------------------------------------
// Parsers.

/// `ModelConfig::from_json` on any text, then everything a loader derives from a config.
pub fn config_json(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let Ok(cfg) = ModelConfig::from_json(&text, Path::new("config.json")) else {
        return;
    };
    let _ = (
        cfg.group_size(),
        cfg.kv_row(),
        cfg.embed_scale(),
        cfg.attn_scale(),
    );
    for layer in 0..cfg.num_layers() {
        let _ = cfg.rope_theta(layer);
    }
    let _ = cfg.kv_bytes(cfg.context_capacity);
    let _ = cfg
        .clone()
        .with_context_capacity(cfg.max_position_embeddings);
}

/// `data` as `model.safetensors` beside the micro config: [`Weights::open`], every tensor read
/// with its own and with a wrong shape, then [`ReferenceModel`] loaded and run if it loads.
pub fn safetensors_model(data: &[u8]) {
    let dir = scratch("safetensors_model");
    let path = dir.join("model.safetensors");
    std::fs::write(&path, data).expect("writing the fuzz input");
    let Ok(w) = Weights::open(&path) else { return };
    for name in w.names() {
        let Some(shape) = w.shape(&name) else {
            panic!("`{name}` is listed but has no shape");
        };
        if let Ok(t) = w.tensor(&name, &shape) {
            assert_eq!(t.len(), shape.iter().product::<usize>());
            std::hint::black_box(t.iter().sum::<f32>());
        }
        let _ = w.tensor(&name, &[1, 2, 3]);
    }
    drop(w);
    if let Ok(model) = ReferenceModel::load_config(&dir, micro_config()) {
        if let Ok((mut kv, _)) = model.prefill(&[1, 2, 3], Logits::Return) {
            let _ = model.step(&mut kv, 4, Logits::Return);
        }
    }
}

/// [`GgufFile::from_bytes`], every metadata value and tensor read, then the import's conversion
/// (`hf_config`, the config parsed back, `hf_tensors`) when the file is a Gemma 3.
pub fn gguf_file(data: &[u8]) {
    /// Values dequantized at most per input, so a fuzz input cannot ask for gigabytes.
    const MAX_VALUES: u64 = 1 << 22;
    let Ok(g) = GgufFile::from_bytes(data.to_vec(), "fuzz.gguf") else {
        return;
    };
    for (_, v) in g.metadata() {
        let _ = (
            v.as_u64(),
            v.as_f64(),
            v.as_str(),
            v.as_array().map(<[_]>::len),
        );
    }
    let mut values = 0u64;
    for t in g.tensors() {
        let _ = (t.row_major_shape(), g.tensor_bytes(t).len());
        values = values.saturating_add(t.n_elements());
        if values <= MAX_VALUES {
            if let Ok(v) = g.dequantize(t) {
                assert_eq!(v.len() as u64, t.n_elements());
            }
        }
    }
    let Ok(json) = gguf::convert::hf_config(&g) else {
        return;
    };
    let Ok(cfg) = ModelConfig::from_json(&json.to_string(), Path::new("config.json")) else {
        return;
    };
    if values <= MAX_VALUES {
        let _ = gguf::convert::hf_tensors(&g, &cfg);
    }
}

// ---------------------------------------------------------------------------------------------
// The contract.

/// Reads fuzz bytes as operation arguments; `None` once the input is used up.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn u8(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    fn u64(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for _ in 0..8 {
            v = v << 8 | u64::from(self.u8()?);
        }
        Some(v)
    }

    /// Up to 11 ids, a few of them past the vocab.
    fn ids(&mut self, vocab: u32) -> Option<Vec<u32>> {
        let n = self.u8()? % 12;
        (0..n)
            .map(|_| {
                let b = self.u8()?;
                Some(match b {
                    250.. => vocab + u32::from(b - 250),
                    _ => u32::from(b) % vocab,
                })
            })
            .collect()
    }

    /// Embedding rows for `n` tokens (sometimes a row short or long), with NaN and infinities.
    fn rows(&mut self, n: usize, hidden: usize) -> Option<Vec<f32>> {
        let len = match self.u8()? {
            0 => (n * hidden).saturating_sub(1),
            1 => n * hidden + hidden,
            _ => n * hidden,
        };
        let seed = self.u8()?;
        Some(
            (0..len)
                .map(|i| match seed.wrapping_add(i as u8) {
                    255 if seed > 200 => f32::NAN,
                    254 if seed > 200 => f32::INFINITY,
                    b => (f32::from(b) - 128.0) / 256.0,
                })
                .collect(),
        )
    }

    fn logits(&mut self) -> Option<Logits> {
        Some(if self.u8()? & 1 == 1 {
            Logits::Return
        } else {
            Logits::Skip
        })
    }
}

/// The same operations on the model directly, with owned states: what the session must match.
struct Shadow {
    handle: u64,
    kv: ReferenceKv,
    live: bool,
    poisoned: bool,
}

struct OpsModel {
    model: std::sync::Arc<ReferenceModel>,
}

fn ops_model() -> &'static OpsModel {
    static MODEL: OnceLock<OpsModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir = scratch("micro");
        write_micro(&dir).expect("writing the micro model");
        let model = ReferenceModel::load_with_capacity(&dir, MICRO_CAPACITY)
            .expect("loading the micro model");
        OpsModel {
            model: std::sync::Arc::new(model),
        }
    })
}

fn same_next(got: &Next, want: &Next) {
    assert_eq!(got.token, want.token);
    let bits = |n: &Next| {
        n.logits
            .as_ref()
            .map(|l| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
    };
    assert_eq!(bits(got), bits(want));
}

/// Both failed with the same kind of error, or both succeeded.
fn same_outcome<T, U>(got: &Result<T, Error>, want: &Result<U, Error>) {
    match (got, want) {
        (Ok(_), Ok(_)) => {}
        (Err(g), Err(w)) => assert_eq!(g.kind(), w.kind(), "session: {g}; model: {w}"),
        (Err(g), Ok(_)) => panic!("the session failed where the model did not: {g}"),
        (Ok(_), Err(w)) => panic!("the session succeeded where the model failed: {w}"),
    }
}

/// A random sequence of contract operations through a [`Session`] on the micro model (stale,
/// foreign and forged handles, out-of-range ids, bad embeddings, injected mid-forward faults,
/// KV budgets), checked step by step against the same operations on the model directly: the
/// same tokens and logits bit for bit, the same error kinds, the live states and their bytes
/// accounted exactly, and poisoned states refused until released.
pub fn contract_ops(data: &[u8]) {
    let m = &ops_model().model;
    m.set_fault_after_layer(None);
    let cfg = m.config().clone();
    let vocab = cfg.vocab_size as u32;
    let s = Session::from_arc(std::sync::Arc::clone(m));
    let mut shadows: Vec<Shadow> = Vec::new();
    let mut cur = Cursor(data);
    let _ = run_ops(&s, m, &mut shadows, &mut cur, vocab, cfg.hidden_size);
    s.close().expect("closing frees every state");
    assert_eq!((s.live(), s.live_kv_bytes()), (0, 0));
    m.set_fault_after_layer(None);
}

fn run_ops(
    s: &Session<ReferenceModel>,
    m: &ReferenceModel,
    shadows: &mut Vec<Shadow>,
    cur: &mut Cursor<'_>,
    vocab: u32,
    hidden: usize,
) -> Option<()> {
    for _ in 0..64 {
        let op = cur.u8()?;
        // A handle: one issued earlier (live or not), or forged from the input.
        let pick = |cur: &mut Cursor<'_>| -> Option<u64> {
            let b = cur.u8()?;
            match shadows.len() {
                n if n > 0 && b < 240 => Some(shadows[b as usize % n].handle),
                _ => cur.u64(),
            }
        };
        match op % 9 {
            0 | 1 => {
                let ids = cur.ids(vocab)?;
                let logits = cur.logits()?;
                let (got, want) = if op % 9 == 0 {
                    (s.prefill(&ids, logits), m.prefill(&ids, logits))
                } else {
                    let rows = cur.rows(ids.len(), hidden)?;
                    (
                        s.prefill_embeddings(&ids, &rows, logits),
                        m.prefill_embeddings(&ids, &rows, logits),
                    )
                };
                match (got, want) {
                    (Err(Error::KvBudget { .. }), Ok(_)) => assert!(s.kv_budget().is_some()),
                    (Ok((h, g)), Ok((kv, w))) => {
                        same_next(&g, &w);
                        shadows.push(Shadow {
                            handle: h,
                            kv,
                            live: true,
                            poisoned: false,
                        });
                    }
                    (got, want) => same_outcome(&got, &want),
                }
            }
            2..=4 => {
                let h = pick(cur)?;
                let ids = if op % 9 == 2 {
                    cur.ids(vocab)?
                } else {
                    vec![cur.ids(vocab)?.first().copied().unwrap_or(3)]
                };
                let logits = cur.logits()?;
                // op 4: the same step with a fault armed after layer 0 or 1.
                let fault = (op % 9 == 4).then_some(usize::from(op / 9 % 2));
                m.set_fault_after_layer(fault);
                let got = if ids.len() == 1 && op % 9 != 2 {
                    s.step(h, ids[0], logits)
                } else {
                    s.extend(h, &ids, logits)
                };
                m.set_fault_after_layer(None);
                let shadow = shadows.iter_mut().find(|x| x.handle == h && x.live);
                match (got, shadow) {
                    (got, None) => {
                        let kind = got.expect_err("a stale handle works").kind();
                        assert!(kind == "stale_handle", "{kind}");
                    }
                    (Err(Error::Poisoned { .. }), Some(x)) => assert!(x.poisoned),
                    (Err(Error::KvBudget { .. }), Some(x)) => {
                        assert!(s.kv_budget().is_some() && !x.poisoned);
                        assert_eq!(s.len(h).ok(), Some(x.kv.len()));
                    }
                    (got, Some(x)) => {
                        assert!(!x.poisoned, "a poisoned state worked: {got:?}");
                        m.set_fault_after_layer(fault);
                        let want = if ids.len() == 1 && op % 9 != 2 {
                            m.step(&mut x.kv, ids[0], logits)
                        } else {
                            m.extend(&mut x.kv, &ids, logits)
                        };
                        m.set_fault_after_layer(None);
                        match (&got, &want) {
                            (Ok(g), Ok(w)) => same_next(g, w),
                            (Err(Error::Backend { .. }), Err(Error::Backend { .. })) => {
                                x.poisoned = true;
                            }
                            _ => same_outcome(&got, &want),
                        }
                    }
                }
            }
            5 => {
                let h = pick(cur)?;
                let got = s.snapshot(h);
                let Some(x) = shadows.iter().find(|x| x.handle == h && x.live) else {
                    assert_eq!(got.expect_err("a stale snapshot").kind(), "stale_handle");
                    continue;
                };
                match got {
                    Ok(copy) => {
                        assert!(!x.poisoned);
                        let kv = m.snapshot(&x.kv).expect("the reference always copies");
                        shadows.push(Shadow {
                            handle: copy,
                            kv,
                            live: true,
                            poisoned: false,
                        });
                    }
                    Err(Error::Poisoned { .. }) => assert!(x.poisoned),
                    Err(Error::KvBudget { .. }) => assert!(s.kv_budget().is_some()),
                    Err(e) => panic!("snapshot of a live state failed: {e}"),
                }
            }
            6 => {
                let h = pick(cur)?;
                let got = s.release(h);
                match shadows.iter_mut().find(|x| x.handle == h && x.live) {
                    Some(x) => {
                        got.expect("releasing a live (even poisoned) state");
                        x.live = false;
                    }
                    None => assert_eq!(got.expect_err("a stale release").kind(), "stale_handle"),
                }
            }
            7 => {
                let h = pick(cur)?;
                let (len, bytes) = (s.len(h), s.kv_bytes(h));
                match shadows.iter().find(|x| x.handle == h && x.live) {
                    Some(x) if x.poisoned => {
                        assert_eq!(len.expect_err("poisoned").kind(), "poisoned");
                    }
                    Some(x) => {
                        assert_eq!(len.ok(), Some(x.kv.len()));
                        assert_eq!(bytes.ok(), Some(m.kv_bytes(&x.kv)));
                    }
                    None => assert_eq!(len.expect_err("stale").kind(), "stale_handle"),
                }
            }
            _ => {
                let cap = cur.u8()?;
                s.set_kv_budget((cap != 0).then(|| u64::from(cap) * 512));
            }
        }
        let live: Vec<&Shadow> = shadows.iter().filter(|x| x.live).collect();
        assert_eq!(s.live(), live.len());
        let bytes: u64 = live.iter().map(|x| m.kv_bytes(&x.kv)).sum();
        assert_eq!(s.live_kv_bytes(), bytes, "KV bytes accounted");
    }
    Some(())
}

// ---------------------------------------------------------------------------------------------
// Seeds.

/// Seed inputs per target: valid files (so the fuzzer starts from deep paths) and a short
/// handwritten operation script.
pub fn seeds() -> Vec<(&'static str, Seeds)> {
    let micro = scratch("seed-micro");
    write_micro(&micro).expect("writing the micro model");
    let weights = std::fs::read(micro.join("model.safetensors")).expect("reading it back");
    vec![
        (
            "config_json",
            vec![
                ("micro", MICRO_CONFIG.into()),
                ("tiny", tiny::config_json(tiny::Preset::Tiny).into()),
                (
                    "real-shapes",
                    tiny::config_json(tiny::Preset::RealShapes).into(),
                ),
            ],
        ),
        ("safetensors_model", vec![("micro", weights)]),
        (
            "gguf",
            vec![
                ("gemma3-micro", gguf_micro()),
                ("k-quants", gguf_k_quants()),
            ],
        ),
        (
            "contract_ops",
            vec![(
                "script",
                vec![
                    0, 6, 1, 2, 3, 4, 5, 6, 1, // prefill [1..=6], logits
                    5, 0, // snapshot #0
                    3, 1, 1, 9, 1, // step #1 with 9
                    2, 0, 3, 4, 5, 6, 0, // extend #0 with [4, 5, 6]
                    4, 1, 1, 7, 0, // step #1 with a fault after layer 0
                    7, 1, // len #1: poisoned
                    6, 1, // release #1
                    8, 1, // budget 512 bytes
                    5, 0, // snapshot #0: over the budget
                    1, 2, 1, 2, 0, 0, 210, // prefill_embeddings of [1, 2], one float short
                ],
            )],
        ),
    ]
}

/// GGUF writer: little-endian, version 3, 32-byte alignment.
struct GgufWriter {
    kvs: Vec<u8>,
    n_kvs: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl GgufWriter {
    fn new() -> Self {
        GgufWriter {
            kvs: Vec::new(),
            n_kvs: 0,
            tensors: Vec::new(),
        }
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    fn u32(mut self, key: &str, v: u32) -> Self {
        Self::string(&mut self.kvs, key);
        self.kvs.extend(4u32.to_le_bytes());
        self.kvs.extend(v.to_le_bytes());
        self.n_kvs += 1;
        self
    }

    fn f32(mut self, key: &str, v: f32) -> Self {
        Self::string(&mut self.kvs, key);
        self.kvs.extend(6u32.to_le_bytes());
        self.kvs.extend(v.to_le_bytes());
        self.n_kvs += 1;
        self
    }

    fn str(mut self, key: &str, v: &str) -> Self {
        Self::string(&mut self.kvs, key);
        self.kvs.extend(8u32.to_le_bytes());
        Self::string(&mut self.kvs, v);
        self.n_kvs += 1;
        self
    }

    fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors.push((name.into(), dims.to_vec(), ty, data));
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let align = |n: usize| n.div_ceil(32) * 32;
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend(self.n_kvs.to_le_bytes());
        b.extend(&self.kvs);
        let mut offset = 0;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            offset = align(offset);
            offsets.push(offset);
            Self::string(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(ty.to_le_bytes());
            b.extend((offset as u64).to_le_bytes());
            offset += data.len();
        }
        let start = align(b.len());
        for ((.., data), off) in self.tensors.iter().zip(offsets) {
            b.resize(start + off, 0);
            b.extend(data);
        }
        b
    }
}

const F32: u32 = 0;
const F16: u32 = 1;
const Q5_0: u32 = 6;
const Q8_0: u32 = 8;
const Q4_K: u32 = 12;
const Q6_K: u32 = 14;
const BF16: u32 = 30;

/// `n` values of ggml type `ty`, deterministic, with small finite block scales.
fn quant(ty: u32, n: usize) -> Vec<u8> {
    let (block, bytes, scales): (usize, usize, &[usize]) = match ty {
        F32 => {
            return (0..n)
                .flat_map(|i| (i as f32 * 0.01).to_le_bytes())
                .collect()
        }
        F16 => {
            return (0..n)
                .flat_map(|i| half::f16::from_f32(i as f32 * 0.01).to_le_bytes())
                .collect()
        }
        BF16 => {
            return (0..n)
                .flat_map(|i| half::bf16::from_f32(1.0 - i as f32 * 0.01).to_le_bytes())
                .collect()
        }
        Q8_0 => (32, 34, &[0]),
        Q5_0 => (32, 22, &[0]),
        Q4_K => (256, 144, &[0, 2]),
        Q6_K => (256, 210, &[208]),
        _ => unreachable!("no seed uses ggml type {ty}"),
    };
    let mut data: Vec<u8> = (0..n / block * bytes)
        .map(|i| (i * 37 % 251) as u8)
        .collect();
    for b in data.chunks_exact_mut(bytes) {
        for &s in scales {
            b[s..s + 2].copy_from_slice(&half::f16::from_f32(0.02).to_bits().to_le_bytes());
        }
    }
    data
}

/// A one-layer Gemma 3 GGUF (hidden 32, 2 heads of 8, FFN 32, vocab 4) in F32, F16, BF16,
/// Q8_0 and Q5_0.
fn gguf_micro() -> Vec<u8> {
    let (h, hd, q, ffn, vocab) = (32u64, 8u64, 16u64, 32u64, 4u64);
    let norm = |n: u64| quant(F32, n as usize);
    GgufWriter::new()
        .str("general.architecture", "gemma3")
        .u32("gemma3.context_length", 64)
        .u32("gemma3.embedding_length", h as u32)
        .u32("gemma3.block_count", 1)
        .u32("gemma3.feed_forward_length", ffn as u32)
        .u32("gemma3.attention.head_count", 2)
        .u32("gemma3.attention.head_count_kv", 1)
        .u32("gemma3.attention.key_length", hd as u32)
        .u32("gemma3.attention.value_length", hd as u32)
        .u32("gemma3.attention.sliding_window", 4)
        .f32("gemma3.rope.freq_base", 1e6)
        .f32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
        .tensor(
            "token_embd.weight",
            &[h, vocab],
            Q8_0,
            quant(Q8_0, (h * vocab) as usize),
        )
        .tensor("output_norm.weight", &[h], F32, norm(h))
        .tensor(
            "blk.0.attn_q.weight",
            &[h, q],
            F16,
            quant(F16, (h * q) as usize),
        )
        .tensor(
            "blk.0.attn_k.weight",
            &[h, hd],
            BF16,
            quant(BF16, (h * hd) as usize),
        )
        .tensor(
            "blk.0.attn_v.weight",
            &[h, hd],
            F32,
            quant(F32, (h * hd) as usize),
        )
        .tensor(
            "blk.0.attn_output.weight",
            &[q, h],
            F32,
            quant(F32, (q * h) as usize),
        )
        .tensor("blk.0.attn_q_norm.weight", &[hd], F32, norm(hd))
        .tensor("blk.0.attn_k_norm.weight", &[hd], F32, norm(hd))
        .tensor("blk.0.attn_norm.weight", &[h], F32, norm(h))
        .tensor("blk.0.post_attention_norm.weight", &[h], F32, norm(h))
        .tensor("blk.0.ffn_norm.weight", &[h], F32, norm(h))
        .tensor("blk.0.post_ffw_norm.weight", &[h], F32, norm(h))
        .tensor(
            "blk.0.ffn_gate.weight",
            &[h, ffn],
            Q5_0,
            quant(Q5_0, (h * ffn) as usize),
        )
        .tensor(
            "blk.0.ffn_up.weight",
            &[h, ffn],
            F16,
            quant(F16, (h * ffn) as usize),
        )
        .tensor(
            "blk.0.ffn_down.weight",
            &[ffn, h],
            Q8_0,
            quant(Q8_0, (ffn * h) as usize),
        )
        .bytes()
}

/// One Q4_K and one Q6_K tensor (not a model): the k-quant dequantizers.
fn gguf_k_quants() -> Vec<u8> {
    GgufWriter::new()
        .str("general.architecture", "none")
        .tensor("a", &[256], Q4_K, quant(Q4_K, 256))
        .tensor("b", &[256, 1], Q6_K, quant(Q6_K, 256))
        .bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_micro_gguf_imports() {
        let g = GgufFile::from_bytes(gguf_micro(), "micro.gguf").unwrap();
        let json = gguf::convert::hf_config(&g).unwrap();
        let cfg = ModelConfig::from_json(&json.to_string(), Path::new("c")).unwrap();
        let tensors = gguf::convert::hf_tensors(&g, &cfg).unwrap();
        assert_eq!(tensors.len(), 15);
        let k = GgufFile::from_bytes(gguf_k_quants(), "k.gguf").unwrap();
        for t in k.tensors() {
            assert_eq!(k.dequantize(t).unwrap().len(), 256);
        }
    }

    #[test]
    fn the_seed_script_runs() {
        let (_, seeds) = seeds().pop().unwrap();
        contract_ops(&seeds[0].1);
    }
}
