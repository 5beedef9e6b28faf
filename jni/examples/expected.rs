//! The Java test's expectations, computed with the plain Rust API (no handles, no JNI), so the
//! Java test compares the bridge against the contract rather than against hard-coded tokens.
//!
//! ```text
//! expected tiny OUT_DIR
//!     writes the tiny test model to OUT_DIR
//! expected flow MODEL_DIR PREFIX TURNS UTTERANCE STEPS SEED
//!     prints the catalog flow: a PREFIX-token prefix prefilled once and snapshotted, then TURNS
//!     turns, each extending a copy of the snapshot by UTTERANCE tokens and stepping STEPS
//!     times greedily
//! expected module MODEL_DIR OUT_DIR [CAPACITY | other-window]
//!     compiles the llvm-cpu module `iree-cpu` loads for MODEL_DIR (with CAPACITY instead of the
//!     config's context capacity, which loading takes from the module; or for another config,
//!     a sliding window one longer) and writes it to OUT_DIR, as `kvsnap export` does, for the
//!     Java test's `moduleDir` checks
//! expected vulkan
//!     exits 0 when IREE opens Vulkan device 0 (a GPU or lavapipe), 1 with IREE's text if not
//! ```
//!
//! Output of `flow`, one record per line, numbers separated by spaces:
//! ```text
//! vocab V
//! prefix ID...
//! prefill TOKEN
//! prefill_embeddings TOKEN
//! turn ID... -> TOKEN...      (the utterance, then the extend token and each step's token)
//! ```

use std::path::Path;
use std::process::ExitCode;

use kvsnap_contract::{KvModel, Logits, ModelConfig, Result};
use kvsnap_iree::compile::Target;
use kvsnap_iree::module;
use kvsnap_iree::runtime::{Device, Instance};
use kvsnap_reference::tiny::{self, Preset, DEFAULT_SEED};
use kvsnap_reference::ReferenceModel;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match args.as_slice() {
        ["tiny", out] => tiny::write_model(Path::new(out), Preset::Tiny, DEFAULT_SEED).map(|_| ()),
        ["flow", dir, prefix, turns, utterance, steps, seed] => {
            match [prefix, turns, utterance, steps, seed].map(|s| s.parse::<u64>()) {
                [Ok(p), Ok(t), Ok(u), Ok(s), Ok(seed)] => flow(
                    Path::new(dir),
                    p as usize,
                    t as usize,
                    u as usize,
                    s as usize,
                    seed,
                ),
                _ => return usage(),
            }
        }
        ["module", dir, out] => export(Path::new(dir), Path::new(out), Change::None),
        ["module", dir, out, "other-window"] => {
            export(Path::new(dir), Path::new(out), Change::OtherWindow)
        }
        ["module", dir, out, capacity] => match capacity.parse::<usize>() {
            Ok(c) => export(Path::new(dir), Path::new(out), Change::Capacity(c)),
            Err(_) => return usage(),
        },
        ["vulkan"] => Instance::new()
            .and_then(|i| Device::vulkan(&i, 0))
            .map(|_| ()),
        _ => return usage(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("expected: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: expected tiny OUT_DIR\n       expected flow MODEL_DIR PREFIX TURNS UTTERANCE STEPS SEED\n       \
         expected module MODEL_DIR OUT_DIR [CAPACITY | other-window]\n       expected vulkan"
    );
    ExitCode::from(2)
}

/// Deterministic token ids in `0..vocab` (splitmix64), the first one the BOS token.
fn ids(n: usize, vocab: usize, bos: u32, state: &mut u64) -> Vec<u32> {
    (0..n)
        .map(|_| {
            *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = *state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % vocab as u64) as u32
        })
        .enumerate()
        .map(|(i, id)| if i == 0 { bos } else { id })
        .collect()
}

fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}

fn flow(
    dir: &Path,
    prefix_len: usize,
    turns: usize,
    utterance: usize,
    steps: usize,
    seed: u64,
) -> Result<()> {
    let m = ReferenceModel::load(dir)?;
    let cfg = m.config();
    let mut rng = seed;
    let prefix = ids(prefix_len, cfg.vocab_size, cfg.bos_token_id, &mut rng);
    println!("vocab {}", cfg.vocab_size);
    println!("prefix {}", join(&prefix));

    let (catalog, first) = m.prefill(&prefix, Logits::Skip)?;
    println!("prefill {}", first.token);
    let rows = m.embedding_rows(&prefix)?;
    let (from_rows, first_from_rows) = m.prefill_embeddings(&prefix, &rows, Logits::Skip)?;
    m.release(from_rows)?;
    println!("prefill_embeddings {}", first_from_rows.token);

    for _ in 0..turns {
        // Utterances do not start with BOS: draw one more id and drop the first.
        let utter = ids(utterance + 1, cfg.vocab_size, 0, &mut rng)[1..].to_vec();
        let mut kv = m.snapshot(&catalog)?;
        let mut out = vec![m.extend(&mut kv, &utter, Logits::Skip)?.token];
        for _ in 0..steps {
            let last = *out.last().expect("out starts non-empty");
            out.push(m.step(&mut kv, last, Logits::Skip)?.token);
        }
        m.release(kv)?;
        println!("turn {} -> {}", join(&utter), join(&out));
    }
    m.release(catalog)
}

/// How an exported module's config differs from its model's.
enum Change {
    None,
    /// Another context capacity: loading takes it from the module.
    Capacity(usize),
    /// A sliding window one longer: a module for another config.
    OtherWindow,
}

/// Writes the llvm-cpu module of `dir`'s config, changed by `change`, to `out`.
fn export(dir: &Path, out: &Path, change: Change) -> Result<()> {
    let capacity = match change {
        Change::Capacity(c) => Some(c),
        Change::None | Change::OtherWindow => None,
    };
    let mut cfg = ModelConfig::from_dir(dir, capacity)?;
    if let Change::OtherWindow = change {
        cfg.sliding_window += 1;
    }
    module::export(out, &cfg, Target::LlvmCpu, &mut |_| {})?;
    Ok(())
}
