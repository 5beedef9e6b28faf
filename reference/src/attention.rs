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

/// `out[t, h] = softmax(q[t, h] . K^T * scale + mask) . V` for the chunk's queries at positions
/// `pos0 + t`, over `segments` (in position order, the chunk's own rows last).
///
/// # Shapes
/// `out`, `q`: `[n, heads, head_dim]`; each segment: `[rows, kv_heads, head_dim]`.
pub fn attention(out: &mut [f32], q: &[f32], pos0: usize, segments: &[KvSegment], s: AttnShape) {
    let hd = s.head_dim;
    let row = s.kv_heads * hd;
    let group = s.heads / s.kv_heads;
    assert_eq!(out.len(), q.len(), "attention: out");
    out.par_chunks_mut(hd)
        .zip(q.par_chunks(hd))
        .enumerate()
        .for_each(|(index, (out, q))| {
            let (t, h) = (index / s.heads, index % s.heads);
            let pos = pos0 + t;
            let lo = s.first_visible(pos);
            let g = (h / group) * hd;
            let visible = |seg: &KvSegment| {
                let rows = seg.k.len() / row;
                let a = lo.max(seg.pos0).min(seg.pos0 + rows) - seg.pos0;
                let b = (pos + 1).max(seg.pos0).min(seg.pos0 + rows) - seg.pos0;
                a..b
            };
            let mut scores = Vec::with_capacity(pos + 1 - lo);
            for seg in segments {
                for r in visible(seg) {
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
                for r in visible(seg) {
                    let w = *p.next().expect("one score per visible key");
                    let v = &seg.v[r * row + g..r * row + g + hd];
                    for (o, &v) in out.iter_mut().zip(v) {
                        *o += w * v;
                    }
                }
            }
        });
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

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

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
