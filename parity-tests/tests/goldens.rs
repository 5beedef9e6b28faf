//! The reference backend against the oracle golden sets.
//!
//! - `tiny`: `goldens/tiny.json` against the tiny model, which is written to a temporary
//!   directory from `kvsnap_reference::tiny` (deterministic, so no weights are committed).
//! - `gemma_3_270m`: every `gemma-3-270m*.json` golden set in `../shared/goldens/`
//!   (`KVSNAP_GOLDENS_DIR` overrides) against the real model in `models/gemma-3-270m/`
//!   (`KVSNAP_MODEL_DIR` overrides; `kvsnap fetch-model` writes it). Without the model the test
//!   prints `SKIPPED: ...` and passes, unless `KVSNAP_REQUIRE_MODEL=1`. Relative override paths
//!   are taken from the workspace root.
//!
//! Cost: the real-model test runs every case in release builds (about half a minute on two
//! cores). Debug builds skip prompts longer than 1024 tokens (the visible set's
//! `catalog_long`); `catalog_tv` (882 tokens) still crosses the 512-key sliding window.
//! `KVSNAP_PARITY_MAX_PROMPT=N` sets that limit explicitly (0: no limit) in either build.

use std::path::{Path, PathBuf};

use kvsnap_contract::KvModel;
use kvsnap_parity::{CaseReport, Checker, GoldenSet, Observer, ParityReport, RunKind};
use kvsnap_reference::tiny::{self, Preset, DEFAULT_SEED};
use kvsnap_reference::ReferenceModel;
use sha2::{Digest, Sha256};

/// Longest prompt the real-model test runs in debug builds unless told otherwise.
const DEBUG_MAX_PROMPT: usize = 1024;

/// The workspace root (this crate's parent).
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crate has a parent")
        .to_path_buf()
}

/// The path in `var`, relative ones taken from the workspace root; `default` when unset.
fn env_path(var: &str, default: PathBuf) -> PathBuf {
    std::env::var_os(var)
        .map(|p| workspace().join(p))
        .unwrap_or(default)
}

/// Prints each run's line to stderr, so `--nocapture` shows the numbers.
struct Print;

impl Observer for Print {
    fn report(&mut self, r: &CaseReport) {
        eprintln!("{r}");
        for failure in r.failures.iter().take(5) {
            eprintln!("    {failure}");
        }
    }
}

/// Checks `cases` of `set` (all when `None`) and asserts that every run of every case ran to
/// the end and passed.
fn assert_parity<M: KvModel>(model: &M, set: &GoldenSet, names: Option<&[&str]>) -> ParityReport {
    let cases = match names {
        Some(names) => set.select(names).unwrap(),
        None => set.select::<&str>(&[]).unwrap(),
    };
    let report = Checker::default().check_cases(model, cases.iter().copied(), &mut Print);
    eprintln!("{}", report.summary());
    assert_eq!(report.reports.len(), 2 * cases.len());
    for (r, case) in report.reports.iter().zip(cases.iter().flat_map(|c| [c, c])) {
        assert!(r.passed(), "{r}");
        // Every position the run produces was checked: nothing was skipped silently.
        assert_eq!(r.tokens_checked, case.greedy.len(), "{r}");
        assert!(r.positions_checked > case.greedy.len(), "{r}");
    }
    assert!(report.passed());
    report
}

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvsnap-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes the tiny model the goldens were made from, checking its bytes against the set's
/// `model_sha256` so that a changed generator cannot pass off as a backend bug (or hide one).
fn tiny_model(set: &GoldenSet, test: &str) -> (TempDir, ReferenceModel) {
    let dir = TempDir::new(&format!("parity-{test}"));
    tiny::write_model(&dir.0, Preset::Tiny, DEFAULT_SEED).unwrap();
    let bytes = std::fs::read(dir.0.join("model.safetensors")).unwrap();
    let sha: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let want = set
        .model_sha256
        .as_deref()
        .expect("goldens/tiny.json records model_sha256");
    assert_eq!(
        sha, want,
        "the tiny model's weights differ from the goldens' model"
    );
    let model = ReferenceModel::load(&dir.0).unwrap();
    (dir, model)
}

fn tiny_goldens() -> GoldenSet {
    GoldenSet::load(&workspace().join("goldens/tiny.json")).unwrap()
}

#[test]
fn tiny() {
    let set = tiny_goldens();
    let (_dir, model) = tiny_model(&set, "tiny");
    let report = assert_parity(&model, &set, None);
    // The tiny window is a few tokens, so a case several windows long exercises the ring.
    let window = model.config().sliding_window;
    assert!(
        set.cases.iter().any(|c| c.ids.len() > 2 * window),
        "goldens/tiny.json has no case longer than twice the {window}-token window"
    );
    assert!(
        report.max_dlogit() > 0.0,
        "float32 never matches a float64 oracle exactly"
    );
}

/// The same backend and goldens with one oracle logit moved by five tolerances must fail,
/// exactly there, in both runs: the passing test above is not vacuous.
#[test]
fn tiny_detects_a_planted_golden_error() {
    let mut set = tiny_goldens();
    let (_dir, model) = tiny_model(&set, "tiny-planted");
    let case = &mut set.cases[0];
    let pos = case.ids.len() + 2;
    case.positions[pos].top[1].1 += 0.01;
    let case = &set.cases[0];
    let report = Checker::default().check_cases(&model, [case], &mut Print);
    assert_eq!(report.cases_failed(), 1);
    for run in RunKind::ALL {
        let r = report.reports.iter().find(|r| r.run == run).unwrap();
        assert_eq!(r.failure_count, 1, "{r}");
        assert_eq!(r.first_failure().unwrap().pos, Some(pos), "{r}");
    }
}

#[test]
fn gemma_3_270m() {
    let model_dir = env_path("KVSNAP_MODEL_DIR", workspace().join("models/gemma-3-270m"));
    let goldens_dir = env_path("KVSNAP_GOLDENS_DIR", workspace().join("../shared/goldens"));
    let required = std::env::var("KVSNAP_REQUIRE_MODEL").is_ok_and(|v| v == "1");
    let present = ["config.json", "model.safetensors"]
        .iter()
        .all(|f| model_dir.join(f).is_file());
    if !present {
        let why = format!(
            "no config.json + model.safetensors in {} (run `kvsnap fetch-model` or set \
             KVSNAP_MODEL_DIR)",
            model_dir.display()
        );
        assert!(!required, "KVSNAP_REQUIRE_MODEL=1 but {why}");
        eprintln!("SKIPPED: gemma_3_270m parity: {why}");
        return;
    }

    let mut files: Vec<PathBuf> = std::fs::read_dir(&goldens_dir)
        .unwrap_or_else(|e| panic!("goldens dir {}: {e}", goldens_dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("gemma-3-270m") && name.ends_with(".json")
        })
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "no gemma-3-270m*.json golden set in {}",
        goldens_dir.display()
    );

    let max_prompt = match std::env::var("KVSNAP_PARITY_MAX_PROMPT") {
        Ok(v) => v
            .parse::<usize>()
            .expect("KVSNAP_PARITY_MAX_PROMPT is a number"),
        Err(_) if cfg!(debug_assertions) => DEBUG_MAX_PROMPT,
        Err(_) => 0,
    };
    let model = ReferenceModel::load(&model_dir).unwrap();
    for file in files {
        let set = GoldenSet::load(&file).unwrap();
        let names: Vec<&str> = set
            .cases
            .iter()
            .filter(|c| max_prompt == 0 || c.ids.len() <= max_prompt)
            .map(|c| c.name.as_str())
            .collect();
        let skipped: Vec<&str> = set
            .cases
            .iter()
            .map(|c| c.name.as_str())
            .filter(|n| !names.contains(n))
            .collect();
        eprintln!(
            "{}: {} cases{}",
            file.display(),
            names.len(),
            if skipped.is_empty() {
                String::new()
            } else {
                format!(
                    " (skipping prompts over {max_prompt} tokens: {}; release builds or \
                     KVSNAP_PARITY_MAX_PROMPT=0 run them)",
                    skipped.join(", ")
                )
            }
        );
        assert!(
            !names.is_empty(),
            "{}: every case was skipped",
            file.display()
        );
        assert_parity(&model, &set, Some(&names));
    }
}
