//! The attention kernel: causal (optionally windowed) softmax attention over cached segments
//! plus the current chunk, with grouped KV heads.

use rayon::prelude::*;

use crate::kernels::{dot, softmax};
use crate::kv::KvSegment;

/// Static shape and masking of one layer's attention.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `Some(w)`: key `j` is visible to query `i` iff `i - w < j <= i`. `None`: iff `j <= i`.
    pub window: Option<usize>,
    /// Multiplies the scores (`query_pre_attn_scalar^-0.5`).
    pub scale: f32,
    /// `tanh` soft-capping of the scores, when the config has one.
    pub softcap: Option<f32>,
}

impl AttnShape {
    /// The first key position visible to a query at `pos`.
    pub fn first_visible(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// Queries per block of the blocked (multi-query) path.
const QUERY_BLOCK: usize = 32;

/// `out[t, h] = softmax(q[t, h] . K^T * scale + mask) . V` for the chunk's queries at positions
/// `pos0 + t`, over `segments` (in position order, the chunk's own rows last).
///
/// A single query (decode) takes the vector path; a chunk takes the blocked path, which computes
/// each (head, query block) with two GEMMs over only the keys that block can see.
///
/// # Shapes
/// `out`, `q`: `[n, heads, head_dim]`; each segment: `[rows, kv_heads, head_dim]`.
pub fn attention(out: &mut [f32], q: &[f32], pos0: usize, segments: &[KvSegment], s: AttnShape) {
    assert_eq!(out.len(), q.len(), "attention: out");
    if q.len() == s.heads * s.head_dim {
        attention_vector(out, q, pos0, segments, s);
    } else {
        attention_blocked(out, q, pos0, segments, s);
    }
}

/// The rows `a..b` of `seg` whose positions lie in `lo..=hi`.
fn rows_in(seg: &KvSegment, row: usize, lo: usize, hi: usize) -> std::ops::Range<usize> {
    let rows = seg.k.len() / row;
    let a = lo.max(seg.pos0).min(seg.pos0 + rows) - seg.pos0;
    let b = (hi + 1).max(seg.pos0).min(seg.pos0 + rows) - seg.pos0;
    a..b.max(a)
}

/// One query per (token, head): dot products and an axpy over the visible keys.
fn attention_vector(out: &mut [f32], q: &[f32], pos0: usize, segments: &[KvSegment], s: AttnShape) {
    let hd = s.head_dim;
    let row = s.kv_heads * hd;
    let group = s.heads / s.kv_heads;
    out.par_chunks_mut(hd)
        .zip(q.par_chunks(hd))
        .enumerate()
        .for_each(|(index, (out, q))| {
            let (t, h) = (index / s.heads, index % s.heads);
            let pos = pos0 + t;
            let lo = s.first_visible(pos);
            let g = (h / group) * hd;
            let mut scores = Vec::with_capacity(pos + 1 - lo);
            for seg in segments {
                for r in rows_in(seg, row, lo, pos) {
                    let mut x = dot(q, &seg.k[r * row + g..r * row + g + hd]) * s.scale;
                    if let Some(cap) = s.softcap {
                        x = (x / cap).tanh() * cap;
                    }
                    scores.push(x);
                }
            }
            softmax(&mut scores);
            out.fill(0.0);
            let mut p = scores.iter();
            for seg in segments {
                for r in rows_in(seg, row, lo, pos) {
                    let w = *p.next().expect("one score per visible key");
                    let v = &seg.v[r * row + g..r * row + g + hd];
                    for (o, &v) in out.iter_mut().zip(v) {
                        *o += w * v;
                    }
                }
            }
        });
}

/// Blocks of queries per head: `S = Q K^T` and `O = P V` as GEMMs over the key range the block
/// can see, masked per query in between.
fn attention_blocked(
    out: &mut [f32],
    q: &[f32],
    pos0: usize,
    segments: &[KvSegment],
    s: AttnShape,
) {
    let hd = s.head_dim;
    let row = s.kv_heads * hd;
    let qrow = s.heads * hd;
    let n = q.len() / qrow;
    let group = s.heads / s.kv_heads;
    let blocks = n.div_ceil(QUERY_BLOCK);

    // Each task owns the output rows of one (block, head); collect them, then scatter.
    let results: Vec<(usize, usize, Vec<f32>)> = (0..blocks * s.heads)
        .into_par_iter()
        .map(|task| {
            let (b, h) = (task / s.heads, task % s.heads);
            let t0 = b * QUERY_BLOCK;
            let bq = QUERY_BLOCK.min(n - t0);
            let g = (h / group) * hd;
            let (first_q, last_q) = (pos0 + t0, pos0 + t0 + bq - 1);
            let lo = s.first_visible(first_q);
            let parts: Vec<(&KvSegment, std::ops::Range<usize>)> = segments
                .iter()
                .map(|seg| (seg, rows_in(seg, row, lo, last_q)))
                .filter(|(_, r)| !r.is_empty())
                .collect();
            let nk: usize = parts.iter().map(|(_, r)| r.len()).sum();

            // S[bq, nk] = Q[t0.., h] . K^T
            let mut scores = vec![0.0f32; bq * nk];
            let q_blk = &q[t0 * qrow + h * hd..];
            let mut col = 0;
            for (seg, r) in &parts {
                let k = &seg.k[r.start * row + g..];
                // SAFETY: Q is read as bq x hd with row stride qrow inside `q`; K^T as hd x len
                // with column stride `row` inside the segment; S is written as bq x len at
                // column offset `col` with row stride nk. All ranges lie inside their slices.
                unsafe {
                    gemm::gemm(
                        bq,
                        r.len(),
                        hd,
                        scores.as_mut_ptr().add(col),
                        1,
                        nk as isize,
                        false,
                        q_blk.as_ptr(),
                        1,
                        qrow as isize,
                        k.as_ptr(),
                        row as isize,
                        1,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                col += r.len();
            }

            // Scale, cap, mask and softmax each query's row.
            for t in 0..bq {
                let qpos = first_q + t;
                let first = s.first_visible(qpos);
                let srow = &mut scores[t * nk..(t + 1) * nk];
                let mut c = 0;
                for (seg, r) in &parts {
                    for key in r.clone() {
                        let kpos = seg.pos0 + key;
                        let x = &mut srow[c];
                        if kpos > qpos || kpos < first {
                            *x = f32::NEG_INFINITY;
                        } else {
                            *x *= s.scale;
                            if let Some(cap) = s.softcap {
                                *x = (*x / cap).tanh() * cap;
                            }
                        }
                        c += 1;
                    }
                }
                softmax(srow);
            }

            // O[bq, hd] = P . V
            let mut o = vec![0.0f32; bq * hd];
            let mut col = 0;
            for (i, (seg, r)) in parts.iter().enumerate() {
                let v = &seg.v[r.start * row + g..];
                // SAFETY: P is read as bq x len at column offset `col` (row stride nk), V as
                // len x hd with row stride `row`, O written as bq x hd; all inside their slices.
                unsafe {
                    gemm::gemm(
                        bq,
                        hd,
                        r.len(),
                        o.as_mut_ptr(),
                        1,
                        hd as isize,
                        i > 0,
                        scores.as_ptr().add(col),
                        1,
                        nk as isize,
                        v.as_ptr(),
                        1,
                        row as isize,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                col += r.len();
            }
            (t0, h, o)
        })
        .collect();

    for (t0, h, o) in results {
        for (t, o) in o.chunks_exact(hd).enumerate() {
            out[(t0 + t) * qrow + h * hd..][..hd].copy_from_slice(o);
        }
    }
}

/// Naive oracle of [`attention`]: full K/V in position order, an explicit additive mask as
/// transformers' eager attention builds it, f64 arithmetic.
///
/// # Shapes
/// `k`, `v`: `[pos0 + n, kv_heads, head_dim]` (every position from 0).
pub fn attention_naive(
    out: &mut [f32],
    q: &[f32],
    pos0: usize,
    k: &[f32],
    v: &[f32],
    s: AttnShape,
) {
    let hd = s.head_dim;
    let row = s.kv_heads * hd;
    let keys = k.len() / row;
    let n = q.len() / (s.heads * hd);
    for t in 0..n {
        let pos = pos0 + t;
        for h in 0..s.heads {
            let g = (h / (s.heads / s.kv_heads)) * hd;
            let qh = &q[(t * s.heads + h) * hd..][..hd];
            let scores: Vec<f64> = (0..keys)
                .map(|j| {
                    let visible = j <= pos && j >= s.first_visible(pos);
                    if !visible {
                        return f64::NEG_INFINITY;
                    }
                    let kj = &k[j * row + g..][..hd];
                    let mut x = qh
                        .iter()
                        .zip(kj)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * s.scale as f64;
                    if let Some(cap) = s.softcap {
                        x = (x / cap as f64).tanh() * cap as f64;
                    }
                    x
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            let o = &mut out[(t * s.heads + h) * hd..][..hd];
            for (d, o) in o.iter_mut().enumerate() {
                *o = ((0..keys)
                    .map(|j| e[j] * v[j * row + g + d] as f64)
                    .sum::<f64>()
                    / sum) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::LayerKv;

    use crate::kernels::tests::values;

    fn shape(window: Option<usize>) -> AttnShape {
        AttnShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            window,
            scale: 0.3,
            softcap: None,
        }
    }

    /// A sequence split into chunks through a real ring or full cache gives the same outputs as
    /// the naive attention over the whole sequence.
    #[test]
    fn chunked_over_cache_matches_naive() {
        for window in [None, Some(1), Some(3), Some(5)] {
            let s = shape(window);
            let row = s.kv_heads * s.head_dim;
            let total = 17;
            let k = values(total * row, 1);
            let v = values(total * row, 2);
            let q = values(total * s.heads * s.head_dim, 3);
            let mut want = vec![0.0; q.len()];
            attention_naive(&mut want, &q, 0, &k, &v, s);

            let mut cache = match window {
                Some(w) => LayerKv::Ring(crate::kv::RingKv::new(w)),
                None => LayerKv::Full(Default::default()),
            };
            let mut pos = 0;
            for n in [1usize, 4, 2, 7, 1, 2] {
                let (kc, vc) = (
                    &k[pos * row..(pos + n) * row],
                    &v[pos * row..(pos + n) * row],
                );
                let qc = &q[pos * s.heads * s.head_dim..(pos + n) * s.heads * s.head_dim];
                let mut segs = cache.segments(pos, row);
                segs.push(KvSegment {
                    k: kc,
                    v: vc,
                    pos0: pos,
                });
                let mut got = vec![0.0; qc.len()];
                attention(&mut got, qc, pos, &segs, s);
                let w = &want[pos * s.heads * s.head_dim..(pos + n) * s.heads * s.head_dim];
                let err = got
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                assert!(err < 1e-5, "window {window:?} chunk at {pos}: {err}");
                cache.commit(pos, kc, vc, row);
                pos += n;
            }
            assert_eq!(pos, total);
        }
    }

    /// Query `i` sees key `j` iff `i - w < j <= i`: perturbing key `i - w` changes nothing,
    /// perturbing key `i - w + 1` changes the output.
    #[test]
    fn window_boundary_is_exact() {
        let w = 4;
        let s = shape(Some(w));
        let row = s.kv_heads * s.head_dim;
        let total = 10;
        let i = 9;
        let k = values(total * row, 4);
        let v = values(total * row, 5);
        let q = values(s.heads * s.head_dim, 6);
        let run = |k: &[f32], v: &[f32]| {
            let mut out = vec![0.0; q.len()];
            let seg = [KvSegment { k, v, pos0: 0 }];
            attention(&mut out, &q, i, &seg, s);
            out
        };
        let base = run(&k, &v);
        let perturb = |j: usize| {
            let mut v2 = v.clone();
            v2[j * row..(j + 1) * row]
                .iter_mut()
                .for_each(|x| *x += 10.0);
            run(&k, &v2)
        };
        assert_eq!(perturb(i - w), base, "key i - w must be masked");
        assert_ne!(perturb(i - w + 1), base, "key i - w + 1 must be visible");
        assert_ne!(perturb(i), base, "the current key must be visible");
    }
}
