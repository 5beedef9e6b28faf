//! The tied LM head's greedy token from a quarter-size copy of its weights, exactly.
//!
//! A decode step reads every weight once, and the tied head is most of them: Gemma 3 270M's
//! `[262144, 640]` f32 table is 671 MB of the 1.07 GB a step reads. When only the argmax is
//! wanted ([`Logits::Skip`](kvsnap_contract::Logits)), [`TiedHead`] scores every row with its
//! weights rounded to int8 with one scale per row (a quarter of the bytes), bounds each row's
//! error, and recomputes in f32 only the rows whose upper bound reaches the best lower bound.
//! The token is the one the full f32 head picks, bit for bit, ties to the lowest id included:
//! the f32 recomputation is the dot product [`matvec`](crate::kernels::matvec) runs.
//!
//! # The bound
//! For a row `w`, its rounding `a = s q` and the normalised hidden state `h` of `n` elements,
//! the f32 results `e ≈ w·h` and `ã ≈ s (q·h)`, summed in any order (`γ = m u / (1 - m u)`
//! with `m = n + 1` roundings, the scaling included, and `u = 2^-24`), satisfy
//! `|e - w·h| <= γ |w| |h|` and `|ã - a·h| <= γ |a| |h| <= γ (|w| + |w - a|) |h|`, and
//! `|w·h - a·h| <= |w - a| |h|` (Cauchy-Schwarz), so
//! `|e - ã| <= |h| ((1 + γ) |w - a| + 2 γ |w|) <= |h| slack` with
//! `slack = 1.01 |w - a| + 4 γ |w|`: twice the rounding term and 1 % more residual, margin for
//! rounding `slack` and `|h|` themselves.
//!
//! With `b_r = |h| slack_r` and `L = max_r (ã_r - b_r)`: the row that attains `L` has
//! `e >= L`, so the largest logit is at least `L`; a row with `ã_r + b_r < L` has `e_r < L`:
//! it can neither be the maximum nor tie with it. The argmax of the remaining rows' exact
//! logits, lowest id first, is the argmax of all of them. On Gemma 3 270M's real weights one
//! to a few rows remain (docs/BENCHMARKS.md, twelfth pass).

use rayon::prelude::*;

use crate::kernels::{dot, matvec_q8};

/// The int8 copy of a tied head's `[vocab, hidden]` table and each row's error bound.
pub struct TiedHead {
    hidden: usize,
    /// `[vocab, hidden]`: `round(w / scale)` of each weight, in [-127, 127].
    q: Vec<i8>,
    /// `[vocab]`: each row's `max |w| / 127`.
    scale: Vec<f32>,
    /// `[vocab]`: `|e - ã| <= |h| slack` for the row's f32 and approximate logits.
    slack: Vec<f32>,
    /// Whether every bound is finite (so every weight is): the bound assumes it.
    finite: bool,
}

impl TiedHead {
    /// Rounds `table` (`[vocab, hidden]`, the f32 head) and bounds each row's error, in
    /// parallel: one read of the table.
    pub fn new(table: &[f32], hidden: usize) -> Self {
        assert!(
            hidden > 0 && table.len().is_multiple_of(hidden),
            "TiedHead: table"
        );
        let vocab = table.len() / hidden;
        let mu = (hidden + 1) as f64 * f64::powi(2.0, -24);
        let gamma = mu / (1.0 - mu);
        let mut q = vec![0i8; table.len()];
        let (mut scale, mut slack) = (vec![0f32; vocab], vec![0f32; vocab]);
        q.par_chunks_mut(hidden)
            .zip(table.par_chunks(hidden))
            .zip(scale.par_iter_mut().zip(slack.par_iter_mut()))
            .for_each(|((q, w), (scale, slack))| {
                let s = w.iter().fold(0f32, |m, w| m.max(w.abs())) / 127.0;
                let (mut residual, mut norm) = (0f64, 0f64);
                for (q, &w) in q.iter_mut().zip(w) {
                    *q = if s > 0.0 {
                        (w / s).round().clamp(-127.0, 127.0) as i8
                    } else {
                        0
                    };
                    let d = f64::from(w) - f64::from(s) * f64::from(*q);
                    residual += d * d;
                    norm += f64::from(w) * f64::from(w);
                }
                let bound = 1.01 * residual.sqrt() + 4.0 * gamma * norm.sqrt();
                *scale = s;
                // Rounded up: `as f32` rounds to nearest, within 2^-24 relative.
                *slack = (bound * (1.0 + 1e-6)) as f32;
            });
        // A weight that is not finite makes its row's norm, and so its bound, not finite.
        let finite = slack.iter().all(|s| s.is_finite());
        TiedHead {
            hidden,
            q,
            scale,
            slack,
            finite,
        }
    }

    /// The argmax over rows of `table . h` (lowest id on a tie), where `table` is the f32 head
    /// this was built from; `None` where the bound does not hold (a weight, `h` or a score not
    /// finite): the caller then computes the full logits.
    ///
    /// # Shapes
    /// `table`: `[vocab, hidden]`; `h`: `[hidden]`.
    pub fn argmax(&self, table: &[f32], h: &[f32]) -> Option<u32> {
        let (hidden, vocab) = (self.hidden, self.slack.len());
        assert_eq!(table.len(), vocab * hidden, "TiedHead::argmax: table");
        assert_eq!(h.len(), hidden, "TiedHead::argmax: h");
        let norm = h
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            .sqrt();
        if !self.finite || !norm.is_finite() {
            return None;
        }
        let mut scores = vec![0.0; vocab];
        matvec_q8(&mut scores, h, &self.q, &self.scale, hidden, vocab);
        let bound = |(&a, &s): (&f32, &f32)| (f64::from(a), norm * f64::from(s));
        // NaN where a score is not finite: it survives `max` below only as the result.
        let lower = scores
            .par_iter()
            .zip(&self.slack)
            .map(bound)
            .map(|(a, b)| if a.is_finite() { a - b } else { f64::NAN })
            .reduce(
                || f64::NEG_INFINITY,
                |x, y| {
                    if x.is_nan() || y.is_nan() {
                        f64::NAN
                    } else {
                        x.max(y)
                    }
                },
            );
        if !lower.is_finite() {
            return None;
        }
        let rows: Vec<usize> = scores
            .par_iter()
            .zip(&self.slack)
            .enumerate()
            .filter(|&(_, r)| {
                let (a, b) = bound(r);
                a + b >= lower
            })
            .map(|(r, _)| r)
            .collect();
        let mut best: Option<(usize, f32)> = None;
        for r in rows {
            let e = dot(&table[r * hidden..(r + 1) * hidden], h);
            if best.is_none_or(|(_, b)| e > b) {
                best = Some((r, e));
            }
        }
        best.map(|(r, _)| r as u32)
    }

    /// `[vocab, hidden]`: each weight's int8 rounding (`round(w / scale)`).
    pub fn q(&self) -> &[i8] {
        &self.q
    }

    /// `[vocab]`: each row's scale (`max |w| / 127`).
    pub fn scale(&self) -> &[f32] {
        &self.scale
    }

    /// `[vocab]`: each row's bound, `|e - ã| <= |h| slack` (module documentation).
    pub fn slack(&self) -> &[f32] {
        &self.slack
    }

    /// Whether every weight is finite and every bound representable (else the bound says
    /// nothing and [`TiedHead::argmax`] always returns `None`).
    pub fn is_finite(&self) -> bool {
        self.finite
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::matvec;
    use crate::kernels::tests::values;
    use kvsnap_contract::argmax;

    fn full_argmax(table: &[f32], h: &[f32], hidden: usize) -> u32 {
        let vocab = table.len() / hidden;
        let mut logits = vec![0.0; vocab];
        matvec(&mut logits, h, table, hidden, vocab);
        argmax(&logits)
    }

    /// Every row's f32 logit lies within the bound of its approximate score.
    #[test]
    fn bound_holds_for_every_row() {
        let (hidden, vocab) = (640, 3000);
        let mut table = values(vocab * hidden, 11);
        // Rows of very different scales, one all zero, one exactly representable (if its
        // largest weight is 127 / 4).
        table[..hidden].iter_mut().for_each(|w| *w *= 1e-3);
        table[hidden..2 * hidden].iter_mut().for_each(|w| *w = 0.0);
        table[2 * hidden..3 * hidden]
            .iter_mut()
            .for_each(|w| *w = (*w * 127.0).round() / 4.0);
        table[2 * hidden] = 127.0 / 4.0;
        let head = TiedHead::new(&table, hidden);
        let h: Vec<f32> = values(hidden, 12).iter().map(|v| v * 30.0).collect();
        let norm = h.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
        let mut exact = vec![0.0; vocab];
        matvec(&mut exact, &h, &table, hidden, vocab);
        let mut scores = vec![0.0; vocab];
        matvec_q8(&mut scores, &h, &head.q, &head.scale, hidden, vocab);
        let mut widest = 0f64;
        for r in 0..vocab {
            let gap = (f64::from(exact[r]) - f64::from(scores[r])).abs();
            let bound = norm * f64::from(head.slack[r]);
            assert!(gap <= bound, "row {r}: |e - a| = {gap} > {bound}");
            widest = widest.max(gap / bound.max(f64::MIN_POSITIVE));
        }
        // The rounding does change the scores: the bound is not vacuous.
        assert!(widest > 0.01, "largest gap / bound {widest}");
    }

    /// The pruned argmax is the full head's, including ties (duplicated rows: the lowest id
    /// wins) and near-ties one f32 step apart.
    #[test]
    fn argmax_matches_the_full_head() {
        for (hidden, vocab, seed) in [(640, 4099, 1), (64, 512, 2), (96, 1000, 3), (40, 77, 4)] {
            let mut table = values(vocab * hidden, seed);
            let h = values(hidden, seed + 100);
            let top = full_argmax(&table, &h, hidden) as usize;
            // A copy of the winner after it, and one before it: the earlier id must win.
            let row: Vec<f32> = table[top * hidden..(top + 1) * hidden].to_vec();
            let (after, before) = ((top + 7) % vocab, top / 2);
            table[after * hidden..(after + 1) * hidden].copy_from_slice(&row);
            let head = TiedHead::new(&table, hidden);
            assert_eq!(
                head.argmax(&table, &h),
                Some(full_argmax(&table, &h, hidden)),
                "{hidden}x{vocab}: duplicate after"
            );
            table[before * hidden..(before + 1) * hidden].copy_from_slice(&row);
            let head = TiedHead::new(&table, hidden);
            let want = full_argmax(&table, &h, hidden);
            assert_eq!(want as usize, before.min(top), "the full head's tie rule");
            assert_eq!(head.argmax(&table, &h), Some(want), "{hidden}x{vocab}: tie");
            // Nudge one weight of the winner by one ulp: a near-tie the exact pass settles.
            let mut nudged = table.clone();
            let w = &mut nudged[want as usize * hidden];
            *w = f32::from_bits(w.to_bits() - 1);
            let head = TiedHead::new(&nudged, hidden);
            assert_eq!(
                head.argmax(&nudged, &h),
                Some(full_argmax(&nudged, &h, hidden)),
                "{hidden}x{vocab}: near tie"
            );
        }
    }

    /// Random hidden states over one table: the pruned and full argmax agree every time.
    #[test]
    fn argmax_matches_on_many_states() {
        let (hidden, vocab) = (128, 2048);
        let table = values(vocab * hidden, 21);
        let head = TiedHead::new(&table, hidden);
        for seed in 0..200 {
            let h: Vec<f32> = values(hidden, 1000 + seed)
                .iter()
                .map(|v| v * (1 + seed % 50) as f32)
                .collect();
            assert_eq!(
                head.argmax(&table, &h),
                Some(full_argmax(&table, &h, hidden)),
                "state {seed}"
            );
        }
    }

    /// A weight or hidden value that is not finite voids the bound: `None`, never a guess.
    #[test]
    fn non_finite_inputs_fall_back() {
        let hidden = 32;
        let mut table = values(16 * hidden, 5);
        let h = values(hidden, 6);
        assert!(TiedHead::new(&table, hidden).argmax(&table, &h).is_some());
        let mut bad_h = h.clone();
        bad_h[3] = f32::NAN;
        assert_eq!(TiedHead::new(&table, hidden).argmax(&table, &bad_h), None);
        table[40] = f32::INFINITY;
        assert_eq!(TiedHead::new(&table, hidden).argmax(&table, &h), None);
    }
}
