//! Helpers shared by the prompt layer's tests.

#![allow(dead_code)]

use std::path::PathBuf;

/// The crate's directory.
pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The visible golden case `name` (text and ids of the real model's prompts).
pub fn golden_case(name: &str) -> serde_json::Value {
    let path = manifest_dir().join("../goldens/gemma-3-270m.visible.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let set: serde_json::Value = serde_json::from_str(&text).expect("goldens are JSON");
    set["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no golden case {name}"))
        .clone()
}

/// The real model's directory (`KVSNAP_MODEL_DIR`, else models/gemma-3-270m) when it holds
/// `file`. Absent: prints `SKIPPED: ...` and returns `None`, or panics when
/// `KVSNAP_REQUIRE_MODEL=1`.
pub fn real_model_with(test: &str, file: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("KVSNAP_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join("../models/gemma-3-270m"));
    if dir.join(file).is_file() {
        return Some(dir);
    }
    let why = format!(
        "{test}: {} not found (run `kvsnap fetch-model` or set KVSNAP_MODEL_DIR)",
        dir.join(file).display()
    );
    if std::env::var("KVSNAP_REQUIRE_MODEL").as_deref() == Ok("1") {
        panic!("KVSNAP_REQUIRE_MODEL=1 but {why}");
    }
    eprintln!("SKIPPED: {why}");
    None
}
