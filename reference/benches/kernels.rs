//! criterion micro-benchmarks of the reference kernels at Gemma 3 270M's shapes.
//!
//! - `matvec/*`: decode projections (one token) including the 640 -> 262144 head, and the
//!   projections on the packed weights the model's layers use (`matvec/packed_*`);
//! - `head/*`: the greedy token of that head by the int8 screen (`kvsnap_reference::head`);
//! - `matmul/*`: the same projections for a 22-token extend and an 860-token prefill, on the
//!   row-major weights and on packed ones (`matmul/packed_*`, what the model's layers run
//!   where the CPU has AVX-512F), and the prefill by the `gemm` crate (`matmul/gemm_crate_*`);
//! - `mlp_down/*`: the MLP's GeGLU and down projection for those chunks, the GeGLU written out
//!   first or computed into the projection's bands (what the model runs);
//! - `attention/*`: one decode query and a 32-query chunk over 64, 512 and 1024 keys, and a
//!   256-query chunk over 1024 (4 query heads sharing one KV head of 256);
//! - `rms_norm/*`: one 640 row and an 860-row prefill;
//! - `snapshot/*`: the clone of an 860-token `ReferenceKv` (real KV shapes: 18 layers, 1 KV head
//!   of 256, 512-key windows), built by a prefill on a model with the real KV shapes and a small
//!   vocabulary and hidden size (the KV does not depend on those).
//!
//! Throughput is reported in bytes of weights (matvec: bytes streamed) or elements, so the
//! numbers compare directly with `kvsnap bench limits`.
//!
//! Run: `cargo bench -p kvsnap-reference --bench kernels` (a filter narrows it, e.g. `-- matvec`).

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvsnap_contract::{KvModel, Logits, ModelConfig};
use kvsnap_reference::attention::{attention, AttnShape};
use kvsnap_reference::head::TiedHead;
use kvsnap_reference::kernels::{
    geglu, geglu_matmul_packed, matmul, matmul_gemm_crate, matmul_packed, matvec, rms_norm,
    PackedWeight, FEW_ROWS,
};
use kvsnap_reference::kv::KvSegment;
use kvsnap_reference::tiny::{config_json, random_weights, Preset};
use kvsnap_reference::{write_safetensors, ReferenceModel};

/// The model's projections: (name, in, out). A layer packs q, k and v as one weight
/// (`qkv`), gate and up as another (`gate_up`); the parts are here too, to compare.
const PROJECTIONS: [(&str, usize, usize); 6] = [
    ("q_640x1024", 640, 1024),
    ("kv_640x256", 640, 256),
    ("qkv_640x1536", 640, 1536),
    ("ffn_640x2048", 640, 2048),
    ("gate_up_640x4096", 640, 4096),
    ("down_2048x640", 2048, 640),
];

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    kvsnap_reference::tiny::uniform(n, seed)
}

fn bench_matvec(c: &mut Criterion) {
    let mut g = c.benchmark_group("matvec");
    let head = ("head_640x262144", 640, 262_144);
    for (name, i, o) in PROJECTIONS.into_iter().chain([head]) {
        let w = values(o * i, 1);
        let x = values(i, 2);
        let mut out = vec![0.0; o];
        g.throughput(Throughput::Bytes((o * i * 4) as u64));
        if o * i > 1 << 24 {
            g.sample_size(20);
        }
        g.bench_function(name, |b| {
            b.iter(|| matvec(black_box(&mut out), &x, &w, i, o))
        });
        if let (true, Some(packed)) = (i * o < 1 << 24, PackedWeight::new(&w, i, o)) {
            g.bench_function(format!("packed_{name}"), |b| {
                b.iter(|| matmul_packed(black_box(&mut out), &x, &packed, 1))
            });
        }
    }
    g.finish();
}

/// The greedy token of the tied head without every logit: the int8 screen plus the rows it
/// recomputes in f32 (`kvsnap_reference::head`), against the f32 head's matvec above. Bytes
/// are the f32 table's, so the two throughputs compare as speed on the same head.
fn bench_head(c: &mut Criterion) {
    let mut g = c.benchmark_group("head");
    g.sample_size(20);
    let (i, o) = (640, 262_144);
    let table = values(o * i, 1);
    let head = TiedHead::new(&table, i).unwrap();
    // A hidden state with one clear winner, as a trained model's usually is.
    let mut x = values(i, 2);
    let winner = 4242;
    x.copy_from_slice(&table[winner * i..(winner + 1) * i]);
    assert_eq!(head.argmax(&table, &x), Some(winner as u32));
    g.throughput(Throughput::Bytes((o * i * 4) as u64));
    g.bench_function("argmax_640x262144", |b| {
        b.iter(|| head.argmax(&table, black_box(&x)))
    });
    g.finish();
}

fn bench_matmul(c: &mut Criterion) {
    let mut g = c.benchmark_group("matmul");
    g.sample_size(20);
    for n in [22usize, 64, 860] {
        for (name, i, o) in PROJECTIONS {
            let w = values(o * i, 1);
            let x = values(n * i, 2);
            let mut out = vec![0.0; n * o];
            g.throughput(Throughput::Elements((2 * n * i * o) as u64));
            g.bench_with_input(BenchmarkId::new(name, n), &n, |b, &n| {
                b.iter(|| matmul(black_box(&mut out), &x, &w, n, i, o))
            });
            if let Some(packed) = PackedWeight::new(&w, i, o) {
                let id = BenchmarkId::new(format!("packed_{name}"), n);
                g.bench_with_input(id, &n, |b, &n| {
                    b.iter(|| matmul_packed(black_box(&mut out), &x, &packed, n))
                });
            }
            if n > FEW_ROWS {
                // The `gemm` crate on the same prefill: what the blocked AVX-512 GEMM replaced.
                let id = BenchmarkId::new(format!("gemm_crate_{name}"), n);
                g.bench_with_input(id, &n, |b, &n| {
                    b.iter(|| matmul_gemm_crate(black_box(&mut out), &x, &w, n, i, o))
                });
            }
        }
    }
    g.finish();
}

/// The MLP's GeGLU and down projection for a 22-token extend and an 860-token prefill, on
/// packed weights: the GeGLU written out and then multiplied (`geglu_then_down`) against the
/// GeGLU computed into the down projection's bands (`geglu_into_down`, what the model runs).
fn bench_mlp_down(c: &mut Criterion) {
    let (f, o) = (2048, 640);
    let Some(packed) = PackedWeight::new(&values(o * f, 1), f, o) else {
        eprintln!("SKIPPED: mlp_down (weights are not packed without the AVX-512F kernels)");
        return;
    };
    let mut g = c.benchmark_group("mlp_down");
    g.sample_size(20);
    for n in [22usize, 860] {
        let gate_up = values(n * 2 * f, 2);
        let mut ffn = vec![0.0; n * f];
        let mut out = vec![0.0; n * o];
        g.throughput(Throughput::Elements((2 * n * f * o) as u64));
        g.bench_with_input(BenchmarkId::new("geglu_then_down", n), &n, |b, &n| {
            b.iter(|| {
                geglu(&mut ffn, &gate_up, f);
                matmul_packed(black_box(&mut out), &ffn, &packed, n)
            })
        });
        g.bench_with_input(BenchmarkId::new("geglu_into_down", n), &n, |b, &n| {
            b.iter(|| geglu_matmul_packed(black_box(&mut out), &gate_up, &packed, n))
        });
    }
    g.finish();
}

fn bench_attention(c: &mut Criterion) {
    let s = AttnShape {
        heads: 4,
        kv_heads: 1,
        head_dim: 256,
        window: None,
        scale: 1.0 / 16.0,
        softcap: None,
    };
    let qrow = s.heads * s.head_dim;
    let row = s.kv_heads * s.head_dim;
    let mut g = c.benchmark_group("attention");
    for keys in [64usize, 512, 1024] {
        let k = values(keys * row, 3);
        let v = values(keys * row, 4);
        let segs = [KvSegment {
            k: &k,
            v: &v,
            pos0: 0,
        }];
        // A decode step, an extend-sized chunk and, at 1024 keys, a prefill-sized one (whose
        // blocks of queries share each call's packed keys).
        let chunks: &[usize] = if keys == 1024 {
            &[1, 32, 256]
        } else {
            &[1, 32]
        };
        for &queries in chunks {
            let q = values(queries * qrow, 5);
            let mut out = vec![0.0; q.len()];
            // The chunk's last query sits at the last key.
            let pos0 = keys - queries;
            let name = match queries {
                1 => "decode".to_string(),
                n => format!("chunk{n}"),
            };
            g.throughput(Throughput::Elements((queries * keys) as u64));
            g.bench_with_input(BenchmarkId::new(name, keys), &keys, |b, _| {
                b.iter(|| attention(black_box(&mut out), &q, pos0, &segs, s))
            });
        }
    }
    g.finish();
}

fn bench_rms_norm(c: &mut Criterion) {
    let mut g = c.benchmark_group("rms_norm");
    let w = values(640, 6);
    for rows in [1usize, 860] {
        let x = values(rows * 640, 7);
        let mut out = vec![0.0; x.len()];
        g.throughput(Throughput::Elements(x.len() as u64));
        g.bench_with_input(BenchmarkId::new("640", rows), &rows, |b, _| {
            b.iter(|| rms_norm(black_box(&mut out), &x, &w, 1e-6))
        });
    }
    g.finish();
}

/// A model with Gemma 3 270M's KV shapes (layers, kinds, KV heads, head_dim, window) and a small
/// vocabulary and hidden size, written to a temporary directory.
fn kv_shaped_model() -> ReferenceModel {
    let mut json: serde_json::Value =
        serde_json::from_str(&config_json(Preset::RealShapes)).expect("preset config is JSON");
    json["vocab_size"] = 1024.into();
    json["hidden_size"] = 64.into();
    json["intermediate_size"] = 128.into();
    let text = json.to_string();
    let dir: PathBuf = std::env::temp_dir().join(format!("kvsnap-bench-kv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("config.json"), &text).expect("write config");
    let cfg = ModelConfig::from_json(&text, &dir.join("config.json")).expect("valid config");
    let tensors = random_weights(&cfg, 0);
    write_safetensors(&dir.join("model.safetensors"), &tensors, None).expect("write weights");
    let model = ReferenceModel::load_config(&dir, cfg).expect("load");
    // The weights are memory-mapped: unlinking the files leaves the mapping valid.
    std::fs::remove_dir_all(&dir).ok();
    model
}

fn bench_snapshot(c: &mut Criterion) {
    let model = kv_shaped_model();
    let ids: Vec<u32> = (0..860u32).map(|i| (i * 7 + 3) % 1024).collect();
    let (kv, _) = model.prefill(&ids, Logits::Skip).expect("prefill");
    let bytes = model.kv_bytes(&kv);
    let mut g = c.benchmark_group("snapshot");
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function("clone_860_tokens", |b| {
        b.iter(|| black_box(model.snapshot(&kv).expect("snapshot")))
    });
    // What the snapshot is judged against: a copy of the same bytes into mapped memory.
    let src = vec![1u8; bytes as usize];
    let mut dst = vec![0u8; bytes as usize];
    g.bench_function("memcpy_same_bytes", |b| {
        b.iter(|| black_box(&mut dst).copy_from_slice(&src))
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_matvec,
    bench_head,
    bench_matmul,
    bench_mlp_down,
    bench_attention,
    bench_rms_norm,
    bench_snapshot
);
criterion_main!(benches);
