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
//! rounding `slack` and `|h|` themselves. The IREE backend's screen computes `ã` so.
//!
//! [`TiedHead::argmax`] rounds `h` too, to int16 steps of `δ = max |h| / L` (`L` small enough
//! that no i32 sum of `n` products overflows): `ĥ = δ x`. Then `S = q·x` is exact in i32 and
//! `ã' = S s δ` is computed in f64, two roundings of `a·ĥ`. With `ε = |ĥ - h|` (computed per
//! call), `|a·ĥ - a·h| <= |a| ε`, and the roundings add at most `2^-52 |a| (|h| + ε)`:
//! `2^-52 |a| |h|` fits in the spare of `slack` (which still counts an f32 summation of `a·h`,
//! `γ |a| |h|`, that the exact sum no longer has), and `2^-52 |a| ε` in a margin on `ε`. So
//! `|e - ã'| <= |h| slack + |a| ε (1 + 2^-20)`; `|a|` is kept per row, rounded up.
//!
//! With `b_r` that bound and `L = max_r (ã'_r - b_r)`: the row that attains `L` has
//! `e >= L`, so the largest logit is at least `L`; a row with `ã'_r + b_r < L` has `e_r < L`:
//! it can neither be the maximum nor tie with it. The argmax of the remaining rows' exact
//! logits, lowest id first, is the argmax of all of them. On Gemma 3 270M's real weights one
//! to a few rows remain (docs/BENCHMARKS.md, twelfth pass).

use std::sync::Mutex;

use rayon::prelude::*;

use crate::buffer::LargeBuffer;
use crate::kernels::{dot, matvec_q8_i16, q8_i16_limit};
use crate::team;

/// The int8 copy of a tied head's `[vocab, hidden]` table and each row's error bound.
pub struct TiedHead {
    hidden: usize,
    /// `[vocab, hidden]`: `round(w / scale)` of each weight, in [-127, 127]. Streamed whole
    /// by every screened step: a [`LargeBuffer`] (huge pages where the OS offers them).
    q: LargeBuffer<i8>,
    /// `[vocab]`: each row's `max |w| / 127`.
    scale: Vec<f32>,
    /// `[vocab]`: `|e - ã| <= |h| slack` for the row's f32 and approximate logits.
    slack: Vec<f32>,
    /// `[vocab]`: `|a| = s |q|`, rounded up: what the rounding of `h` costs a row.
    norm_a: Vec<f32>,
    /// Whether every bound is finite (so every weight is): the bound assumes it.
    finite: bool,
    /// `[vocab]`: the screen's sums, kept from call to call so that a decode step allocates no
    /// buffer of the vocabulary's size (a call that finds it in use allocates its own).
    sums: Mutex<Vec<i32>>,
}

impl TiedHead {
    /// Rounds `table` (`[vocab, hidden]`, the f32 head) and bounds each row's error, in
    /// parallel: one read of the table.
    ///
    /// # Errors
    /// The OS's error when it cannot map the int8 copy.
    pub fn new(table: &[f32], hidden: usize) -> std::io::Result<Self> {
        assert!(
            hidden > 0 && table.len().is_multiple_of(hidden),
            "TiedHead: table"
        );
        let vocab = table.len() / hidden;
        let mu = (hidden + 1) as f64 * f64::powi(2.0, -24);
        let gamma = mu / (1.0 - mu);
        let mut q = LargeBuffer::zeroed(table.len())?;
        let (mut scale, mut slack) = (vec![0f32; vocab], vec![0f32; vocab]);
        let mut norm_a = vec![0f32; vocab];
        q.par_chunks_mut(hidden)
            .zip(table.par_chunks(hidden))
            .zip(scale.par_iter_mut().zip(slack.par_iter_mut()))
            .zip(norm_a.par_iter_mut())
            .for_each(|(((q, w), (scale, slack)), norm_a)| {
                let s = w.iter().fold(0f32, |m, w| m.max(w.abs())) / 127.0;
                let (mut residual, mut norm, mut rounded) = (0f64, 0f64, 0f64);
                for (q, &w) in q.iter_mut().zip(w) {
                    *q = if s > 0.0 {
                        (w / s).round().clamp(-127.0, 127.0) as i8
                    } else {
                        0
                    };
                    let a = f64::from(s) * f64::from(*q);
                    let d = f64::from(w) - a;
                    residual += d * d;
                    norm += f64::from(w) * f64::from(w);
                    rounded += a * a;
                }
                let bound = 1.01 * residual.sqrt() + 4.0 * gamma * norm.sqrt();
                *scale = s;
                // Rounded up: `as f32` rounds to nearest, within 2^-24 relative.
                *slack = (bound * (1.0 + 1e-6)) as f32;
                *norm_a = (rounded.sqrt() * (1.0 + 1e-6)) as f32;
            });
        // A weight that is not finite makes its row's norm, and so its bound, not finite.
        let finite = slack.iter().all(|s| s.is_finite());
        Ok(TiedHead {
            hidden,
            q,
            scale,
            slack,
            norm_a,
            finite,
            sums: Mutex::new(Vec::new()),
        })
    }

    /// The addresses of the int8 table (see [`crate::buffer::huge_page_bytes`]).
    pub fn addresses(&self) -> std::ops::Range<usize> {
        self.q.addresses()
    }

    /// The argmax over rows of `table . h` (lowest id on a tie), where `table` is the f32 head
    /// this was built from; `None` where the bound does not hold (a weight or `h` not finite):
    /// the caller then computes the full logits.
    ///
    /// # Shapes
    /// `table`: `[vocab, hidden]`; `h`: `[hidden]`.
    pub fn argmax(&self, table: &[f32], h: &[f32]) -> Option<u32> {
        let (hidden, vocab) = (self.hidden, self.slack.len());
        assert_eq!(table.len(), vocab * hidden, "TiedHead::argmax: table");
        assert_eq!(h.len(), hidden, "TiedHead::argmax: h");
        let (mut kept, mut own) = (self.sums.try_lock().ok(), Vec::new());
        let sums = kept.as_deref_mut().unwrap_or(&mut own);
        sums.resize(vocab, 0);
        let screen = self.screen(h, sums)?;
        // Rows in blocks: one task a block, each block's scores and bounds computed once into
        // a buffer by a loop the compiler vectorises. A block keeps the rows that reach its
        // own best lower bound, a superset of those that reach the global one.
        let blocks = team::map(vocab.div_ceil(SCREEN_BLOCK), |b| {
            screen.block(self, b * SCREEN_BLOCK..((b + 1) * SCREEN_BLOCK).min(vocab))
        });
        let (lower, mut rows) =
            blocks
                .into_iter()
                .fold((f64::NEG_INFINITY, Vec::new()), |(l1, mut r1), (l2, r2)| {
                    r1.extend(r2);
                    (l1.max(l2), r1)
                });
        if !lower.is_finite() {
            return None;
        }
        rows.sort_unstable();
        rows.retain(|&r| {
            let (mut hi, mut lo) = ([0f64; 1], [0f64; 1]);
            screen.rows(self, r..r + 1, &mut hi, &mut lo);
            hi[0] >= lower
        });
        let mut best: Option<(usize, f32)> = None;
        for r in rows {
            let e = dot(&table[r * hidden..(r + 1) * hidden], h);
            if best.is_none_or(|(_, b)| e > b) {
                best = Some((r, e));
            }
        }
        best.map(|(r, _)| r as u32)
    }

    /// Every row's exact `q·x` for `h` rounded to int16 steps (module documentation), with
    /// what the bounds need; `None` where they do not hold (a weight or `h` not finite).
    fn screen<'s>(&self, h: &[f32], sums: &'s mut [i32]) -> Option<Screen<'s>> {
        let (hidden, vocab) = (self.hidden, self.slack.len());
        let norm = h
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            .sqrt();
        if !self.finite || !norm.is_finite() {
            return None;
        }
        let limit = f32::from(q8_i16_limit(hidden));
        let peak = h.iter().fold(0f32, |m, v| m.max(v.abs()));
        let delta = peak / limit;
        // `δ` may round, underflow or be 0 (`h` all zero): `ε` below is of the `x` chosen, so
        // any choice is sound (the clamp keeps the sums from overflowing).
        let x: Vec<i16> = h
            .iter()
            .map(|&v| {
                let t = if delta > 0.0 {
                    (v / delta).round()
                } else {
                    0.0
                };
                t.clamp(-limit, limit) as i16
            })
            .collect();
        let delta = f64::from(delta);
        let err = h
            .iter()
            .zip(&x)
            .map(|(&v, &x)| (delta * f64::from(x) - f64::from(v)).powi(2))
            .sum::<f64>()
            .sqrt();
        matvec_q8_i16(sums, &x, &self.q, hidden, vocab);
        Some(Screen {
            sums,
            delta,
            norm,
            err: err * (1.0 + 1e-6) * (1.0 + f64::powi(2.0, -20)),
        })
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

/// The screen of one call of [`TiedHead::argmax`].
struct Screen<'s> {
    /// `[vocab]`: each row's `q·x`, exact.
    sums: &'s [i32],
    /// The step `δ` of `x`.
    delta: f64,
    /// `|h|`.
    norm: f64,
    /// `ε = |ĥ - h|` with the margins for the roundings of `ã'` and of `ε` itself.
    err: f64,
}

/// Rows per block of [`TiedHead::argmax`]'s pass over the screen's scores.
const SCREEN_BLOCK: usize = 2048;

impl Screen<'_> {
    /// The best lower bound among rows `range` (at most [`SCREEN_BLOCK`]) and the rows whose
    /// upper bound reaches it, compiled for AVX-512 where the CPU has it (the loops are f64:
    /// 2 lanes in the baseline build; 0.26 ms of a decode step, 1.1% of its samples, before).
    fn block(&self, head: &TiedHead, range: std::ops::Range<usize>) -> (f64, Vec<usize>) {
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::avx512f() {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { self.block_avx512(head, range) };
        }
        self.block_plain(head, range)
    }

    /// [`Screen::block_plain`] compiled for AVX-512.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn block_avx512(
        &self,
        head: &TiedHead,
        range: std::ops::Range<usize>,
    ) -> (f64, Vec<usize>) {
        self.block_plain(head, range)
    }

    #[inline(always)]
    fn block_plain(&self, head: &TiedHead, range: std::ops::Range<usize>) -> (f64, Vec<usize>) {
        let (mut hi, mut lo) = ([0f64; SCREEN_BLOCK], [0f64; SCREEN_BLOCK]);
        self.rows(head, range.clone(), &mut hi, &mut lo);
        let n = range.len();
        let best = lo[..n].iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let rows = (0..n)
            .filter(|&k| hi[k] >= best)
            .map(|k| range.start + k)
            .collect();
        (best, rows)
    }

    /// For rows `range`, each row's approximate logit `ã' = S s δ` plus (into `hi`) and minus
    /// (into `lo`) its bound `|h| slack + |a| ε`: the row's f32 logit lies between the two
    /// (module documentation).
    #[inline(always)]
    fn rows(&self, head: &TiedHead, range: std::ops::Range<usize>, hi: &mut [f64], lo: &mut [f64]) {
        let n = range.len();
        let (sums, scale) = (&self.sums[range.clone()], &head.scale[range.clone()]);
        let (slack, norm_a) = (&head.slack[range.clone()], &head.norm_a[range]);
        for k in 0..n {
            let a = f64::from(sums[k]) * f64::from(scale[k]) * self.delta;
            let bound = self.norm * f64::from(slack[k]) + self.err * f64::from(norm_a[k]);
            hi[k] = a + bound;
            lo[k] = a - bound;
        }
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
        let head = TiedHead::new(&table, hidden).unwrap();
        let h: Vec<f32> = values(hidden, 12).iter().map(|v| v * 30.0).collect();
        let norm = h.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
        let mut exact = vec![0.0; vocab];
        matvec(&mut exact, &h, &table, hidden, vocab);
        let mut sums = vec![0; vocab];
        let screen = head.screen(&h, &mut sums).unwrap();
        assert_eq!(screen.norm, norm);
        assert!(screen.err > 0.0, "h is rounded to int16 steps");
        let mut widest = 0f64;
        for (r, &e) in exact.iter().enumerate() {
            let (mut hi, mut lo) = ([0f64; 1], [0f64; 1]);
            screen.rows(&head, r..r + 1, &mut hi, &mut lo);
            let e = f64::from(e);
            assert!(
                lo[0] <= e && e <= hi[0],
                "row {r}: {e} outside [{}, {}]",
                lo[0],
                hi[0]
            );
            let (mid, half) = ((hi[0] + lo[0]) / 2.0, (hi[0] - lo[0]) / 2.0);
            widest = widest.max((e - mid).abs() / half.max(f64::MIN_POSITIVE));
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
            let head = TiedHead::new(&table, hidden).unwrap();
            assert_eq!(
                head.argmax(&table, &h),
                Some(full_argmax(&table, &h, hidden)),
                "{hidden}x{vocab}: duplicate after"
            );
            table[before * hidden..(before + 1) * hidden].copy_from_slice(&row);
            let head = TiedHead::new(&table, hidden).unwrap();
            let want = full_argmax(&table, &h, hidden);
            assert_eq!(want as usize, before.min(top), "the full head's tie rule");
            assert_eq!(head.argmax(&table, &h), Some(want), "{hidden}x{vocab}: tie");
            // Nudge one weight of the winner by one ulp: a near-tie the exact pass settles.
            let mut nudged = table.clone();
            let w = &mut nudged[want as usize * hidden];
            *w = f32::from_bits(w.to_bits() - 1);
            let head = TiedHead::new(&nudged, hidden).unwrap();
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
        let head = TiedHead::new(&table, hidden).unwrap();
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

    /// Calls from several threads at once share one head: one of them screens into the kept
    /// buffer, the others into their own, and each gets its own state's token.
    #[test]
    fn argmax_from_threads_at_once() {
        let (hidden, vocab) = (64, 3000);
        let table = values(vocab * hidden, 31);
        let head = TiedHead::new(&table, hidden).unwrap();
        std::thread::scope(|scope| {
            for thread in 0..4u64 {
                let (head, table) = (&head, &table);
                scope.spawn(move || {
                    for seed in 0..40 {
                        let h = values(hidden, 5000 + 100 * thread + seed);
                        assert_eq!(
                            head.argmax(table, &h),
                            Some(full_argmax(table, &h, hidden)),
                            "thread {thread}, state {seed}"
                        );
                    }
                });
            }
        });
    }

    /// A weight or hidden value that is not finite voids the bound: `None`, never a guess.
    #[test]
    fn non_finite_inputs_fall_back() {
        let hidden = 32;
        let mut table = values(16 * hidden, 5);
        let h = values(hidden, 6);
        assert!(TiedHead::new(&table, hidden)
            .unwrap()
            .argmax(&table, &h)
            .is_some());
        let mut bad_h = h.clone();
        bad_h[3] = f32::NAN;
        assert_eq!(
            TiedHead::new(&table, hidden)
                .unwrap()
                .argmax(&table, &bad_h),
            None
        );
        table[40] = f32::INFINITY;
        assert_eq!(
            TiedHead::new(&table, hidden).unwrap().argmax(&table, &h),
            None
        );
    }
}
