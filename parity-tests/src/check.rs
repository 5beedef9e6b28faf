//! The golden-set checker: runs every case through a [`KvModel`] the way the product uses it and
//! compares each position the backend produces with the oracle (`shared/goldens/FORMAT.md`).
//!
//! Each case runs twice:
//! - [`RunKind::OneShot`]: `prefill(ids)`, then the greedy decode, forking a snapshot midway.
//! - [`RunKind::Incremental`]: `prefill(ids[..h])` with `h = len / 2`, fork a snapshot, then on it
//!   `extend(ids[h..n-1])` and `step(ids[n-1])`, then the greedy decode.
//!
//! At a fork the snapshot takes the next operation first, and only then the original is extended
//! with different tokens over (the first of) the same positions and released. A snapshot that shares state with
//! its original (a shared length, or shared buffers updated in place) then reads the original's
//! tokens on its next call and fails the logit checks; perturbing before the snapshot's write
//! would let the snapshot overwrite the damage and hide it.
//!
//! Tokens: the decode always feeds the oracle's greedy tokens (teacher forcing). The backend's own
//! token must equal the oracle's wherever the oracle's margin exceeds twice the tolerance; where
//! it does not (a near-tie float32 may break either way) a different token is allowed and the
//! report records that teacher forcing took over from there.

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use kvsnap_contract::{argmax, Error, KvModel, Logits, Next, Tolerance};

use crate::golden::Case;

/// At most this many failures are kept per run (all are counted).
pub const MAX_KEPT_FAILURES: usize = 32;

/// How many tokens the original gets after a fork.
const PERTURB_TOKENS: usize = 4;

/// The operation sequence a run uses to reach the prompt's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RunKind {
    /// One prefill of the whole prompt; snapshot midway through the decode.
    OneShot,
    /// Prefill of the first half, snapshot, extend and step the rest on the snapshot.
    Incremental,
}

impl RunKind {
    /// Both runs, in the order they are reported.
    pub const ALL: [RunKind; 2] = [RunKind::OneShot, RunKind::Incremental];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            RunKind::OneShot => "one-shot",
            RunKind::Incremental => "incremental",
        }
    }
}

impl fmt::Display for RunKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for RunKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        RunKind::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| format!("unknown run `{s}` (runs: one-shot, incremental)"))
    }
}

/// What went wrong at one position (or before any, for `pos: None`).
#[derive(Debug)]
pub struct Failure {
    /// Position of `ids + greedy` whose logits (or token) failed.
    pub pos: Option<usize>,
    /// What failed.
    pub kind: FailureKind,
}

/// The kinds of disagreement the checker reports.
#[derive(Debug)]
pub enum FailureKind {
    /// One of the oracle's top-k ids has a logit outside the tolerance.
    Logit { id: u32, got: f32, want: f64 },
    /// Log-sum-exp over the whole vocabulary is outside the tolerance.
    Lse { got: f64, want: f64 },
    /// The backend's argmax differs from the oracle's top id at a clear (not near-tie) margin.
    Argmax { got: u32, want: u32, margin: f64 },
    /// Decode step `step` produced a token other than the oracle's greedy one at a clear margin.
    Greedy {
        step: usize,
        got: u32,
        want: u32,
        margin: f64,
    },
    /// The returned token is not the argmax of the returned logits.
    TokenNotArgmax { token: u32, argmax: u32 },
    /// Logits were asked for and not returned.
    NoLogits,
    /// The logits do not have one value per vocabulary entry.
    LogitsLength { got: usize, want: usize },
    /// The golden set mentions a token id the model's vocabulary does not have.
    VocabMismatch { id: u32, vocab: usize },
    /// A backend call failed; the run stops there.
    Backend { op: &'static str, error: Error },
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureKind::Logit { id, got, want } => write!(
                f,
                "logit of id {id}: got {got:.6}, want {want:.6} (|d| {:.3e})",
                (*got as f64 - want).abs()
            ),
            FailureKind::Lse { got, want } => write!(
                f,
                "lse: got {got:.6}, want {want:.6} (|d| {:.3e})",
                (got - want).abs()
            ),
            FailureKind::Argmax { got, want, margin } => {
                write!(f, "argmax {got}, want {want} (oracle margin {margin:.4})")
            }
            FailureKind::Greedy {
                step,
                got,
                want,
                margin,
            } => write!(
                f,
                "greedy step {step}: token {got}, want {want} (oracle margin {margin:.4})"
            ),
            FailureKind::TokenNotArgmax { token, argmax } => {
                write!(
                    f,
                    "returned token {token} is not the logits' argmax {argmax}"
                )
            }
            FailureKind::NoLogits => write!(f, "logits were requested but not returned"),
            FailureKind::LogitsLength { got, want } => {
                write!(f, "{got} logits, expected vocab size {want}")
            }
            FailureKind::VocabMismatch { id, vocab } => write!(
                f,
                "golden token id {id} is outside the model's vocab {vocab} (wrong model?)"
            ),
            FailureKind::Backend { op, error } => write!(f, "{op} failed: {error}"),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.pos {
            Some(pos) => write!(f, "pos {pos}: {}", self.kind),
            None => write!(f, "{}", self.kind),
        }
    }
}

/// The result of one run of one case.
#[derive(Debug)]
pub struct CaseReport {
    /// The case's name.
    pub case: String,
    /// Which run.
    pub run: RunKind,
    /// Prompt length in tokens.
    pub prompt_len: usize,
    /// Positions whose logits were checked.
    pub positions_checked: usize,
    /// Largest |backend - oracle| over the top-k logits of every checked position.
    pub max_dlogit: f64,
    /// Position of `max_dlogit`.
    pub max_dlogit_pos: Option<usize>,
    /// Largest |backend - oracle| log-sum-exp.
    pub max_dlse: f64,
    /// Decode steps whose token equals the oracle's greedy token.
    pub tokens_matched: usize,
    /// Decode steps whose token was compared.
    pub tokens_checked: usize,
    /// First decode step whose token differed at a near-tie; the oracle's tokens were fed
    /// anyway, as they are everywhere.
    pub teacher_forced_from: Option<usize>,
    /// The first [`MAX_KEPT_FAILURES`] failures, in order.
    pub failures: Vec<Failure>,
    /// Number of failures, kept or not.
    pub failure_count: usize,
    /// Wall time of the run.
    pub elapsed_s: f64,
}

impl CaseReport {
    fn new(case: &Case, run: RunKind) -> Self {
        CaseReport {
            case: case.name.clone(),
            run,
            prompt_len: case.ids.len(),
            positions_checked: 0,
            max_dlogit: 0.0,
            max_dlogit_pos: None,
            max_dlse: 0.0,
            tokens_matched: 0,
            tokens_checked: 0,
            teacher_forced_from: None,
            failures: Vec::new(),
            failure_count: 0,
            elapsed_s: 0.0,
        }
    }

    /// Whether every check of the run passed.
    pub fn passed(&self) -> bool {
        self.failure_count == 0
    }

    /// The first failure, if any.
    pub fn first_failure(&self) -> Option<&Failure> {
        self.failures.first()
    }

    fn fail(&mut self, pos: Option<usize>, kind: FailureKind) {
        self.failure_count += 1;
        if self.failures.len() < MAX_KEPT_FAILURES {
            self.failures.push(Failure { pos, kind });
        }
    }
}

impl fmt::Display for CaseReport {
    /// One line: verdict, worst errors, tokens, timing, and the first failure if any.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<16} {:<11} {}  max|dlogit| {:.3e}  max|dlse| {:.3e}  tokens {}/{}  {} pos  {:.2} s",
            self.case,
            self.run,
            if self.passed() { "PASS" } else { "FAIL" },
            self.max_dlogit,
            self.max_dlse,
            self.tokens_matched,
            self.tokens_checked,
            self.positions_checked,
            self.elapsed_s
        )?;
        if let Some(step) = self.teacher_forced_from {
            write!(f, "  teacher-forced from step {step}")?;
        }
        if let Some(first) = self.first_failure() {
            write!(f, "  {} failure(s), first: {first}", self.failure_count)?;
        }
        Ok(())
    }
}

/// The results of a set of runs.
#[derive(Debug)]
pub struct ParityReport {
    /// The tolerance every run was checked with.
    pub tolerance: Tolerance,
    /// One report per (case, run), in the order they ran.
    pub reports: Vec<CaseReport>,
}

impl ParityReport {
    /// Each case once, in order, with whether all its runs passed.
    pub fn case_verdicts(&self) -> Vec<(&str, bool)> {
        let mut verdicts: Vec<(&str, bool)> = Vec::new();
        for r in &self.reports {
            match verdicts.iter_mut().find(|(name, _)| *name == r.case) {
                Some((_, ok)) => *ok &= r.passed(),
                None => verdicts.push((&r.case, r.passed())),
            }
        }
        verdicts
    }

    /// Cases all of whose runs passed.
    pub fn cases_passed(&self) -> usize {
        self.case_verdicts().iter().filter(|v| v.1).count()
    }

    /// Cases with at least one failed run.
    pub fn cases_failed(&self) -> usize {
        self.case_verdicts().iter().filter(|v| !v.1).count()
    }

    /// Whether every run passed.
    pub fn passed(&self) -> bool {
        self.reports.iter().all(CaseReport::passed)
    }

    /// Largest top-k logit error over every run.
    pub fn max_dlogit(&self) -> f64 {
        self.reports
            .iter()
            .map(|r| r.max_dlogit)
            .fold(0.0, f64::max)
    }

    /// Largest log-sum-exp error over every run.
    pub fn max_dlse(&self) -> f64 {
        self.reports.iter().map(|r| r.max_dlse).fold(0.0, f64::max)
    }

    /// `parity: N cases passed, M failed, max |dlogit| X`.
    pub fn summary(&self) -> String {
        format!(
            "parity: {} cases passed, {} failed, max |dlogit| {:.3e}",
            self.cases_passed(),
            self.cases_failed(),
            self.max_dlogit()
        )
    }
}

/// Where a run is, for progress output on long cases.
#[derive(Clone, Debug)]
pub struct Progress<'a> {
    /// The case's name.
    pub case: &'a str,
    /// Which run.
    pub run: RunKind,
    /// The operation just finished (`prefill`, `extend`, `step`), or `start` (with `done` 0)
    /// before the first.
    pub op: &'static str,
    /// Operations finished so far.
    pub done: usize,
    /// Operations the run makes in all.
    pub total: usize,
    /// Seconds since the run started.
    pub elapsed_s: f64,
}

/// Receives progress and reports while a set runs (the CLI prints them; tests may ignore them).
pub trait Observer {
    /// Before a run's first backend operation and after each one.
    fn progress(&mut self, _progress: &Progress<'_>) {}
    /// After each run.
    fn report(&mut self, _report: &CaseReport) {}
}

/// An observer that ignores everything.
pub struct Quiet;

impl Observer for Quiet {}

/// Checks backends against golden cases within a tolerance.
#[derive(Clone, Debug)]
pub struct Checker {
    /// Logit and log-sum-exp tolerance; margins at most twice its bound count as near-ties.
    pub tolerance: Tolerance,
    /// Which runs each case gets.
    pub runs: Vec<RunKind>,
}

impl Default for Checker {
    fn default() -> Self {
        Checker::new(Tolerance::LOGITS)
    }
}

impl Checker {
    /// A checker with both runs.
    pub fn new(tolerance: Tolerance) -> Self {
        Checker {
            tolerance,
            runs: RunKind::ALL.to_vec(),
        }
    }

    /// Runs every case with every configured run.
    pub fn check_cases<'a, M: KvModel>(
        &self,
        model: &M,
        cases: impl IntoIterator<Item = &'a Case>,
        observer: &mut dyn Observer,
    ) -> ParityReport {
        let mut reports = Vec::new();
        for case in cases {
            for &run in &self.runs {
                let report = self.check_run(model, case, run, observer);
                observer.report(&report);
                reports.push(report);
            }
        }
        ParityReport {
            tolerance: self.tolerance,
            reports,
        }
    }

    /// Runs one case one way and checks every position it produces.
    pub fn check_run<M: KvModel>(
        &self,
        model: &M,
        case: &Case,
        run: RunKind,
        observer: &mut dyn Observer,
    ) -> CaseReport {
        let start = Instant::now();
        let vocab = model.config().vocab_size;
        let mut run_state = RunState::new(case, run, self.tolerance, vocab);
        let max_id = case.max_id();
        if max_id as usize >= vocab {
            run_state
                .report
                .fail(None, FailureKind::VocabMismatch { id: max_id, vocab });
        } else {
            let plan = Plan::new(case, run);
            let mut on_op = |op: &'static str, done: usize| {
                observer.progress(&Progress {
                    case: &case.name,
                    run,
                    op,
                    done,
                    total: plan.ops.len() + 1,
                    elapsed_s: start.elapsed().as_secs_f64(),
                });
            };
            on_op("start", 0);
            if let Err(stop) = plan.execute(model, &mut run_state, &mut on_op) {
                run_state.report.fail(
                    stop.pos,
                    FailureKind::Backend {
                        op: stop.op,
                        error: stop.error,
                    },
                );
            }
        }
        let mut report = run_state.report;
        report.elapsed_s = start.elapsed().as_secs_f64();
        report
    }
}

/// One backend operation after the prefill. Positions index `ids + greedy`.
#[derive(Clone, Debug, PartialEq)]
enum Op {
    /// Feed the tokens at `start..end`; produces the logits of position `end - 1`.
    Extend { start: usize, end: usize },
    /// Feed the token at `pos`; produces the logits of position `pos`.
    Step { pos: usize },
}

impl Op {
    fn range(&self) -> std::ops::Range<usize> {
        match *self {
            Op::Extend { start, end } => start..end,
            Op::Step { pos } => pos..pos + 1,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Op::Extend { .. } => "extend",
            Op::Step { .. } => "step",
        }
    }
}

/// The operations of one run: a prefill, then `ops`, forking a snapshot before `ops[fork]`.
#[derive(Debug, PartialEq)]
struct Plan {
    /// The prefill feeds positions `0..prefill`.
    prefill: usize,
    ops: Vec<Op>,
    fork: Option<usize>,
}

/// A backend error that stops a run.
struct Stop {
    op: &'static str,
    pos: Option<usize>,
    error: Error,
}

impl Plan {
    fn new(case: &Case, run: RunKind) -> Plan {
        let n = case.ids.len();
        let steps = case.greedy.len();
        let decode = (n..n + steps).map(|pos| Op::Step { pos });
        match run {
            RunKind::OneShot => Plan {
                prefill: n,
                ops: decode.collect(),
                fork: (steps > 0).then_some(steps / 2),
            },
            RunKind::Incremental => {
                // With one prompt token there is nothing to split: the fork moves to the decode.
                let h = (n / 2).max(1);
                let mut ops = Vec::new();
                if h + 1 < n {
                    ops.push(Op::Extend {
                        start: h,
                        end: n - 1,
                    });
                }
                if h < n {
                    ops.push(Op::Step { pos: n - 1 });
                }
                ops.extend(decode);
                let fork = (!ops.is_empty()).then_some(0);
                Plan {
                    prefill: h,
                    ops,
                    fork,
                }
            }
        }
    }

    fn execute<M: KvModel>(
        &self,
        model: &M,
        run: &mut RunState<'_>,
        on_op: &mut dyn FnMut(&'static str, usize),
    ) -> Result<(), Stop> {
        let case = run.case;
        let tokens =
            |range: std::ops::Range<usize>| -> Vec<u32> { range.map(|p| case.token(p)).collect() };
        let stop = |op, pos| move |error| Stop { op, pos, error };

        let last = self.prefill - 1;
        let (mut kv, next) = model
            .prefill(&case.ids[..self.prefill], Logits::Return)
            .map_err(stop("prefill", Some(last)))?;
        run.observe(last, &next);
        on_op("prefill", 1);

        for (i, op) in self.ops.iter().enumerate() {
            let range = op.range();
            let pos = range.end - 1;
            let ids = tokens(range);
            let original = if self.fork == Some(i) {
                let snapshot = model.snapshot(&kv).map_err(stop("snapshot", None))?;
                Some(std::mem::replace(&mut kv, snapshot))
            } else {
                None
            };
            let next = match op {
                Op::Extend { .. } => model.extend(&mut kv, &ids, Logits::Return),
                Op::Step { .. } => model.step(&mut kv, ids[0], Logits::Return),
            }
            .map_err(stop(op.name(), Some(pos)))?;
            run.observe(pos, &next);
            if let Some(mut original) = original {
                // Other tokens over (the first of) the positions the snapshot just wrote; see
                // the module doc. A few are enough: the snapshot reads all of them next.
                let other: Vec<u32> = ids
                    .iter()
                    .take(PERTURB_TOKENS)
                    .map(|&t| (t + 1) % run.vocab as u32)
                    .collect();
                model
                    .extend(&mut original, &other, Logits::Skip)
                    .map_err(stop("extend (perturbing the original)", None))?;
                model
                    .release(original)
                    .map_err(stop("release (the original)", None))?;
            }
            on_op(op.name(), i + 2);
        }
        model.release(kv).map_err(stop("release", None))
    }
}

/// The checks of one run in progress, position by position: what [`Checker::check_run`] applies
/// to every position it produces, usable on its own by callers that drive the model themselves
/// (the CLI's catalog demo).
pub struct RunState<'a> {
    case: &'a Case,
    tolerance: Tolerance,
    vocab: usize,
    report: CaseReport,
}

impl<'a> RunState<'a> {
    /// Starts the checks of `run` over `case` for a model with `vocab` logits.
    pub fn new(case: &'a Case, run: RunKind, tolerance: Tolerance, vocab: usize) -> Self {
        RunState {
            case,
            tolerance,
            vocab,
            report: CaseReport::new(case, run),
        }
    }

    /// The report so far.
    pub fn report(&self) -> &CaseReport {
        &self.report
    }

    /// Checks the logits and token the backend produced at `pos` of `ids + greedy`, as
    /// shared/goldens/FORMAT.md says.
    pub fn observe(&mut self, pos: usize, next: &Next) {
        let golden = self.case.position(pos);
        let report = &mut self.report;
        report.positions_checked += 1;
        let Some(logits) = next.logits.as_deref() else {
            report.fail(Some(pos), FailureKind::NoLogits);
            return;
        };
        if logits.len() != self.vocab {
            report.fail(
                Some(pos),
                FailureKind::LogitsLength {
                    got: logits.len(),
                    want: self.vocab,
                },
            );
            return;
        }

        for &(id, want) in &golden.top {
            let got = logits[id as usize];
            let d = error(got as f64, want);
            if d > report.max_dlogit {
                report.max_dlogit = d;
                report.max_dlogit_pos = Some(pos);
            }
            if !self.tolerance.accepts(got as f64, want) {
                report.fail(Some(pos), FailureKind::Logit { id, got, want });
            }
        }

        let lse = log_sum_exp(logits);
        report.max_dlse = report.max_dlse.max(error(lse, golden.lse));
        if !self.tolerance.accepts(lse, golden.lse) {
            report.fail(
                Some(pos),
                FailureKind::Lse {
                    got: lse,
                    want: golden.lse,
                },
            );
        }

        let best = argmax(logits);
        if next.token != best {
            report.fail(
                Some(pos),
                FailureKind::TokenNotArgmax {
                    token: next.token,
                    argmax: best,
                },
            );
        }

        // The oracle's greedy token is its top id, so at decode positions the greedy check is
        // the argmax check; elsewhere (prompt positions, the last decode position) argmax is.
        let (top_id, top_logit) = golden.top[0];
        let clear = golden.margin > 2.0 * self.tolerance.bound(top_logit);
        let n = self.case.ids.len();
        let step = (pos + 1)
            .checked_sub(n)
            .filter(|&s| s < self.case.greedy.len());
        if let Some(step) = step {
            let want = self.case.greedy[step];
            report.tokens_checked += 1;
            if next.token == want {
                report.tokens_matched += 1;
            } else if clear {
                report.fail(
                    Some(pos),
                    FailureKind::Greedy {
                        step,
                        got: next.token,
                        want,
                        margin: golden.margin,
                    },
                );
            } else if report.teacher_forced_from.is_none() {
                report.teacher_forced_from = Some(step);
            }
        } else if clear && next.token != top_id {
            report.fail(
                Some(pos),
                FailureKind::Argmax {
                    got: next.token,
                    want: top_id,
                    margin: golden.margin,
                },
            );
        }
    }
}

/// |got - want|, with NaN counted as infinitely wrong so it always shows in the maxima.
fn error(got: f64, want: f64) -> f64 {
    let d = (got - want).abs();
    if d.is_nan() {
        f64::INFINITY
    } else {
        d
    }
}

/// `ln(sum(exp(x)))` over all of `logits`, accumulated in f64; NaN if any logit is NaN.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    if logits.iter().any(|x| x.is_nan()) {
        return f64::NAN;
    }
    let max = logits
        .iter()
        .map(|&x| x as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    if !max.is_finite() {
        return max;
    }
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln()
}

#[cfg(test)]
mod tests;
