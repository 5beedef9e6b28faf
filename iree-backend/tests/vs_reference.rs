//! `IreeModel` (llvm-cpu) against `kvsnap_reference::ReferenceModel` on the tiny model: every
//! operation's logits within `Tolerance::LOGITS` and the same greedy tokens.
//!
//! Prints `SKIPPED: iree-compile not found` (and passes) when the compiler is not installed.

use std::sync::OnceLock;

use kvsnap_contract::{Error, KvModel, Logits, Next, Tolerance};
use kvsnap_iree::compile::{Compiler, Target};
use kvsnap_iree::graphs::{DType, HeadMode, Input, Role};
use kvsnap_iree::{IreeModel, IreeOptions};
use kvsnap_reference::tiny::{write_model, Preset, DEFAULT_SEED};
use kvsnap_reference::ReferenceModel;

struct Pair {
    iree: IreeModel,
    reference: ReferenceModel,
}

/// The tiny model on IREE (`target`) and on the reference, built once per test binary and
/// target; `None` (with a visible SKIPPED line) without a compiler or a device.
fn pair(target: Target) -> Option<&'static Pair> {
    static CPU: OnceLock<Option<Pair>> = OnceLock::new();
    static VULKAN: OnceLock<Option<Pair>> = OnceLock::new();
    let cell = match target {
        Target::LlvmCpu => &CPU,
        Target::VulkanSpirv => &VULKAN,
    };
    cell.get_or_init(|| {
        compiler()?;
        let dir = std::env::temp_dir().join(format!(
            "kvsnap-iree-parity-{}-{}",
            target.name(),
            std::process::id()
        ));
        write_model(&dir, Preset::Tiny, DEFAULT_SEED).expect("tiny model");
        let reference = ReferenceModel::load(&dir).expect("reference model");
        let opts = IreeOptions {
            target,
            ..IreeOptions::cpu()
        };
        let iree = match IreeModel::load(&dir, &opts) {
            Ok(m) => m,
            Err(e) if target == Target::VulkanSpirv && e.kind() == "unsupported" => {
                eprintln!("SKIPPED: no Vulkan device ({e})");
                return None;
            }
            Err(e) => panic!("IREE model on {}: {e}", target.name()),
        };
        Some(Pair { iree, reference })
    })
    .as_ref()
}

/// The IREE compiler, or `None` after a visible SKIPPED line when it is not installed.
fn compiler() -> Option<Compiler> {
    Compiler::discover()
        .map_err(|e| eprintln!("SKIPPED: iree-compile not found ({e})"))
        .ok()
}

/// One test per (scenario, target): `cpu_{name}` and `vulkan_{name}`.
macro_rules! per_target {
    ($($name:ident),* $(,)?) => {
        mod cpu {
            $(#[test]
            fn $name() {
                if let Some(p) = super::pair(super::Target::LlvmCpu) {
                    super::$name(p);
                }
            })*
        }
        mod vulkan {
            $(#[test]
            fn $name() {
                if let Some(p) = super::pair(super::Target::VulkanSpirv) {
                    super::$name(p);
                }
            })*
        }
    };
}

per_target!(
    prefill_extend_step_match_the_reference,
    long_prefill_up_to_capacity_and_overflow_leaves_state_unchanged,
    snapshots_are_independent,
    embeddings_input_matches_ids_input,
    kv_bytes_are_the_allocated_buffers,
    both_input_kinds_serve_every_operation,
    steps_through_every_global_span_match_the_reference,
    queued_decode_matches_the_reference,
    decode_to_the_capacity_matches_the_reference,
);

/// Deterministic token ids in the tiny vocab.
fn ids(n: usize, seed: u64) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((i * 2_654_435_761 + seed * 977 + 12_345) % 512) as u32)
        .collect()
}

/// Asserts `got` matches `want` (logits within `Tolerance::LOGITS`, same token); returns the
/// largest logit difference.
#[track_caller]
fn assert_close(what: &str, got: &Next, want: &Next) -> f64 {
    let (g, w) = (
        got.logits.as_ref().expect("iree logits"),
        want.logits.as_ref().expect("reference logits"),
    );
    assert_eq!(g.len(), w.len(), "{what}: logits length");
    let tol = Tolerance::LOGITS;
    let (worst, at) = g
        .iter()
        .zip(w)
        .enumerate()
        .map(|(i, (a, b))| ((a - b).abs() as f64, i))
        .fold((0.0, 0), |m, x| if x.0 > m.0 { x } else { m });
    assert!(
        g.iter()
            .zip(w)
            .all(|(a, b)| tol.accepts(*a as f64, *b as f64)),
        "{what}: logit {at} differs by {worst} (got {}, want {})",
        g[at],
        w[at]
    );
    assert_eq!(got.token, want.token, "{what}: next token");
    worst
}

/// One sequence run on an IREE model and on the reference in lockstep: every call returns the
/// logits on both and asserts that they agree ([`assert_close`]).
struct Lockstep<'m> {
    iree: &'m IreeModel,
    reference: &'m ReferenceModel,
    a: <IreeModel as KvModel>::Kv,
    b: <ReferenceModel as KvModel>::Kv,
    /// The largest logit difference so far.
    worst: f64,
}

impl<'m> Lockstep<'m> {
    /// Prefills `ids` on both; returns the pair and IREE's next token and logits.
    #[track_caller]
    fn prefill(
        iree: &'m IreeModel,
        reference: &'m ReferenceModel,
        what: &str,
        ids: &[u32],
    ) -> (Self, Next) {
        let (a, na) = iree.prefill(ids, Logits::Return).unwrap();
        let (b, nb) = reference.prefill(ids, Logits::Return).unwrap();
        let worst = assert_close(what, &na, &nb);
        let s = Lockstep {
            iree,
            reference,
            a,
            b,
            worst,
        };
        (s, na)
    }

    #[track_caller]
    fn compare(&mut self, what: &str, na: Next, nb: Next) -> Next {
        self.worst = self.worst.max(assert_close(what, &na, &nb));
        na
    }

    #[track_caller]
    fn extend(&mut self, what: &str, ids: &[u32]) -> Next {
        let na = self.iree.extend(&mut self.a, ids, Logits::Return).unwrap();
        let nb = self
            .reference
            .extend(&mut self.b, ids, Logits::Return)
            .unwrap();
        self.compare(what, na, nb)
    }

    #[track_caller]
    fn step(&mut self, what: &str, id: u32) -> Next {
        let na = self.iree.step(&mut self.a, id, Logits::Return).unwrap();
        let nb = self
            .reference
            .step(&mut self.b, id, Logits::Return)
            .unwrap();
        self.compare(what, na, nb)
    }

    /// A snapshot of both states, continuing independently.
    fn snapshot(&self) -> Lockstep<'m> {
        Lockstep {
            a: self.iree.snapshot(&self.a).unwrap(),
            b: self.reference.snapshot(&self.b).unwrap(),
            ..*self
        }
    }
}

fn prefill_extend_step_match_the_reference(p: &Pair) {
    let r = Logits::Return;
    let seq = ids(60, 1);
    // 23 rows as a 24-row chunk, 30 as a 32-row one, 5 as an 8-row one (the default chunks),
    // then steps: crosses the 6-token window and pads every call.
    let (mut s, _) = Lockstep::prefill(&p.iree, &p.reference, "prefill 23", &seq[..23]);
    s.extend("extend 30", &seq[23..53]);
    let mut t = s.extend("extend 5", &seq[53..58]).token;
    for i in 0..8 {
        t = s.step(&format!("step {i}"), t).token;
    }
    assert_eq!(p.iree.len(&s.a), 66);
    // Logits::Skip returns the token only.
    let skip = p.iree.step(&mut s.a, t, Logits::Skip).unwrap();
    let want = p.reference.step(&mut s.b, t, r).unwrap();
    assert_eq!((skip.token, skip.logits), (want.token, None));
    // Every KV buffer was updated in place by every call (no whole-buffer copies).
    assert_eq!(p.iree.kv_copies(), 0, "KV results in new buffers");
    // The tokens came back through host memory the calls wrote (no transfer after a call).
    assert!(p.iree.token_read_mapped());
}

/// Greedy steps queued on the device one after another (`IreeModel::decode_queued`: each
/// step's id is the previous step's token storage) give the reference's tokens step by step,
/// and leave the state the reference's steps leave (the next step's logits match). Bad
/// input is refused before anything runs and leaves the state usable.
fn queued_decode_matches_the_reference(p: &Pair) {
    let r = Logits::Return;
    let seq = ids(30, 7);
    let (mut a, first) = p.iree.prefill(&seq, r).unwrap();
    let (mut b, want_first) = p.reference.prefill(&seq, r).unwrap();
    assert_close("prefill", &first, &want_first);
    // 20 steps cross the tiny model's 6-token window and its ring's modulus many times.
    let steps = 20;
    let got = p.iree.decode_queued(&mut a, first.token, steps).unwrap();
    // The reference's `decode` is the contract's default, a loop of its `step`.
    let want = p.reference.decode(&mut b, want_first.token, steps).unwrap();
    assert_eq!(got, want, "queued tokens against the reference's steps");
    assert_eq!(p.iree.len(&a), seq.len() + steps);
    let next = *got.last().unwrap();

    let cap = p.iree.config().context_capacity;
    let vocab = p.iree.config().vocab_size as u32;
    let room = cap - p.iree.len(&a);
    let refused = [
        (p.iree.decode_queued(&mut a, next, 0), "empty"),
        (p.iree.decode_queued(&mut a, vocab, 1), "token"),
        (p.iree.decode_queued(&mut a, next, room + 1), "overflow"),
    ];
    for (result, what) in refused {
        match (result, what) {
            (Err(Error::EmptyInput { .. }), "empty")
            | (Err(Error::TokenOutOfRange { .. }), "token")
            | (Err(Error::ContextOverflow { .. }), "overflow") => {}
            (other, _) => panic!("{what}: expected its input error, got {other:?}"),
        }
    }
    assert_eq!(
        p.iree.len(&a),
        seq.len() + steps,
        "a refused call changed the state"
    );
    let after = p.iree.step(&mut a, next, r).unwrap();
    let want_after = p.reference.step(&mut b, next, r).unwrap();
    assert_close("the step after the queued ones", &after, &want_after);
    assert_eq!(p.iree.kv_copies(), 0, "KV results in new buffers");
}

/// [`KvModel::decode`] from a 10-token prefix to the capacity, against the reference's steps.
/// On Vulkan it runs the multi-step decode entry points (checked by their calls), of every
/// span, then single steps where 16 no longer fit before the capacity; on llvm-cpu a loop of
/// screened steps. The step after it matches too, so the state is the reference's.
fn decode_to_the_capacity_matches_the_reference(p: &Pair) {
    let cap = p.iree.config().context_capacity;
    let seq = ids(10, 3);
    let (mut a, first) = p.iree.prefill(&seq, Logits::Skip).unwrap();
    let (mut b, want_first) = p.reference.prefill(&seq, Logits::Skip).unwrap();
    assert_eq!(first.token, want_first.token, "prefill");
    let calls_before = multi_step_calls(p);
    let got = p.iree.decode(&mut a, first.token, cap - 10).unwrap();
    let want = p.reference.decode(&mut b, first.token, cap - 10).unwrap();
    assert_eq!(got, want, "decoded tokens against the reference's steps");
    assert_eq!(p.iree.len(&a), cap);
    let multi = p.iree.manifest().entry_points.iter().any(|e| e.steps > 1);
    assert_eq!(
        multi,
        p.iree.backend() == "iree-vulkan",
        "multi-step entry points"
    );
    if multi {
        let calls = multi_step_calls(p) - calls_before;
        let wanted = (cap as u64 - 10) / 16;
        assert!(
            calls >= wanted,
            "{calls} multi-step calls for {} steps",
            cap - 10
        );
    }
    let last = *got.last().unwrap();
    assert!(matches!(
        p.iree.decode(&mut a, last, 1),
        Err(Error::ContextOverflow { .. })
    ));
    // Again from the same prefix, 40 steps (on Vulkan 16 + 16 + 8, the last call half padding).
    let (mut c, _) = p.iree.prefill(&seq, Logits::Skip).unwrap();
    let again = p.iree.decode(&mut c, first.token, 40).unwrap();
    assert_eq!(again, want[..40], "a second decode from the same prefix");
    let r = Logits::Return;
    let after = p.iree.step(&mut c, again[39], r).unwrap();
    let (mut d, _) = p.reference.prefill(&seq, Logits::Skip).unwrap();
    p.reference.decode(&mut d, first.token, 40).unwrap();
    let want_after = p.reference.step(&mut d, want[39], r).unwrap();
    assert_close("the step after a decode", &after, &want_after);
}

/// Calls of the model's multi-step decode entry points so far.
fn multi_step_calls(p: &Pair) -> u64 {
    p.iree
        .entry_calls()
        .into_iter()
        .filter(|(name, _)| name.starts_with("decode_ids_k"))
        .map(|(_, n)| n)
        .sum()
}

/// Decode steps from a short prefix to the capacity: on llvm-cpu each runs the step entry point
/// of the shortest span that holds it (`GraphOptions::spans`: the global layers over its first
/// rows, and the sliding layers too while the span is within the ring's modulus), so the steps
/// cross every span's end; each matches the reference. On llvm-cpu a step with logits runs a
/// span's `_logits` entry point and one without its screened one: both kinds cross the spans.
fn steps_through_every_global_span_match_the_reference(p: &Pair) {
    let manifest = p.iree.manifest();
    let capacity = manifest.capacity;
    let mut steps: Vec<_> = manifest
        .entry_points
        .iter()
        .filter(|e| e.chunk == 1 && e.input == Role::Ids && e.head != HeadMode::Full)
        .map(|e| e.span)
        .collect();
    steps.sort_unstable();
    let mut want = match p.iree.backend() {
        "iree-cpu" => vec![16, 32, 64],
        _ => Vec::new(), // no branches on Vulkan
    };
    want.push(capacity);
    assert_eq!(steps, want, "the decode steps' global rows");
    let seq = ids(capacity, 7);
    let (mut s, _) = Lockstep::prefill(&p.iree, &p.reference, "prefill 10", &seq[..10]);
    // Greedy steps without logits from a snapshot, to row 80: the screened steps' tokens.
    let mut greedy = s.snapshot();
    let mut t = seq[10];
    for i in 10..80 {
        let got = p.iree.step(&mut greedy.a, t, Logits::Skip).unwrap();
        let want = p.reference.step(&mut greedy.b, t, Logits::Skip).unwrap();
        assert_eq!(got.token, want.token, "greedy step to row {}", i + 1);
        t = got.token;
    }
    for (i, &t) in seq[10..].iter().enumerate() {
        s.step(&format!("step {} to row {}", i, 11 + i), t);
    }
    assert_eq!(p.iree.len(&s.a), capacity);
    if p.iree.backend() == "iree-cpu" {
        let calls: Vec<(&str, u64)> = p.iree.entry_calls();
        for span in [16, 32, 64] {
            for name in [
                format!("chunk_ids_c1_s{span}"),
                format!("chunk_ids_c1_s{span}_logits"),
            ] {
                let n = calls.iter().find(|(e, _)| *e == name).map_or(0, |c| c.1);
                assert!(n > 0, "{name} never ran: {calls:?}");
            }
        }
    }
}

fn long_prefill_up_to_capacity_and_overflow_leaves_state_unchanged(p: &Pair) {
    let r = Logits::Return;
    let cap = p.iree.config().context_capacity;
    let seq = ids(cap, 2);
    // 80 = 64 + 16, 20 more as a 24-row chunk padded from 20, then the 27 rows up to the
    // capacity as 24 + 1 + 1 + 1: no padded chunk fits past row 124.
    let (mut s, _) = Lockstep::prefill(&p.iree, &p.reference, "prefill 80", &seq[..80]);
    s.extend("extend to 100", &seq[80..100]);
    s.extend("extend to capacity - 1", &seq[100..cap - 1]);
    let err = p.iree.extend(&mut s.a, &[1, 2], r).unwrap_err();
    assert_eq!(err.kind(), "context_overflow");
    let err = p.iree.step(&mut s.a, 512, r).unwrap_err();
    assert_eq!(err.kind(), "token_out_of_range");
    assert_eq!(p.iree.len(&s.a), cap - 1);
    s.step("last step", seq[cap - 1]);
}

fn snapshots_are_independent(p: &Pair) {
    let seq = ids(40, 3);
    let (mut s, _) = Lockstep::prefill(&p.iree, &p.reference, "prefill 20", &seq[..20]);
    let mut snap = s.snapshot();
    // Diverge the original (a chunk and steps, so every KV buffer is written).
    s.extend("original's extend after snapshot", &seq[20..37]);
    for &t in &seq[37..40] {
        s.step("original after snapshot", t);
    }
    // The snapshot still continues from token 20.
    for (i, &t) in [7u32, 300, 42, 5, 6, 7, 8].iter().enumerate() {
        snap.step(&format!("snapshot step {i}"), t);
    }
    assert_eq!(p.iree.len(&snap.a), 27);
    p.iree.release(snap.a).unwrap();
    // The original is unaffected by the snapshot's steps.
    s.step("original after the snapshot diverged", 9);
}

fn embeddings_input_matches_ids_input(p: &Pair) {
    let r = Logits::Return;
    let seq = ids(45, 4);
    let rows = p.reference.embedding_rows(&seq).unwrap();
    let (mut a, na) = p.iree.prefill(&seq, r).unwrap();
    let (mut e, ne) = p.iree.prefill_embeddings(&seq, &rows, r).unwrap();
    let (mut b, nb) = p.reference.prefill(&seq, r).unwrap();
    assert_close("embeddings vs reference", &ne, &nb);
    assert_close("embeddings vs ids", &ne, &na);
    for &t in &[3u32, 4, 5] {
        let na = p.iree.step(&mut a, t, r).unwrap();
        let ne = p.iree.step(&mut e, t, r).unwrap();
        let nb = p.reference.step(&mut b, t, r).unwrap();
        assert_close("step after embeddings prefill", &ne, &nb);
        assert_close("step after ids prefill", &na, &nb);
    }
    let bad = p.iree.prefill_embeddings(&seq, &rows[1..], r).unwrap_err();
    assert_eq!(bad.kind(), "shape_mismatch");
}

fn kv_bytes_are_the_allocated_buffers(p: &Pair) {
    let cfg = p.iree.config();
    let (kv, _) = p.iree.prefill(&[1, 2, 3], Logits::Skip).unwrap();
    let ring = p.iree.manifest().ring;
    let rows: usize = cfg
        .layer_kinds
        .iter()
        .map(|k| match k {
            kvsnap_contract::LayerKind::Sliding => ring.rows,
            kvsnap_contract::LayerKind::Global => cfg.context_capacity,
        })
        .sum();
    assert_eq!(
        p.iree.kv_bytes(&kv),
        (rows * 2 * cfg.kv_row() * 4 + ring.rows * 4) as u64
    );
}

/// On the CPU the load report counts one import per weight argument and one for the int8
/// screen table (its scales and bounds are uploads), with their bytes, and each wraps the host
/// memory in place (page-aligned buffers): none is copied.
#[test]
fn cpu_imports_every_weight_in_place() {
    let Some(p) = pair(Target::LlvmCpu) else {
        return;
    };
    let imports = p.iree.load_report().imports;
    let entry = &p.iree.manifest().entry_points[0];
    let screen = entry.screen().take(1).count();
    let bytes: usize = entry
        .weights()
        .chain(entry.screen().take(screen))
        .map(|t| t.dims.iter().product::<usize>() * if t.dtype == DType::I8 { 1 } else { 4 })
        .sum();
    assert_eq!(imports.copied, 0, "{imports:?}");
    assert_eq!(
        imports.zero_copy,
        (entry.weights().count() + screen) as u64,
        "{imports:?}"
    );
    assert_eq!(imports.zero_copy_bytes, bytes as u64, "{imports:?}");
}

/// The real Gemma 3 270M (`$KVSNAP_REAL_MODEL`, default `models/gemma-3-270m`): parity with the
/// reference on a prefill, an extend and steps, plus the timings of one 64-row chunk and one
/// decode step. Run with `cargo test -p kvsnap-iree --release --test vs_reference -- --ignored
/// --nocapture` (`KVSNAP_REAL_TARGET=vulkan` for Vulkan device 0).
#[test]
#[ignore = "needs the real model and minutes of compile time"]
fn real_model_parity_and_timings() {
    use std::time::Instant;
    let dir = std::env::var_os("KVSNAP_REAL_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/gemma-3-270m")
        });
    if !dir.join("model.safetensors").is_file() || Compiler::discover().is_err() {
        eprintln!(
            "SKIPPED: no real model at {} or no iree-compile",
            dir.display()
        );
        return;
    }
    // `KVSNAP_REAL_TARGET=vulkan` runs it on Vulkan device 0 instead of the CPU.
    let mut opts = match std::env::var("KVSNAP_REAL_TARGET").as_deref() {
        Ok("vulkan") => IreeOptions::vulkan(),
        _ => IreeOptions::cpu(),
    };
    opts.verbose = true;
    let iree = IreeModel::load(&dir, &opts).unwrap();
    let rep = iree.load_report();
    eprintln!(
        "module: {} KB MLIR, compile {:.1} s (cache hit: {}), weights {:?}",
        rep.mlir_bytes / 1024,
        rep.compile.as_secs_f64(),
        rep.cache_hit,
        rep.imports
    );
    let reference = ReferenceModel::load(&dir).unwrap();
    let vocab = iree.config().vocab_size as u64;
    let seq: Vec<u32> = (0..130u64)
        .map(|i| ((i * 2_654_435_761 + 12_345) % vocab) as u32)
        .collect();
    let (mut s, _) = Lockstep::prefill(&iree, &reference, "real prefill 100", &seq[..100]);
    let mut t = s.extend("real extend 20", &seq[100..120]).token;
    for i in 0..5 {
        t = s.step(&format!("real step {i}"), t).token;
    }
    let worst = s.worst;
    eprintln!("largest logit difference from the reference: {worst:.2e}");

    // Timings: min and median over repetitions (the min is robust to other load on the box).
    let stats = |mut ms: Vec<f64>| {
        ms.sort_by(f64::total_cmp);
        (ms[0], ms[ms.len() / 2])
    };
    let skip = Logits::Skip;
    let (mut kv, n) = iree.prefill(&seq[..64], skip).unwrap();
    let chunk = stats(
        (0..5)
            .map(|_| {
                let mut snap = iree.snapshot(&kv).unwrap();
                let start = Instant::now();
                iree.extend(&mut snap, &seq[64..128], skip).unwrap();
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    );
    let mut t = n.token;
    let step = stats(
        (0..20)
            .map(|_| {
                let start = Instant::now();
                t = iree.step(&mut kv, t, skip).unwrap().token;
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    );
    let start = Instant::now();
    let snap = iree.snapshot(&kv).unwrap();
    let snapshot = start.elapsed();
    eprintln!(
        "one 64-row chunk (extend at 64): min {:.1} ms, median {:.1} ms; decode step: min {:.1} \
         ms, median {:.1} ms; snapshot ({} MB): {:.2} ms",
        chunk.0,
        chunk.1,
        step.0,
        step.1,
        iree.kv_bytes(&snap) >> 20,
        snapshot.as_secs_f64() * 1e3
    );
}

/// The head's two-stage argmax over the real vocab (262144) with planted maxima past the
/// 65535-iteration shader loop limit, ties, NaN and -inf, on each target that is available.
#[test]
fn argmax_with_planted_maxima_on_every_target() {
    use kvsnap_iree::graphs::argmax_module;
    use kvsnap_iree::runtime::{BufferView, Device, Instance, Session};
    use kvsnap_reference::tiny::config;

    let Some(compiler) = compiler() else {
        return;
    };
    let cfg = config(Preset::RealShapes);
    let vocab = cfg.vocab_size;
    let mlir = argmax_module(&cfg);
    let instance = Instance::new().unwrap();
    for target in [Target::LlvmCpu, Target::VulkanSpirv] {
        let device = match target {
            Target::LlvmCpu => Device::cpu(&instance).unwrap(),
            Target::VulkanSpirv => match Device::vulkan(&instance, 0) {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("SKIPPED: no Vulkan device ({e})");
                    continue;
                }
            },
        };
        let vmfb = compiler.compile(&mlir, target, &mut |_| {}).unwrap().vmfb;
        let session = Session::new(&device, &vmfb).unwrap();
        let run = |logits: &[f32]| -> u32 {
            let input = BufferView::from_f32(&device, &[vocab], logits).unwrap();
            let out = session.call("argmax", &[&input]).unwrap();
            out[0].to_i32_vec().unwrap()[0] as u32
        };
        let base: Vec<f32> = (0..vocab)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
            .collect();
        for planted in [
            0,
            511,
            512,
            65534,
            65535,
            65536,
            131_071,
            200_000,
            vocab - 1,
        ] {
            let mut l = base.clone();
            l[planted] = 5.0;
            assert_eq!(
                run(&l),
                planted as u32,
                "{}: max at {planted}",
                target.name()
            );
            assert_eq!(run(&l), kvsnap_contract::argmax(&l));
        }
        // Ties go to the lowest index; NaN never wins; all -inf gives 0.
        let mut l = base.clone();
        l[70_000] = 5.0;
        l[250_000] = 5.0;
        l[3] = f32::NAN;
        l[100_000] = f32::NAN;
        assert_eq!(run(&l), 70_000, "{}: tie and NaN", target.name());
        assert_eq!(run(&vec![f32::NEG_INFINITY; vocab]), 0, "{}", target.name());
    }
}

/// A Vulkan module compiled for a named GPU keeps IREE's code for the chunks' products and
/// attention (`GraphOptions::spirv_chunks`), with kvsnap's norms and head around them: the
/// tiny model exported for `vp_android_baseline_2022` (an Android profile lavapipe runs) and
/// loaded from its directory, whose description names the target, matches the reference
/// through prefills, extends and steps as the generic module does.
#[test]
fn vulkan_module_for_a_named_gpu_matches_the_reference() {
    let Some(compiler) = compiler() else {
        return;
    };
    let compiler = compiler
        .with_vulkan_target(Some("vp_android_baseline_2022"))
        .unwrap();
    let dir = std::env::temp_dir().join(format!("kvsnap-iree-named-{}", std::process::id()));
    write_model(&dir, Preset::Tiny, DEFAULT_SEED).expect("tiny model");
    let cfg = kvsnap_contract::ModelConfig::from_dir(&dir, None).unwrap();
    let opts = IreeOptions {
        target: Target::VulkanSpirv,
        ..IreeOptions::cpu()
    };
    let module_dir = dir.join("module");
    kvsnap_iree::module::export_with(&compiler, &module_dir, &cfg, &opts, &mut |_| {}).unwrap();
    let info = kvsnap_iree::module::info(&module_dir, Target::VulkanSpirv).unwrap();
    assert_eq!(
        info.vulkan_target.as_deref(),
        Some("vp_android_baseline_2022")
    );
    let mlir = std::fs::read_to_string(module_dir.join("kvsnap.vulkan-spirv.mlir")).unwrap();
    if kvsnap_iree::kernels::spirv_kernels().is_some() {
        assert!(
            mlir.contains("kvsnap_add_norm_rows_"),
            "the chunks' norms are kvsnap's"
        );
    }
    assert!(
        !mlir.contains("kvsnap_matmul_"),
        "the chunks' products are IREE's"
    );
    assert!(
        !mlir.contains("kvsnap_attend_rows_"),
        "the chunks' attention is IREE's"
    );
    let opts = IreeOptions {
        module_dir: Some(module_dir),
        ..opts
    };
    let iree = match IreeModel::load(&dir, &opts) {
        Ok(m) => m,
        Err(e) if e.kind() == "unsupported" => {
            eprintln!("SKIPPED: no Vulkan device ({e})");
            return;
        }
        Err(e) => panic!("IREE model for a named GPU: {e}"),
    };
    let reference = ReferenceModel::load(&dir).unwrap();
    prefill_extend_step_match_the_reference(&Pair { iree, reference });
    std::fs::remove_dir_all(&dir).ok();
}

/// The decode step's tied head on Vulkan in kvsnap's SPIR-V kernel (`head`: the logits and
/// the token in one dispatch) on planted tables, `h` the first unit row so that each logit is
/// exactly its row's first weight: the token as `kvsnap_contract::argmax` with maxima at
/// workgroup edges (8 rows each) and where the last workgroup's threads wrap (128 of them),
/// ties within a workgroup, across workgroups of one thread and of two, NaN (never wins),
/// every logit -inf or NaN (0); over the real vocab (32768 workgroups) and one of a partial
/// last workgroup. Then a random table's logits against the host's sums.
#[test]
fn spirv_head_matches_the_contract_argmax_on_planted_tables() {
    use kvsnap_iree::graphs::head_module;
    use kvsnap_iree::kernels::spirv_kernels;
    use kvsnap_iree::runtime::{BufferView, Device, Instance, Session};
    use kvsnap_reference::tiny::config;

    let Some(compiler) = compiler() else {
        return;
    };
    let Some(kernels) = spirv_kernels() else {
        eprintln!("SKIPPED: this build has no SPIR-V kernels (glslangValidator not found)");
        return;
    };
    let instance = Instance::new().unwrap();
    let device = match Device::vulkan(&instance, 0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("SKIPPED: no Vulkan device ({e})");
            return;
        }
    };
    for (vocab, hidden) in [(262_144, 8), (1003, 12)] {
        let mut cfg = config(Preset::RealShapes);
        (cfg.vocab_size, cfg.hidden_size) = (vocab, hidden);
        let (mlir, objects) = head_module(&cfg, kernels);
        let target = Target::VulkanSpirv;
        let compiled = compiler.compile_tuned(&mlir, None, &objects, target, &mut |_| {});
        let session = Session::new(&device, &compiled.unwrap().vmfb).unwrap();
        let run = |table: &[f32], h: &[f32]| -> (u32, Vec<f32>) {
            let table = BufferView::from_f32(&device, &[vocab, hidden], table).unwrap();
            let h = BufferView::from_f32(&device, &[hidden], h).unwrap();
            let out = session.call("head", &[&table, &h]).unwrap();
            let next = out[0].to_i32_vec().unwrap()[0] as u32;
            (next, out[1].to_f32_vec().unwrap())
        };
        // Rows whose first weights are `firsts`, the others finite.
        let table_of = |firsts: &[f32]| -> Vec<f32> {
            let rest = |i: usize, j: usize| ((i * 31 + j * 7) % 17) as f32 * 0.25 - 2.0;
            (0..vocab)
                .flat_map(|i| (0..hidden).map(move |j| if j == 0 { firsts[i] } else { rest(i, j) }))
                .collect()
        };
        let mut unit = vec![0.0; hidden];
        unit[0] = 1.0;
        let check = |firsts: &[f32], what: &str| {
            let (next, logits) = run(&table_of(firsts), &unit);
            let same =
                |(a, b): (&f32, &f32)| a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan();
            assert!(
                logits.iter().zip(firsts).all(same),
                "{vocab}: {what}: logits"
            );
            assert_eq!(next, kvsnap_contract::argmax(firsts), "{vocab}: {what}");
        };
        let base: Vec<f32> = (0..vocab)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
            .collect();
        let edges = [0, 7, 8, 1023, 1024, 1031, vocab / 2, vocab - 8, vocab - 1];
        for planted in edges.into_iter().filter(|&i| i < vocab) {
            let mut l = base.clone();
            l[planted] = 5.0;
            check(&l, &format!("max at {planted}"));
        }
        for tie in [[9, 10], [1030, 6], [8, 8 + 8 * 128], [16, vocab - 1]] {
            let mut l = base.clone();
            for i in tie.into_iter().filter(|&i| i < vocab) {
                l[i] = 5.0;
            }
            check(&l, &format!("tie at {tie:?}"));
        }
        let mut l = base.clone();
        for (i, v) in [
            (2, f32::NAN),
            (5, 5.0),
            (vocab / 3, f32::NAN),
            (vocab - 1, f32::NAN),
        ] {
            l[i] = v;
        }
        check(&l, "NaN");
        check(&vec![f32::NEG_INFINITY; vocab], "all -inf");
        check(&vec![f32::NAN; vocab], "all NaN");

        let table: Vec<f32> = (0..vocab * hidden)
            .map(|i| ((i * 2_654_435_761) % 10_007) as f32 / 10_007.0 - 0.5)
            .collect();
        let h: Vec<f32> = (0..hidden).map(|j| 1.0 - 0.1 * j as f32).collect();
        let (next, logits) = run(&table, &h);
        for (i, got) in logits.iter().enumerate() {
            let row = &table[i * hidden..(i + 1) * hidden];
            let want: f64 = row.iter().zip(&h).map(|(&a, &b)| a as f64 * b as f64).sum();
            assert!(
                (*got as f64 - want).abs() < 1e-5,
                "{vocab}: logit {i}: {got} vs {want}"
            );
        }
        assert_eq!(
            next,
            kvsnap_contract::argmax(&logits),
            "{vocab}: random table"
        );
    }
}

/// The screened head's token (llvm-cpu) against `kvsnap_reference::head::TiedHead` and the
/// full head, on planted tables: a vocab that is not a whole number of blocks, winners at
/// block and table edges, duplicated winners (the lowest id wins), and the cases it must
/// leave to the full head (-1): more candidate blocks than it recomputes, a NaN state. With
/// IREE's code and with kvsnap's kernels for the scores (257 panels: 32 runs of 8 and one of
/// 1) and the candidate rows.
#[test]
fn screened_head_matches_the_reference_screen_on_planted_tables() {
    use kvsnap_iree::graphs::{
        pack_panels, screen_module, SCREEN_BLOCK, SCREEN_BLOCKS, TABLE_LANES,
    };
    use kvsnap_iree::runtime::{BufferView, Device, ElementType, Instance, Session};
    use kvsnap_reference::head::TiedHead;
    use kvsnap_reference::tiny::config;

    let Some(compiler) = compiler() else {
        return;
    };
    let mut cfg = config(Preset::Tiny);
    cfg.vocab_size = 4099; // 257 panels, the last of 3 rows; 257 blocks > SCREEN_BLOCKS
    cfg.hidden_size = 72; // rows of 4.5 vectors: the kernels' partial last vector
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    assert!(vocab.div_ceil(SCREEN_BLOCK) > SCREEN_BLOCKS);
    let instance = Instance::new().unwrap();
    let device = Device::cpu(&instance).unwrap();
    let full = |table: &[f32], h: &[f32]| -> u32 {
        let logits: Vec<f32> = table
            .chunks_exact(hidden)
            .map(|row| kvsnap_reference::kernels::dot(row, h))
            .collect();
        kvsnap_contract::argmax(&logits)
    };
    let values = kvsnap_reference::tiny::uniform;
    let base = values(vocab * hidden, 7);
    let kernel = kvsnap_iree::kernels::kernel_object();
    if kernel.is_none() {
        eprintln!("SKIPPED: the screen kernel's half: no kernel object on this build or host");
    }
    let variants = [None].into_iter().chain(kernel.map(Some));
    for own_kernels in variants {
        let objects: Vec<_> = own_kernels.into_iter().collect();
        let mlir = screen_module(&cfg, own_kernels);
        assert_eq!(mlir.contains("@screen_16["), own_kernels.is_some());
        let vmfb = compiler
            .compile_tuned(&mlir, None, &objects, Target::LlvmCpu, &mut |_| {})
            .unwrap()
            .vmfb;
        let session = Session::new(&device, &vmfb).unwrap();
        let run = |table: &[f32], h: &[f32]| -> i32 {
            let head = TiedHead::new(table, hidden).unwrap();
            let mut panels = vec![0i8; vocab.div_ceil(TABLE_LANES) * hidden * TABLE_LANES];
            pack_panels(head.q(), hidden, TABLE_LANES, &mut panels);
            let bytes: Vec<u8> = panels.iter().map(|&q| q as u8).collect();
            let dims = [vocab.div_ceil(TABLE_LANES), hidden, TABLE_LANES];
            let q8 = BufferView::from_bytes(&device, &dims, ElementType::I8, &bytes).unwrap();
            let scale = BufferView::from_f32(&device, &[vocab], head.scale()).unwrap();
            let slack = BufferView::from_f32(&device, &[vocab], head.slack()).unwrap();
            let t = BufferView::from_f32(&device, &[vocab, hidden], table).unwrap();
            let hv = BufferView::from_f32(&device, &[hidden], h).unwrap();
            let out = session
                .call("screen", &[&q8, &scale, &slack, &t, &hv])
                .unwrap();
            out[0].to_i32_vec().unwrap()[0]
        };
        let w = if own_kernels.is_some() {
            "kernel"
        } else {
            "IREE's code"
        };
        for (case, seed) in (0..6).map(|i| (format!("random state {i}"), 100 + i)) {
            let h = values(hidden, seed);
            let want = full(&base, &h);
            assert_eq!(
                TiedHead::new(&base, hidden).unwrap().argmax(&base, &h),
                Some(want)
            );
            assert_eq!(run(&base, &h), want as i32, "{w}: {case}");
        }
        // A planted winner at block and table edges, copied once before and once after it.
        for winner in [0, 15, 16, 2047, 4095, 4096, vocab - 1] {
            let mut table = base.clone();
            let h = values(hidden, 9);
            let row: Vec<f32> = h.iter().map(|v| v * 0.9).collect();
            table[winner * hidden..(winner + 1) * hidden].copy_from_slice(&row);
            assert_eq!(run(&table, &h), winner as i32, "{w}: winner {winner}");
            let later = (winner + 1234) % vocab;
            table[later * hidden..(later + 1) * hidden].copy_from_slice(&row);
            let want = winner.min(later) as i32;
            assert_eq!(
                run(&table, &h),
                want,
                "{w}: winner {winner} tied with {later}"
            );
            assert_eq!(full(&table, &h) as i32, want);
        }
        // Every row alike: every block holds candidates, more than the screen recomputes.
        let same: Vec<f32> = (0..vocab).flat_map(|_| base[..hidden].to_vec()).collect();
        assert_eq!(run(&same, &values(hidden, 3)), -1, "{w}: all rows alike");
        // A NaN in the state: the bound says nothing.
        let mut h = values(hidden, 4);
        h[5] = f32::NAN;
        assert_eq!(run(&base, &h), -1, "{w}: NaN state");
    }
}

/// Writes a variant of the tiny model into a fresh temporary directory named after `tag`: its
/// `config.json` edited by `config`, random weights from `seed` edited by `weights`. Returns
/// the directory and the config as the models read it.
fn tiny_variant(
    tag: &str,
    config: impl FnOnce(&mut serde_json::Value),
    seed: u64,
    weights: impl FnOnce(&kvsnap_contract::ModelConfig, &mut [kvsnap_reference::TensorOut]),
) -> (std::path::PathBuf, kvsnap_contract::ModelConfig) {
    use kvsnap_reference::tiny::{config_json, random_weights};

    let dir = std::env::temp_dir().join(format!("kvsnap-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&config_json(Preset::Tiny)).unwrap();
    config(&mut json);
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let cfg = kvsnap_contract::ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let mut tensors = random_weights(&cfg, seed);
    weights(&cfg, &mut tensors);
    kvsnap_reference::write_safetensors(&dir.join("model.safetensors"), &tensors, None).unwrap();
    (dir, cfg)
}

/// The host's fallback when the screen cannot settle the token: a model whose embedding rows
/// are all alike leaves every 16-row block a candidate (64 of them, more than the screen
/// recomputes), so each call without logits runs its chunk again with the full head. The
/// token is still the full head's (every logit ties: the lowest id), the reference's screen
/// agrees, and the state the rerun leaves continues exactly as one built with logits.
#[test]
fn unsettled_screen_reruns_the_chunk_with_the_full_head() {
    if compiler().is_none() {
        return;
    }
    let config = |json: &mut serde_json::Value| json["vocab_size"] = 1024.into();
    let (dir, _) = tiny_variant("screen-rerun", config, 3, |cfg, tensors| {
        let embed = tensors
            .iter_mut()
            .find(|t| t.name == "model.embed_tokens.weight")
            .unwrap();
        let row = embed.data[..cfg.hidden_size].to_vec();
        for r in embed.data.chunks_exact_mut(cfg.hidden_size) {
            r.copy_from_slice(&row);
        }
    });
    let iree = IreeModel::load(&dir, &IreeOptions::cpu()).unwrap();
    let reference = ReferenceModel::load(&dir).unwrap();
    let (skip, ret) = (Logits::Skip, Logits::Return);

    let ids = [5u32, 9, 200, 1000, 17];
    let (mut a, na) = iree.prefill(&ids, skip).unwrap();
    assert_eq!(
        iree.screen_fallbacks(),
        1,
        "the prefill's last chunk ran again"
    );
    let (mut b, nb) = iree.prefill(&ids, ret).unwrap();
    assert_eq!(
        iree.screen_fallbacks(),
        1,
        "a call with logits has no screen"
    );
    assert_eq!(
        (na.token, nb.token),
        (0, 0),
        "all logits tie: the lowest id"
    );
    assert_eq!(reference.prefill(&ids, skip).unwrap().1.token, 0);
    for (i, id) in [3u32, 700, 42].into_iter().enumerate() {
        let sa = iree.step(&mut a, id, skip).unwrap();
        assert_eq!(iree.screen_fallbacks(), 2 + i as u64);
        let sb = iree.step(&mut b, id, ret).unwrap();
        assert_eq!(sa.token, sb.token, "step {i}");
    }
    // The reruns left `a` as the calls with logits left `b`: the next logits are equal.
    let la = iree.step(&mut a, 11, ret).unwrap();
    let lb = iree.step(&mut b, 11, ret).unwrap();
    assert_eq!(la.logits, lb.logits);
    assert_eq!(iree.len(&a), ids.len() + 4);
    std::fs::remove_dir_all(&dir).ok();
}

/// Projections stacked into one argument whose parts end mid-panel: head_dim 20 makes q 80
/// rows and k and v 40 each (2.5 and 1.25 panels of 32 lanes), ffn 552 makes gate and up
/// 17.25 panels each. In panels (llvm-cpu) each part starts at a whole panel, after zero
/// padding; in rows (Vulkan) right after the previous one. A prefill, an extend and steps
/// match the reference on each target, and on each both with kvsnap's kernels (on llvm-cpu
/// the panel-product kernel: one product over the stack, parts sliced off; the 36 panels of
/// gate and up in 16 workgroups of 2 or 3; on Vulkan the SPIR-V kernels, the attention over
/// 20-dim heads, the products of parts of any length; where the build and host have them)
/// and with IREE's code.
#[test]
fn stacked_projections_with_partial_panels_match_the_reference() {
    use kvsnap_iree::graphs::PROJECTION_LANES;

    if compiler().is_none() {
        return;
    }
    let config = |json: &mut serde_json::Value| {
        json["head_dim"] = 20.into();
        json["intermediate_size"] = 552.into();
    };
    let (dir, cfg) = tiny_variant("stacked", config, 5, |_, _| {});
    let reference = ReferenceModel::load(&dir).unwrap();
    let seq = ids(40, 9);
    let runs = [
        (Target::LlvmCpu, true),
        (Target::LlvmCpu, false),
        (Target::VulkanSpirv, true),
        (Target::VulkanSpirv, false),
    ];
    for (target, own_kernels) in runs {
        let opts = IreeOptions {
            target,
            chunks: vec![8],
            own_kernels,
            ..IreeOptions::cpu()
        };
        let iree = match IreeModel::load(&dir, &opts) {
            Ok(m) => m,
            Err(e) if target == Target::VulkanSpirv && e.kind() == "unsupported" => {
                eprintln!("SKIPPED: the Vulkan half: no Vulkan device ({e})");
                continue;
            }
            Err(e) => panic!("IREE model on {}: {e}", target.name()),
        };
        let (linked, objects) = match target {
            Target::LlvmCpu => (kvsnap_iree::kernels::kernel_object().is_some(), 1),
            Target::VulkanSpirv => match kvsnap_iree::kernels::spirv_kernels() {
                Some(kernels) => (true, kernels.objects().len()),
                None => (false, 0),
            },
        };
        let linked = own_kernels && linked;
        assert_eq!(
            iree.load_report().objects.len(),
            if linked { objects } else { 0 }
        );
        if own_kernels && !linked {
            eprintln!(
                "SKIPPED: kvsnap's kernels on {}: not on this build or host",
                target.name()
            );
        }
        let weights: Vec<_> = iree.manifest().entry_points[0].weights().cloned().collect();
        let qkv = weights
            .iter()
            .find(|w| w.name == "model.layers.0.self_attn.qkv_proj.weight")
            .expect("q, k and v stacked");
        assert_eq!(
            qkv.parts,
            ["q_proj", "k_proj", "v_proj"].map(|p| format!("model.layers.0.self_attn.{p}.weight"))
        );
        let gate_up = weights
            .iter()
            .find(|w| w.name == "model.layers.0.mlp.gate_up_proj.weight")
            .expect("gate and up stacked");
        let lanes = PROJECTION_LANES;
        let (h, w) = (
            cfg.hidden_size,
            format!("{} own kernels {own_kernels}", target.name()),
        );
        match target {
            Target::LlvmCpu => {
                assert_eq!(qkv.dims, [3 + 2 + 2, h, lanes], "{w}");
                assert_eq!(gate_up.dims, [18 + 18, h, lanes], "{w}");
            }
            Target::VulkanSpirv => {
                assert_eq!(qkv.dims, [80 + 40 + 40, h], "{w}");
                assert_eq!(gate_up.dims, [552 + 552, h], "{w}");
            }
        }
        // 13 rows as 8 + 8 (the last padded), 11 as 8 + 8, then steps.
        let (mut s, _) = Lockstep::prefill(&iree, &reference, "prefill 13", &seq[..13]);
        let mut t = s.extend("extend 11", &seq[13..24]).token;
        for i in 0..6 {
            t = s.step(&format!("{w}: step {i}"), t).token;
        }
        assert_eq!(iree.len(&s.a), 30, "{w}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The largest chunk's span entry points (`GraphOptions::spans`): with a window of 64 and
/// chunks of 8 and 16, the ring's modulus is 80 and the 16-row chunk gets spans of 32 and 64,
/// over whose first rows both kinds of layer attend. A prefill and extends run through each
/// span, then past the modulus (where the ring wraps and the whole-ring entry takes over),
/// each call matching the reference.
#[test]
fn prefill_chunks_attend_over_the_rows_written_so_far() {
    if compiler().is_none() {
        return;
    }
    let config = |json: &mut serde_json::Value| json["sliding_window"] = 64.into();
    let (dir, _) = tiny_variant("spans", config, 6, |_, _| {});
    let reference = ReferenceModel::load(&dir).unwrap();
    let opts = IreeOptions {
        chunks: vec![8, 16],
        ..IreeOptions::cpu()
    };
    let iree = IreeModel::load(&dir, &opts).unwrap();
    assert_eq!(iree.manifest().ring.modulus, 80);
    let calls = |name: &str| {
        let calls = iree.entry_calls();
        calls.iter().find(|(e, _)| *e == name).map(|c| c.1)
    };
    let seq = ids(120, 4);
    // 40 rows as 16 (s32) + 16 (s32) + 8; 30 as 16 (s64) + 16 (padded from 14, past 64).
    let (mut s, _) = Lockstep::prefill(&iree, &reference, "prefill 40", &seq[..40]);
    assert_eq!(calls("chunk_ids_c16_s32"), Some(2));
    assert_eq!(calls("chunk_ids_c8"), Some(1));
    let mut t = s.extend("extend 30", &seq[40..70]).token;
    assert_eq!(calls("chunk_ids_c16_s64"), Some(1));
    assert_eq!(calls("chunk_ids_c16"), Some(1));
    // Past the modulus the ring wraps: the whole ring's entry points.
    s.extend("extend 40", &seq[70..110]);
    for i in 0..6 {
        t = s.step(&format!("step {i}"), t).token;
    }
    assert_eq!(calls("chunk_ids_c16_s32"), Some(2));
    assert_eq!(calls("chunk_ids_c16_s64"), Some(1));
    assert!(calls("chunk_ids_c16") > Some(1));
    assert_eq!(iree.len(&s.a), 116);
    assert_eq!(iree.kv_copies(), 0, "KV results in new buffers");
    std::fs::remove_dir_all(&dir).ok();
}

/// The default entry points follow the target (embeddings-input on Vulkan, ids-input on the
/// CPU), and the other kind compiles and serves prefill, extend and step on the same target too.
fn both_input_kinds_serve_every_operation(p: &Pair) {
    let target = match p.iree.backend() {
        "iree-vulkan" => Target::VulkanSpirv,
        _ => Target::LlvmCpu,
    };
    let default = match target {
        Target::VulkanSpirv => Input::Embeddings,
        Target::LlvmCpu => Input::Ids,
    };
    assert_eq!(p.iree.input(), default);
    let other = match default {
        Input::Ids => Input::Embeddings,
        Input::Embeddings => Input::Ids,
    };
    let dir = std::env::temp_dir().join(format!(
        "kvsnap-iree-inputs-{}-{}",
        target.name(),
        std::process::id()
    ));
    write_model(&dir, Preset::Tiny, DEFAULT_SEED).expect("tiny model");
    let opts = IreeOptions {
        target,
        input: Some(other),
        ..IreeOptions::cpu()
    };
    let m = IreeModel::load(&dir, &opts).expect("second input kind loads");
    assert_eq!(m.input(), other);
    let seq = ids(23, 9);
    let (mut s, _) = Lockstep::prefill(&m, &p.reference, "prefill", &seq[..10]);
    s.extend("extend", &seq[10..22]);
    s.step("step", seq[22]);
    assert_eq!(
        m.embedding_rows(&seq[..2]).unwrap(),
        p.reference.embedding_rows(&seq[..2]).unwrap()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
