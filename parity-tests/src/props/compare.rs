//! How one result is compared with a ground truth, and what a divergence says.

use std::fmt;

use kvsnap_contract::{argmax, Next, Tolerance};

use crate::check::log_sum_exp;
use crate::golden::Position;

/// The first disagreement a script run found: which backend, which op, which slot, which
/// position, against which ground truth, and the numbers.
#[derive(Clone, Debug, PartialEq)]
pub struct Divergence {
    /// The backend under test.
    pub backend: &'static str,
    /// Index of the op in the script; `None` for the driver's closing checks.
    pub op_index: Option<usize>,
    /// The op as Rust source (or what the closing check did).
    pub op: String,
    /// The slot the op acted on or created.
    pub slot: Option<usize>,
    /// The first diverging position of the slot's history: the position whose logits
    /// (predicting the token after it) disagree. `None` when the divergence is not about a
    /// position (an error where none was due, or the wrong error).
    pub position: Option<usize>,
    /// What the result was compared with.
    pub truth: String,
    /// The numbers.
    pub detail: String,
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "backend `{}`: ", self.backend)?;
        match self.op_index {
            Some(i) => write!(f, "op #{i} `{}`", self.op)?,
            None => write!(f, "{}", self.op)?,
        }
        if let Some(slot) = self.slot {
            write!(f, " on slot {slot}")?;
        }
        match self.position {
            Some(p) => write!(
                f,
                ": first diverging position {p} (history length {}, the logits predict token {})",
                p + 1,
                p + 1
            )?,
            None => f.write_str(": ")?,
        }
        write!(f, "\n  against {}\n  {}", self.truth, self.detail)
    }
}

/// Greedy margin of `logits`: best minus second best.
fn margin(logits: &[f32]) -> f64 {
    let best = argmax(logits) as usize;
    let second = logits
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != best)
        .map(|(_, &v)| v as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    logits[best] as f64 - second
}

/// Logits of a result that must carry them.
pub(crate) fn logits_of(next: &Next) -> Result<&[f32], String> {
    next.logits
        .as_deref()
        .ok_or_else(|| "logits were requested but not returned".to_string())
}

/// Checks the contract's own promises about one result: logits of vocab length, token their
/// argmax.
pub(crate) fn well_formed(next: &Next, vocab: usize) -> Result<(), String> {
    let logits = logits_of(next)?;
    if logits.len() != vocab {
        return Err(format!(
            "{} logits returned, the vocab has {vocab}",
            logits.len()
        ));
    }
    let best = argmax(logits);
    if next.token != best {
        return Err(format!(
            "returned token {} is not the argmax {best} of the returned logits",
            next.token
        ));
    }
    Ok(())
}

/// Every logit within `tol` of the truth's, and the same token unless the truth's greedy
/// margin is a near-tie (at most twice the tolerance), where float32 may break either way.
/// Returns the largest logit difference.
pub(crate) fn within_tolerance(got: &Next, want: &Next, tol: Tolerance) -> Result<f64, String> {
    let (g, w) = (logits_of(got)?, logits_of(want)?);
    if g.len() != w.len() {
        return Err(format!("{} logits, the truth has {}", g.len(), w.len()));
    }
    let mut worst: Option<(usize, f64)> = None;
    let mut max_d = 0.0f64;
    for (i, (&a, &b)) in g.iter().zip(w).enumerate() {
        let d = (a as f64 - b as f64).abs();
        let d = if d.is_nan() { f64::INFINITY } else { d };
        max_d = max_d.max(d);
        if !tol.accepts(a as f64, b as f64) && worst.is_none() {
            worst = Some((i, d));
        }
    }
    if let Some((i, d)) = worst {
        return Err(format!(
            "logit[{i}] {:?} vs {:?}: |d| {d:.3e} > bound {:.1e} (first of the vocab out of \
             tolerance; max |d| over the vocab {max_d:.3e})",
            g[i],
            w[i],
            tol.bound(w[i] as f64)
        ));
    }
    let m = margin(w);
    if got.token != want.token && m > 2.0 * tol.bound(w[want.token as usize] as f64) {
        return Err(format!(
            "token {} vs {} at a clear margin {m:.4} (max |d| logit {max_d:.3e})",
            got.token, want.token
        ));
    }
    Ok(max_d)
}

/// Token and every logit bit-for-bit equal.
pub(crate) fn bit_exact(got: &Next, want: &Next) -> Result<(), String> {
    let (g, w) = (logits_of(got)?, logits_of(want)?);
    if g.len() != w.len() {
        return Err(format!("{} logits, the truth has {}", g.len(), w.len()));
    }
    let differing = g
        .iter()
        .zip(w)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    if let Some(i) = (0..g.len()).find(|&i| g[i].to_bits() != w[i].to_bits()) {
        return Err(format!(
            "logit[{i}] {:?} (bits {:#010x}) vs {:?} (bits {:#010x}); {differing} of {} logits \
             differ; tokens {} vs {}",
            g[i],
            g[i].to_bits(),
            w[i],
            w[i].to_bits(),
            g.len(),
            got.token,
            want.token
        ));
    }
    if got.token != want.token {
        return Err(format!("token {} vs {}", got.token, want.token));
    }
    Ok(())
}

/// The oracle's top-k logits and log-sum-exp within `tol`, and its greedy token unless its
/// margin is a near-tie. Returns the largest top-k logit difference.
pub(crate) fn against_golden(got: &Next, want: &Position, tol: Tolerance) -> Result<f64, String> {
    let g = logits_of(got)?;
    let mut max_d = 0.0f64;
    for &(id, logit) in &want.top {
        let Some(&v) = g.get(id as usize) else {
            return Err(format!(
                "golden id {id} is outside the {} returned logits",
                g.len()
            ));
        };
        let d = (v as f64 - logit).abs();
        max_d = max_d.max(if d.is_nan() { f64::INFINITY } else { d });
        if !tol.accepts(v as f64, logit) {
            return Err(format!(
                "logit of id {id}: {v:?} vs oracle {logit:.6}: |d| {d:.3e} > bound {:.1e}",
                tol.bound(logit)
            ));
        }
    }
    let lse = log_sum_exp(g);
    if !tol.accepts(lse, want.lse) {
        return Err(format!(
            "log-sum-exp {lse:.6} vs oracle {:.6}: |d| {:.3e}",
            want.lse,
            (lse - want.lse).abs()
        ));
    }
    let best = want.top[0].0;
    if got.token != best && want.margin > 2.0 * tol.bound(want.top[0].1) {
        return Err(format!(
            "token {} vs oracle {best} at a clear margin {:.4}",
            got.token, want.margin
        ));
    }
    Ok(max_d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn next(logits: Vec<f32>) -> Next {
        Next {
            token: argmax(&logits),
            logits: Some(logits),
        }
    }

    #[test]
    fn one_ulp_passes_the_tolerance_but_not_bit_exactness() {
        let a = next(vec![1.0, 3.0, 2.0]);
        let b = next(vec![1.0, f32::from_bits(3.0f32.to_bits() + 1), 2.0]);
        assert!(within_tolerance(&a, &b, Tolerance::LOGITS).is_ok());
        let e = bit_exact(&a, &b).unwrap_err();
        assert!(
            e.starts_with("logit[1] 3.0 (bits 0x40400000) vs 3.0000002"),
            "{e}"
        );
    }

    #[test]
    fn tokens_may_differ_only_at_a_near_tie() {
        let tol = Tolerance::LOGITS;
        let tie = next(vec![1.0, 1.001, 0.0]);
        let flipped = Next {
            token: 0,
            logits: tie.logits.clone(),
        };
        assert!(within_tolerance(&flipped, &tie, tol).is_ok());
        let clear = next(vec![1.0, 1.5, 0.0]);
        let flipped = Next {
            token: 0,
            logits: clear.logits.clone(),
        };
        assert!(within_tolerance(&flipped, &clear, tol)
            .unwrap_err()
            .contains("clear margin"));
        assert!(within_tolerance(&next(vec![1.0, 1.5, 0.01]), &clear, tol)
            .unwrap_err()
            .starts_with("logit[2]"));
    }

    #[test]
    fn well_formed_results() {
        assert!(well_formed(&next(vec![0.0, 1.0]), 2).is_ok());
        assert!(well_formed(&next(vec![0.0, 1.0]), 3).is_err());
        let wrong = Next {
            token: 0,
            logits: Some(vec![0.0, 1.0]),
        };
        assert!(well_formed(&wrong, 2)
            .unwrap_err()
            .contains("not the argmax"));
    }
}
