//! Golden sets and parity checks for kvsnap backends.
//!
//! [`GoldenSet::load`] reads an oracle golden set (`shared/goldens/FORMAT.md`);
//! [`Checker::check_cases`] runs its cases through any [`kvsnap_contract::KvModel`] — a one-shot
//! prefill and an incremental prefill/extend/step, each with a snapshot fork — and returns a
//! [`ParityReport`] of per-position logit, log-sum-exp and greedy-token agreement.

pub mod check;
pub mod golden;
pub mod props;

pub use check::{
    log_sum_exp, CaseReport, Checker, Failure, FailureKind, Observer, ParityReport, Progress,
    Quiet, RunKind, RunState,
};
pub use golden::{Case, GoldenError, GoldenSet, Position};
