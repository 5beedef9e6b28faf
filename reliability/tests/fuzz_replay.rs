//! Replays the kept fuzz corpus (`tests/fuzz_corpus/<target>/`: the seeds, the crashes found
//! and a few interesting inputs) through the fuzz targets' bodies, so CI checks them without
//! cargo-fuzz. `write_seeds` (ignored) regenerates the seeds.

use std::path::{Path, PathBuf};

use kvsnap_reliability::fuzz::{self, TARGETS};

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz_corpus")
        .join(target)
}

fn replay(target: &str) {
    let (_, body) = TARGETS.iter().find(|(t, _)| *t == target).unwrap();
    replay_dir(&corpus(target), target, body);
}

fn replay_dir(dir: &Path, target: &str, body: &dyn Fn(&[u8])) {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no corpus in {}", dir.display());
    for f in &files {
        let bytes = std::fs::read(f).unwrap();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&bytes)));
        assert!(caught.is_ok(), "{target} panicked on {}", f.display());
    }
    println!("{target}: {} inputs replayed", files.len());
}

#[test]
fn config_json() {
    replay("config_json");
}

#[test]
fn safetensors_model() {
    replay("safetensors_model");
}

#[test]
fn gguf() {
    replay("gguf");
}

#[test]
fn contract_ops() {
    replay("contract_ops");
}

/// Inputs of open issues outside this crate (`tests/fuzz_corpus/open/`), through the loaders
/// without the fuzz targets' guards: each aborts the process out of memory (or takes seconds)
/// until the loaders bound the layer count (see `fuzz::KNOWN_ISSUE_MAX_LAYERS`).
#[test]
#[ignore = "open issue: config and GGUF loaders allocate per declared layer; aborts out of memory"]
fn open_issues() {
    let open = corpus("open");
    replay_dir(&open.join("config_json"), "config_json", &|bytes| {
        let text = String::from_utf8_lossy(bytes);
        let _ = kvsnap_contract::ModelConfig::from_json(&text, Path::new("config.json"));
    });
    replay_dir(&open.join("gguf"), "gguf", &|bytes| {
        if let Ok(g) = kvsnap_reference::gguf::GgufFile::from_bytes(bytes.to_vec(), "open.gguf") {
            let _ = kvsnap_reference::gguf::convert::hf_config(&g);
        }
    });
}

/// Writes the seed inputs of every target into the corpus.
#[test]
#[ignore = "regenerates tests/fuzz_corpus/*/seed-*"]
fn write_seeds() {
    for (target, seeds) in fuzz::seeds() {
        let dir = corpus(target);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in seeds {
            std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
        }
    }
}
