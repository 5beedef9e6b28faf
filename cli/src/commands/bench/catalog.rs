//! The catalog scenario: prefill the prefix once, snapshot it, then serve each turn from the
//! snapshot (restore, extend by the utterance, greedy steps), and what a stateless runtime would
//! have paid for the same turn.

use std::time::Instant;

use anyhow::ensure;
use kvsnap_contract::{KvModel, Logits};
use serde_json::{json, Value};

use super::floor::{CostModel, HeadRead};
use super::limits::{Limits, Probe};
use super::{fmt_s, median, percentile, Workload};

/// Timings of one served turn.
#[derive(Clone, Debug)]
pub struct Turn {
    /// Snapshot of the prefix snapshot (the restore).
    pub restore_s: f64,
    /// Extend by the utterance.
    pub extend_s: f64,
    /// The greedy steps, all in one [`KvModel::decode`] call (which a GPU backend runs
    /// without a round trip to the host between steps).
    pub decode_s: f64,
    /// Restore to release, everything included.
    pub total_s: f64,
    /// Greedy tokens: the extend's, then each step's.
    pub tokens: Vec<u32>,
}

impl Turn {
    /// A greedy step's time, the turn's decode over its steps; `None` for a turn of none.
    pub fn step_s(&self) -> Option<f64> {
        let steps = self.tokens.len().saturating_sub(1);
        (steps > 0).then(|| self.decode_s / steps as f64)
    }
}

/// Turns served from one prefix snapshot.
#[derive(Clone, Debug)]
pub struct Served {
    /// Every timed prefill of the prefix, in order (the last one is the snapshot's source);
    /// [`Served::prefill_s`] is their median.
    pub prefill_runs_s: Vec<f64>,
    /// Snapshot of the prefilled prefix.
    pub snapshot_s: f64,
    /// KV bytes the backend holds for the prefix snapshot (IREE: whole buffers, capacity rows
    /// included).
    pub kv_bytes: u64,
    /// KV bytes the prefix's positions occupy (sliding layers trimmed to their window): what a
    /// snapshot must copy at least, the same figure for every backend.
    pub live_kv_bytes: u64,
    /// Best copy of `live_kv_bytes` between two already faulted-in buffers.
    pub memcpy_s: f64,
    /// The turns, in order.
    pub turns: Vec<Turn>,
    /// Read bandwidth of the probe (bytes/s) before each turn and after the last: `turns + 1`
    /// values, or none when no probe ran.
    pub probe_read_bps: Vec<f64>,
}

impl Served {
    /// The prefix prefill: the median of the timed runs.
    pub fn prefill_s(&self) -> f64 {
        median(&self.prefill_runs_s)
    }
}

/// What the stateless contract would cost for one turn.
#[derive(Clone, Debug)]
pub struct Stateless {
    /// Sum over the turn's steps.
    pub turn_s: f64,
    /// `measured` (every step run) or `extrapolated` (one step run, the others scaled by FLOPs).
    pub kind: &'static str,
    /// The measured stateless step on the whole prompt.
    pub first_step_s: f64,
    /// Stateless steps whose greedy token equals the stateful turn's, out of those run.
    pub tokens_agree: (usize, usize),
}

/// Prefills the prefix `prefill_reps` times (one prefill is a single, noisy sample of the
/// figure most often compared), snapshots the last one and serves `turns` turns of
/// `extend + steps`, with `probe` run before each turn and after the last when given.
pub fn serve<M: KvModel>(
    model: &M,
    w: &Workload,
    prefill_reps: usize,
    turns: usize,
    steps: usize,
    probe: Option<&Probe>,
) -> anyhow::Result<Served> {
    ensure!(turns > 0, "at least one turn");
    ensure!(prefill_reps > 0, "at least one prefill of the prefix");
    let mut prefill_runs_s = Vec::with_capacity(prefill_reps);
    let prefix_kv = loop {
        eprintln!(
            "prefilling the {}-token prefix ({}/{prefill_reps}) ...",
            w.prefix.len(),
            prefill_runs_s.len() + 1
        );
        let t = Instant::now();
        let (kv, _) = model.prefill(&w.prefix, Logits::Skip)?;
        prefill_runs_s.push(t.elapsed().as_secs_f64());
        if prefill_runs_s.len() == prefill_reps {
            break kv;
        }
        model.release(kv)?;
    };
    let t = Instant::now();
    let snapshot = model.snapshot(&prefix_kv)?;
    let snapshot_s = t.elapsed().as_secs_f64();
    model.release(prefix_kv)?;
    let kv_bytes = model.kv_bytes(&snapshot);
    eprintln!(
        "prefix prefill {} (median of {prefill_reps}), snapshot {} ({:.1} MiB)",
        fmt_s(median(&prefill_runs_s)),
        fmt_s(snapshot_s),
        kv_bytes as f64 / (1 << 20) as f64
    );

    let mut served = Vec::with_capacity(turns);
    let mut probe_read_bps: Vec<f64> = probe.map(Probe::read_bps).into_iter().collect();
    for index in 0..turns {
        let t0 = Instant::now();
        let mut kv = model.snapshot(&snapshot)?;
        let restore_s = t0.elapsed().as_secs_f64();
        let t = Instant::now();
        let next = model.extend(&mut kv, &w.utterance, Logits::Skip)?;
        let extend_s = t.elapsed().as_secs_f64();
        let mut tokens = vec![next.token];
        let t = Instant::now();
        if steps > 0 {
            tokens.extend(model.decode(&mut kv, next.token, steps)?);
        }
        let decode_s = t.elapsed().as_secs_f64();
        model.release(kv)?;
        let total_s = t0.elapsed().as_secs_f64();
        let probed = match probe {
            Some(p) => {
                probe_read_bps.push(p.read_bps());
                format!(", then read {:.1} GB/s", probe_read_bps[index + 1] / 1e9)
            }
            None => String::new(),
        };
        eprintln!(
            "turn {}/{turns}: {} (restore {}, extend {}, steps {}{probed})",
            index + 1,
            fmt_s(total_s),
            fmt_s(restore_s),
            fmt_s(extend_s),
            fmt_s(decode_s)
        );
        served.push(Turn {
            restore_s,
            extend_s,
            decode_s,
            total_s,
            tokens,
        });
    }
    let first = &served[0].tokens;
    ensure!(
        served.iter().all(|t| &t.tokens == first),
        "turns served from one snapshot produced different tokens: a snapshot is not independent"
    );
    model.release(snapshot)?;
    let live_kv_bytes = model.config().kv_bytes(w.prefix.len());
    Ok(Served {
        prefill_runs_s,
        snapshot_s,
        kv_bytes,
        live_kv_bytes,
        memcpy_s: memcpy_seconds(live_kv_bytes as usize),
        turns: served,
        probe_read_bps,
    })
}

/// The stateless cost of a turn that produced `tokens` after `prompt`: one fresh prefill of the
/// whole sequence per produced token (head sliced). Runs every step when `measure`, otherwise
/// runs the first and scales it by the FLOPs of the others.
pub fn stateless_turn<M: KvModel>(
    model: &M,
    cost: &CostModel,
    prompt: &[u32],
    tokens: &[u32],
    measure: bool,
) -> anyhow::Result<Stateless> {
    let mut seq = prompt.to_vec();
    let mut times = Vec::new();
    let mut agree = 0;
    // Extrapolation rests on one step, so it is timed twice and the faster run kept.
    let calls = if measure { tokens.len() } else { 2 };
    for i in 0..calls.min(tokens.len()) {
        // Measured: step `i` runs the prompt and the `i` tokens produced before it.
        // Extrapolated: both runs are the first step.
        let produced = if measure { i } else { 0 };
        seq.truncate(prompt.len());
        seq.extend_from_slice(&tokens[..produced]);
        eprintln!(
            "stateless step {}/{calls} on {} tokens ...",
            i + 1,
            seq.len()
        );
        let t = Instant::now();
        let (kv, next) = model.prefill(&seq, Logits::Skip)?;
        times.push(t.elapsed().as_secs_f64());
        model.release(kv)?;
        // Both contracts compute the same greedy continuation (near-ties aside).
        agree += usize::from(next.token == tokens[produced]);
    }
    let first_step_s = if measure {
        times[0]
    } else {
        times.iter().copied().fold(f64::INFINITY, f64::min)
    };
    let (turn_s, kind) = if measure {
        (times.iter().sum(), "measured")
    } else {
        let base = cost.stateless_step(prompt.len()).flops;
        let sum: f64 = (0..tokens.len())
            .map(|s| first_step_s * cost.stateless_step(prompt.len() + s).flops / base)
            .sum();
        (sum, "extrapolated")
    };
    Ok(Stateless {
        turn_s,
        kind,
        first_step_s,
        tokens_agree: (agree, times.len()),
    })
}

/// Best of five copies of `bytes` between two buffers whose pages are already mapped, each
/// copy from memory rather than cache, as a restore's is.
///
/// A restore's source is the prefix snapshot, evicted by the turn before it (15 decode steps
/// stream some 16 GB of weights). Copied again and again, 20 MiB of source and destination stay
/// in a 48 MiB last-level cache and the "memcpy" would run at cache speed: on such a machine
/// (an Ice Lake server) it read 1.5-1.8 ms in cache against 1.9-2.1 ms from memory.
fn memcpy_seconds(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    (0..5)
        .map(|_| {
            evict(&src);
            evict(&dst);
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Writes `buf` back and evicts it from every cache level (x86-64; elsewhere nothing is done,
/// and the copy may run from cache).
fn evict(buf: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_clflush, _mm_mfence};
        for line in buf.chunks(64) {
            // SAFETY: the address lies inside a live allocation; CLFLUSH is part of SSE2,
            // which every x86-64 CPU has.
            unsafe { _mm_clflush(line.as_ptr()) };
        }
        // SAFETY: as above; orders the flushes before the timed copy.
        unsafe { _mm_mfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = buf;
}

/// Measures the whole catalog scenario, `probe` run around every turn when given.
pub fn measure<M: KvModel>(
    model: &M,
    w: &Workload,
    prefill_reps: usize,
    turns: usize,
    steps: usize,
    measure_stateless: bool,
    probe: Option<&Probe>,
) -> anyhow::Result<(Served, Stateless)> {
    let served = serve(model, w, prefill_reps, turns, steps, probe)?;
    let cost = CostModel::of(model);
    let stateless = stateless_turn(
        model,
        &cost,
        &w.prompt(),
        &served.turns[0].tokens,
        measure_stateless,
    )?;
    Ok((served, stateless))
}

/// Each turn against the floor at the bandwidth probed next to it: the better of the probes
/// before and after the turn.
struct Probed {
    /// The turn's floor at its probed bandwidth.
    turn_floor_s: Vec<f64>,
    /// The turn's time over that floor.
    turn_x: Vec<f64>,
    /// The floor of the turn's middle decode step at its probed bandwidth.
    step_floor_s: Vec<f64>,
    /// The turn's median decode step over that floor.
    step_x: Vec<f64>,
}

impl Probed {
    /// `None` unless `served` ran a probe around every turn.
    fn new(
        served: &Served,
        limits: &Limits,
        turn_floor: impl Fn(&Limits) -> f64,
        step_floor: impl Fn(&Limits) -> f64,
    ) -> Option<Probed> {
        let bps = &served.probe_read_bps;
        if bps.len() != served.turns.len() + 1 {
            return None;
        }
        let mut p = Probed {
            turn_floor_s: Vec::new(),
            turn_x: Vec::new(),
            step_floor_s: Vec::new(),
            step_x: Vec::new(),
        };
        for (turn, pair) in served.turns.iter().zip(bps.windows(2)) {
            let at = Limits {
                read_bandwidth_bps: pair[0].max(pair[1]),
                ..*limits
            };
            let (turn_floor, step_floor) = (turn_floor(&at), step_floor(&at));
            p.turn_floor_s.push(turn_floor);
            p.turn_x.push(turn.total_s / turn_floor);
            p.step_floor_s.push(step_floor);
            if let Some(step_s) = turn.step_s() {
                p.step_x.push(step_s / step_floor);
            }
        }
        Some(p)
    }
}

/// The smallest and largest of `values` (non-negative figures: ratios, rates).
fn span(values: &[f64]) -> (f64, f64) {
    values.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| {
        (lo.min(x), hi.max(x))
    })
}

/// The catalog figures with their floors.
pub struct Report {
    json: Value,
    table: Vec<[String; 4]>,
    header: String,
    footer: Vec<String>,
}

impl Report {
    /// Sets the measured `run` against the floors of `cost` at `limits`.
    pub fn new(
        backend: &str,
        w: &Workload,
        run: &(Served, Stateless),
        cost: &CostModel,
        limits: &Limits,
        peak_rss: u64,
    ) -> Self {
        let (served, stateless) = run;
        let (np, nu) = (w.prefix.len(), w.utterance.len());
        let steps = served.turns[0].tokens.len() - 1;
        let turn_s: Vec<f64> = served.turns.iter().map(|t| t.total_s).collect();
        let all_steps: Vec<f64> = served.turns.iter().filter_map(Turn::step_s).collect();
        let extend: Vec<f64> = served.turns.iter().map(|t| t.extend_s).collect();
        let restore: Vec<f64> = served.turns.iter().map(|t| t.restore_s).collect();
        let (p50, p90) = (percentile(&turn_s, 50.0), percentile(&turn_s, 90.0));
        let decode_step_s = if all_steps.is_empty() {
            0.0
        } else {
            median(&all_steps)
        };
        let (extend_s, restore_s) = (median(&extend), median(&restore));
        let prefill_s = served.prefill_s();

        let prefill = cost.chunk(0, np);
        let extend_work = cost.chunk(np, nu);
        let prompt = np + nu;
        // The median step of a turn sits in its middle.
        let mid_step = cost.chunk(prompt + steps / 2, 1);
        let floor_prefill = prefill.floor_s(limits);
        let floor_extend = extend_work.floor_s(limits);
        let floor_step = mid_step.floor_s(limits);
        // The same step with every f32 weight of the head read: the f32 model's floor.
        let f32_step = cost.with_head(HeadRead::F32).chunk(prompt + steps / 2, 1);
        let turn_floor_at = |limits: &Limits| {
            extend_work.floor_s(limits)
                + (0..steps)
                    .map(|s| cost.chunk(prompt + s, 1).floor_s(limits))
                    .sum::<f64>()
        };
        let floor_turn = turn_floor_at(limits);
        let probed = Probed::new(served, limits, turn_floor_at, |l| mid_step.floor_s(l));
        let weights = cost.weights_bytes();
        let greedy_ok = served.turns[0]
            .tokens
            .iter()
            .zip(&w.greedy)
            .take_while(|(a, b)| a == b)
            .count();

        let mut json = json!({
            "backend": backend,
            "case": w.case,
            "prefix_tokens": np,
            "prefix_prefill_s": prefill_s,
            "prefix_prefill_runs_s": served.prefill_runs_s,
            "turns": served.turns.len(),
            "turn_steps": steps,
            "turn_p50_s": p50,
            "turn_p90_s": p90,
            "turn_s": turn_s,
            "snapshot_s": served.snapshot_s,
            "restore_s": restore_s,
            "restore_first_s": served.turns[0].restore_s,
            "kv_bytes": served.kv_bytes,
            "live_kv_bytes": served.live_kv_bytes,
            "memcpy_live_kv_s": served.memcpy_s,
            "decode_step_s": decode_step_s,
            "extend_tokens": nu,
            "extend_s": extend_s,
            "stateless_turn_s": stateless.turn_s,
            "stateless_turn_kind": stateless.kind,
            "stateless_step_prompt_s": stateless.first_step_s,
            "stateless_tokens_agree": [stateless.tokens_agree.0, stateless.tokens_agree.1],
            "stateless_ratio": stateless.turn_s / p50,
            "read_bandwidth_bps": limits.read_bandwidth_bps,
            "sgemm_flops": limits.sgemm_flops,
            "limits": limits.json(),
            "floor_decode_step_s": floor_step,
            "floor_extend_s": floor_extend,
            "floor_turn_s": floor_turn,
            "floor_prefix_prefill_s": floor_prefill,
            "prefix_prefill_flops": prefill.flops,
            "decode_step_bytes": mid_step.bytes,
            "head_read": cost.head().name(),
            "floor_decode_step_f32_head_s": f32_step.floor_s(limits),
            "decode_step_f32_head_bytes": f32_step.bytes,
            "peak_rss_bytes": peak_rss,
            "weights_bytes": weights,
            "greedy_tokens": served.turns[0].tokens,
            "greedy_matches_oracle_prefix": greedy_ok,
        });

        // The probed figures (null without probes).
        let median_of = |v: &[f64]| (!v.is_empty()).then(|| median(v));
        let probe_fields = json!({
            "probe_read_bps": served.probe_read_bps,
            "turn_probe_floor_s": probed.as_ref().map(|p| &p.turn_floor_s),
            "turn_x_probe_floor": probed.as_ref().map(|p| &p.turn_x),
            "turn_x_probe_floor_p50": probed.as_ref().and_then(|p| median_of(&p.turn_x)),
            "decode_step_x_probe_floor": probed.as_ref().map(|p| &p.step_x),
            "decode_step_x_probe_floor_p50": probed.as_ref().and_then(|p| median_of(&p.step_x)),
        });
        if let (Some(fields), Value::Object(probe)) = (json.as_object_mut(), probe_fields) {
            fields.extend(probe);
        }

        let x = |measured: f64, floor: f64| format!("{:.2}x", measured / floor);
        let mut table = vec![
            [
                format!(
                    "prefix prefill ({np} tok), median of {}",
                    served.prefill_runs_s.len()
                ),
                fmt_s(prefill_s),
                fmt_s(floor_prefill),
                x(prefill_s, floor_prefill),
            ],
            [
                format!("turn p50 (extend {nu} + {steps} steps)"),
                fmt_s(p50),
                fmt_s(floor_turn),
                x(p50, floor_turn),
            ],
            [
                "turn p90".into(),
                fmt_s(p90),
                fmt_s(floor_turn),
                x(p90, floor_turn),
            ],
            [
                format!("extend ({nu} tok), median"),
                fmt_s(extend_s),
                fmt_s(floor_extend),
                x(extend_s, floor_extend),
            ],
            [
                "decode step, median".into(),
                fmt_s(decode_step_s),
                fmt_s(floor_step),
                x(decode_step_s, floor_step),
            ],
        ];
        if let Some(p) = &probed {
            let range = |v: &[f64]| {
                let (lo, hi) = span(v);
                format!("{:.2}x ({lo:.2}-{hi:.2})", median(v))
            };
            table.push([
                "turn, each at its probed bandwidth".into(),
                fmt_s(p50),
                fmt_s(median(&p.turn_floor_s)),
                range(&p.turn_x),
            ]);
            if !p.step_x.is_empty() {
                table.push([
                    "decode step, each turn's median likewise".into(),
                    fmt_s(decode_step_s),
                    fmt_s(median(&p.step_floor_s)),
                    range(&p.step_x),
                ]);
            }
        }
        table.extend([
            [
                "snapshot of the prefix (first)".into(),
                fmt_s(served.snapshot_s),
                format!("{} memcpy", fmt_s(served.memcpy_s)),
                x(served.snapshot_s, served.memcpy_s),
            ],
            [
                "restore, median".into(),
                fmt_s(restore_s),
                format!("{} memcpy", fmt_s(served.memcpy_s)),
                x(restore_s, served.memcpy_s),
            ],
            [
                "restore, first turn".into(),
                fmt_s(served.turns[0].restore_s),
                format!("{} memcpy", fmt_s(served.memcpy_s)),
                x(served.turns[0].restore_s, served.memcpy_s),
            ],
            [
                format!("stateless turn ({})", stateless.kind),
                fmt_s(stateless.turn_s),
                String::new(),
                format!(
                    "{:.0}x p50 ({}/{} tokens agree)",
                    stateless.turn_s / p50,
                    stateless.tokens_agree.0,
                    stateless.tokens_agree.1
                ),
            ],
            [
                "peak RSS".into(),
                format!("{:.0} MB", peak_rss as f64 / 1e6),
                format!("{:.0} MB weights", weights as f64 / 1e6),
                format!("{:+.0} MB", (peak_rss as f64 - weights as f64) / 1e6),
            ],
        ]);
        let header = format!(
            "catalog `{}` on {backend}: {np}-token prefix prefilled once ({:.1} MiB KV), {} turns of restore + extend {nu} + {steps} greedy steps",
            w.case,
            served.kv_bytes as f64 / (1 << 20) as f64,
            served.turns.len()
        );
        let mut footer = vec![
            format!(
                "prefill {:.0} tok/s = {:.0}% of the SGEMM rate; decode {:.1} tok/s = {:.0}% of the read bandwidth ({:.0} MB per step, head {}; {:.2}x the floor of the f32 head's {:.0} MB)",
                np as f64 / prefill_s,
                100.0 * floor_prefill / prefill_s,
                1.0 / decode_step_s,
                100.0 * floor_step / decode_step_s,
                mid_step.bytes / 1e6,
                cost.head().name(),
                decode_step_s / f32_step.floor_s(limits),
                f32_step.bytes / 1e6
            ),
            format!(
                "limits ({} threads): read {:.2} GB/s, SGEMM {:.1} GFLOP/s; greedy tokens match the oracle for {greedy_ok}/{}",
                limits.threads,
                limits.read_bandwidth_bps / 1e9,
                limits.sgemm_flops / 1e9,
                w.greedy.len().min(served.turns[0].tokens.len())
            ),
        ];
        if !served.probe_read_bps.is_empty() {
            let bps = &served.probe_read_bps;
            let (lo, hi) = span(bps);
            footer.push(format!(
                "probes before each turn and after the last: read {:.1}-{:.1} GB/s (median {:.1}); a turn's floor takes the better of its two",
                lo / 1e9,
                hi / 1e9,
                median(bps) / 1e9
            ));
        }
        Report {
            json,
            table,
            header,
            footer,
        }
    }

    /// Prints the table on stdout.
    pub fn print(&self) {
        println!("{}", self.header);
        print_table(&["figure", "measured", "floor", "vs floor"], &self.table);
        for line in &self.footer {
            println!("{line}");
        }
    }

    /// The JSON object of the keys (and a few more).
    pub fn json(&self) -> Value {
        self.json.clone()
    }
}

/// Prints aligned columns: the first left-aligned, the others right-aligned.
pub fn print_table<const N: usize>(header: &[&str; N], rows: &[[String; N]]) {
    let mut width = header.map(str::len);
    for row in rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(width).enumerate() {
            if i == 0 {
                s += &format!("{cell:<w$}");
            } else {
                s += &format!("  {cell:>w$}");
            }
        }
        println!("{}", s.trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsnap_reference::tiny::{self, Preset};
    use kvsnap_reference::ReferenceModel;

    /// The tiny model (6-token window, so turns cross it) written once per test process.
    fn tiny_model() -> ReferenceModel {
        let dir = std::env::temp_dir().join(format!("kvsnap-bench-tiny-{}", std::process::id()));
        tiny::write_model(&dir, Preset::Tiny, tiny::DEFAULT_SEED).unwrap();
        let model = ReferenceModel::load(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        model
    }

    /// Each turn is set against the better of the probes around it, and the floor follows the
    /// bandwidth: at twice the bandwidth a bytes-bound floor halves.
    #[test]
    fn each_turn_takes_the_better_probe_around_it() {
        let turn = |total_s: f64, step_s: f64| Turn {
            restore_s: 0.0,
            extend_s: 0.0,
            decode_s: 2.0 * step_s,
            total_s,
            tokens: vec![7; 3],
        };
        let served = Served {
            prefill_runs_s: vec![1.0],
            snapshot_s: 0.0,
            kv_bytes: 0,
            live_kv_bytes: 0,
            memcpy_s: 0.0,
            turns: vec![turn(2.0, 0.2), turn(3.0, 0.4)],
            probe_read_bps: vec![10.0, 20.0, 40.0],
        };
        let limits = Limits {
            read_bandwidth_bps: 1.0,
            sgemm_flops: 1.0,
            sgemm_gemm_crate_flops: 1.0,
            sgemm_reference_flops: 1.0,
            buffer_bytes: 0,
            sgemm_n: 0,
            threads: 2,
        };
        // A bytes-bound floor: 100 bytes a turn, 4 bytes a step.
        let p = Probed::new(
            &served,
            &limits,
            |l| 100.0 / l.read_bandwidth_bps,
            |l| 4.0 / l.read_bandwidth_bps,
        )
        .unwrap();
        assert_eq!(p.turn_floor_s, vec![100.0 / 20.0, 100.0 / 40.0]);
        assert_eq!(p.turn_x, vec![2.0 / 5.0, 3.0 / 2.5]);
        assert_eq!(p.step_floor_s, vec![4.0 / 20.0, 4.0 / 40.0]);
        assert_eq!(p.step_x, vec![0.2 / 0.2, 0.4 / 0.1]);

        let unprobed = Served {
            probe_read_bps: Vec::new(),
            ..served
        };
        assert!(Probed::new(&unprobed, &limits, |_| 1.0, |_| 1.0).is_none());
    }

    /// Turns from one snapshot produce the same tokens, and so does the stateless redecode of
    /// every step: the scenario times the same computation both ways.
    #[test]
    fn turns_and_stateless_redecode_agree_on_the_tiny_model() {
        let model = tiny_model();
        let w = Workload {
            case: "synthetic".into(),
            prefix: (1..12).collect(),
            utterance: vec![105, 40, 41],
            greedy: Vec::new(),
        };
        let probe = Probe::new(1 << 20).unwrap();
        let served = serve(&model, &w, 2, 3, 4, Some(&probe)).unwrap();
        assert_eq!(served.prefill_runs_s.len(), 2);
        assert_eq!(
            served.probe_read_bps.len(),
            4,
            "a probe before each turn and after the last"
        );
        assert!(served
            .probe_read_bps
            .iter()
            .all(|&b| b.is_finite() && b > 0.0));
        assert!(served.prefill_runs_s.contains(&served.prefill_s()));
        assert_eq!(served.turns.len(), 3);
        assert!(served
            .turns
            .iter()
            .all(|t| t.tokens.len() == 5 && t.step_s().is_some()));
        assert_eq!(served.kv_bytes, model.config().kv_bytes(w.prefix.len()));
        assert_eq!(served.live_kv_bytes, served.kv_bytes);

        let cost = CostModel::of(&model);
        let tokens = &served.turns[0].tokens;
        let measured = stateless_turn(&model, &cost, &w.prompt(), tokens, true).unwrap();
        assert_eq!(measured.kind, "measured");
        assert_eq!(measured.tokens_agree, (5, 5));
        let extrapolated = stateless_turn(&model, &cost, &w.prompt(), tokens, false).unwrap();
        assert_eq!(extrapolated.kind, "extrapolated");
        assert_eq!(extrapolated.tokens_agree, (2, 2));
        // Five steps, each at least as long as the measured first one (more FLOPs each).
        assert!(extrapolated.turn_s >= 5.0 * extrapolated.first_step_s);
    }
}
