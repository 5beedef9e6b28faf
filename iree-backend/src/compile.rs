//! The compile step: StableHLO MLIR text -> IREE VM flatbuffer (vmfb), through the `iree-compile`
//! executable of the pip package `iree-base-compiler==3.13.0`.
//!
//! The compiler must match the runtime that eerie-sys vendors (3.13): a vmfb from another IREE
//! version does not load, so [`Compiler::discover`] refuses any other version up front.
//!
//! Results are cached on disk, keyed by the sha256 of (MLIR text, flags, compiler version), so a
//! second compile of the same module costs one hash and one file read.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvsnap_contract::{Error, Result};
use sha2::{Digest, Sha256};

/// Environment variable naming the `iree-compile` executable to use.
pub const COMPILER_ENV: &str = "KVSNAP_IREE_COMPILE";
/// Environment variable naming the compile cache directory.
pub const CACHE_DIR_ENV: &str = "KVSNAP_CACHE_DIR";
/// The compiler release line the runtime accepts.
pub const REQUIRED_VERSION_PREFIX: &str = "3.13.";
/// Environment variable naming IREE's Vulkan target for [`Target::VulkanSpirv`] compiles
/// (`--iree-vulkan-target`, see [`Compiler::with_vulkan_target`]).
pub const VULKAN_TARGET_ENV: &str = "KVSNAP_VULKAN_TARGET";

/// How much of the compiler's stderr an error keeps (the tail holds the diagnostic).
const STDERR_TAIL_BYTES: usize = 6000;
/// How often a running compile reports its elapsed time.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(10);
/// How long the compiler's processes may go without using any CPU before the compile counts as
/// hung (see [`CompileProgress::Restarted`]); a working compile never idles that long.
const STALL_LIMIT: Duration = Duration::from_secs(120);
/// How often a running compile's CPU time is read.
const CPU_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// How many times a hung compile is started again before the compile fails.
const STALL_RESTARTS: usize = 1;

/// What the compiled module runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Host CPU code for the `local-task` driver.
    LlvmCpu,
    /// SPIR-V for the `vulkan` driver: IREE 3.13's default target environment, which runs on
    /// any Vulkan 1.x device, or a GPU's own ([`Compiler::with_vulkan_target`]).
    VulkanSpirv,
}

impl Target {
    /// The name used in messages and cache entries: `llvm-cpu` or `vulkan-spirv`.
    pub fn name(self) -> &'static str {
        match self {
            Target::LlvmCpu => "llvm-cpu",
            Target::VulkanSpirv => "vulkan-spirv",
        }
    }

    /// The backend name errors carry for this target: `iree-cpu` or `iree-vulkan`.
    pub fn backend(self) -> &'static str {
        match self {
            Target::LlvmCpu => "iree-cpu",
            Target::VulkanSpirv => "iree-vulkan",
        }
    }

    /// The `iree-compile` flags selecting this target (input is always StableHLO). Every entry
    /// point takes IREE's coarse-fences ABI (`--iree-execution-model=async-external`): it
    /// returns once its work is queued and signals a fence the caller passes, which the
    /// runtime waits on itself (`runtime::wait`: IREE's own wait spins where a worker it
    /// preempted has yet to finish). On llvm-cpu IREE's microkernels are off: the mmt4d
    /// microkernel has no tile for the projections' 32-lane panels and falls back to a scalar
    /// loop (about 40x slower), while the compiler's own code runs them as 8 x 32 register
    /// tiles (see `graphs::PROJECTION_LANES`).
    pub fn flags(self) -> Vec<String> {
        let flags: &[&str] = match self {
            Target::LlvmCpu => &[
                "--iree-input-type=stablehlo",
                "--iree-execution-model=async-external",
                "--iree-hal-target-device=local",
                "--iree-hal-local-target-device-backends=llvm-cpu",
                "--iree-llvmcpu-target-cpu=host",
                "--iree-llvmcpu-enable-ukernels=none",
            ],
            Target::VulkanSpirv => &[
                "--iree-input-type=stablehlo",
                "--iree-execution-model=async-external",
                "--iree-hal-target-device=vulkan",
            ],
        };
        flags.iter().map(|s| s.to_string()).collect()
    }
}

/// Progress of one compile, reported through the callback of [`Compiler::compile`].
#[derive(Debug, Clone)]
pub enum CompileProgress {
    /// The module was found in the cache; nothing is compiled.
    CacheHit {
        /// The cached vmfb.
        path: PathBuf,
    },
    /// The compiler was started.
    Started {
        /// Size of the MLIR text in bytes.
        mlir_bytes: usize,
        /// The target being compiled for.
        target: Target,
    },
    /// The compiler is still running.
    Running {
        /// Time since [`CompileProgress::Started`].
        elapsed: Duration,
        /// The target being compiled for.
        target: Target,
    },
    /// The compiler's processes used no CPU for the stall limit (two minutes unless
    /// [`Compiler::with_stall_limit`]) and were killed; the compile starts again. IREE 3.13's
    /// `iree-compile` deadlocked that way once (every thread waiting on a futex, for 30
    /// minutes) on a module that compiled in 27-46 s in six runs by hand.
    Restarted {
        /// How long the killed attempt ran.
        elapsed: Duration,
        /// The target being compiled for.
        target: Target,
    },
    /// The compiler finished successfully and the vmfb is in the cache.
    Finished {
        /// Wall time of the compile.
        elapsed: Duration,
        /// Size of the vmfb in bytes.
        vmfb_bytes: usize,
        /// The target compiled for.
        target: Target,
    },
}

impl std::fmt::Display for CompileProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CompileProgress::CacheHit { path } => write!(f, "using cached {}", path.display()),
            CompileProgress::Started { mlir_bytes, target } => write!(
                f,
                "compiling {} KB of MLIR for {} ...",
                mlir_bytes.div_ceil(1024),
                target.name()
            ),
            CompileProgress::Running { elapsed, target } => write!(
                f,
                "  ... still compiling for {} ({:.0} s)",
                target.name(),
                elapsed.as_secs_f64()
            ),
            CompileProgress::Restarted { elapsed, target } => write!(
                f,
                "  ... iree-compile for {} stopped using CPU (hung after {:.0} s): killed, \
                 compiling again",
                target.name(),
                elapsed.as_secs_f64()
            ),
            CompileProgress::Finished {
                elapsed,
                vmfb_bytes,
                target,
            } => write!(
                f,
                "compiled for {} in {:.1} s ({} KB vmfb)",
                target.name(),
                elapsed.as_secs_f64(),
                vmfb_bytes.div_ceil(1024)
            ),
        }
    }
}

/// How one run of the compiler ended.
enum Run {
    /// It exited (successfully or not), with its stderr.
    Exited(std::process::ExitStatus, Vec<u8>),
    /// Its processes used no CPU for the stall limit; they were killed.
    Stalled,
}

/// The CPU time (clock ticks) used so far by the processes of process group `group`, from
/// `/proc` (the compiler may be a Python entry point that starts the real binary); `None` where
/// `/proc` is missing.
fn group_cpu_ticks(group: u32) -> Option<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
        // utime stime ...`; `comm` may hold spaces, so split after its closing parenthesis.
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let fields: Vec<&str> = after.split_whitespace().collect();
        if fields.get(2).and_then(|g| g.parse::<u32>().ok()) != Some(group) {
            continue;
        }
        let ticks = |i: usize| fields.get(i).and_then(|t| t.parse::<u64>().ok());
        total += ticks(11).unwrap_or(0) + ticks(12).unwrap_or(0);
    }
    Some(total)
}

/// Kills every process of process group `group` (the compiler and what it started), then
/// `child`, the group's leader, and reaps it.
fn kill_group(group: u32, child: &mut std::process::Child) {
    // `kill -KILL -- -GROUP`: std has no signal API beyond `Child::kill`, which would leave the
    // real compiler running under a killed Python entry point.
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{group}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let _ = child.kill();
    let _ = child.wait();
}

/// A compiled module: the vmfb bytes and where the cache keeps them.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The IREE VM flatbuffer.
    pub vmfb: Vec<u8>,
    /// The cache file holding the same bytes.
    pub path: PathBuf,
    /// Whether the module came from the cache.
    pub cache_hit: bool,
    /// The cache key (hex sha256).
    pub key: String,
}

/// An object file a module links into its executables (`hal.executable.objects` naming it by
/// `name`, a bare file name): the compiler finds it in the directory passed with
/// `--iree-hal-executable-object-search-path`, where [`Compiler::compile_tuned`] writes it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LinkedObject {
    /// The file name the module refers to it by.
    pub name: &'static str,
    /// Its bytes (an ELF object for the target).
    pub bytes: &'static [u8],
}

impl std::fmt::Debug for LinkedObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LinkedObject({}, {} bytes)", self.name, self.bytes.len())
    }
}

/// Writes `object` into `dir` under its name unless a file there already holds its bytes,
/// through a file named with `unique` and a rename, so that parallel compiles never see a
/// half-written object.
fn write_object(dir: &Path, object: &LinkedObject, unique: &str) -> Result<()> {
    let path = dir.join(object.name);
    if std::fs::read(&path).is_ok_and(|bytes| bytes == object.bytes) {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tmp = dir.join(format!("{}.{unique}.tmp", object.name));
    std::fs::write(&tmp, object.bytes).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
}

/// A located and version-checked `iree-compile`, plus the cache it compiles into.
#[derive(Debug, Clone)]
pub struct Compiler {
    exe: PathBuf,
    version: String,
    cache_dir: PathBuf,
    extra_flags: Vec<String>,
    /// See [`Compiler::with_vulkan_target`].
    vulkan_target: Option<String>,
    /// See [`Compiler::with_stall_limit`].
    stall_limit: Duration,
}

fn tool_error(op: impl Into<String>, status: impl Into<String>) -> Error {
    Error::Backend {
        backend: "iree-compile",
        op: op.into(),
        status: status.into(),
    }
}

/// `name` as a Vulkan target ([`Compiler::with_vulkan_target`]): trimmed, `None` when absent or
/// empty, refused unless made of letters, digits, `_`, `-` and `.`.
fn vulkan_target_name(name: Option<&str>) -> Result<Option<String>> {
    match name.map(str::trim) {
        None | Some("") => Ok(None),
        Some(name)
            if name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) =>
        {
            Ok(Some(name.to_string()))
        }
        Some(name) => Err(tool_error(
            "choose the Vulkan target",
            format!(
                "`{name}` is not a Vulkan target name ({VULKAN_TARGET_ENV} or \
                 --vulkan-target): expected a GPU architecture or product such as \
                 `ampere`, `rdna3`, `valhall4` or `rtx4090`"
            ),
        )),
    }
}

/// The Vulkan target `$KVSNAP_VULKAN_TARGET` names, checked as [`Compiler::with_vulkan_target`]
/// checks it; `None` when unset or empty.
pub fn vulkan_target_from_env() -> Result<Option<String>> {
    vulkan_target_name(std::env::var(VULKAN_TARGET_ENV).ok().as_deref())
}

impl Compiler {
    /// Finds `iree-compile`: `$KVSNAP_IREE_COMPILE`, else `.venv/bin/iree-compile` in the current
    /// directory or one of its parents (or the workspace this crate was built in), else `PATH`.
    /// Checks that it is a 3.13.x compiler. `$KVSNAP_VULKAN_TARGET`, where set, is its Vulkan
    /// target ([`Compiler::with_vulkan_target`]).
    pub fn discover() -> Result<Self> {
        let exe = find_compiler().ok_or_else(|| {
            tool_error(
                "find iree-compile",
                format!(
                    "iree-compile not found: set {COMPILER_ENV}, or run scripts/setup-iree.sh \
                     (installs iree-base-compiler==3.13.0 into .venv), or put it on PATH"
                ),
            )
        })?;
        Self::with_executable(exe)?.with_vulkan_target(vulkan_target_from_env()?.as_deref())
    }

    /// Uses the given `iree-compile` executable after checking its version.
    pub fn with_executable(exe: impl Into<PathBuf>) -> Result<Self> {
        let exe = exe.into();
        let version = cached_version(&exe)?;
        if !version_is_supported(&version) {
            return Err(tool_error(
                "check iree-compile version",
                format!(
                    "{} is IREE compiler {version}, but the runtime is IREE 3.13 and only loads \
                     modules from a 3.13.x compiler: install iree-base-compiler==3.13.0 \
                     (scripts/setup-iree.sh)",
                    exe.display()
                ),
            ));
        }
        Ok(Compiler {
            exe,
            version,
            cache_dir: default_cache_dir(),
            extra_flags: Vec::new(),
            vulkan_target: None,
            stall_limit: STALL_LIMIT,
        })
    }

    /// Compiles [`Target::VulkanSpirv`] modules for one GPU's SPIR-V environment
    /// (`--iree-vulkan-target`): an architecture (`ampere`, `ada`, `rdna3`, `valhall4`,
    /// `adreno`), an LLVM-style name (`sm_86`, `gfx1100`) or a product (`rtx4090`). `None` or
    /// an empty name keeps IREE's default environment, which runs on any Vulkan device
    /// (lavapipe included) but leaves a GPU's subgroups and wide loads unused: on the H200 the
    /// catalog's decode step took 42.5 ms with it and 16.6 ms compiled for `ampere`
    /// (docs/BENCHMARKS.md). A module for one GPU may not run on another. The name is part of
    /// the cache key; one IREE does not know fails the compile with IREE's message. A name with
    /// other characters than letters, digits, `_`, `-` and `.` is refused here.
    pub fn with_vulkan_target(mut self, name: Option<&str>) -> Result<Self> {
        self.vulkan_target = vulkan_target_name(name)?;
        Ok(self)
    }

    /// The Vulkan target of [`Compiler::with_vulkan_target`], if any.
    pub fn vulkan_target(&self) -> Option<&str> {
        self.vulkan_target.as_deref()
    }

    /// How long the compiler's processes may use no CPU before the compile counts as hung and
    /// is started again (once; see [`CompileProgress::Restarted`]). Two minutes by default.
    pub fn with_stall_limit(mut self, limit: Duration) -> Self {
        self.stall_limit = limit;
        self
    }

    /// Compiles into (and looks up in) `dir` instead of the default cache directory.
    pub fn with_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = dir.into();
        self
    }

    /// Adds flags passed to every compile after the target flags (part of the cache key).
    pub fn with_extra_flags<I, S>(mut self, flags: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extra_flags.extend(flags.into_iter().map(Into::into));
        self
    }

    /// The compiler's version string, e.g. `3.13.0rc20261016 @ 89ece87b...`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The `iree-compile` executable in use.
    pub fn executable(&self) -> &Path {
        &self.exe
    }

    /// The cache directory.
    pub fn cache_dir(&self) -> &Path {
        &self.cache_dir
    }

    /// The full flag list for `target` (target flags, the Vulkan target where it applies, then
    /// extra flags).
    pub fn flags(&self, target: Target) -> Vec<String> {
        let mut flags = target.flags();
        if let (Target::VulkanSpirv, Some(name)) = (target, &self.vulkan_target) {
            flags.push(format!("--iree-vulkan-target={name}"));
        }
        flags.extend(self.extra_flags.iter().cloned());
        flags
    }

    /// The cache key of compiling `mlir` for `target` with this compiler.
    pub fn cache_key(&self, mlir: &str, target: Target) -> String {
        self.tuned_cache_key(mlir, None, &[], target)
    }

    /// The cache key of compiling `mlir` with the tuning spec `spec` (its text) and the linked
    /// `objects` for `target`.
    pub fn tuned_cache_key(
        &self,
        mlir: &str,
        spec: Option<&str>,
        objects: &[LinkedObject],
        target: Target,
    ) -> String {
        let mut h = Sha256::new();
        h.update(b"kvsnap-iree-compile-v1\0");
        h.update(mlir.as_bytes());
        h.update(b"\0");
        if let Some(spec) = spec {
            h.update(b"tuning-spec\0");
            h.update(spec.as_bytes());
            h.update(b"\0");
        }
        for object in objects {
            h.update(b"object\0");
            h.update(object.name.as_bytes());
            h.update(b"\0");
            h.update(object.bytes);
            h.update(b"\0");
        }
        for flag in self.flags(target) {
            h.update(flag.as_bytes());
            h.update(b"\0");
        }
        h.update(self.version.as_bytes());
        hex(&h.finalize())
    }

    /// Compiles `mlir` for `target`, or returns the cached result of an identical earlier compile.
    /// `progress` receives a few human-readable events (see [`CompileProgress`]'s `Display`).
    ///
    /// A failed compile leaves the MLIR in the cache directory (named in the error) for
    /// reproduction with `iree-compile` by hand.
    pub fn compile(
        &self,
        mlir: &str,
        target: Target,
        progress: &mut dyn FnMut(&CompileProgress),
    ) -> Result<Compiled> {
        self.compile_tuned(mlir, None, &[], target, progress)
    }

    /// [`Compiler::compile`] with an IREE tuning spec (the text of a transform module, passed
    /// as `--iree-codegen-tuning-spec-path`) and the objects the module links (written into
    /// the cache's `objects` directory, passed as `--iree-hal-executable-object-search-path`);
    /// both are part of the cache key.
    pub fn compile_tuned(
        &self,
        mlir: &str,
        spec: Option<&str>,
        objects: &[LinkedObject],
        target: Target,
        progress: &mut dyn FnMut(&CompileProgress),
    ) -> Result<Compiled> {
        let key = self.tuned_cache_key(mlir, spec, objects, target);
        let vmfb_path = self.cache_dir.join(format!("{key}.{}.vmfb", target.name()));
        if vmfb_path.is_file() {
            let vmfb = std::fs::read(&vmfb_path).map_err(|e| Error::io(&vmfb_path, e))?;
            progress(&CompileProgress::CacheHit {
                path: vmfb_path.clone(),
            });
            return Ok(Compiled {
                vmfb,
                path: vmfb_path,
                cache_hit: true,
                key,
            });
        }

        std::fs::create_dir_all(&self.cache_dir).map_err(|e| Error::io(&self.cache_dir, e))?;
        // The input and the output are named uniquely per process and per compile (threads of
        // one process, parallel tests, may compile the same MLIR at once), and the vmfb is
        // renamed into place, so a concurrent or interrupted compile never leaves a truncated
        // file under the final name nor reads one that another compile is rewriting.
        static COMPILES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let unique = format!(
            "{key}.{}.{}-{}",
            target.name(),
            std::process::id(),
            COMPILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let mlir_path = self.cache_dir.join(format!("{unique}.mlir"));
        std::fs::write(&mlir_path, mlir).map_err(|e| Error::io(&mlir_path, e))?;
        let mut flags = self.flags(target);
        let spec_path = match spec {
            Some(spec) => {
                let path = self.cache_dir.join(format!("{unique}.tuning.mlir"));
                std::fs::write(&path, spec).map_err(|e| Error::io(&path, e))?;
                flags.push(format!(
                    "--iree-codegen-tuning-spec-path={}",
                    path.display()
                ));
                Some(path)
            }
            None => None,
        };
        if !objects.is_empty() {
            let dir = self.cache_dir.join("objects");
            for object in objects {
                write_object(&dir, object, &unique)?;
            }
            flags.push(format!(
                "--iree-hal-executable-object-search-path={}",
                dir.display()
            ));
        }
        let tmp_path = self.cache_dir.join(format!("{unique}.tmp"));

        let op = format!("compile for {}", target.name());
        progress(&CompileProgress::Started {
            mlir_bytes: mlir.len(),
            target,
        });
        let start = Instant::now();
        let mut restarts = 0;
        let (exit, stderr) = loop {
            let attempt = Instant::now();
            match self.run(&flags, &mlir_path, &tmp_path, &op, target, progress)? {
                Run::Exited(exit, stderr) => break (exit, stderr),
                Run::Stalled if restarts < STALL_RESTARTS => {
                    restarts += 1;
                    progress(&CompileProgress::Restarted {
                        elapsed: attempt.elapsed(),
                        target,
                    });
                }
                Run::Stalled => {
                    return Err(tool_error(
                        op,
                        format!(
                            "iree-compile used no CPU for {} s, {} times in a row (hung); input \
                             kept at {}",
                            self.stall_limit.as_secs_f64(),
                            restarts + 1,
                            mlir_path.display()
                        ),
                    ))
                }
            }
        };
        let elapsed = start.elapsed();

        if !exit.success() {
            let _ = std::fs::remove_file(&tmp_path);
            return Err(tool_error(
                op,
                format!(
                    "iree-compile exited with {exit} after {:.1} s (input kept at {}{}); stderr tail:\n{}",
                    elapsed.as_secs_f64(),
                    mlir_path.display(),
                    spec_path
                        .as_ref()
                        .map(|p| format!(", tuning spec at {}", p.display()))
                        .unwrap_or_default(),
                    tail(&stderr, STDERR_TAIL_BYTES)
                ),
            ));
        }
        let vmfb = std::fs::read(&tmp_path).map_err(|e| Error::io(&tmp_path, e))?;
        std::fs::rename(&tmp_path, &vmfb_path).map_err(|e| Error::io(&vmfb_path, e))?;
        let _ = std::fs::remove_file(&mlir_path);
        if let Some(path) = &spec_path {
            let _ = std::fs::remove_file(path);
        }
        progress(&CompileProgress::Finished {
            elapsed,
            vmfb_bytes: vmfb.len(),
            target,
        });
        Ok(Compiled {
            vmfb,
            path: vmfb_path,
            cache_hit: false,
            key,
        })
    }

    /// Runs the compiler once on `mlir_path` into `tmp_path`, reporting progress, in a process
    /// group of its own; kills the group if it uses no CPU for the stall limit (checked where
    /// `/proc` exists).
    fn run(
        &self,
        flags: &[String],
        mlir_path: &Path,
        tmp_path: &Path,
        op: &str,
        target: Target,
        progress: &mut dyn FnMut(&CompileProgress),
    ) -> Result<Run> {
        use std::os::unix::process::CommandExt;

        let start = Instant::now();
        let mut child = Command::new(&self.exe)
            .args(flags)
            .arg(mlir_path)
            .arg("-o")
            .arg(tmp_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .map_err(|e| tool_error(op, format!("cannot run {}: {e}", self.exe.display())))?;
        let group = child.id();

        // Drain stderr on a thread so a chatty compiler never blocks on a full pipe.
        let mut stderr_pipe = child.stderr.take();
        let stderr_reader = std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(pipe) = stderr_pipe.as_mut() {
                let _ = pipe.read_to_end(&mut buf);
            }
            buf
        });
        let mut last_report = Instant::now();
        let mut cpu = (group_cpu_ticks(group), Instant::now());
        let mut last_cpu_check = Instant::now();
        loop {
            match child.try_wait() {
                Ok(Some(exit)) => {
                    let stderr = stderr_reader.join().unwrap_or_default();
                    return Ok(Run::Exited(exit, stderr));
                }
                Ok(None) => {
                    if last_report.elapsed() >= PROGRESS_INTERVAL {
                        last_report = Instant::now();
                        progress(&CompileProgress::Running {
                            elapsed: start.elapsed(),
                            target,
                        });
                    }
                    if last_cpu_check.elapsed() >= CPU_CHECK_INTERVAL {
                        last_cpu_check = Instant::now();
                        let now = group_cpu_ticks(group);
                        if now.is_none() || now != cpu.0 {
                            cpu = (now, Instant::now());
                        } else if cpu.1.elapsed() >= self.stall_limit {
                            kill_group(group, &mut child);
                            // Not joined: a process that escaped the group would hold the
                            // pipe open; the reader ends whenever the pipe closes.
                            drop(stderr_reader);
                            let _ = std::fs::remove_file(tmp_path);
                            return Ok(Run::Stalled);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    kill_group(group, &mut child);
                    return Err(tool_error(op, format!("waiting for iree-compile: {e}")));
                }
            }
        }
    }

    /// Compiles `mlir` and writes the vmfb to `out` as well (for `iree-run-module` and exports).
    pub fn compile_to_file(
        &self,
        mlir: &str,
        target: Target,
        out: &Path,
        progress: &mut dyn FnMut(&CompileProgress),
    ) -> Result<Compiled> {
        let compiled = self.compile(mlir, target, progress)?;
        let mut f = std::fs::File::create(out).map_err(|e| Error::io(out, e))?;
        f.write_all(&compiled.vmfb).map_err(|e| Error::io(out, e))?;
        Ok(compiled)
    }
}

/// True for a `3.13.x` version string.
pub fn version_is_supported(version: &str) -> bool {
    version.starts_with(REQUIRED_VERSION_PREFIX)
}

/// The version of `exe`, queried once per process and executable: `iree-compile --version` costs
/// about 100 ms (a Python entry point), which every model load would pay otherwise. The memo is
/// keyed by the path and the file's size and modification time, so a replaced compiler is
/// queried again.
fn cached_version(exe: &Path) -> Result<String> {
    type Key = (PathBuf, Option<(u64, std::time::SystemTime)>);
    static VERSIONS: Mutex<Vec<(Key, String)>> = Mutex::new(Vec::new());
    let identity = std::fs::metadata(exe)
        .ok()
        .and_then(|m| Some((m.len(), m.modified().ok()?)));
    let key = (exe.to_path_buf(), identity);
    let known = |versions: &[(Key, String)]| {
        versions
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.clone())
    };
    // A poisoned lock only means another thread panicked while holding it; the list stays valid.
    let lock = || VERSIONS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(version) = known(&lock()) {
        return Ok(version);
    }
    let version = query_version(exe)?;
    let mut versions = lock();
    if known(&versions).is_none() {
        versions.push((key, version.clone()));
    }
    Ok(version)
}

/// Runs `iree-compile --version` and returns the text after "IREE compiler version ".
fn query_version(exe: &Path) -> Result<String> {
    let op = "check iree-compile version";
    let out = Command::new(exe)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| tool_error(op, format!("cannot run {}: {e}", exe.display())))?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    parse_version(&text).ok_or_else(|| {
        tool_error(
            op,
            format!(
                "{} --version printed no IREE compiler version ({}): {}",
                exe.display(),
                out.status,
                tail(text.as_bytes(), 500)
            ),
        )
    })
}

/// Extracts the version from `iree-compile --version` output.
fn parse_version(text: &str) -> Option<String> {
    let marker = "IREE compiler version ";
    text.lines().find_map(|line| {
        line.find(marker)
            .map(|i| line[i + marker.len()..].trim().to_string())
    })
}

fn find_compiler() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(COMPILER_ENV) {
        return Some(PathBuf::from(p));
    }
    let venv_exe = Path::new(".venv").join("bin").join("iree-compile");
    let mut roots = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        roots.push(cwd);
    }
    roots.push(build_workspace_root());
    for root in &roots {
        for dir in root.ancestors() {
            let candidate = dir.join(&venv_exe);
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("iree-compile"))
        .find(|p| p.is_file())
}

/// The workspace this crate was built in (the parent of this crate's manifest directory).
fn build_workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// `$KVSNAP_CACHE_DIR`, else `.cache/kvsnap/iree` in the enclosing Cargo workspace (found from the
/// current directory, then the workspace this crate was built in), else in the current directory.
pub fn default_cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os(CACHE_DIR_ENV) {
        return PathBuf::from(p);
    }
    let sub = Path::new(".cache").join("kvsnap").join("iree");
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    let is_workspace_root = |dir: &Path| {
        std::fs::read_to_string(dir.join("Cargo.toml"))
            .map(|s| s.contains("[workspace]"))
            .unwrap_or(false)
    };
    if let Some(root) = cwd.ancestors().find(|d| is_workspace_root(d)) {
        return root.join(sub);
    }
    let built = build_workspace_root();
    if is_workspace_root(&built) {
        return built.join(sub);
    }
    cwd.join(sub)
}

fn tail(bytes: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim_end();
    if text.len() <= max {
        return text.to_string();
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("...{}", &text[start..])
}

/// `bytes` in lowercase hexadecimal, two digits each.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_pip_compiler_version() {
        let text = "IREE (https://iree.dev):\n  IREE compiler version 3.13.0rc20261016 @ 89ece87b\n  LLVM version 24.0.0git\n";
        let v = parse_version(text).unwrap();
        assert_eq!(v, "3.13.0rc20261016 @ 89ece87b");
        assert!(version_is_supported(&v));
        assert!(!version_is_supported("3.11.0 @ abc"));
        assert!(!version_is_supported("3.1.0"));
    }

    #[test]
    fn tail_keeps_the_end_on_a_char_boundary() {
        assert_eq!(tail(b"short\n", 100), "short");
        let t = tail("ééééé".as_bytes(), 3);
        assert!(t.starts_with("...") && t.ends_with('é'));
    }

    #[test]
    fn progress_reads_like_a_log_line() {
        let s = CompileProgress::Started {
            mlir_bytes: 2048,
            target: Target::LlvmCpu,
        }
        .to_string();
        assert_eq!(s, "compiling 2 KB of MLIR for llvm-cpu ...");
    }
}
