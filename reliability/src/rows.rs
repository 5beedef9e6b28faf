//! The rows of the reliability matrix, each a function over a [`Backend`];
//! [`crate::reliability_tests!`] makes one `#[test]` of each per backend.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use kvsnap_contract::handles::reason;
use kvsnap_contract::{DynModel, Error, KvModel, Logits, Result, Session};

use crate::fixtures::{self, Breakage, CAPACITY};
use crate::rss;
use crate::witness::{expect_err, isolated, PREFIX, UTTERANCE};

/// Loads a backend's model from a directory with a context capacity.
pub type Load<M> = Box<dyn Fn(&Path, usize) -> Result<M> + Send + Sync>;
/// Arms (`Some(layer)`) or disarms (`None`) a backend's one-shot mid-forward failure.
pub type Fault<M> = Box<dyn Fn(&M, Option<usize>) + Send + Sync>;
/// Bytes a backend's own allocator holds live (IREE's device allocator statistics).
pub type LiveBytes<M> = Box<dyn Fn(&M) -> u64 + Send + Sync>;

/// How many cycles the leak rows run (after how many unmeasured warm-up cycles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cycles {
    /// Warm-up snapshot/release cycles.
    pub snapshot_warm_up: usize,
    /// Measured snapshot/release cycles.
    pub snapshot: usize,
    /// Warm-up open/close cycles.
    pub open_warm_up: usize,
    /// Measured open/close cycles.
    pub open: usize,
    /// The most the leakable RSS may grow over the measured cycles (the C heap's bytes in use
    /// are always held to [`LEAK_LIMIT_KIB`]).
    pub rss_limit_kib: i64,
}

impl Cycles {
    /// The full counts: 1,000 + 10,000 snapshot/release and 100 + 1,000 open/close cycles.
    pub const FULL: Cycles = Cycles {
        snapshot_warm_up: 1_000,
        snapshot: 10_000,
        open_warm_up: 100,
        open: 1_000,
        rss_limit_kib: LEAK_LIMIT_KIB,
    };
}

/// One backend under test: its model on the tiny weights, and how to load and break it.
pub struct Backend<M: KvModel> {
    /// The tiny model, shared by the rows.
    pub model: Arc<M>,
    /// Directory holding the tiny model and the broken copies.
    pub root: PathBuf,
    /// How to load a model directory.
    pub load: Load<M>,
    /// The fault hook, if the backend has one.
    pub fault: Option<Fault<M>>,
    /// The backend allocator's live bytes, if it reports them.
    pub live_bytes: Option<LiveBytes<M>>,
    /// The leak rows' cycle counts.
    pub cycles: Cycles,
}

impl<M: KvModel> Backend<M> {
    /// Writes the tiny model under `root/tiny` and loads it with [`CAPACITY`]; no fault hook,
    /// no allocator statistics, [`Cycles::FULL`].
    pub fn new(root: PathBuf, load: Load<M>) -> Result<Self> {
        let dir = root.join("tiny");
        fixtures::write_tiny(&dir)?;
        let model = Arc::new(load(&dir, CAPACITY)?);
        Ok(Backend {
            model,
            root,
            load,
            fault: None,
            live_bytes: None,
            cycles: Cycles::FULL,
        })
    }

    fn session(&self) -> Session<M> {
        Session::from_arc(Arc::clone(&self.model))
    }

    fn vocab(&self) -> u32 {
        self.model.config().vocab_size as u32
    }

    fn hidden(&self) -> usize {
        self.model.config().hidden_size
    }

    /// Loads the tiny model broken by `how` while the witnesses live.
    fn load_broken(&self, how: Breakage, kind: &str, fragments: &[&str]) {
        let dir = fixtures::write_broken(&self.root, how).expect("writing the broken model");
        isolated(&self.model, |_, _| {
            let e = expect_err((self.load)(&dir, CAPACITY).map(|_| ()), kind, fragments);
            let _ = writeln!(std::io::stderr(), "{how:?}: {e}");
        });
    }
}

/// Says loudly that a row did not run.
fn skip(why: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}

/// Raw embedding rows of `n` tokens for `b`'s model (any finite values do).
fn rows_of<M: KvModel>(b: &Backend<M>, n: usize) -> Vec<f32> {
    (0..n * b.hidden()).map(|i| (i % 7) as f32 * 0.01).collect()
}

// ---------------------------------------------------------------------------------------------
// Bad inputs.

/// Empty ids in every operation that takes ids.
pub fn empty_ids<M: KvModel>(b: &Backend<M>) {
    isolated(&b.model, |s, w| {
        expect_err(s.prefill(&[], Logits::Skip), "empty_input", &["prefill"]);
        expect_err(s.extend(w.a, &[], Logits::Skip), "empty_input", &["extend"]);
        expect_err(
            s.prefill_embeddings(&[], &[], Logits::Skip),
            "empty_input",
            &["prefill_embeddings"],
        );
    });
}

/// A token id `>= vocab` (first, last, in the middle of a chunk; `u32::MAX`). Negative ids
/// cannot reach a `u32` API; the JNI conversion that rejects them is tested in
/// `tests/jni_path.rs`.
pub fn token_id_out_of_range<M: KvModel>(b: &Backend<M>) {
    let v = b.vocab();
    isolated(&b.model, |s, w| {
        let vocab = format!("vocab size {v}");
        let msg = format!("token id {v} at input index 2");
        expect_err(
            s.prefill(&[1, 2, v, 3], Logits::Skip),
            "token_out_of_range",
            &["prefill", &msg, &vocab],
        );
        expect_err(
            s.extend(w.a, &[1, 2, v], Logits::Skip),
            "token_out_of_range",
            &["extend", &msg],
        );
        expect_err(
            s.step(w.b, u32::MAX, Logits::Skip),
            "token_out_of_range",
            &["step", "4294967295"],
        );
        expect_err(
            s.prefill_embeddings(&[v + 1], &rows_of(b, 1), Logits::Skip),
            "token_out_of_range",
            &["prefill_embeddings"],
        );
    });
}

/// Embedding rows for more or fewer tokens than the ids.
pub fn embeddings_wrong_row_count<M: KvModel>(b: &Backend<M>) {
    let h = b.hidden();
    isolated(&b.model, |s, _| {
        let e = expect_err(
            s.prefill_embeddings(&[1, 2, 3], &rows_of(b, 2), Logits::Skip),
            "shape_mismatch",
            &["prefill_embeddings", "embeddings"],
        );
        assert!(
            matches!(&e, Error::ShapeMismatch { expected, got, .. }
                if expected == &[3, h] && got == &[2, h]),
            "{e:?}"
        );
        expect_err(
            s.prefill_embeddings(&[1], &rows_of(b, 2), Logits::Skip),
            "shape_mismatch",
            &["embeddings"],
        );
    });
}

/// Embedding rows one float wider than `hidden`.
pub fn embeddings_wrong_width<M: KvModel>(b: &Backend<M>) {
    let h = b.hidden();
    isolated(&b.model, |s, _| {
        let rows: Vec<f32> = vec![0.01; 3 * (h + 1)];
        let e = expect_err(
            s.prefill_embeddings(&[1, 2, 3], &rows, Logits::Skip),
            "shape_mismatch",
            &["embeddings"],
        );
        assert!(
            matches!(&e, Error::ShapeMismatch { expected, got, .. }
                if expected == &[3, h] && got == &[3 * (h + 1)]),
            "{e:?}"
        );
    });
}

fn non_finite<M: KvModel>(b: &Backend<M>, bad: f32, shown: &str) {
    let h = b.hidden();
    isolated(&b.model, |s, _| {
        let mut rows = rows_of(b, 3);
        rows[2 * h + 5] = bad;
        let e = expect_err(
            s.prefill_embeddings(&[1, 2, 3], &rows, Logits::Skip),
            "non_finite",
            &["prefill_embeddings", "embeddings", shown, "row 2, column 5"],
        );
        let _ = writeln!(std::io::stderr(), "{e}");
    });
}

/// A NaN in the embedding rows is rejected before anything runs (it would make every later
/// logit of the sequence NaN).
pub fn nan_embeddings<M: KvModel>(b: &Backend<M>) {
    non_finite(b, f32::NAN, "NaN");
}

/// An infinity in the embedding rows is rejected like a NaN.
pub fn inf_embeddings<M: KvModel>(b: &Backend<M>) {
    non_finite(b, f32::NEG_INFINITY, "-inf");
}

/// An extend one token past the capacity fails; one that ends exactly at it succeeds.
pub fn extend_past_capacity<M: KvModel>(b: &Backend<M>) {
    isolated(&b.model, |s, w| {
        let room = CAPACITY - PREFIX.len();
        let over = vec![3; room + 1];
        let msg = format!(
            "{} tokens cached + {} new > capacity {CAPACITY}",
            PREFIX.len(),
            room + 1
        );
        expect_err(
            s.extend(w.a, &over, Logits::Skip),
            "context_overflow",
            &["extend", &msg],
        );
        let c = s.snapshot(w.a).unwrap();
        s.extend(c, &over[1..], Logits::Skip)
            .expect("an extend to exactly the capacity");
        assert_eq!(s.len(c).unwrap(), CAPACITY);
        s.release(c).unwrap();
    });
}

/// A step on a state at the capacity fails and leaves it usable.
pub fn step_past_capacity<M: KvModel>(b: &Backend<M>) {
    isolated(&b.model, |s, w| {
        let c = s.snapshot(w.a).unwrap();
        s.extend(c, &vec![3; CAPACITY - PREFIX.len()], Logits::Skip)
            .unwrap();
        let msg = format!("{CAPACITY} tokens cached + 1 new > capacity {CAPACITY}");
        expect_err(
            s.step(c, 1, Logits::Skip),
            "context_overflow",
            &["step", &msg],
        );
        assert_eq!(s.len(c).unwrap(), CAPACITY);
        s.snapshot(c).and_then(|d| s.release(d)).unwrap();
        s.release(c).unwrap();
    });
}

/// A prefill longer than the capacity fails; one of exactly the capacity succeeds.
pub fn prefill_past_capacity<M: KvModel>(b: &Backend<M>) {
    isolated(&b.model, |s, _| {
        expect_err(
            s.prefill(&[4; CAPACITY + 1], Logits::Skip),
            "context_overflow",
            &["prefill"],
        );
        expect_err(
            s.prefill_embeddings(&[4; CAPACITY + 1], &rows_of(b, CAPACITY + 1), Logits::Skip),
            "context_overflow",
            &["prefill_embeddings"],
        );
        let (c, _) = s.prefill(&[4; CAPACITY], Logits::Skip).unwrap();
        s.release(c).unwrap();
    });
}

/// Every operation on a released handle.
pub fn released_handle<M: KvModel>(b: &Backend<M>) {
    isolated(&b.model, |s, w| {
        let c = s.snapshot(w.a).unwrap();
        s.release(c).unwrap();
        all_ops_fail(s, c, reason::RELEASED);
    });
}

/// Every operation on handles that were never issued: zero, an unused slot, a future
/// generation of a live slot, and a handle of another session.
pub fn never_issued_handle<M: KvModel>(b: &Backend<M>) {
    isolated(&b.model, |s, w| {
        all_ops_fail(s, 0, reason::ZERO);
        all_ops_fail(s, w.a + 1000, reason::NEVER_ISSUED);
        all_ops_fail(s, w.a + (1 << 24), reason::NEVER_ISSUED);
        let other = b.session();
        let (foreign, _) = other.prefill(&[1, 2], Logits::Skip).unwrap();
        all_ops_fail(s, foreign, reason::FOREIGN);
        other.close().unwrap();
    });
}

fn all_ops_fail(s: &dyn DynModel, h: u64, why: &str) {
    let f = &["stale handle", why];
    expect_err(s.step(h, 1, Logits::Skip), "stale_handle", f);
    expect_err(s.extend(h, &[1, 2], Logits::Skip), "stale_handle", f);
    expect_err(s.snapshot(h), "stale_handle", f);
    expect_err(s.len(h), "stale_handle", f);
    expect_err(s.kv_bytes(h), "stale_handle", f);
    expect_err(s.release(h), "stale_handle", f);
}

/// A second release of a handle fails, and does not free the state that reused its slot.
pub fn double_release<M: KvModel>(b: &Backend<M>) {
    isolated(&b.model, |s, w| {
        let c = s.snapshot(w.a).unwrap();
        s.release(c).unwrap();
        let d = s.snapshot(w.b).unwrap();
        assert_ne!(c, d);
        expect_err(s.release(c), "stale_handle", &["release", reason::RELEASED]);
        assert_eq!(s.len(d).unwrap(), PREFIX.len() + 1, "d survived");
        s.release(d).unwrap();
        expect_err(s.release(d), "stale_handle", &[reason::RELEASED]);
    });
}

/// A model directory whose weights lack a tensor.
pub fn missing_tensor<M: KvModel>(b: &Backend<M>) {
    b.load_broken(
        Breakage::MissingTensor,
        "weights_mismatch",
        &["model.layers.3.mlp.up_proj.weight", "missing"],
    );
}

/// A model directory with a transposed tensor.
pub fn wrong_tensor_shape<M: KvModel>(b: &Backend<M>) {
    b.load_broken(
        Breakage::WrongShape,
        "weights_mismatch",
        &[
            "model.layers.1.self_attn.o_proj.weight",
            "shape [128, 64], expected [64, 128]",
        ],
    );
}

/// A model directory with an I64 tensor.
pub fn wrong_tensor_dtype<M: KvModel>(b: &Backend<M>) {
    b.load_broken(
        Breakage::WrongDtype,
        "weights_mismatch",
        &["model.norm.weight", "I64"],
    );
}

/// `model.safetensors` cut short: empty, inside the header length, inside the header, inside
/// the data, one byte short.
pub fn truncated_safetensors<M: KvModel>(b: &Backend<M>) {
    let full = fixtures::tiny_safetensors_len();
    for n in [0, 5, 100, full / 2, full - 1] {
        b.load_broken(
            Breakage::Truncated(n),
            "format",
            &["model.safetensors", "invalid safetensors"],
        );
    }
}

/// A config whose vocab size does not match the embedding rows.
pub fn config_mismatching_weights<M: KvModel>(b: &Backend<M>) {
    b.load_broken(
        Breakage::ConfigMismatch,
        "weights_mismatch",
        &["model.embed_tokens.weight", "expected [1024, 64]"],
    );
}

/// A model directory without `config.json`, and one whose config is not JSON.
pub fn missing_or_invalid_config<M: KvModel>(b: &Backend<M>) {
    b.load_broken(Breakage::MissingConfig, "io", &["config.json"]);
    b.load_broken(
        Breakage::InvalidConfig,
        "config",
        &["config.json", "not JSON"],
    );
}

// ---------------------------------------------------------------------------------------------
// Failure atomicity.

/// A failure midway through an extend or a step (after some layers wrote their K/V rows) poisons
/// the state: that call reports the cause, every later call on the handle fails with
/// [`Error::Poisoned`] naming it, release still frees it, and nothing else changes.
pub fn mid_operation_failure_poisons<M: KvModel>(b: &Backend<M>) {
    let Some(fault) = &b.fault else {
        return skip("mid_operation_failure_poisons: this backend has no fault hook");
    };
    isolated(&b.model, |s, w| {
        let c = s.snapshot(w.a).unwrap();
        let d = s.snapshot(w.b).unwrap();
        // The backend's hook names where it failed ("after layer 1" on the reference, "after
        // chunk 0" on IREE, whose graphs run all layers in one call).
        fault(&b.model, Some(1));
        expect_err(
            s.extend(c, &UTTERANCE, Logits::Skip),
            "backend",
            &["injected fault after"],
        );
        fault(&b.model, Some(0));
        expect_err(
            s.step(d, 9, Logits::Skip),
            "backend",
            &["injected fault after"],
        );
        fault(&b.model, None);
        for h in [c, d] {
            let f = &["poisoned by an earlier failure", "injected fault after"];
            expect_err(s.step(h, 1, Logits::Skip), "poisoned", f);
            expect_err(s.extend(h, &[1, 2], Logits::Skip), "poisoned", f);
            expect_err(s.snapshot(h), "poisoned", f);
            expect_err(s.len(h), "poisoned", f);
            s.release(h).expect("a poisoned state can be released");
            expect_err(s.release(h), "stale_handle", &[reason::RELEASED]);
        }
    });
}

/// A failure midway through a prefill leaves no state behind and no bytes counted.
pub fn failed_prefill_changes_nothing<M: KvModel>(b: &Backend<M>) {
    let Some(fault) = &b.fault else {
        return skip("failed_prefill_changes_nothing: this backend has no fault hook");
    };
    isolated(&b.model, |s, _| {
        fault(&b.model, Some(2));
        expect_err(s.prefill(&PREFIX, Logits::Skip), "backend", &["injected"]);
        fault(&b.model, Some(0));
        expect_err(
            s.prefill_embeddings(&[1, 2], &rows_of(b, 2), Logits::Skip),
            "backend",
            &["injected"],
        );
        fault(&b.model, None);
    });
}

// ---------------------------------------------------------------------------------------------
// Resource exhaustion.

/// With the cap one byte short of another witness-sized state, a snapshot and a prefill fail
/// with the figures in the message, and nothing changes; lifting the cap lets them through.
pub fn kv_budget_refuses_new_states<M: KvModel>(b: &Backend<M>) {
    isolated(&b.model, |s, w| {
        let live = s.live_kv_bytes();
        let one = s.kv_bytes(w.a).unwrap();
        let cap = live + one - 1;
        s.set_kv_budget(Some(cap));
        let figures = format!("{live} bytes live + {one} new > cap {cap} bytes");
        let e = expect_err(
            s.snapshot(w.a),
            "kv_budget",
            &["snapshot", "KV budget exceeded", &figures],
        );
        let _ = writeln!(std::io::stderr(), "{e}");
        let e = expect_err(
            s.prefill(&PREFIX, Logits::Skip),
            "kv_budget",
            &["prefill", &format!("{live} bytes live")],
        );
        assert!(
            matches!(e, Error::KvBudget { adding, .. } if adding <= one),
            "{e}"
        );
        assert_eq!(s.live_kv_bytes(), live);
        s.set_kv_budget(Some(live + one));
        let c = s.snapshot(w.a).expect("exactly at the cap is allowed");
        s.set_kv_budget(None);
        s.release(c).unwrap();
    });
}

/// With the cap at the live bytes, an extend that would grow a state fails and leaves it
/// unchanged (backends that allocate the whole capacity up front never grow, and succeed).
pub fn kv_budget_refuses_growth<M: KvModel>(b: &Backend<M>) {
    isolated(&b.model, |s, w| {
        let c = s.snapshot(w.a).unwrap();
        let bytes = s.kv_bytes(c).unwrap();
        let grows = b.model.config().kv_bytes(PREFIX.len() + UTTERANCE.len()) > bytes;
        let live = s.live_kv_bytes();
        s.set_kv_budget(Some(live));
        let result = s.extend(c, &UTTERANCE, Logits::Return);
        s.set_kv_budget(None);
        if grows {
            expect_err(result, "kv_budget", &["extend", &format!("cap {live}")]);
            assert_eq!(s.len(c).unwrap(), PREFIX.len());
            assert_eq!(s.kv_bytes(c).unwrap(), bytes);
            // c continues exactly like an untouched snapshot of a.
            let d = s.snapshot(w.a).unwrap();
            let want = s.extend(d, &UTTERANCE, Logits::Return).unwrap();
            let got = s.extend(c, &UTTERANCE, Logits::Return).unwrap();
            assert_eq!(bits(&got), bits(&want));
            s.release(d).unwrap();
        } else {
            result.expect("an extend that does not grow the state fits");
        }
        s.release(c).unwrap();
    });
}

fn bits(n: &kvsnap_contract::Next) -> (u32, Vec<u32>) {
    let logits = n.logits.as_deref().unwrap_or_default();
    (n.token, logits.iter().map(|v| v.to_bits()).collect())
}

// ---------------------------------------------------------------------------------------------
// Concurrency.

/// Eight distinct handles driven from eight threads at once produce what they produce one after
/// the other, bit for bit.
pub fn parallel_handles_match_serial<M: KvModel>(b: &Backend<M>) {
    let s = b.session();
    let script = |s: &Session<M>, i: usize| -> Vec<(u32, Vec<u32>)> {
        let mut prompt = PREFIX.to_vec();
        prompt.rotate_left(i);
        let (h, first) = s.prefill(&prompt, Logits::Return).unwrap();
        let mut out = vec![bits(&first)];
        out.push(bits(&s.extend(h, &UTTERANCE, Logits::Return).unwrap()));
        for _ in 0..4 {
            let last = out.last().unwrap().0;
            out.push(bits(&s.step(h, last, Logits::Return).unwrap()));
        }
        s.release(h).unwrap();
        out
    };
    let serial: Vec<_> = (0..8).map(|i| script(&s, i)).collect();
    for _ in 0..3 {
        let start = Barrier::new(8);
        let parallel: Vec<_> = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..8)
                .map(|i| {
                    let (s, start) = (&s, &start);
                    scope.spawn(move || {
                        start.wait();
                        script(s, i)
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert!(parallel == serial, "parallel handles diverged from serial");
    }
    assert_eq!(s.live(), 0);
}

/// Two threads stepping one handle (misuse) are serialised by the handle's lock: every step
/// lands once, and the state ends exactly as 20 serial steps leave it.
pub fn one_handle_from_two_threads_is_serialised<M: KvModel>(b: &Backend<M>) {
    let s = b.session();
    // Every step appends token 7, so the final state does not depend on the interleaving, and
    // the tokens returned are those of the serial run in some order.
    let (serial_h, _) = s.prefill(&PREFIX, Logits::Skip).unwrap();
    let mut serial: Vec<u32> = (0..20)
        .map(|_| s.step(serial_h, 7, Logits::Skip).unwrap().token)
        .collect();
    let (h, _) = s.prefill(&PREFIX, Logits::Skip).unwrap();
    let start = Barrier::new(2);
    let mut racing: Vec<u32> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (s, start) = (&s, &start);
                scope.spawn(move || {
                    start.wait();
                    (0..10)
                        .map(|_| {
                            let t = s.step(h, 7, Logits::Skip).unwrap().token;
                            let _ = s.len(h).unwrap();
                            t
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect()
    });
    serial.sort_unstable();
    racing.sort_unstable();
    assert_eq!(racing, serial);
    assert_eq!(s.len(h).unwrap(), PREFIX.len() + 20);
    let want = s.step(serial_h, 7, Logits::Return).unwrap();
    let got = s.step(h, 7, Logits::Return).unwrap();
    assert_eq!(bits(&got), bits(&want));
    s.close().unwrap();
}

/// A release racing steps on the same handle: the steps before it succeed (or, once the
/// capacity is full, are refused as overflow), the ones after it fail with a stale handle,
/// nothing else happens.
pub fn release_racing_calls<M: KvModel>(b: &Backend<M>) {
    let s = b.session();
    for round in 0..5 {
        let (h, _) = s.prefill(&PREFIX[..8], Logits::Skip).unwrap();
        let start = Barrier::new(2);
        std::thread::scope(|scope| {
            let stepper = scope.spawn(|| {
                start.wait();
                loop {
                    match s.step(h, 3, Logits::Skip) {
                        // A fast backend can fill the tiny capacity before the release comes:
                        // the refused steps change nothing, so keep calling until it does.
                        Ok(_) | Err(Error::ContextOverflow { .. }) => continue,
                        Err(Error::StaleHandle { reason, .. }) => return reason,
                        Err(e) => panic!("unexpected error: {e}"),
                    }
                }
            });
            start.wait();
            std::thread::sleep(std::time::Duration::from_millis(round));
            s.release(h).unwrap();
            let why = stepper.join().unwrap();
            assert!(
                why == reason::RELEASED || why == reason::RELEASED_WHILE_WAITING,
                "{why}"
            );
        });
    }
    assert_eq!((s.live(), s.live_kv_bytes()), (0, 0));
}

// ---------------------------------------------------------------------------------------------
// Leaks.

/// Most RSS growth allowed over the measured cycles.
pub const LEAK_LIMIT_KIB: i64 = 1024;

fn report_growth(what: &str, g: Option<rss::Growth>, rss_limit_kib: i64) {
    let Some(g) = g else {
        return skip(&format!("{what}: no /proc/self/status"));
    };
    let heap = match (g.heap_kib, g.heap_kib()) {
        (Some((a, b)), Some(d)) => format!("heap in use {a} KiB -> {b} KiB ({d:+} KiB)"),
        _ => "heap in use not reported by this C library".to_string(),
    };
    let huge = match g.huge_kib {
        Some((a, b)) => format!("; in transparent huge pages {a} KiB -> {b} KiB"),
        None => String::new(),
    };
    let _ = writeln!(
        std::io::stderr(),
        "{what}: anonymous + shared RSS {} KiB -> {} KiB, lowest {} KiB -> {} KiB ({:+} KiB over {} cycles; samples {:?} KiB); {heap}{huge}",
        g.before_kib,
        g.after_kib,
        g.floor_before_kib,
        g.floor_after_kib,
        g.kib(),
        g.cycles,
        g.samples_kib
    );
    assert!(
        g.kib() < rss_limit_kib,
        "{what}: RSS grew {} KiB over {} cycles",
        g.kib(),
        g.cycles
    );
    if let Some(d) = g.heap_kib() {
        assert!(
            d < LEAK_LIMIT_KIB,
            "{what}: the heap's bytes in use grew {d} KiB over {} cycles",
            g.cycles
        );
    }
}

/// `read()` once it returns `want`, or its last value after [`SETTLE_TIMEOUT`]. IREE's task
/// queue releases a submission's resources (the buffers the last call used) on a worker thread
/// after it signals the call done, so right after the states are released the allocator may
/// still count them for a moment: a busy machine showed one state's bytes live just after
/// close. A leak stays counted and fails after the wait.
fn settled(read: impl Fn() -> u64, want: u64) -> u64 {
    let start = std::time::Instant::now();
    let first = read();
    let mut got = first;
    while got != want && start.elapsed() < SETTLE_TIMEOUT {
        std::thread::sleep(std::time::Duration::from_millis(1));
        got = read();
    }
    if first != want {
        let _ = writeln!(
            std::io::stderr(),
            "allocator live bytes {first} right after release, {got} after {:?} (want {want})",
            start.elapsed()
        );
    }
    got
}

/// How long [`settled`] waits for the allocator's count to come back.
const SETTLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Checks that the backend allocator's live bytes came back to `before` (exactly: on the CPU
/// device every allocation and free is counted).
fn report_live_bytes(what: &str, before: u64, after: u64) {
    let _ = writeln!(
        std::io::stderr(),
        "{what}: allocator live bytes {before} -> {after}"
    );
    assert_eq!(after, before, "{what}: allocator live bytes changed");
}

/// Snapshot/release cycles ([`Cycles::snapshot`], 10,000 by default; every 10th snapshot
/// stepped, every 100th refused by the budget) keep RSS flat within [`LEAK_LIMIT_KIB`] after
/// the warm-up, and the backend allocator's live bytes (where reported) unchanged.
pub fn no_leak_over_snapshot_release_cycles<M: KvModel>(b: &Backend<M>) {
    let s = b.session();
    let (a, _) = s.prefill(&PREFIX, Logits::Skip).unwrap();
    let one = s.kv_bytes(a).unwrap();
    let c = b.cycles;
    let mut live_before = None;
    let growth = rss::measure(c.snapshot_warm_up, c.snapshot, |i| {
        if i == c.snapshot_warm_up {
            live_before = b.live_bytes.as_ref().map(|f| f(&b.model));
        }
        if i % 100 == 0 {
            s.set_kv_budget(Some(one));
            expect_err(s.snapshot(a), "kv_budget", &[]);
            s.set_kv_budget(None);
        }
        let c = s.snapshot(a).unwrap();
        if i % 10 == 0 {
            s.step(c, (i % 500) as u32, Logits::Skip).unwrap();
        }
        s.release(c).unwrap();
    });
    assert_eq!((s.live(), s.live_kv_bytes()), (1, one));
    let what = format!("{} snapshot/release cycles", c.snapshot);
    if let (Some(f), Some(before)) = (&b.live_bytes, live_before) {
        report_live_bytes(&what, before, settled(|| f(&b.model), before));
    }
    report_growth(&what, growth, b.cycles.rss_limit_kib);
}

/// Open/close cycles of the tiny model ([`Cycles::open`], 1,000 by default: load, prefill,
/// snapshot, close with live states) keep RSS flat within [`LEAK_LIMIT_KIB`] after the warm-up;
/// where the backend reports allocator statistics, closing returns each model's allocator to
/// its live bytes after loading.
pub fn no_leak_over_open_close_cycles<M: KvModel>(b: &Backend<M>) {
    let dir = b.root.join("tiny");
    let c = b.cycles;
    let mut live = None;
    let growth = rss::measure(c.open_warm_up, c.open, |_| {
        let m = Arc::new((b.load)(&dir, CAPACITY).unwrap());
        let loaded = b.live_bytes.as_ref().map(|f| f(&m));
        let s = Session::from_arc(Arc::clone(&m));
        let (a, _) = s.prefill(&PREFIX[..4], Logits::Skip).unwrap();
        s.snapshot(a).unwrap();
        s.close().unwrap();
        if let (Some(f), Some(loaded)) = (&b.live_bytes, loaded) {
            let closed = settled(|| f(&m), loaded);
            assert_eq!(
                closed, loaded,
                "allocator live bytes after close vs after load"
            );
            live = Some((loaded, closed));
        }
    });
    let what = format!("{} open/close cycles", c.open);
    if let Some((loaded, closed)) = live {
        report_live_bytes(&format!("{what} (last, load -> close)"), loaded, closed);
    }
    report_growth(&what, growth, b.cycles.rss_limit_kib);
}
