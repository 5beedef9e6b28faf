//! The KV buffer pool of `IreeModel` (`kvsnap_iree::kv`): released states' buffer sets are
//! reused, and a state started in a reused set holds exactly what it would in a fresh one
//! (copied rows equal, every other full-layer row zero, the same logits bit for bit); poisoned
//! states are not reused; the last release empties the pool and gives the allocator back what
//! loading left; on the CPU the first snapshot lands in the spare set started beside the
//! prefill.
//!
//! Prints `SKIPPED: iree-compile not found` (and passes) when the compiler is not installed.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvsnap_contract::{KvModel, Logits};
use kvsnap_iree::compile::{Compiler, Target};
use kvsnap_iree::graphs::KvLayout;
use kvsnap_iree::{IreeKv, IreeModel, IreeOptions};
use kvsnap_reference::tiny::{write_model, Preset, DEFAULT_SEED};

const CAPACITY: usize = 128;

/// The tests share the model directory, the process's CPU device and its allocator count: one
/// at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn live_bytes(m: &IreeModel) -> u64 {
    m.device().allocator_stats().live_bytes()
}

/// The allocator's live bytes once they equal `want`, or after 2 s: IREE's task queue releases
/// a submission's buffers on a worker thread after signalling it done.
fn settled(m: &IreeModel, want: u64) -> u64 {
    let start = Instant::now();
    loop {
        let got = live_bytes(m);
        if got == want || start.elapsed() > Duration::from_secs(2) {
            return got;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + seed * 11 + 3) % 500)
        .collect()
}

/// Two independent loads of the tiny model on `target` (each with its own pool), or `None`
/// (SKIPPED) without a compiler or a device.
fn models(target: Target) -> Option<(IreeModel, IreeModel)> {
    if let Err(e) = Compiler::discover() {
        eprintln!("SKIPPED: iree-compile not found ({e})");
        return None;
    }
    let dir = std::env::temp_dir().join(format!("kvsnap-kv-pool-{}", std::process::id()));
    write_model(&dir, Preset::Tiny, DEFAULT_SEED).expect("tiny model");
    let opts = IreeOptions {
        capacity: Some(CAPACITY),
        target,
        ..IreeOptions::cpu()
    };
    let load = || IreeModel::load(&dir, &opts);
    match (load(), load()) {
        (Ok(a), Ok(b)) => Some((a, b)),
        (Err(e), _) | (_, Err(e)) if target == Target::VulkanSpirv && e.kind() == "unsupported" => {
            eprintln!("SKIPPED: no Vulkan device ({e})");
            None
        }
        (Err(e), _) | (_, Err(e)) => panic!("tiny model on {}: {e}", target.name()),
    }
}

fn bytes(kv: &IreeKv) -> Vec<Vec<u8>> {
    kv.buffers()
        .iter()
        .map(|b| b.read_bytes().expect("read back"))
        .collect()
}

/// Asserts equal buffers, naming the first byte that differs (not dumping megabytes).
fn same_bytes<A: AsRef<[u8]>>(what: &str, got: &[A], want: &[A]) {
    assert_eq!(got.len(), want.len(), "{what}: buffer count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.as_ref(), w.as_ref());
        assert_eq!(g.len(), w.len(), "{what}: buffer {i} length");
        let first = g.iter().zip(w).position(|(a, b)| a != b);
        assert_eq!(first, None, "{what}: buffer {i} differs from byte");
    }
}

/// Whether buffer `i` of a state is a full layer's (`[capacity, ...]`, one row per position).
fn is_full(m: &IreeModel, i: usize) -> bool {
    m.manifest().kv_layouts.get(i / 2) == Some(&KvLayout::Full)
}

/// Asserts that `copy` holds what a whole copy of `src` into a zero set would: the full layers'
/// rows `..len` equal and the rest zero, every other buffer equal whole.
fn assert_copy_of(m: &IreeModel, what: &str, copy: &IreeKv, src: &IreeKv) {
    let len = m.len(src);
    assert_eq!(m.len(copy), len, "{what}: length");
    for (i, (from, copy)) in bytes(src).iter().zip(&bytes(copy)).enumerate() {
        if is_full(m, i) {
            let row = from.len() / CAPACITY;
            let rows = format!("{what}: buffer {i}, rows ..{len}");
            same_bytes(&rows, &[&copy[..len * row]], &[&from[..len * row]]);
            let nonzero = copy[len * row..].iter().position(|&x| x != 0);
            assert_eq!(nonzero, None, "{what}: buffer {i}: rows {len}.. are zero");
        } else {
            same_bytes(&format!("{what}: buffer {i}, whole"), &[copy], &[from]);
        }
    }
}

/// The bytes a whole copy of `kv` moves: the full layers' live rows, every other buffer whole.
fn whole_copy_bytes(m: &IreeModel, kv: &IreeKv) -> u64 {
    let buffers = kv.buffers().iter().enumerate();
    buffers
        .map(|(i, b)| match is_full(m, i) {
            true => b.byte_length() / CAPACITY * m.len(kv),
            false => b.byte_length(),
        } as u64)
        .sum()
}

#[test]
fn cpu_reused_sets_hold_exactly_what_fresh_ones_would() {
    reused_sets_hold_exactly_what_fresh_ones_would(Target::LlvmCpu);
}

/// The same on Vulkan (lavapipe in CI): the copies and fills at row offsets are queue
/// operations of another driver. The allocator check is CPU-only (IREE 3.13's Vulkan allocator
/// does not count pooled frees, see `AllocatorStats`).
#[test]
fn vulkan_reused_sets_hold_exactly_what_fresh_ones_would() {
    reused_sets_hold_exactly_what_fresh_ones_would(Target::VulkanSpirv);
}

fn reused_sets_hold_exactly_what_fresh_ones_would(target: Target) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some((m, fresh)) = models(target) else {
        return;
    };
    assert!(
        (0..m.manifest().kv_layouts.len() * 2).any(|i| is_full(&m, i)),
        "the tiny model needs a global layer for this test"
    );
    let alive = live_bytes(&m);
    assert_eq!(m.kv_free_sets(), 0);

    // A long state, and a copy of it that writes rows 40.. before it goes back to the pool.
    let (a, _) = m.prefill(&ids(40, 1), Logits::Skip).unwrap();
    let mut s = m.snapshot(&a).unwrap();
    m.extend(&mut s, &ids(5, 2), Logits::Skip).unwrap();
    drop(s);
    assert_eq!(
        m.kv_free_sets(),
        1,
        "a released state's set is kept while `a` lives"
    );

    // A prefill in the reused set equals one in a fresh model, buffers and logits.
    let short = ids(5, 3);
    let (b, got) = m.prefill(&short, Logits::Return).unwrap();
    assert_eq!(m.kv_free_sets(), 0);
    let (b_fresh, want) = fresh.prefill(&short, Logits::Return).unwrap();
    assert_eq!(got.logits, want.logits);
    same_bytes("prefill in a reused set", &bytes(&b), &bytes(&b_fresh));

    // Dirty a set again, then snapshot the short state into it.
    let mut s = m.snapshot(&a).unwrap();
    m.step(&mut s, 7, Logits::Skip).unwrap();
    drop(s);
    let mut c = m.snapshot(&b).unwrap();
    assert_copy_of(&m, "snapshot into a reused set", &c, &b);
    // And it computes what the original does, bit for bit.
    let mut b = b;
    let next_c = m.step(&mut c, 9, Logits::Return).unwrap();
    let next_b = m.step(&mut b, 9, Logits::Return).unwrap();
    assert_eq!(next_c.logits, next_b.logits);

    // A poisoned state's buffers are not reused.
    let free = m.kv_free_sets();
    m.set_fault_after_chunk(Some(0));
    assert!(m.extend(&mut c, &ids(3, 4), Logits::Skip).is_err());
    drop(c);
    assert_eq!(m.kv_free_sets(), free, "a poisoned state's set is dropped");

    // The last release empties the pool: the device allocator is back where loading left it.
    drop((a, b, b_fresh));
    assert_eq!(m.kv_free_sets(), 0);
    if target == Target::LlvmCpu {
        assert_eq!(settled(&m, alive), alive);
    }
}

#[test]
fn a_state_of_another_model_is_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some((m, other)) = models(Target::LlvmCpu) else {
        return;
    };
    let (a, _) = other.prefill(&ids(4, 5), Logits::Skip).unwrap();
    let e = m.snapshot(&a).unwrap_err();
    assert!(e.to_string().contains("another model"), "{e}");
    assert_eq!(m.kv_free_sets(), 0);
}

/// On the CPU a model's first state starts a spare set beside it (`kvsnap_iree::kv`), and the
/// snapshot of that state lands in the spare instead of allocating: the allocator's live bytes
/// reach two sets during the prefill and stay there through the snapshot. The snapshot equals
/// its source, the spare's other rows are zero, and the last release gives everything back. A
/// spare not taken goes back with the last state too, and a model starts one spare only.
#[test]
fn cpu_first_snapshot_lands_in_the_spare_set() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some((m, other)) = models(Target::LlvmCpu) else {
        return;
    };
    let alive = live_bytes(&m);
    let (a, _) = m.prefill(&ids(30, 6), Logits::Skip).unwrap();
    let set = m.kv_bytes(&a);
    assert_eq!(
        settled(&m, alive + 2 * set),
        alive + 2 * set,
        "the prefill's set and the spare"
    );
    let s = m.snapshot(&a).unwrap();
    assert_eq!(live_bytes(&m), alive + 2 * set, "the snapshot allocated");
    assert_eq!(m.kv_free_sets(), 0);
    assert_copy_of(&m, "snapshot into the spare", &s, &a);
    drop((a, s));
    assert_eq!(settled(&m, alive), alive);

    // Once per model: a later first state allocates its own set and nothing more.
    let (a, _) = m.prefill(&ids(10, 7), Logits::Skip).unwrap();
    assert_eq!(settled(&m, alive + set), alive + set, "one set, no spare");
    drop(a);
    assert_eq!(settled(&m, alive), alive);

    // The other model's spare, never taken, goes back with its only state.
    let alive = live_bytes(&other);
    let (a, _) = other.prefill(&ids(10, 8), Logits::Skip).unwrap();
    assert_eq!(settled(&other, alive + 2 * set), alive + 2 * set);
    drop(a);
    assert_eq!(
        settled(&other, alive),
        alive,
        "the untaken spare was released"
    );
}

#[test]
fn cpu_a_restore_moves_only_what_the_last_turn_wrote() {
    a_restore_moves_only_what_the_last_turn_wrote(Target::LlvmCpu);
}

#[test]
fn vulkan_a_restore_moves_only_what_the_last_turn_wrote() {
    a_restore_moves_only_what_the_last_turn_wrote(Target::VulkanSpirv);
}

/// The catalog's loop: restore one snapshot, extend and decode, release, and again. A restore
/// into the set of the previous copy of the same snapshot moves only the ring rows that copy's
/// turn wrote, and still holds byte for byte what a whole copy does, and computes the same
/// logits as a fresh model; once the snapshot itself is written, the next restore copies whole.
fn a_restore_moves_only_what_the_last_turn_wrote(target: Target) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some((m, fresh)) = models(target) else {
        return;
    };
    let prefix = ids(50, 9);
    let (a, _) = m.prefill(&prefix, Logits::Skip).unwrap();
    let mut snap = m.snapshot(&a).unwrap();
    drop(a);
    let whole = whole_copy_bytes(&m, &snap);
    let copied = |restore: &dyn Fn() -> IreeKv| {
        let before = m.kv_copied_bytes();
        let kv = restore();
        (kv, m.kv_copied_bytes() - before)
    };

    let (mut w, moved) = copied(&|| m.snapshot(&snap).unwrap());
    assert_eq!(moved, whole, "the first restore copies whole");
    m.extend(&mut w, &ids(5, 10), Logits::Skip).unwrap();
    m.step(&mut w, 11, Logits::Skip).unwrap();
    drop(w);
    // What a restore may move after a turn: the positions table, and in each ring the rows of
    // the turn's calls, the extend's padded at most to the smallest chunk that holds it (the
    // model's plan never pads more than that one call), and as many again where they ran past
    // the ring's modulus and were folded back to the rows their positions map to.
    let chunks = m.manifest().chunks.clone();
    let ring_rows = m.manifest().ring.rows;
    let bound = |utterance: usize, steps: usize| -> u64 {
        let extend = chunks.iter().copied().find(|&c| c >= utterance).unwrap();
        let buffers = snap.buffers().iter().enumerate();
        buffers
            .map(
                |(i, b)| match (is_full(&m, i), i / 2 < m.manifest().kv_layouts.len()) {
                    (true, _) => 0,
                    (false, true) => b.byte_length() / ring_rows * (2 * extend + steps),
                    (false, false) => b.byte_length(),
                } as u64,
            )
            .sum()
    };
    let mut last_turn = (5, 1);

    // Turns long enough to wrap the sliding rings (a window of 6 in rows of 70 + 64).
    let (mut fresh_kv, _) = fresh.prefill(&prefix, Logits::Skip).unwrap();
    let fresh_snap = fresh.snapshot(&fresh_kv).unwrap();
    for (turn, utterance) in [(0, 25), (1, 40), (2, 3)] {
        let (mut w, moved) = copied(&|| m.snapshot(&snap).unwrap());
        let what = format!("restore {turn}");
        let most = bound(last_turn.0, last_turn.1);
        assert!(
            moved <= most && most < whole,
            "{what} moved {moved} bytes: more than {most} or a whole copy's {whole}"
        );
        last_turn = (utterance, 3);
        assert_copy_of(&m, &what, &w, &snap);
        fresh_kv = fresh.snapshot(&fresh_snap).unwrap();
        let tokens = ids(utterance, 12 + turn);
        let got = m.extend(&mut w, &tokens, Logits::Return).unwrap();
        let want = fresh
            .extend(&mut fresh_kv, &tokens, Logits::Return)
            .unwrap();
        assert_eq!(got.logits, want.logits, "{what}: extend");
        for id in [13, 14, 15] {
            let got = m.step(&mut w, id, Logits::Return).unwrap();
            let want = fresh.step(&mut fresh_kv, id, Logits::Return).unwrap();
            assert_eq!(got.logits, want.logits, "{what}: step {id}");
        }
    }

    // The snapshot written: its next restore is a whole copy of what it holds now.
    m.step(&mut snap, 16, Logits::Skip).unwrap();
    let (w, moved) = copied(&|| m.snapshot(&snap).unwrap());
    assert_eq!(
        moved,
        whole_copy_bytes(&m, &snap),
        "after the snapshot changed"
    );
    assert_copy_of(&m, "restore of the changed snapshot", &w, &snap);
}
