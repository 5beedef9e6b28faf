//! The process-resident devices and modules (`kvsnap_iree::resident`): models of one config
//! share one loaded module whatever their weights, reopening reuses it, idle modules are bounded
//! and can be dropped. Its own test binary, so the counts are this file's alone.
//!
//! Prints `SKIPPED: iree-compile not found` (and passes) when the compiler is not installed.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use kvsnap_contract::{KvModel, Logits};
use kvsnap_iree::compile::Compiler;
use kvsnap_iree::resident::{self, Resident, MAX_IDLE_MODULES};
use kvsnap_iree::{IreeModel, IreeOptions};
use kvsnap_reference::tiny::{write_model, Preset, DEFAULT_SEED};
use kvsnap_reference::ReferenceModel;

/// The tests change and read the process-wide registry: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const PROMPT: [u32; 5] = [2, 105, 17, 300, 4];

/// A tiny model with weights from `seed`, or `None` (SKIPPED) without a compiler.
fn tiny(seed: u64) -> Option<PathBuf> {
    if let Err(e) = Compiler::discover() {
        eprintln!("SKIPPED: iree-compile not found ({e})");
        return None;
    }
    let dir = std::env::temp_dir().join(format!("kvsnap-resident-{seed}-{}", std::process::id()));
    write_model(&dir, Preset::Tiny, seed).expect("tiny model");
    Some(dir)
}

fn cpu(capacity: usize) -> IreeOptions {
    IreeOptions {
        capacity: Some(capacity),
        ..IreeOptions::cpu()
    }
}

/// The greedy token after `PROMPT` on IREE and on the reference must agree.
fn check_against_reference(m: &IreeModel, dir: &Path) -> u32 {
    let (_, got) = m.prefill(&PROMPT, Logits::Skip).unwrap();
    let (_, want) = ReferenceModel::load(dir)
        .unwrap()
        .prefill(&PROMPT, Logits::Skip)
        .unwrap();
    assert_eq!(got.token, want.token);
    got.token
}

#[test]
fn models_of_one_config_share_one_module_and_reopening_reuses_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (Some(a_dir), Some(b_dir)) = (tiny(DEFAULT_SEED), tiny(DEFAULT_SEED + 1)) else {
        return;
    };
    resident::release_idle_modules();
    let base = resident::resident().modules;

    let a = IreeModel::load(&a_dir, &cpu(40)).unwrap();
    let b = IreeModel::load(&b_dir, &cpu(40)).unwrap();
    assert_eq!(
        resident::resident().modules,
        base + 1,
        "two models of one config, one module"
    );
    // Different weights through the one module: each model still gives its own reference's token.
    let ta = check_against_reference(&a, &a_dir);
    let tb = check_against_reference(&b, &b_dir);
    eprintln!("tokens after the prompt: {ta} (seed {DEFAULT_SEED}), {tb} (another seed)");

    drop(a);
    assert_eq!(resident::resident().idle_modules, 0, "b still uses it");
    drop(b);
    let idle = resident::resident();
    assert_eq!((idle.modules, idle.idle_modules), (base + 1, base + 1));

    // Reopening takes the resident module (no new one) and runs as before.
    let again = IreeModel::load(&a_dir, &cpu(40)).unwrap();
    assert_eq!(resident::resident().modules, base + 1);
    assert_eq!(check_against_reference(&again, &a_dir), ta);

    assert_eq!(resident::release_idle_modules(), 0, "in use: not released");
    drop(again);
    assert_eq!(resident::release_idle_modules(), base + 1);
    let Resident {
        devices, modules, ..
    } = resident::resident();
    assert_eq!(modules, 0);
    assert_eq!(devices, 1, "the CPU device stays open");
}

#[test]
fn idle_modules_are_bounded_least_recently_used_first() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dir) = tiny(DEFAULT_SEED) else {
        return;
    };
    resident::release_idle_modules();
    // One module per capacity (the capacity is a static shape of the graphs): c[0] .. c[MAX].
    let c: Vec<usize> = (0..=MAX_IDLE_MODULES).map(|i| 24 + 8 * i).collect();
    let want = check_against_reference(&IreeModel::load(&dir, &cpu(c[0])).unwrap(), &dir);
    let counts = || {
        let r = resident::resident();
        (r.modules, r.idle_modules)
    };
    let open_close = |capacity: usize| {
        let m = IreeModel::load(&dir, &cpu(capacity)).unwrap();
        let loaded = counts();
        assert_eq!(check_against_reference(&m, &dir), want);
        loaded
    };
    for &capacity in &c[1..] {
        open_close(capacity);
    }
    // Closing the last one left MAX + 1 idle: the least recently used, c[0], went.
    assert_eq!(counts(), (MAX_IDLE_MODULES, MAX_IDLE_MODULES));
    // c[0] loads anew (one more module while it is open); closing it pushes out c[1].
    assert_eq!(open_close(c[0]), (MAX_IDLE_MODULES + 1, MAX_IDLE_MODULES));
    assert_eq!(counts(), (MAX_IDLE_MODULES, MAX_IDLE_MODULES));
    // c[0] and c[2] are resident (reused: no new module), c[1] is not.
    assert_eq!(open_close(c[0]).0, MAX_IDLE_MODULES);
    assert_eq!(open_close(c[2]).0, MAX_IDLE_MODULES);
    assert_eq!(open_close(c[1]).0, MAX_IDLE_MODULES + 1);
    assert_eq!(resident::release_idle_modules(), MAX_IDLE_MODULES);
}

#[test]
fn release_unused_closes_what_no_model_holds_and_a_later_load_reopens_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dir) = tiny(DEFAULT_SEED) else {
        return;
    };
    let m = IreeModel::load(&dir, &cpu(40)).unwrap();
    let want = check_against_reference(&m, &dir);
    let (kv, _) = m.prefill(&PROMPT, Logits::Skip).unwrap();
    let held = resident::release_unused();
    assert_eq!(
        (held.devices, held.idle_devices, held.idle_modules),
        (1, 0, 0),
        "the model holds its device and module"
    );
    assert!(held.modules >= 1);
    drop(m);
    // The KV state's buffers still hold the device; the module is idle now and goes.
    let buffers = resident::release_unused();
    assert_eq!((buffers.devices, buffers.modules), (1, 0));
    drop(kv);
    assert_eq!(
        resident::release_unused(),
        Resident {
            devices: 0,
            modules: 0,
            idle_modules: 0,
            idle_devices: 0,
        }
    );
    // A load opens the device and loads the module again, and computes as before.
    let again = IreeModel::load(&dir, &cpu(40)).unwrap();
    assert_eq!(resident::resident().devices, 1);
    assert_eq!(check_against_reference(&again, &dir), want);
}
