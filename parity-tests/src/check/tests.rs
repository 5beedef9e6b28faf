//! Tests of the checker itself, against a table model whose logits the test controls.
//!
//! Each planted fault must make the checker fail at the right position, and tolerated
//! disagreements (a near-tie broken the other way) must pass.

use std::path::Path;
use std::sync::{Arc, Mutex};

use kvsnap_contract::{Error, KvModel, Logits, ModelConfig, Next, Result, Tolerance};

use super::*;
use crate::golden::{Case, Position};

const VOCAB: usize = 32;
const TOP_K: usize = 4;
const STEPS: usize = 16;

/// Replays `rows[pos]` at each position while the history equals `seq`; any other history
/// gets visibly wrong logits, so feeding a wrong token or a leaky snapshot shows up.
struct Table {
    cfg: ModelConfig,
    seq: Vec<u32>,
    rows: Vec<Vec<f32>>,
    /// Return this token instead of the argmax at this position.
    wrong_token: Option<(usize, u32)>,
    /// Snapshots share the token buffer with their original (updated in place, as an IREE
    /// buffer would be) and copy only the length.
    shallow_snapshot: bool,
    /// Calls that would grow a state past this many tokens fail.
    capacity: usize,
}

struct TableKv {
    buf: Arc<Mutex<Vec<u32>>>,
    len: usize,
}

impl Table {
    fn new(case: &Case, rows: Vec<Vec<f32>>) -> Self {
        let cfg = ModelConfig::from_json(
            &format!(
                r#"{{"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                    "intermediate_size": 8, "vocab_size": {VOCAB}}}"#
            ),
            Path::new("table.json"),
        )
        .unwrap();
        Table {
            cfg,
            seq: case.ids.iter().chain(&case.greedy).copied().collect(),
            rows,
            wrong_token: None,
            shallow_snapshot: false,
            capacity: usize::MAX,
        }
    }

    fn next(&self, kv: &TableKv, logits: Logits) -> Next {
        let pos = kv.len - 1;
        let history = kv.buf.lock().unwrap()[..kv.len].to_vec();
        let mut row = self.rows[pos].clone();
        if history[..] != self.seq[..kv.len] {
            row.iter_mut().for_each(|x| *x = -*x);
        }
        let token = match self.wrong_token {
            Some((p, token)) if p == pos => token,
            _ => argmax(&row),
        };
        Next {
            token,
            logits: (logits == Logits::Return).then_some(row),
        }
    }
}

impl KvModel for Table {
    type Kv = TableKv;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn backend(&self) -> &'static str {
        "table"
    }

    fn prefill(&self, ids: &[u32], logits: Logits) -> Result<(TableKv, Next)> {
        let mut kv = TableKv {
            buf: Arc::new(Mutex::new(Vec::new())),
            len: 0,
        };
        let next = self.extend(&mut kv, ids, logits)?;
        Ok((kv, next))
    }

    fn extend(&self, kv: &mut TableKv, ids: &[u32], logits: Logits) -> Result<Next> {
        if kv.len + ids.len() > self.capacity {
            return Err(Error::ContextOverflow {
                op: "extend",
                have: kv.len,
                adding: ids.len(),
                capacity: self.capacity,
            });
        }
        {
            // Write in place over whatever the buffer holds past `len`, as a device would.
            let mut buf = kv.buf.lock().unwrap();
            for (i, &id) in ids.iter().enumerate() {
                if kv.len + i < buf.len() {
                    buf[kv.len + i] = id;
                } else {
                    buf.push(id);
                }
            }
        }
        kv.len += ids.len();
        Ok(self.next(kv, logits))
    }

    fn snapshot(&self, kv: &TableKv) -> Result<TableKv> {
        let buf = if self.shallow_snapshot {
            kv.buf.clone()
        } else {
            Arc::new(Mutex::new(kv.buf.lock().unwrap()[..kv.len].to_vec()))
        };
        Ok(TableKv { buf, len: kv.len })
    }

    fn len(&self, kv: &TableKv) -> usize {
        kv.len
    }
}

/// Deterministic rows in [-4, 4] whose best value leads the second by at least 0.5.
fn rows(len: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            let mut row: Vec<f32> = (0..VOCAB)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
                })
                .collect();
            let best = argmax(&row) as usize;
            row[best] += 0.5;
            row
        })
        .collect()
}

/// The oracle's view of `rows` for the prompt `ids`: greedy tokens and per-position goldens.
fn golden(name: &str, ids: &[u32], rows: &[Vec<f32>]) -> Case {
    let n = ids.len();
    let greedy: Vec<u32> = (0..STEPS).map(|i| argmax(&rows[n - 1 + i])).collect();
    let positions = rows
        .iter()
        .enumerate()
        .map(|(pos, row)| {
            let mut order: Vec<u32> = (0..VOCAB as u32).collect();
            order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            let top: Vec<(u32, f64)> = order[..TOP_K]
                .iter()
                .map(|&id| (id, row[id as usize] as f64))
                .collect();
            Position {
                pos,
                margin: top[0].1 - top[1].1,
                lse: log_sum_exp(row),
                top,
            }
        })
        .collect();
    Case {
        name: name.into(),
        text: String::new(),
        ids: ids.to_vec(),
        greedy,
        greedy_matches_nocache_argmax: Some(true),
        positions,
    }
}

/// A case with an `n`-token prompt and the table model that reproduces it exactly.
fn setup(n: usize) -> (Case, Table) {
    let rows = rows(n + STEPS, n as u64);
    let mut ids = vec![2];
    ids.extend((1..n).map(|i| (i * 7 % VOCAB) as u32));
    let case = golden("c", &ids, &rows);
    let model = Table::new(&case, rows);
    (case, model)
}

fn check(model: &Table, case: &Case, run: RunKind) -> CaseReport {
    Checker::default().check_run(model, case, run, &mut Quiet)
}

fn failure_kinds(report: &CaseReport) -> Vec<(Option<usize>, String)> {
    report
        .failures
        .iter()
        .map(|f| {
            let kind = format!("{:?}", f.kind);
            (f.pos, kind.split([' ', '{']).next().unwrap().to_string())
        })
        .collect()
}

#[test]
fn plans_follow_the_brief() {
    let (case, _) = setup(6);
    let one_shot = Plan::new(&case, RunKind::OneShot);
    assert_eq!(one_shot.prefill, 6);
    assert_eq!(one_shot.ops.len(), 16);
    assert_eq!(one_shot.ops[8], Op::Step { pos: 14 }, "fork after step 8");
    assert_eq!(one_shot.fork, Some(8));

    let incremental = Plan::new(&case, RunKind::Incremental);
    assert_eq!(incremental.prefill, 3);
    assert_eq!(incremental.ops[0], Op::Extend { start: 3, end: 5 });
    assert_eq!(incremental.ops[1], Op::Step { pos: 5 });
    assert_eq!(incremental.ops[2], Op::Step { pos: 6 });
    assert_eq!(incremental.ops.len(), 18);
    assert_eq!(incremental.fork, Some(0));

    let (case, _) = setup(2);
    let plan = Plan::new(&case, RunKind::Incremental);
    assert_eq!((plan.prefill, &plan.ops[0]), (1, &Op::Step { pos: 1 }));
    let (case, _) = setup(1);
    let plan = Plan::new(&case, RunKind::Incremental);
    assert_eq!((plan.prefill, &plan.ops[0]), (1, &Op::Step { pos: 1 }));
}

#[test]
fn exact_model_passes_every_run_and_length() {
    for n in [1, 2, 3, 6, 11] {
        let (case, model) = setup(n);
        for run in RunKind::ALL {
            let r = check(&model, &case, run);
            assert!(r.passed(), "n={n} {run}: {r}");
            assert_eq!(r.max_dlogit, 0.0);
            assert!(r.max_dlse < 1e-12, "{}", r.max_dlse);
            assert_eq!((r.tokens_matched, r.tokens_checked), (STEPS, STEPS));
            assert_eq!(r.teacher_forced_from, None);
        }
        let positions = |run| check(&model, &case, run).positions_checked;
        assert_eq!(positions(RunKind::OneShot), STEPS + 1);
        let incremental_prompt = match n {
            1 => 1,
            2 => 2,
            _ => 3,
        };
        assert_eq!(positions(RunKind::Incremental), STEPS + incremental_prompt);
    }
}

#[test]
fn planted_wrong_logit_fails_where_it_is_produced() {
    let (case, mut model) = setup(6);
    let pos = 6 + 3;
    let id = case.positions[pos].top[2].0;
    model.rows[pos][id as usize] += 0.003;
    for run in RunKind::ALL {
        let r = check(&model, &case, run);
        assert!(!r.passed(), "{run}: {r}");
        assert_eq!(
            failure_kinds(&r),
            vec![(Some(pos), "Logit".to_string())],
            "{run}"
        );
        assert!((r.max_dlogit - 0.003).abs() < 1e-6, "{}", r.max_dlogit);
        assert_eq!(r.max_dlogit_pos, Some(pos));
    }

    // The end of the first half's prefill is produced by the incremental run only.
    let (case, mut model) = setup(6);
    let id = case.positions[2].top[0].0;
    model.rows[2][id as usize] -= 0.01;
    assert!(check(&model, &case, RunKind::OneShot).passed());
    let r = check(&model, &case, RunKind::Incremental);
    assert_eq!(failure_kinds(&r)[0], (Some(2), "Logit".to_string()));
}

#[test]
fn planted_wrong_lse_fails() {
    let (case, mut model) = setup(6);
    let pos = 6 + 5;
    // Raise every id outside the top-k to just below the k-th: the top-k logits stay exact, the
    // distribution does not.
    let top = &case.positions[pos].top;
    let below = top[TOP_K - 1].1 as f32 - 0.01;
    for (id, x) in model.rows[pos].iter_mut().enumerate() {
        if top.iter().all(|t| t.0 as usize != id) {
            *x = below;
        }
    }
    for run in RunKind::ALL {
        let r = check(&model, &case, run);
        assert_eq!(
            failure_kinds(&r),
            vec![(Some(pos), "Lse".to_string())],
            "{run}: {r}"
        );
        assert_eq!(r.max_dlogit, 0.0);
        assert!(r.max_dlse > 2e-3);
    }
}

#[test]
fn planted_wrong_greedy_token_fails() {
    let (case, mut model) = setup(6);
    let pos = 6 + 2;
    let step = pos + 1 - 6;
    let want = case.greedy[step];
    model.wrong_token = Some((pos, (want + 1) % VOCAB as u32));
    for run in RunKind::ALL {
        let r = check(&model, &case, run);
        assert!(!r.passed(), "{run}: {r}");
        assert!(
            r.failures.iter().any(|f| f.pos == Some(pos)
                && matches!(f.kind, FailureKind::Greedy { step: s, want: w, .. } if s == step && w == want)),
            "{run}: {r}"
        );
        assert_eq!((r.tokens_matched, r.tokens_checked), (STEPS - 1, STEPS));
        assert_eq!(
            r.teacher_forced_from, None,
            "a clear margin is a failure, not a near-tie"
        );
    }

    // A wrong token at a prompt position (the end of the incremental run's extend) is an
    // argmax failure.
    let (case, mut model) = setup(6);
    let want = case.positions[4].top[0].0;
    model.wrong_token = Some((4, (want + 1) % VOCAB as u32));
    assert!(check(&model, &case, RunKind::OneShot).passed());
    let r = check(&model, &case, RunKind::Incremental);
    assert!(
        r.failures.iter().any(|f| f.pos == Some(4)
            && matches!(f.kind, FailureKind::Argmax { want: w, .. } if w == want)),
        "{r}"
    );
}

#[test]
fn near_tie_flipped_token_passes_with_teacher_forcing() {
    let (mut case, mut model) = setup(6);
    let pos = 6 + 4;
    let step = pos + 1 - 6;
    // The oracle's best two are 0.001 apart (< 2 * 2e-3); the backend has them the other way
    // round, each within 1e-3 of the oracle.
    let (a, b) = (case.positions[pos].top[0].0, case.positions[pos].top[1].0);
    let x = case.positions[pos].top[0].1 as f32 + 1.0;
    model.rows[pos][a as usize] = x + 0.0005;
    model.rows[pos][b as usize] = x - 0.0005;
    case = golden("c", &case.ids, &model.rows);
    assert!(case.positions[pos].margin <= 4e-3 && case.greedy[step] == a);
    model.seq = case.ids.iter().chain(&case.greedy).copied().collect();
    model.rows[pos][a as usize] = x - 0.0005;
    model.rows[pos][b as usize] = x + 0.0005;

    for run in RunKind::ALL {
        let r = check(&model, &case, run);
        // The table model answers any history but the oracle's with wrong logits, so this pass
        // also proves the checker fed the oracle's token after the flip.
        assert!(r.passed(), "{run}: {r}");
        assert_eq!(r.teacher_forced_from, Some(step));
        assert_eq!((r.tokens_matched, r.tokens_checked), (STEPS - 1, STEPS));
        assert!((r.max_dlogit - 1e-3).abs() < 1e-6, "{}", r.max_dlogit);
    }

    // The same flip with a margin the tolerance calls clear is a failure.
    let tight = Checker::new(Tolerance::abs(1e-4));
    let r = tight.check_run(&model, &case, RunKind::OneShot, &mut Quiet);
    assert!(r
        .failures
        .iter()
        .any(|f| matches!(f.kind, FailureKind::Greedy { step: s, .. } if s == step)));
}

#[test]
fn leaky_snapshot_fails() {
    let (case, mut model) = setup(6);
    model.shallow_snapshot = true;
    for run in RunKind::ALL {
        let r = check(&model, &case, run);
        assert!(!r.passed(), "{run}: {r}");
        assert!(matches!(
            r.first_failure().unwrap().kind,
            FailureKind::Logit { .. }
        ));
    }
}

#[test]
fn backend_errors_stop_the_run_and_fail_it() {
    let (case, mut model) = setup(6);
    model.capacity = 6 + 4;
    let r = check(&model, &case, RunKind::OneShot);
    assert_eq!(r.failure_count, 1, "{r}");
    let f = r.first_failure().unwrap();
    assert_eq!(f.pos, Some(10));
    assert!(matches!(
        &f.kind,
        FailureKind::Backend {
            op: "step",
            error: Error::ContextOverflow { .. }
        }
    ));
    assert!(
        f.to_string()
            .contains("step failed: extend: context overflow"),
        "{f}"
    );
    assert_eq!(r.positions_checked, 1 + 4);
}

#[test]
fn missing_or_misshapen_logits_fail() {
    struct NoLogits(Table);
    impl KvModel for NoLogits {
        type Kv = TableKv;
        fn config(&self) -> &ModelConfig {
            &self.0.cfg
        }
        fn backend(&self) -> &'static str {
            "no-logits"
        }
        fn prefill(&self, ids: &[u32], _: Logits) -> Result<(TableKv, Next)> {
            self.0.prefill(ids, Logits::Skip)
        }
        fn extend(&self, kv: &mut TableKv, ids: &[u32], _: Logits) -> Result<Next> {
            self.0.extend(kv, ids, Logits::Skip)
        }
        fn snapshot(&self, kv: &TableKv) -> Result<TableKv> {
            self.0.snapshot(kv)
        }
        fn len(&self, kv: &TableKv) -> usize {
            kv.len
        }
    }
    let (case, model) = setup(4);
    let r = Checker::default().check_run(&NoLogits(model), &case, RunKind::OneShot, &mut Quiet);
    assert_eq!(r.failure_count, STEPS + 1);
    assert!(matches!(r.failures[0].kind, FailureKind::NoLogits));

    let (case, mut model) = setup(4);
    model.rows[5].push(0.0);
    let r = check(&model, &case, RunKind::OneShot);
    assert_eq!(
        failure_kinds(&r),
        vec![(Some(5), "LogitsLength".to_string())]
    );
}

#[test]
fn golden_ids_outside_the_vocab_fail_before_running() {
    let (mut case, model) = setup(4);
    case.positions[7].top[3].0 = VOCAB as u32 + 5;
    let r = check(&model, &case, RunKind::Incremental);
    assert_eq!(r.positions_checked, 0);
    assert!(matches!(
        r.first_failure().unwrap().kind,
        FailureKind::VocabMismatch { id, vocab: VOCAB } if id == VOCAB as u32 + 5
    ));
}

#[test]
fn nan_logits_fail_and_show_as_infinite_error() {
    let (case, mut model) = setup(4);
    let id = case.positions[4].top[1].0;
    model.rows[4][id as usize] = f32::NAN;
    let r = check(&model, &case, RunKind::OneShot);
    assert!(!r.passed());
    assert!(r.max_dlogit.is_infinite() && r.max_dlse.is_infinite());
}

#[test]
fn parity_report_counts_a_case_as_passed_iff_all_its_runs_pass() {
    let (good, good_model) = setup(5);
    let (mut bad, _) = setup(5);
    bad.name = "bad".into();
    // Planted in a position only the incremental run produces.
    bad.positions[1].lse += 0.5;

    struct Collect(Vec<String>, usize);
    impl Observer for Collect {
        fn progress(&mut self, p: &Progress<'_>) {
            assert!(p.done <= p.total && (p.done == 0) == (p.op == "start"));
            self.1 += 1;
        }
        fn report(&mut self, r: &CaseReport) {
            self.0.push(format!("{}/{}", r.case, r.run));
        }
    }
    let mut seen = Collect(Vec::new(), 0);
    let report = Checker::default().check_cases(&good_model, [&good, &bad], &mut seen);
    assert_eq!(
        seen.0,
        [
            "c/one-shot",
            "c/incremental",
            "bad/one-shot",
            "bad/incremental"
        ]
    );
    assert_eq!(seen.1, 2 * (18 + 20));
    assert_eq!(report.case_verdicts(), vec![("c", true), ("bad", false)]);
    assert!(report.reports[2].passed() && !report.reports[3].passed());
    assert_eq!((report.cases_passed(), report.cases_failed()), (1, 1));
    assert!(!report.passed());
    assert_eq!(
        report.summary(),
        "parity: 1 cases passed, 1 failed, max |dlogit| 0.000e0"
    );
    let line = report.reports[3].to_string();
    assert!(
        line.contains("FAIL") && line.contains("pos 1: lse"),
        "{line}"
    );
}

#[test]
fn run_names_round_trip() {
    for run in RunKind::ALL {
        assert_eq!(run.name().parse::<RunKind>().unwrap(), run);
    }
    assert!("both"
        .parse::<RunKind>()
        .unwrap_err()
        .contains("one-shot, incremental"));
}

#[test]
fn log_sum_exp_is_stable() {
    assert!((log_sum_exp(&[0.0, 0.0]) - 2f64.ln()).abs() < 1e-15);
    assert!((log_sum_exp(&[1000.0, 1000.0]) - (1000.0 + 2f64.ln())).abs() < 1e-9);
    assert!(log_sum_exp(&[1.0, f32::NAN]).is_nan());
}
