//! `kvsnap parity`: check a backend against a golden set.
//!
//! stdout gets one line per case and run, then the summary
//! `parity: N cases passed, M failed, max |dlogit| X`; stderr gets the setup, progress on long
//! runs and the details of failures. The exit code is 0 iff every run of every case passed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use kvsnap_contract::{KvModel, Tolerance, DEFAULT_CONTEXT_CAPACITY};
use kvsnap_parity::{Case, CaseReport, Checker, GoldenSet, Observer, Progress, RunKind};
use kvsnap_reference::ReferenceModel;

use super::backend::Backend;

/// Failures listed on stderr per failed run.
const FAILURES_SHOWN: usize = 5;
/// A run that has taken this long starts reporting progress.
const PROGRESS_AFTER_S: f64 = 2.0;

/// Arguments of `kvsnap parity`.
#[derive(clap::Args)]
pub struct Args {
    /// Model directory (Hugging Face config.json + model.safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// Golden set to check against (format kvsnap-goldens, version 1).
    #[arg(long)]
    pub goldens: PathBuf,
    /// Backend to check: `reference`, `iree-cpu` or `iree-vulkan`.
    #[arg(long, default_value_t = Backend::Reference)]
    pub backend: Backend,
    /// Absolute tolerance on logits and log-sum-exp; oracle margins up to twice it are near-ties.
    #[arg(long, default_value_t = Tolerance::LOGITS.abs)]
    pub tolerance: f64,
    /// Only these cases (comma-separated names; default: all).
    #[arg(long, value_delimiter = ',')]
    pub cases: Vec<String>,
    /// Runs per case (comma-separated: one-shot, incremental).
    #[arg(long, value_delimiter = ',', default_value = "one-shot,incremental")]
    pub runs: Vec<RunKind>,
}

/// Loads the goldens and the backend, checks every selected case, prints the results.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if !(args.tolerance.is_finite() && args.tolerance >= 0.0) {
        bail!(
            "--tolerance must be a non-negative number, got {}",
            args.tolerance
        );
    }
    if args.runs.is_empty() {
        bail!("--runs is empty (runs: one-shot, incremental)");
    }
    let set = GoldenSet::load(&args.goldens)?;
    let cases = set.select(&args.cases)?;
    let checker = Checker {
        tolerance: Tolerance::abs(args.tolerance),
        runs: dedup(&args.runs),
    };
    eprintln!(
        "kvsnap parity: backend {}, model {}, goldens {} ({} of {} cases, top_k {}), tolerance {:e}",
        args.backend,
        args.model.display(),
        args.goldens.display(),
        cases.len(),
        set.cases.len(),
        set.top_k,
        args.tolerance
    );
    // Not `with_model!`: the reference is loaded with room for the longest case.
    match args.backend {
        Backend::Reference => {
            let start = Instant::now();
            let model = load_reference(&args.model, &cases)?;
            eprintln!(
                "loaded {} in {:.1} s",
                args.model.display(),
                start.elapsed().as_secs_f64()
            );
            check(&model, &checker, &cases)
        }
        Backend::IreeCpu | Backend::IreeVulkan => {
            let start = Instant::now();
            let mut opts = super::backend::iree_options(args.backend)?;
            if longest(&cases) > DEFAULT_CONTEXT_CAPACITY {
                opts.capacity = Some(longest(&cases));
            }
            let model = kvsnap_iree::IreeModel::load(&args.model, &opts)
                .with_context(|| format!("loading {} on {}", args.model.display(), args.backend))?;
            eprintln!(
                "loaded {} in {:.1} s",
                args.model.display(),
                start.elapsed().as_secs_f64()
            );
            check(&model, &checker, &cases)
        }
    }
}

/// Tokens of the longest selected case (prompt and greedy continuation).
fn longest(cases: &[&Case]) -> usize {
    cases
        .iter()
        .map(|c| c.ids.len() + c.greedy.len())
        .max()
        .unwrap_or(0)
}

/// Loads the reference model with room for the longest selected case.
fn load_reference(dir: &Path, cases: &[&Case]) -> anyhow::Result<ReferenceModel> {
    let longest = longest(cases);
    let model = if longest > DEFAULT_CONTEXT_CAPACITY {
        ReferenceModel::load_with_capacity(dir, longest)
    } else {
        ReferenceModel::load(dir)
    }
    .with_context(|| format!("loading the reference model from {}", dir.display()))?;
    super::backend::note_reference_load(&model);
    Ok(model)
}

/// Runs the checker and prints the per-run lines and the summary.
fn check<M: KvModel>(model: &M, checker: &Checker, cases: &[&Case]) -> anyhow::Result<ExitCode> {
    let mut printer = Printer {
        last_progress_s: 0.0,
    };
    let report = checker.check_cases(model, cases.iter().copied(), &mut printer);
    println!("{}", report.summary());
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The order given, each run once.
fn dedup(runs: &[RunKind]) -> Vec<RunKind> {
    let mut out: Vec<RunKind> = Vec::new();
    for &run in runs {
        if !out.contains(&run) {
            out.push(run);
        }
    }
    out
}

/// Prints reports to stdout and (throttled) progress and failure details to stderr.
struct Printer {
    /// When the current run last printed progress.
    last_progress_s: f64,
}

impl Observer for Printer {
    fn progress(&mut self, p: &Progress<'_>) {
        if p.done == 0 {
            self.last_progress_s = 0.0;
            return;
        }
        if p.elapsed_s >= PROGRESS_AFTER_S && p.elapsed_s - self.last_progress_s >= 1.0 {
            self.last_progress_s = p.elapsed_s;
            eprintln!(
                "  {}/{}: {} done ({}/{} ops, {:.1} s)",
                p.case, p.run, p.op, p.done, p.total, p.elapsed_s
            );
        }
    }

    fn report(&mut self, r: &CaseReport) {
        println!("{r}");
        for failure in r.failures.iter().take(FAILURES_SHOWN) {
            eprintln!("  {}/{}: {failure}", r.case, r.run);
        }
        if r.failure_count > FAILURES_SHOWN {
            eprintln!(
                "  {}/{}: ... {} more",
                r.case,
                r.run,
                r.failure_count - FAILURES_SHOWN
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names() {
        assert_eq!("reference".parse::<Backend>(), Ok(Backend::Reference));
        assert_eq!("iree-cpu".parse::<Backend>(), Ok(Backend::IreeCpu));
        assert_eq!("iree-vulkan".parse::<Backend>(), Ok(Backend::IreeVulkan));
        let e = "cuda".parse::<Backend>().unwrap_err();
        assert_eq!(
            e,
            "unknown backend `cuda` (known: reference, iree-cpu, iree-vulkan)"
        );
    }

    #[test]
    fn runs_keep_order_once() {
        use RunKind::*;
        assert_eq!(
            dedup(&[Incremental, OneShot, Incremental]),
            [Incremental, OneShot]
        );
    }
}
