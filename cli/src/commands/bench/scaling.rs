//! The scaling scenario: a stateless step (the whole sequence recomputed, head sliced) against a
//! stateful step at several sequence lengths, as MISSION.md's table, and the per-turn ratio of
//! the two contracts on the catalog turn.

use std::time::Instant;

use anyhow::ensure;
use kvsnap_contract::{KvModel, Logits};
use serde_json::{json, Value};

use super::catalog::{self, print_table, Stateless};
use super::floor::CostModel;
use super::limits::Limits;
use super::{fmt_s, median, Workload};

/// Stateful steps timed per length (cheap, so more of them than stateless ones).
const MIN_STATEFUL_REPS: usize = 10;

/// Measured step times at one sequence length.
#[derive(Clone, Debug)]
pub struct Row {
    /// Tokens in the sequence after the step.
    pub seq: usize,
    /// Median stateless step: prefill of `seq` tokens.
    pub stateless_s: f64,
    /// Median stateful step: one token appended to a `seq - 1`-token state.
    pub stateful_s: f64,
}

/// The whole scaling measurement.
#[derive(Clone, Debug)]
pub struct Run {
    /// One row per length.
    pub rows: Vec<Row>,
    /// Prompt tokens of the catalog turn.
    pub prompt_tokens: usize,
    /// Median stateful catalog turn (restore, extend, steps).
    pub turn_p50_s: f64,
    /// Turns the median is over.
    pub turns: usize,
    /// Tokens the turn produces.
    pub turn_tokens: usize,
    /// The stateless cost of the same turn.
    pub stateless: Stateless,
}

/// Times stateless and stateful steps at each of `seqs`, then the catalog turn both ways.
pub fn measure<M: KvModel>(
    model: &M,
    w: &Workload,
    seqs: &[usize],
    reps: usize,
    turns: usize,
    steps: usize,
    measure_stateless: bool,
) -> anyhow::Result<Run> {
    ensure!(reps > 0, "--reps must be at least 1");
    ensure!(
        seqs.iter().all(|&s| s >= 2),
        "sequence lengths must be at least 2"
    );
    // The catalog prompt, repeated as needed: the values do not matter for timing.
    let prompt = w.prompt();
    let longest = seqs.iter().copied().max().unwrap_or(0);
    let ids: Vec<u32> = prompt.iter().copied().cycle().take(longest).collect();

    let mut rows = Vec::new();
    for &seq in seqs {
        let mut stateless = Vec::new();
        for r in 0..reps {
            eprintln!(
                "scaling: stateless step on {seq} tokens ({}/{reps}) ...",
                r + 1
            );
            let t = Instant::now();
            let (kv, _) = model.prefill(&ids[..seq], Logits::Skip)?;
            stateless.push(t.elapsed().as_secs_f64());
            model.release(kv)?;
        }
        eprintln!("scaling: stateful steps at {seq} tokens ...");
        let (base, _) = model.prefill(&ids[..seq - 1], Logits::Skip)?;
        let mut stateful = Vec::new();
        for _ in 0..reps.max(MIN_STATEFUL_REPS) {
            let mut kv = model.snapshot(&base)?;
            let t = Instant::now();
            model.step(&mut kv, ids[seq - 1], Logits::Skip)?;
            stateful.push(t.elapsed().as_secs_f64());
            model.release(kv)?;
        }
        model.release(base)?;
        let row = Row {
            seq,
            stateless_s: median(&stateless),
            stateful_s: median(&stateful),
        };
        eprintln!(
            "scaling: SEQ {seq}: stateless {}, stateful {}",
            fmt_s(row.stateless_s),
            fmt_s(row.stateful_s)
        );
        rows.push(row);
    }

    let served = catalog::serve(model, w, 1, turns, steps, None)?;
    let turn_s: Vec<f64> = served.turns.iter().map(|t| t.total_s).collect();
    let cost = CostModel::of(model);
    let tokens = &served.turns[0].tokens;
    let stateless = catalog::stateless_turn(model, &cost, &prompt, tokens, measure_stateless)?;
    Ok(Run {
        rows,
        prompt_tokens: prompt.len(),
        turn_p50_s: median(&turn_s),
        turns: turn_s.len(),
        turn_tokens: tokens.len(),
        stateless,
    })
}

/// The scaling figures with their floors.
pub struct Report {
    json: Value,
    table: Vec<[String; 7]>,
    footer: String,
}

impl Report {
    /// Sets `run` against the floors of `cost` at `limits`.
    pub fn new(backend: &str, run: &Run, cost: &CostModel, limits: &Limits, peak_rss: u64) -> Self {
        let mut rows = Vec::new();
        let mut table = Vec::new();
        for r in &run.rows {
            let floor_stateless = cost.stateless_step(r.seq).floor_s(limits);
            let floor_stateful = cost.chunk(r.seq - 1, 1).floor_s(limits);
            rows.push(json!({
                "seq": r.seq,
                "stateless_step_s": r.stateless_s,
                "stateful_step_s": r.stateful_s,
                "step_ratio": r.stateless_s / r.stateful_s,
                "floor_stateless_step_s": floor_stateless,
                "floor_stateful_step_s": floor_stateful,
            }));
            table.push([
                r.seq.to_string(),
                fmt_s(r.stateless_s),
                format!("{:.2}x", r.stateless_s / floor_stateless),
                fmt_s(r.stateful_s),
                format!("{:.2}x", r.stateful_s / floor_stateful),
                format!("{:.0}x", r.stateless_s / r.stateful_s),
                format!("{:.1}", 1.0 / r.stateful_s),
            ]);
        }
        let ratio = run.stateless.turn_s / run.turn_p50_s;
        let json = json!({
            "backend": backend,
            "rows": rows,
            "catalog_prompt_tokens": run.prompt_tokens,
            "turn_tokens": run.turn_tokens,
            "turns": run.turns,
            "turn_p50_s": run.turn_p50_s,
            "stateless_turn_s": run.stateless.turn_s,
            "stateless_turn_kind": run.stateless.kind,
            "turn_ratio": ratio,
            "read_bandwidth_bps": limits.read_bandwidth_bps,
            "sgemm_flops": limits.sgemm_flops,
            "limits": limits.json(),
            "peak_rss_bytes": peak_rss,
            "weights_bytes": cost.weights_bytes(),
        });
        let footer = format!(
            "catalog turn ({} prompt tokens, {} produced): stateful p50 {} over {} turns, stateless {} ({}): {:.0}x\nlimits ({} threads): read {:.2} GB/s, SGEMM {:.1} GFLOP/s",
            run.prompt_tokens,
            run.turn_tokens,
            fmt_s(run.turn_p50_s),
            run.turns,
            fmt_s(run.stateless.turn_s),
            run.stateless.kind,
            ratio,
            limits.threads,
            limits.read_bandwidth_bps / 1e9,
            limits.sgemm_flops / 1e9
        );
        Report {
            json,
            table,
            footer,
        }
    }

    /// Prints the table on stdout.
    pub fn print(&self) {
        print_table(
            &[
                "SEQ",
                "stateless step",
                "vs floor",
                "stateful step",
                "vs floor",
                "ratio",
                "tok/s",
            ],
            &self.table,
        );
        println!("{}", self.footer);
    }

    /// The JSON object (`rows` holds the table).
    pub fn json(&self) -> Value {
        self.json.clone()
    }
}
