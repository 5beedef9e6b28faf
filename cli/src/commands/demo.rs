//! `kvsnap demo`: the catalog scenario on a golden case. Prefill the catalog prefix once,
//! snapshot it, then serve each turn from the snapshot (restore, extend by the user turn,
//! decode greedily) and check every produced position against the oracle.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use kvsnap_contract::{KvModel, Logits, Tolerance};
use kvsnap_parity::{Case, CaseReport, GoldenSet, RunKind, RunState};

use super::backend::{with_model, Backend};

/// `<start_of_turn>` in the Gemma 3 vocabulary.
const START_OF_TURN: u32 = 105;

/// Arguments of `kvsnap demo`.
#[derive(clap::Args)]
pub struct Args {
    /// HF model directory (config.json, model.safetensors).
    #[arg(long, default_value = "models/gemma-3-270m")]
    model: PathBuf,
    /// Golden set holding the catalog case.
    #[arg(long, default_value = "goldens/gemma-3-270m.visible.json")]
    goldens: PathBuf,
    /// The case to serve; its prompt is split before its last user turn.
    #[arg(long, default_value = "catalog_tv")]
    case: String,
    /// Turns served from the one prefix snapshot.
    #[arg(long, default_value_t = 3)]
    turns: usize,
    /// Backend to run.
    #[arg(long, default_value_t = Backend::Reference)]
    backend: Backend,
    /// Absolute tolerance on logits and log-sum-exp.
    #[arg(long, default_value_t = Tolerance::LOGITS.abs)]
    tolerance: f64,
}

/// Runs the demo; exits non-zero iff a turn disagrees with the oracle.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let goldens = GoldenSet::load(&args.goldens)?;
    let case = goldens
        .select(&[args.case.as_str()])?
        .into_iter()
        .next()
        .context("case selection returned nothing")?
        .clone();
    let t = Instant::now();
    eprintln!("loading {} on {} ...", args.model.display(), args.backend);
    with_model!(args.backend, &args.model, |m| {
        eprintln!("loaded in {:.2} s", t.elapsed().as_secs_f64());
        serve(m, &case, &args)
    })
}

/// Where the last user turn starts: the second-to-last `<start_of_turn>` (the last one opens
/// the model's turn).
fn split_point(case: &Case) -> anyhow::Result<usize> {
    let starts: Vec<usize> = (0..case.ids.len())
        .filter(|&i| case.ids[i] == START_OF_TURN)
        .collect();
    match starts.len() {
        0 | 1 => bail!(
            "case `{}` has no user turn after a prefix (needs two <start_of_turn> tokens)",
            case.name
        ),
        n => Ok(starts[n - 2]),
    }
}

fn serve<M: KvModel>(model: &M, case: &Case, args: &Args) -> anyhow::Result<ExitCode> {
    let tol = Tolerance::abs(args.tolerance);
    let k = split_point(case)?;
    let (prefix, turn) = case.ids.split_at(k);
    println!(
        "catalog `{}`: {} prefix tokens (everything before the user turn), {} turn tokens, {} decode steps",
        case.name,
        prefix.len(),
        turn.len(),
        case.greedy.len()
    );

    eprintln!("prefilling the prefix ...");
    let t = Instant::now();
    let (prefix_kv, _) = model.prefill(prefix, Logits::Skip)?;
    let prefill_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let snapshot = model.snapshot(&prefix_kv)?;
    let snapshot_s = t.elapsed().as_secs_f64();
    model.release(prefix_kv)?;
    println!(
        "prefix prefill {:.2} s ({:.0} tok/s), snapshot {:.2} ms ({:.1} MiB of KV)",
        prefill_s,
        prefix.len() as f64 / prefill_s,
        snapshot_s * 1e3,
        model.kv_bytes(&snapshot) as f64 / (1 << 20) as f64
    );

    let mut failed = 0;
    let mut worst = 0.0f64;
    let mut turn_times = Vec::new();
    for t_index in 1..=args.turns {
        let t0 = Instant::now();
        let mut kv = model.snapshot(&snapshot)?;
        let restore_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut next = model.extend(&mut kv, turn, Logits::Return)?;
        let extend_s = t1.elapsed().as_secs_f64();
        let mut check = RunState::new(case, RunKind::Incremental, tol, model.config().vocab_size);
        let t2 = Instant::now();
        for (s, &want) in case.greedy.iter().enumerate() {
            check.observe(case.ids.len() - 1 + s, &next);
            // Teacher forcing: always feed the oracle's token (a mismatch above is recorded).
            if s + 1 < case.greedy.len() {
                next = model.step(&mut kv, want, Logits::Return)?;
            }
        }
        let decode_s = t2.elapsed().as_secs_f64();
        model.release(kv)?;
        let total = t0.elapsed().as_secs_f64();
        turn_times.push(total);
        let report = check.report();
        worst = worst.max(report.max_dlogit);
        let steps = case.greedy.len().saturating_sub(1);
        println!(
            "turn {t_index}: restore {:.2} ms, extend {} tokens {:.3} s, {} steps {:.3} s ({:.1} tok/s), total {:.3} s; {}",
            restore_s * 1e3,
            turn.len(),
            extend_s,
            steps,
            decode_s,
            steps as f64 / decode_s,
            total,
            verdict(report)
        );
        if !report.passed() {
            failed += 1;
        }
    }

    // What the stateless contract would have cost: every generated token recomputes the whole
    // sequence; estimated from the measured prefill rate.
    let rate = prefix.len() as f64 / prefill_s;
    let n = case.ids.len();
    let stateless: f64 = (0..case.greedy.len()).map(|s| (n + s) as f64 / rate).sum();
    let mut sorted = turn_times.clone();
    sorted.sort_by(f64::total_cmp);
    let p50 = sorted[sorted.len() / 2];
    println!(
        "per turn p50 {:.3} s; a stateless redecode would take about {:.1} s per turn (estimated from the prefill rate): {:.0}x",
        p50,
        stateless,
        stateless / p50
    );
    println!(
        "parity: {} turns passed, {} failed, max |dlogit| {:.2e}",
        args.turns - failed,
        failed,
        worst
    );
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// One line on a turn's checks.
fn verdict(report: &CaseReport) -> String {
    match report.first_failure() {
        None => format!(
            "parity ok ({}/{} tokens, max |dlogit| {:.1e})",
            report.tokens_matched, report.tokens_checked, report.max_dlogit
        ),
        Some(first) => format!(
            "PARITY FAILED: {} problems, first: {first}",
            report.failure_count
        ),
    }
}
