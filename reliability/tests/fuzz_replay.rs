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

/// Inputs that once aborted the process out of memory (`tests/fuzz_corpus/open/`: configs and
/// GGUFs declaring billions of layers): the loaders now refuse them with a typed error before
/// allocating anything per layer (`kvsnap_contract::MAX_LAYERS`).
#[test]
fn huge_layer_counts_are_refused() {
    let open = corpus("open");
    replay_dir(&open.join("config_json"), "config_json", &|bytes| {
        let text = String::from_utf8_lossy(bytes);
        let e = kvsnap_contract::ModelConfig::from_json(&text, Path::new("config.json"))
            .expect_err("a config with billions of layers must be refused");
        assert!(e.to_string().contains("more than kvsnap supports"), "{e}");
    });
    replay_dir(&open.join("gguf"), "gguf", &|bytes| {
        let g = kvsnap_reference::gguf::GgufFile::from_bytes(bytes.to_vec(), "open.gguf")
            .expect("the GGUF itself parses");
        let e = kvsnap_reference::gguf::convert::hf_config(&g)
            .expect_err("a GGUF with billions of layers must be refused");
        assert!(e.to_string().contains("more than kvsnap supports"), "{e}");
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
