//! `kvsnap bench`: performance scenarios, each measured against this machine's own limits in the
//! same process.
//!
//! - `catalog`: the catalog prefix prefilled once and snapshotted, then turns served from the
//!   snapshot (restore, extend by the utterance, greedy steps).
//! - `scaling`: per-step time of the stateless redecode (the whole sequence every step, head
//!   sliced) against the stateful step at several sequence lengths, and the per-turn ratio.
//! - `limits`: read bandwidth and SGEMM rate only.
//! - `plot`: no measurement; draws earlier scaling runs (several backends) into one SVG.
//! - `workload`: no measurement; writes the catalog workload's token ids (prefix, utterance, the
//!   oracle's greedy continuation) for other engines' runs of the same scenario.
//!
//! Each prints a table on stdout (progress goes to stderr) and, with `--json`, writes one JSON
//! object. Every scenario is generic over [`KvModel`], so any backend of [`with_model!`] runs it.

mod catalog;
mod floor;
mod limits;
mod plot;
mod scaling;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use kvsnap_contract::KvModel;
use kvsnap_parity::GoldenSet;
use serde_json::{json, Value};

use super::backend::{vulkan_target, with_model, Backend, LoadFacts};
use floor::CostModel;
use limits::Limits;

/// `<start_of_turn>` in the Gemma 3 vocabulary.
const START_OF_TURN: u32 = 105;

/// The scenarios of `kvsnap bench`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Prefix prefilled once, turns served from its snapshot.
    Catalog,
    /// Stateless redecode against stateful steps at several sequence lengths.
    Scaling,
    /// Read bandwidth and SGEMM rate of this machine.
    Limits,
    /// No measurement: draw the scaling runs of `--plot-with` into `--plot`.
    Plot,
    /// No measurement: write the workload's token ids into `--ids-out`.
    Workload,
}

impl Scenario {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Catalog => "catalog",
            Scenario::Scaling => "scaling",
            Scenario::Limits => "limits",
            Scenario::Plot => "plot",
            Scenario::Workload => "workload",
        }
    }
}

/// Arguments of `kvsnap bench`.
#[derive(clap::Args)]
pub struct Args {
    /// The scenario to run.
    #[arg(value_enum)]
    scenario: Scenario,
    /// HF model directory (config.json, model.safetensors): the real model or
    /// `kvsnap tiny-model --preset real-shapes`.
    #[arg(long, default_value = "models/gemma-3-270m")]
    model: PathBuf,
    /// Backend to run.
    #[arg(long, default_value_t = Backend::Reference)]
    backend: Backend,
    /// Write the results as one JSON object to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// `scaling` only: draw the scaling table as an SVG to this file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// `scaling` only: scaling JSON files of other runs (other backends) to draw in the same plot.
    #[arg(long = "plot-with")]
    plot_with: Vec<PathBuf>,
    /// `workload` only: folder to write prefix.ids, utterance.ids and greedy.ids to (one token
    /// id a line).
    #[arg(long = "ids-out")]
    ids_out: Option<PathBuf>,
    /// Golden set holding the catalog prompt (only its token ids are used).
    #[arg(long, default_value = "goldens/gemma-3-270m.visible.json")]
    goldens: PathBuf,
    /// The case whose prompt is split before its last user turn into prefix and utterance.
    #[arg(long, default_value = "catalog_tv")]
    case: String,
    /// Turns served from the snapshot (default: 20 for `catalog`, 5 for `scaling`).
    #[arg(long)]
    turns: Option<usize>,
    /// `catalog`: timed prefills of the prefix (the median is reported, every one is in the JSON).
    #[arg(long, default_value_t = 3)]
    prefill_reps: usize,
    /// Greedy decode steps per turn after the extend.
    #[arg(long, default_value_t = 15)]
    steps: usize,
    /// `scaling`: sequence lengths.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    seqs: Vec<usize>,
    /// `scaling`: timed stateless steps per length (stateful steps: at least 10).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Run every stateless step of a turn instead of extrapolating from one measured step.
    #[arg(long)]
    measure_stateless: bool,
    /// Bytes of the read-bandwidth buffer (well above the last-level cache).
    #[arg(long, default_value_t = 1 << 30)]
    bandwidth_bytes: u64,
    /// `catalog`: bytes of the bandwidth probe run before every turn and after the last, so that
    /// each turn is also set against the bandwidth of its own moment (0: no probes). Its pages
    /// are subtracted from the peak RSS.
    #[arg(long, default_value_t = 256 << 20)]
    probe_bytes: u64,
    /// Side of the square SGEMM that measures the FLOP rate.
    #[arg(long, default_value_t = 2048)]
    sgemm_n: usize,
}

/// Runs the chosen scenario.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let plots = matches!(args.scenario, Scenario::Scaling | Scenario::Plot);
    if !plots && (args.plot.is_some() || !args.plot_with.is_empty()) {
        bail!("--plot draws the scaling table: use it with `kvsnap bench scaling` or `plot`");
    }
    if args.ids_out.is_some() != (args.scenario == Scenario::Workload) {
        bail!("--ids-out is where `kvsnap bench workload` writes, and it needs one");
    }
    let load_before = load_average();
    let mut out = match args.scenario {
        Scenario::Plot => return plot_only(&args),
        Scenario::Workload => return write_workload(&args),
        Scenario::Limits => {
            let limits = limits::measure(args.bandwidth_bytes, args.sgemm_n)?;
            print_limits(&limits);
            limits.json()
        }
        Scenario::Catalog => load_and_run(&args, ModelScenario::Catalog)?,
        Scenario::Scaling => load_and_run(&args, ModelScenario::Scaling)?,
    };
    let fields = out.as_object_mut().context("results are a JSON object")?;
    fields.insert("scenario".into(), json!(args.scenario.name()));
    fields.insert(
        "loadavg_1m".into(),
        json!({ "before": load_before, "after": load_average() }),
    );
    fields.insert("unix_time".into(), json!(unix_time()));
    if let Some(path) = &args.json {
        write_json(path, &out)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        let mut runs = vec![out.clone()];
        runs.extend(read_runs(&args.plot_with)?);
        plot::scaling_svg(path, &runs)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// `kvsnap bench plot`: draws earlier scaling runs, measures nothing.
fn plot_only(args: &Args) -> anyhow::Result<ExitCode> {
    let path = args
        .plot
        .as_ref()
        .context("`kvsnap bench plot` needs --plot FILE")?;
    if args.plot_with.is_empty() {
        bail!("`kvsnap bench plot` needs at least one --plot-with scaling JSON");
    }
    plot::scaling_svg(path, &read_runs(&args.plot_with)?)?;
    eprintln!("wrote {}", path.display());
    Ok(ExitCode::SUCCESS)
}

/// `kvsnap bench workload`: writes the workload's ids, measures nothing.
fn write_workload(args: &Args) -> anyhow::Result<ExitCode> {
    let dir = args
        .ids_out
        .as_ref()
        .context("--ids-out is checked in run")?;
    let w = Workload::load(&args.goldens, &args.case)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, ids) in [
        ("prefix", &w.prefix),
        ("utterance", &w.utterance),
        ("greedy", &w.greedy),
    ] {
        let path = dir.join(format!("{name}.ids"));
        let text: String = ids.iter().map(|id| format!("{id}\n")).collect();
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    eprintln!(
        "`{}`: {}-token prefix, {}-token utterance, {} greedy tokens -> {}",
        w.case,
        w.prefix.len(),
        w.utterance.len(),
        w.greedy.len(),
        dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// The scenarios that run a model.
#[derive(Clone, Copy)]
enum ModelScenario {
    Catalog,
    Scaling,
}

/// Loads the workload and the backend, then runs `scenario` on it.
fn load_and_run(args: &Args, scenario: ModelScenario) -> anyhow::Result<Value> {
    let workload = Workload::load(&args.goldens, &args.case)?;
    let t = Instant::now();
    eprintln!("loading {} on {} ...", args.model.display(), args.backend);
    Ok(with_model!(args.backend, &args.model, |m| {
        eprintln!("loaded in {:.2} s", t.elapsed().as_secs_f64());
        run_model(m, &workload, args, scenario)?
    }))
}

/// Runs a model scenario on `model`, with the limits measured before and after it (the best of
/// the two is kept: the machine is shared, and a limit is the best it can do). The peak RSS is
/// reset after the first measurement so that it is the scenario's own, not the bandwidth
/// buffer's.
fn run_model<M: KvModel + LoadFacts>(
    model: &M,
    w: &Workload,
    args: &Args,
    scenario: ModelScenario,
) -> anyhow::Result<Value> {
    let cost = CostModel::of(model);
    let before = limits::measure(args.bandwidth_bytes, args.sgemm_n)?;
    // Made before the reset, resident throughout: the peak minus its pages is the scenario's.
    let probe = (matches!(scenario, ModelScenario::Catalog) && args.probe_bytes > 0)
        .then(|| limits::Probe::new(args.probe_bytes))
        .transpose()?;
    let rss_reset = reset_peak_rss();
    if !rss_reset {
        eprintln!("warning: could not reset the peak RSS; it includes the bandwidth buffer");
    }
    let cpu = CpuClock::start();
    let (report, peak_rss) = match scenario {
        ModelScenario::Catalog => {
            let turns = args.turns.unwrap_or(20);
            let run = catalog::measure(
                model,
                w,
                args.prefill_reps,
                turns,
                args.steps,
                args.measure_stateless,
                probe.as_ref(),
            )?;
            let probe_rss = probe.as_ref().map_or(0, limits::Probe::resident_bytes);
            (
                Measured::Catalog(run),
                peak_rss_bytes()?.saturating_sub(probe_rss),
            )
        }
        ModelScenario::Scaling => {
            let turns = args.turns.unwrap_or(5);
            let run = scaling::measure(
                model,
                w,
                &args.seqs,
                args.reps,
                turns,
                args.steps,
                args.measure_stateless,
            )?;
            (Measured::Scaling(run), peak_rss_bytes()?)
        }
    };
    let cpu_share = cpu.share();
    let after = limits::measure(args.bandwidth_bytes, args.sgemm_n)?;
    let limits = before.best(&after);
    let mut out = match report {
        Measured::Catalog(run) => {
            let r = catalog::Report::new(model.backend(), w, &run, &cost, &limits, peak_rss);
            r.print();
            r.json()
        }
        Measured::Scaling(run) => {
            let r = scaling::Report::new(model.backend(), &run, &cost, &limits, peak_rss);
            r.print();
            r.json()
        }
    };
    // A CPU backend keeps every core busy: below about 95% of them, other processes took time
    // that the figures include. A GPU backend's host mostly waits, so its share says nothing.
    let competed = match args.backend {
        Backend::IreeVulkan => " (on Vulkan the device does the work)",
        _ if cpu_share < 0.95 => ": other processes competed, re-measure when quiet",
        _ => "",
    };
    println!(
        "the scenario got {:.0}% of {} cores{competed}",
        100.0 * cpu_share,
        limits.threads
    );
    let fields = out.as_object_mut().context("results are a JSON object")?;
    fields.insert(
        "limits_samples".into(),
        json!({ "before": before.json(), "after": after.json() }),
    );
    fields.insert("cpu_share".into(), json!(cpu_share));
    fields.insert("peak_rss_reset".into(), json!(rss_reset));
    fields.insert("load".into(), model.load_facts());
    if let Some(inputs) = model.input_facts() {
        println!(
            "the calls' small inputs: {} written through a host mapping, {} uploaded",
            inputs["mapped"], inputs["uploaded"]
        );
        fields.insert("inputs".into(), inputs);
    }
    if let Some(reads) = model.read_facts() {
        println!(
            "the results read back: {} through a host mapping, {} by a transfer",
            reads["mapped"], reads["transferred"]
        );
        fields.insert("reads".into(), reads);
    }
    if args.backend == Backend::IreeVulkan {
        // Which SPIR-V the figures are of: null is IREE's generic environment.
        fields.insert("vulkan_target".into(), json!(vulkan_target()?));
    }
    Ok(out)
}

/// The raw measurements of a model scenario.
enum Measured {
    Catalog((catalog::Served, catalog::Stateless)),
    Scaling(scaling::Run),
}

/// CPU time of this process against wall time, to tell a quiet run from a contended one.
struct CpuClock {
    wall: Instant,
    cpu_s: Option<f64>,
}

impl CpuClock {
    fn start() -> Self {
        CpuClock {
            wall: Instant::now(),
            cpu_s: process_cpu_seconds(),
        }
    }

    /// CPU seconds used per wall second per rayon thread since `start` (0 when unknown).
    fn share(&self) -> f64 {
        let wall = self.wall.elapsed().as_secs_f64();
        match (self.cpu_s, process_cpu_seconds()) {
            (Some(a), Some(b)) if wall > 0.0 => {
                (b - a) / wall / rayon::current_num_threads() as f64
            }
            _ => 0.0,
        }
    }
}

/// User + system CPU seconds of this process (/proc/self/stat, 100 ticks per second).
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the `(comm)`: state is field 3, utime 14 and stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Resets the peak RSS (VmHWM) to the current RSS; false where the kernel does not allow it.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The catalog prompt split into the prefix (prefilled once) and the utterance (one per turn).
#[derive(Clone, Debug)]
pub struct Workload {
    /// Golden case the prompt comes from.
    pub case: String,
    /// Everything before the last user turn.
    pub prefix: Vec<u32>,
    /// The last user turn up to the model's turn.
    pub utterance: Vec<u32>,
    /// The oracle's greedy continuation of the whole prompt (for a sanity check only).
    pub greedy: Vec<u32>,
}

impl Workload {
    /// Reads case `case` of golden set `path` and splits its prompt before the second-to-last
    /// `<start_of_turn>` (the last one opens the model's turn).
    pub fn load(path: &Path, case: &str) -> anyhow::Result<Self> {
        let set = GoldenSet::load(path)?;
        let case = set
            .select(&[case])?
            .into_iter()
            .next()
            .context("case selection returned nothing")?;
        let starts: Vec<usize> = (0..case.ids.len())
            .filter(|&i| case.ids[i] == START_OF_TURN)
            .collect();
        if starts.len() < 2 {
            bail!(
                "case `{}` has no user turn after a prefix (needs two <start_of_turn> tokens)",
                case.name
            );
        }
        let (prefix, utterance) = case.ids.split_at(starts[starts.len() - 2]);
        Ok(Workload {
            case: case.name.clone(),
            prefix: prefix.to_vec(),
            utterance: utterance.to_vec(),
            greedy: case.greedy.clone(),
        })
    }

    /// The whole prompt: prefix then utterance.
    pub fn prompt(&self) -> Vec<u32> {
        [self.prefix.as_slice(), &self.utterance].concat()
    }
}

/// Nearest-rank percentile `p` (0..=100) of `values`.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    assert!(!values.is_empty(), "percentile of nothing");
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Median (nearest rank) of `values`.
pub fn median(values: &[f64]) -> f64 {
    percentile(values, 50.0)
}

/// The process's peak resident set (VmHWM) in bytes.
pub fn peak_rss_bytes() -> anyhow::Result<u64> {
    status_bytes("VmHWM")
}

/// The resident set of this process now, in bytes (Linux: `VmRSS` of /proc/self/status).
pub fn rss_bytes() -> anyhow::Result<u64> {
    status_bytes("VmRSS")
}

/// A `kB` field of /proc/self/status, in bytes.
fn status_bytes(field: &str) -> anyhow::Result<u64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = status
        .lines()
        .find(|l| {
            l.strip_prefix(field)
                .is_some_and(|rest| rest.starts_with(':'))
        })
        .with_context(|| format!("/proc/self/status has no {field} line"))?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("unreadable {field} line `{line}`"))?;
    Ok(kib * 1024)
}

/// The 1-minute load average, when /proc says it.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Reads the scaling JSON objects of earlier runs.
fn read_runs(paths: &[PathBuf]) -> anyhow::Result<Vec<Value>> {
    paths
        .iter()
        .map(|p| {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
        })
        .collect()
}

fn write_json(path: &Path, value: &Value) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

fn print_limits(l: &Limits) {
    println!(
        "limits ({} threads): read bandwidth {:.2} GB/s over {:.2} GiB; SGEMM {}^3 {:.1} GFLOP/s \
         (the gemm crate {:.1}, the reference's matmul {:.1})",
        l.threads,
        l.read_bandwidth_bps / 1e9,
        l.buffer_bytes as f64 / (1u64 << 30) as f64,
        l.sgemm_n,
        l.sgemm_flops / 1e9,
        l.sgemm_gemm_crate_flops / 1e9,
        l.sgemm_reference_flops / 1e9
    );
}

/// Seconds as a short human figure (`812 us`, `73.4 ms`, `2.31 s`).
pub fn fmt_s(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.0} us", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        assert_eq!(median(&v), 10.0);
        assert_eq!(percentile(&v, 90.0), 18.0);
        assert_eq!(percentile(&v, 100.0), 20.0);
        assert_eq!(percentile(&[3.0], 90.0), 3.0);
    }

    #[test]
    fn catalog_case_splits_before_the_user_turn() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens/gemma-3-270m.visible.json");
        let w = Workload::load(&path, "catalog_tv").unwrap();
        assert_eq!(w.prefix.len(), 860);
        assert_eq!(w.utterance.len(), 22);
        assert_eq!(w.utterance[0], START_OF_TURN);
        assert_eq!(w.prompt().len(), 882);
    }

    /// `kvsnap bench ARGS...`, parsed as the CLI parses it.
    fn parse(argv: &[&str]) -> Args {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let argv = std::iter::once("bench").chain(argv.iter().copied());
        <Cli as clap::Parser>::try_parse_from(argv).unwrap().args
    }

    fn read_ids(path: &Path) -> Vec<u32> {
        let text = std::fs::read_to_string(path).unwrap();
        text.lines().map(|l| l.parse().unwrap()).collect()
    }

    #[test]
    fn workload_ids_are_the_split_prompt_and_the_oracle_continuation() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let goldens = root.join("goldens/gemma-3-270m.visible.json");
        let dir = std::env::temp_dir().join(format!("kvsnap-workload-{}", std::process::id()));
        let args = parse(&[
            "workload",
            "--goldens",
            goldens.to_str().unwrap(),
            "--ids-out",
            dir.to_str().unwrap(),
        ]);
        run(args).unwrap();
        let (prefix, utterance) = (
            read_ids(&dir.join("prefix.ids")),
            read_ids(&dir.join("utterance.ids")),
        );
        let greedy = read_ids(&dir.join("greedy.ids"));
        std::fs::remove_dir_all(&dir).unwrap();

        let set = GoldenSet::load(&goldens).unwrap();
        let case = set.select(&["catalog_tv"]).unwrap().remove(0);
        assert_eq!([prefix.as_slice(), &utterance].concat(), case.ids);
        assert_eq!(greedy, case.greedy);
        assert_eq!(utterance[0], START_OF_TURN);
        assert_eq!(utterance.iter().filter(|&&t| t == START_OF_TURN).count(), 2);
    }

    #[test]
    fn ids_out_belongs_to_the_workload_scenario_only() {
        let err = run(parse(&["limits", "--ids-out", "x"])).unwrap_err();
        assert!(err.to_string().contains("--ids-out"), "{err}");
        let err = run(parse(&["workload"])).unwrap_err();
        assert!(err.to_string().contains("--ids-out"), "{err}");
    }

    #[test]
    fn peak_rss_is_read() {
        assert!(peak_rss_bytes().unwrap() > 0);
    }
}
