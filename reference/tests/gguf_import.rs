//! GGUF import: the real Gemma 3 270M against gguf-py's sha256 list, a synthetic Gemma 3 GGUF
//! end to end, and hostile files (truncated, corrupted) that must give typed errors, never panics.
//!
//! The real model is found through `KVSNAP_GGUF` or at
//! `models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf` under the repository root (where
//! `kvsnap fetch-model` puts it); the sha256 list through `KVSNAP_GOLDENS_DIR` or the shared
//! goldens beside the repository. Without them the test prints `SKIPPED: ...`, unless
//! `KVSNAP_REQUIRE_MODEL=1`, which turns absence into a failure (CI sets it).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use kvsnap_contract::{Error, LayerKind, ModelConfig};
use kvsnap_reference::gguf::{self, GgufFile, Value};
use kvsnap_reference::Weights;
use sha2::{Digest, Sha256};

// ---------------------------------------------------------------------------------------------
// The real model.

const GOLDEN_LIST: &str = "gemma-3-270m-f32.sha256";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn real_gguf() -> PathBuf {
    match std::env::var_os("KVSNAP_GGUF") {
        Some(p) => PathBuf::from(p),
        None => repo_root().join("models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf"),
    }
}

fn goldens_dir() -> PathBuf {
    match std::env::var_os("KVSNAP_GOLDENS_DIR") {
        Some(p) => PathBuf::from(p),
        None => Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/goldens")).into(),
    }
}

/// Fails under `KVSNAP_REQUIRE_MODEL=1`, otherwise says loudly that the test did not run.
fn skip(why: String) {
    if std::env::var("KVSNAP_REQUIRE_MODEL").as_deref() == Ok("1") {
        panic!("{why} (KVSNAP_REQUIRE_MODEL=1 makes this a failure)");
    }
    // Straight to the process's stderr: libtest captures `eprintln!` of passing tests, and a
    // skip must be seen.
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}

fn sha256_f32(values: &[f32]) -> String {
    let mut h = Sha256::new();
    for chunk in values.chunks(1 << 16) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
        h.update(&bytes);
    }
    gguf::hex(&h.finalize())
}

/// `sha256  name  [d0, d1]` lines; `#` lines are comments.
fn read_golden_list(path: &Path) -> BTreeMap<String, (String, Vec<usize>)> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let (sha, rest) = line.split_once(char::is_whitespace).unwrap();
        let rest = rest.trim_start();
        let (name, shape) = rest.split_once(char::is_whitespace).unwrap();
        let shape: Vec<usize> = shape
            .trim()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .split(',')
            .map(|d| d.trim().parse().unwrap())
            .collect();
        out.insert(name.to_string(), (sha.to_string(), shape));
    }
    out
}

#[test]
fn real_gemma_3_270m_matches_gguf_py_sha256() {
    let gguf_path = real_gguf();
    let list = goldens_dir().join(GOLDEN_LIST);
    if !gguf_path.is_file() {
        return skip(format!(
            "no GGUF at {} (run `kvsnap fetch-model` or set KVSNAP_GGUF)",
            gguf_path.display()
        ));
    }
    if !list.is_file() {
        return skip(format!(
            "no sha256 list at {} (set KVSNAP_GOLDENS_DIR)",
            list.display()
        ));
    }
    let golden = read_golden_list(&list);
    assert_eq!(golden.len(), 236, "Gemma 3 270M has 236 tensors");

    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gguf_import_real");
    let _ = std::fs::remove_dir_all(&out);
    let report = gguf::import(&gguf_path, &out, &mut |line| eprintln!("import: {line}")).unwrap();
    assert_eq!(report.tensors, 236);

    let weights = Weights::open(&report.weights_path).unwrap();
    let mut names = weights.names();
    names.sort();
    let want_names: Vec<String> = golden.keys().cloned().collect();
    assert_eq!(names, want_names, "tensor names");
    let mut mismatches = Vec::new();
    for (name, (sha, shape)) in &golden {
        let got = sha256_f32(&weights.f32(name, shape).unwrap());
        if &got != sha {
            mismatches.push(format!("{name}: got {got}, gguf-py gives {sha}"));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} tensors differ from gguf-py 0.19.0:\n{}",
        mismatches.len(),
        golden.len(),
        mismatches.join("\n")
    );

    let cfg = ModelConfig::from_file(&report.config_path).unwrap();
    assert_eq!(cfg, report.config);
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.head_dim,
            cfg.vocab_size
        ),
        (640, 2048, 256, 262144)
    );
    assert_eq!((cfg.num_attention_heads, cfg.num_key_value_heads), (4, 1));
    let globals: Vec<usize> = (0..cfg.num_layers())
        .filter(|&i| cfg.layer_kinds[i] == LayerKind::Global)
        .collect();
    assert_eq!(globals, [5, 11, 17]);
    assert_eq!(cfg.sliding_window, 512);
    assert_eq!((cfg.rope_theta_global, cfg.rope_theta_local), (1e6, 1e4));
    assert_eq!(cfg.rms_norm_eps, 1e-6);
    assert_eq!(cfg.query_pre_attn_scalar, 256.0);
    assert_eq!(cfg.max_position_embeddings, 32768);
    assert_eq!(
        (cfg.bos_token_id, cfg.eos_token_ids.as_slice()),
        (2, &[1, 106][..])
    );
    drop(weights);
    std::fs::remove_dir_all(&out).unwrap();
}

// ---------------------------------------------------------------------------------------------
// A GGUF writer for synthetic and corrupted files.

/// One metadata value, encoded as its type tag and payload.
fn tagged(tag: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = tag.to_le_bytes().to_vec();
    v.extend_from_slice(payload);
    v
}

fn string_bytes(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

fn v_u32(x: u32) -> Vec<u8> {
    tagged(4, &x.to_le_bytes())
}

fn v_f32(x: f32) -> Vec<u8> {
    tagged(6, &x.to_le_bytes())
}

fn v_str(s: &str) -> Vec<u8> {
    tagged(8, &string_bytes(s.as_bytes()))
}

fn v_str_array(items: &[&str]) -> Vec<u8> {
    let mut p = 8u32.to_le_bytes().to_vec();
    p.extend_from_slice(&(items.len() as u64).to_le_bytes());
    for s in items {
        p.extend(string_bytes(s.as_bytes()));
    }
    tagged(9, &p)
}

#[derive(Clone)]
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    ty: u32,
    data: Vec<u8>,
    /// Recorded instead of the real offset, to corrupt it.
    offset: Option<u64>,
}

#[derive(Clone)]
struct GgufImage {
    magic: [u8; 4],
    version: u32,
    /// Recorded instead of the real counts, to corrupt them.
    counts: Option<(u64, u64)>,
    kvs: Vec<(Vec<u8>, Vec<u8>)>,
    tensors: Vec<RawTensor>,
    alignment: usize,
}

impl GgufImage {
    fn new() -> Self {
        GgufImage {
            magic: *b"GGUF",
            version: 3,
            counts: None,
            kvs: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
        }
    }

    fn kv(mut self, key: &str, value: Vec<u8>) -> Self {
        self.kvs.push((key.as_bytes().to_vec(), value));
        self
    }

    fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors.push(RawTensor {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
            data,
            offset: None,
        });
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let align = |n: usize| n.div_ceil(self.alignment) * self.alignment;
        let mut b = self.magic.to_vec();
        b.extend(self.version.to_le_bytes());
        let (nt, nk) = self
            .counts
            .unwrap_or((self.tensors.len() as u64, self.kvs.len() as u64));
        b.extend(nt.to_le_bytes());
        b.extend(nk.to_le_bytes());
        for (k, v) in &self.kvs {
            b.extend(string_bytes(k));
            b.extend(v);
        }
        let mut offset = 0;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            offset = align(offset);
            offsets.push(offset);
            b.extend(string_bytes(t.name.as_bytes()));
            b.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(t.ty.to_le_bytes());
            b.extend(t.offset.unwrap_or(offset as u64).to_le_bytes());
            offset += t.data.len();
        }
        let data_start = align(b.len());
        for (t, off) in self.tensors.iter().zip(offsets) {
            b.resize(data_start + off, 0);
            b.extend(&t.data);
        }
        b
    }

    fn parse(&self) -> kvsnap_contract::Result<GgufFile> {
        GgufFile::from_bytes(self.bytes(), "synthetic.gguf")
    }
}

/// A deterministic byte stream (64-bit LCG), for quantized payloads and fuzzing.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

const F32: u32 = 0;
const F16: u32 = 1;
const Q5_0: u32 = 6;
const Q8_0: u32 = 8;
const Q4_K: u32 = 12;
const Q6_K: u32 = 14;
const BF16: u32 = 30;

/// `n_blocks` random blocks of `ty` whose f16 scales are set to small finite values.
fn quant_data(rng: &mut Lcg, ty: u32, n_values: usize) -> Vec<u8> {
    let (block, bytes, scales): (usize, usize, &[usize]) = match ty {
        Q8_0 => (32, 34, &[0]),
        Q5_0 => (32, 22, &[0]),
        Q4_K => (256, 144, &[0, 2]),
        Q6_K => (256, 210, &[208]),
        _ => unreachable!(),
    };
    let mut data = rng.bytes(n_values / block * bytes);
    for b in data.chunks_exact_mut(bytes) {
        for &s in scales {
            let bits = half::f16::from_f32(0.01 + (rng.next() % 100) as f32 * 1e-3).to_bits();
            b[s..s + 2].copy_from_slice(&bits.to_le_bytes());
        }
    }
    data
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

// Tiny Gemma 3: hidden 256 (so k-quant rows fit), 2 query heads of 32, 1 KV head, FFN 64,
// vocab 8, 6 layers (layer 5 global), window 4.
const H: u64 = 256;
const HD: u64 = 32;
const Q: u64 = 2 * HD;
const KV: u64 = HD;
const FFN: u64 = 64;
const VOCAB: u64 = 8;
const LAYERS: usize = 6;

/// A tiny Gemma 3 GGUF using every supported type. Norms store `1 + w` with `w = i / 8 - 1`.
fn tiny_gemma() -> GgufImage {
    let mut rng = Lcg(7);
    let norm = |n: u64| f32_bytes((0..n).map(|i| i as f32 / 8.0));
    let mut g = GgufImage::new()
        .kv("general.architecture", v_str("gemma3"))
        .kv("general.name", v_str("tiny"))
        .kv("general.tags", v_str_array(&["a", "b"]))
        .kv("gemma3.context_length", v_u32(128))
        .kv("gemma3.embedding_length", v_u32(H as u32))
        .kv("gemma3.block_count", v_u32(LAYERS as u32))
        .kv("gemma3.feed_forward_length", v_u32(FFN as u32))
        .kv("gemma3.attention.head_count", v_u32(2))
        .kv("gemma3.attention.head_count_kv", v_u32(1))
        .kv("gemma3.attention.key_length", v_u32(HD as u32))
        .kv("gemma3.attention.value_length", v_u32(HD as u32))
        .kv("gemma3.attention.sliding_window", v_u32(4))
        .kv("gemma3.rope.freq_base", v_f32(1e6))
        .kv("gemma3.attention.layer_norm_rms_epsilon", v_f32(1e-6));
    g = g.tensor(
        "token_embd.weight",
        &[H, VOCAB],
        Q8_0,
        quant_data(&mut rng, Q8_0, (H * VOCAB) as usize),
    );
    g = g.tensor("output_norm.weight", &[H], F32, norm(H));
    for l in 0..LAYERS {
        let n = |s: &str| format!("blk.{l}.{s}");
        let f16: Vec<u8> = (0..H * Q)
            .flat_map(|i| half::f16::from_f32(i as f32 * 0.001 - 3.0).to_le_bytes())
            .collect();
        let bf16: Vec<u8> = (0..H * KV)
            .flat_map(|i| half::bf16::from_f32(1.0 - i as f32 * 0.01).to_le_bytes())
            .collect();
        g = g
            .tensor(
                &n("attn_q.weight"),
                &[H, Q],
                Q6_K,
                quant_data(&mut rng, Q6_K, (H * Q) as usize),
            )
            .tensor(&n("attn_k.weight"), &[H, KV], BF16, bf16)
            .tensor(
                &n("attn_v.weight"),
                &[H, KV],
                F32,
                f32_bytes((0..H * KV).map(|i| i as f32)),
            )
            .tensor(&n("attn_output.weight"), &[Q, H], F16, f16)
            .tensor(&n("attn_q_norm.weight"), &[HD], F32, norm(HD))
            .tensor(&n("attn_k_norm.weight"), &[HD], F32, norm(HD))
            .tensor(&n("attn_norm.weight"), &[H], F32, norm(H))
            .tensor(&n("post_attention_norm.weight"), &[H], F32, norm(H))
            .tensor(&n("ffn_norm.weight"), &[H], F32, norm(H))
            .tensor(&n("post_ffw_norm.weight"), &[H], F32, norm(H))
            .tensor(
                &n("ffn_gate.weight"),
                &[H, FFN],
                Q4_K,
                quant_data(&mut rng, Q4_K, (H * FFN) as usize),
            )
            .tensor(
                &n("ffn_up.weight"),
                &[H, FFN],
                Q8_0,
                quant_data(&mut rng, Q8_0, (H * FFN) as usize),
            )
            .tensor(
                &n("ffn_down.weight"),
                &[FFN, H],
                Q5_0,
                quant_data(&mut rng, Q5_0, (FFN * H) as usize),
            );
    }
    g
}

fn write_image(name: &str, image: &GgufImage) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gguf_import");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, image.bytes()).unwrap();
    path
}

#[test]
fn synthetic_gemma_imports_to_hf_names_shapes_and_norms() {
    let image = tiny_gemma();
    let path = write_image("tiny.gguf", &image);
    let out = path.with_extension("hf");
    let _ = std::fs::remove_dir_all(&out);
    let mut lines = Vec::new();
    let report = gguf::import(&path, &out, &mut |l| lines.push(l.to_string())).unwrap();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(report.tensors, 2 + 13 * LAYERS);

    let cfg = ModelConfig::from_file(&out.join("config.json")).unwrap();
    assert_eq!(cfg, report.config);
    assert_eq!(cfg.vocab_size, VOCAB as usize);
    assert_eq!(cfg.hidden_size, H as usize);
    assert_eq!(cfg.head_dim, HD as usize);
    assert_eq!(cfg.query_pre_attn_scalar, HD as f64);
    assert_eq!(cfg.sliding_window, 4);
    assert_eq!(cfg.max_position_embeddings, 128);
    assert_eq!(
        cfg.rms_norm_eps, 1e-6,
        "f32 epsilon written as its shortest decimal"
    );
    let mut kinds = vec![LayerKind::Sliding; LAYERS];
    kinds[5] = LayerKind::Global;
    assert_eq!(cfg.layer_kinds, kinds);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(json["model_type"], "gemma3_text");
    assert_eq!(json["architectures"][0], "Gemma3ForCausalLM");

    let gguf = GgufFile::open(&path).unwrap();
    assert_eq!(
        gguf.get("general.tags")
            .and_then(Value::as_array)
            .map(|a| a.len()),
        Some(2)
    );
    let w = Weights::open(&out.join("model.safetensors")).unwrap();
    assert_eq!(w.names().len(), report.tensors);

    // Shapes are the GGUF dims reversed; data needs no transpose.
    let v = w
        .f32(
            "model.layers.3.self_attn.v_proj.weight",
            &[KV as usize, H as usize],
        )
        .unwrap();
    assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32));
    // Norms: stored 1 + w, written w; 0.125 - 1 = -0.875 exactly.
    let norm = w
        .f32("model.layers.0.self_attn.q_norm.weight", &[HD as usize])
        .unwrap();
    assert_eq!(norm[1], -0.875);
    assert!(norm
        .iter()
        .enumerate()
        .all(|(i, &x)| x == i as f32 / 8.0 - 1.0));
    let fnorm = w.f32("model.norm.weight", &[H as usize]).unwrap();
    assert_eq!(fnorm[8], 0.0);
    // Quantized tensors are written exactly as dequantized.
    for (gguf_name, hf_name) in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        (
            "blk.2.attn_q.weight",
            "model.layers.2.self_attn.q_proj.weight",
        ),
        (
            "blk.2.attn_k.weight",
            "model.layers.2.self_attn.k_proj.weight",
        ),
        (
            "blk.2.attn_output.weight",
            "model.layers.2.self_attn.o_proj.weight",
        ),
        (
            "blk.4.ffn_gate.weight",
            "model.layers.4.mlp.gate_proj.weight",
        ),
        ("blk.4.ffn_up.weight", "model.layers.4.mlp.up_proj.weight"),
        (
            "blk.4.ffn_down.weight",
            "model.layers.4.mlp.down_proj.weight",
        ),
    ] {
        let t = gguf.tensor(gguf_name).unwrap();
        let want = gguf.dequantize(t).unwrap();
        let got = w.f32(hf_name, &t.row_major_shape()).unwrap();
        assert_eq!(sha256_f32(&got), sha256_f32(&want), "{hf_name}");
        assert!(got.iter().all(|x| x.is_finite()), "{hf_name}");
    }
    drop(w);
    std::fs::remove_dir_all(&out).unwrap();
}

fn format_error(image: &GgufImage) -> String {
    match image.parse() {
        Err(e @ Error::Format { format: "gguf", .. }) => e.to_string(),
        Err(e) => panic!("expected a gguf format error, got {e:?}"),
        Ok(_) => panic!("expected a gguf format error, the file parsed"),
    }
}

#[test]
fn every_truncation_is_a_format_error() {
    // Small, but with every kind of metadata and two tensors.
    let image = GgufImage::new()
        .kv("a.u32", v_u32(7))
        .kv("a.f32", v_f32(0.5))
        .kv("a.str", v_str("x"))
        .kv("a.arr", v_str_array(&["p", "qq"]))
        .kv("a.bool", tagged(7, &[1]))
        .kv("a.i64", tagged(11, &(-5i64).to_le_bytes()))
        .kv("a.f64", tagged(12, &2.5f64.to_le_bytes()))
        .kv("a.nested", {
            // [[1u8, 2u8]]
            let mut p = 9u32.to_le_bytes().to_vec();
            p.extend(1u64.to_le_bytes());
            p.extend(0u32.to_le_bytes());
            p.extend(2u64.to_le_bytes());
            p.extend([1, 2]);
            tagged(9, &p)
        })
        .tensor("t0", &[4], F32, f32_bytes([1.0, 2.0, 3.0, 4.0]))
        .tensor("t1", &[32], Q8_0, vec![0; 34]);
    let full = image.bytes();
    let parsed = GgufFile::from_bytes(full.clone(), "full.gguf").unwrap();
    assert_eq!(parsed.metadata().len(), 8);
    assert_eq!(parsed.get("a.i64"), Some(&Value::I64(-5)));
    assert_eq!(parsed.get("a.bool"), Some(&Value::Bool(true)));
    let t0 = parsed.tensor("t0").unwrap();
    assert_eq!(parsed.dequantize(t0).unwrap(), [1.0, 2.0, 3.0, 4.0]);
    for len in 0..full.len() {
        match GgufFile::from_bytes(full[..len].to_vec(), "cut.gguf") {
            Err(Error::Format { format: "gguf", .. }) => {}
            Err(e) => panic!("cut at {len}: wrong error kind {e:?}"),
            Ok(_) => panic!("cut at {len} of {} parsed", full.len()),
        }
    }
    // On disk too: an empty file and a cut one.
    let path = write_image("cut.gguf", &image);
    std::fs::write(&path, &full[..full.len() - 1]).unwrap();
    assert!(matches!(GgufFile::open(&path), Err(Error::Format { .. })));
    std::fs::write(&path, b"").unwrap();
    assert!(matches!(GgufFile::open(&path), Err(Error::Format { .. })));
    let missing = path.with_extension("missing");
    assert!(matches!(GgufFile::open(&missing), Err(Error::Io { .. })));
}

#[test]
fn corrupted_headers_are_named_format_errors() {
    let base = GgufImage::new()
        .kv("k", v_u32(1))
        .tensor("t", &[32], Q8_0, vec![0; 34]);
    assert!(base.parse().is_ok());
    let cases: Vec<(&str, GgufImage)> = vec![
        (
            "bad magic",
            GgufImage {
                magic: *b"GGML",
                ..base.clone()
            },
        ),
        (
            "version 1 is not supported",
            GgufImage {
                version: 1,
                ..base.clone()
            },
        ),
        (
            "big-endian",
            GgufImage {
                version: 3u32.swap_bytes(),
                ..base.clone()
            },
        ),
        (
            "tensor infos claimed",
            GgufImage {
                counts: Some((u64::MAX, 1)),
                ..base.clone()
            },
        ),
        (
            "metadata entries claimed",
            GgufImage {
                counts: Some((1, 1 << 40)),
                ..base.clone()
            },
        ),
        (
            "claims 18446744073709551615 bytes",
            base.clone().kv("s", tagged(8, &u64::MAX.to_le_bytes())),
        ),
        (
            "array elements claimed",
            base.clone().kv("a", {
                let mut p = 0u32.to_le_bytes().to_vec();
                p.extend(u64::MAX.to_le_bytes());
                tagged(9, &p)
            }),
        ),
        (
            "nested deeper",
            base.clone().kv("a", {
                let mut p = Vec::new();
                for _ in 0..12 {
                    p.extend(9u32.to_le_bytes());
                    p.extend(1u64.to_le_bytes());
                }
                p.extend(0u32.to_le_bytes());
                p.extend(0u64.to_le_bytes());
                tagged(9, &p)
            }),
        ),
        (
            "unknown value type 13",
            base.clone().kv("x", tagged(13, &[0; 8])),
        ),
        ("expected 0 or 1", base.clone().kv("b", tagged(7, &[2]))),
        ("not UTF-8", {
            let mut g = base.clone();
            g.kvs.push((vec![0xff, 0xfe], v_u32(0)));
            g
        }),
        ("appears twice", base.clone().kv("k", v_u32(2))),
        (
            "expected a power of two",
            base.clone().kv("general.alignment", v_u32(24)),
        ),
        (
            "expected a power of two",
            base.clone().kv("general.alignment", v_u32(0)),
        ),
        ("n_dims is 0", base.clone().tensor("z", &[], F32, vec![])),
        (
            "n_dims is 5",
            base.clone().tensor("z", &[1, 1, 1, 1, 1], F32, vec![0; 4]),
        ),
        (
            "unknown ggml type id 4",
            base.clone().tensor("z", &[1], 4, vec![0; 4]),
        ),
        (
            "not a multiple of the Q8_0 block size",
            base.clone().tensor("z", &[16], Q8_0, vec![0; 34]),
        ),
        (
            "overflow",
            base.clone().tensor("z", &[u64::MAX, 2], F32, vec![]),
        ),
        (
            "run past the end",
            base.clone().tensor("z", &[1 << 20], F32, vec![0; 4]),
        ),
        (
            "appears twice",
            base.clone().tensor("t", &[4], F32, vec![0; 16]),
        ),
        ("not a multiple of the alignment", {
            let mut g = base.clone().tensor("z", &[4], F32, vec![0; 16]);
            g.tensors[1].offset = Some(36);
            g
        }),
        ("run past the end", {
            let mut g = base.clone();
            g.tensors[0].offset = Some(u64::MAX - 31);
            g
        }),
    ];
    for (want, image) in cases {
        let e = format_error(&image);
        assert!(e.contains(want), "expected `{want}` in: {e}");
        assert!(e.contains("synthetic.gguf"), "error names the file: {e}");
    }
}

#[test]
fn random_corruption_never_panics() {
    let full = tiny_gemma().bytes();
    // The header (metadata and tensor infos) is where a flipped byte changes the parse.
    let header = 4096.min(full.len());
    let mut rng = Lcg(42);
    for _ in 0..3000 {
        let mut bytes = full.clone();
        for _ in 0..1 + rng.next() % 4 {
            let at = (rng.next() as usize) % header;
            bytes[at] = rng.next() as u8;
        }
        if let Ok(g) = GgufFile::from_bytes(bytes, "fuzz.gguf") {
            // Whatever parsed must also dequantize or fail with a typed error.
            for t in g.tensors().iter().take(4) {
                let _ = g.dequantize(t);
            }
        }
    }
}

#[test]
fn import_rejects_what_it_cannot_convert() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gguf_import");
    let import = |name: &str, image: GgufImage| {
        let path = write_image(name, &image);
        gguf::import(&path, &dir.join(format!("{name}.hf")), &mut |_| {}).unwrap_err()
    };

    let mut llama = tiny_gemma();
    llama.kvs[0].1 = v_str("llama");
    let e = import("llama.gguf", llama);
    assert!(
        matches!(e, Error::Format { .. }) && e.to_string().contains("only `gemma3`"),
        "{e}"
    );

    let mut missing = tiny_gemma();
    missing.tensors.retain(|t| t.name != "blk.3.ffn_up.weight");
    let e = import("missing.gguf", missing);
    assert!(
        matches!(&e, Error::WeightsMismatch { tensor, .. } if tensor == "model.layers.3.mlp.up_proj.weight"),
        "{e}"
    );

    let untied = tiny_gemma().tensor(
        "output.weight",
        &[H, VOCAB],
        F32,
        vec![0; (H * VOCAB * 4) as usize],
    );
    let e = import("untied.gguf", untied);
    assert!(e.to_string().contains("untied LM head"), "{e}");

    let mut unsupported = tiny_gemma();
    let t = unsupported
        .tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.ffn_gate.weight")
        .unwrap();
    t.ty = 10; // Q2_K: same block size, 84 bytes per block
    t.data.truncate((H * FFN / 256 * 84) as usize);
    let e = import("q2k.gguf", unsupported);
    assert!(
        matches!(&e, Error::WeightsMismatch { tensor, problem, .. }
            if tensor == "blk.0.ffn_gate.weight" && problem.contains("Q2_K")),
        "{e}"
    );

    let mut wrong_shape = tiny_gemma();
    wrong_shape
        .tensors
        .iter_mut()
        .find(|t| t.name == "blk.1.attn_v.weight")
        .unwrap()
        .dims = vec![KV, H];
    let e = import("shape.gguf", wrong_shape);
    assert!(e.to_string().contains("expected [32, 256]"), "{e}");

    let mut no_eps = tiny_gemma();
    no_eps
        .kvs
        .retain(|(k, _)| k != b"gemma3.attention.layer_norm_rms_epsilon");
    let e = import("eps.gguf", no_eps);
    assert!(
        e.to_string()
            .contains("missing metadata `gemma3.attention.layer_norm_rms_epsilon`"),
        "{e}"
    );

    let extra_layer = tiny_gemma().tensor(
        "blk.6.attn_norm.weight",
        &[H],
        F32,
        vec![0; (H * 4) as usize],
    );
    let e = import("extra.gguf", extra_layer);
    assert!(e.to_string().contains("6-layer model does not have"), "{e}");
}
