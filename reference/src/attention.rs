//! The attention kernel: causal (optionally windowed) softmax attention over cached segments
//! plus the current chunk, with grouped KV heads.

use crate::kernels::{few_rows, matmul, scores_packed, softmax, KeyPanels, KEY_PANEL};
use crate::kv::KvSegment;
use crate::team;

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
/// each (head, query block) as two matrix products over only the keys that block can see.
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

/// A segment's rows that some query of a block sees, and the column of the first of them in
/// a row of scores (the segments' visible rows numbered on from one segment to the next).
struct Visible<'s, 'a> {
    seg: &'s KvSegment<'a>,
    rows: std::ops::Range<usize>,
    col: usize,
}

impl<'a> Visible<'_, 'a> {
    /// Columns `cols` of the value rows (`row` floats each), in place.
    fn values(&self, row: usize, cols: std::ops::Range<usize>) -> Strided<'a> {
        Strided {
            data: &self.seg.v[self.rows.start * row..self.rows.end * row],
            stride: row,
            cols,
        }
    }

    /// This part's columns of the rows of scores `p` (`nk` each).
    fn weights<'p>(&self, p: &'p [f32], nk: usize) -> Strided<'p> {
        Strided {
            data: p,
            stride: nk,
            cols: self.col..self.col + self.rows.len(),
        }
    }
}

/// Columns `cols` of the rows of a row-major matrix, `stride` floats apart in `data`: a block
/// of it read in place.
#[derive(Clone, Debug)]
struct Strided<'a> {
    data: &'a [f32],
    stride: usize,
    cols: std::ops::Range<usize>,
}

impl Strided<'_> {
    fn rows(&self) -> usize {
        self.data.len() / self.stride.max(1)
    }
}

/// The segments' non-empty runs of rows at positions `lo..=hi`, and how many rows they hold.
fn visible<'s, 'a>(
    segments: &'s [KvSegment<'a>],
    row: usize,
    lo: usize,
    hi: usize,
) -> (Vec<Visible<'s, 'a>>, usize) {
    let mut parts = Vec::new();
    let mut nk = 0;
    for seg in segments {
        let rows = rows_in(seg, row, lo, hi);
        if !rows.is_empty() {
            let col = nk;
            nk += rows.len();
            parts.push(Visible { seg, rows, col });
        }
    }
    (parts, nk)
}

/// Keys per task of a decode step's scores (64 KiB of keys at the model's head size).
const KEY_BLOCK: usize = 64;
/// Value dimensions per task of a decode step's weighted sums: one AVX-512 tile's width.
const DIM_STRIP: usize = 64;

/// One query (a decode step) in two parallel passes that each read the visible keys or values
/// once, however many heads share a KV head: the scores by blocks of [`KEY_BLOCK`] keys, each
/// block against its KV head's queries in [`few_rows`]' 4 x 4 tiles of dot products; then,
/// after each head's softmax, the value rows weighted by [`weighted_rows`] in strips of
/// [`DIM_STRIP`] dimensions (a KV head's queries in one tile). Split by heads instead, each of
/// two threads read every key and value row for its two of the four heads: over 48 sliding
/// layers' keys and values from memory (512 keys each, a throwaway loop, five interleaved
/// runs) 113-141 us a layer that way, 100-110 us this way (docs/BENCHMARKS.md, fifteenth
/// pass).
fn attention_vector(out: &mut [f32], q: &[f32], pos0: usize, segments: &[KvSegment], s: AttnShape) {
    let hd = s.head_dim;
    let row = s.kv_heads * hd;
    let group = s.heads / s.kv_heads;
    let (parts, nk) = visible(segments, row, s.first_visible(pos0), pos0);

    // Scores key by key for each KV head ([kv_heads, padded, group], the keys padded to whole
    // blocks), by blocks of keys in parallel: each key row met by its KV head's queries in
    // 4 x 4 tiles of dot products.
    let blocks = nk.div_ceil(KEY_BLOCK);
    let padded = blocks * KEY_BLOCK;
    let mut by_key = vec![0.0f32; s.kv_heads * padded * group];
    team::for_each_chunk(&mut by_key, KEY_BLOCK * group, |c, block| {
        let (kv, first) = (c / blocks, c % blocks * KEY_BLOCK);
        let qs = &q[kv * group * hd..][..group * hd];
        let keys = first..(first + KEY_BLOCK).min(nk);
        for part in &parts {
            let (r, col) = (&part.rows, part.col);
            let (a, b) = (keys.start.max(col), keys.end.min(col + r.len()));
            if a < b {
                let rows = r.start + a - col..r.start + b - col;
                let k = head_rows(part.seg.k, &rows, row, kv * hd, hd);
                let t = &mut block[(a - first) * group..(b - first) * group];
                few_rows(t, qs, &k, group, hd);
            }
        }
        for x in &mut block[..keys.len() * group] {
            *x *= s.scale;
            if let Some(cap) = s.softcap {
                *x = (*x / cap).tanh() * cap;
            }
        }
    });
    // Head by head ([heads, nk]) for the softmax and the weighted sums.
    let mut scores = vec![0.0f32; s.heads * nk];
    for (kv, head) in by_key.chunks_exact((padded * group).max(1)).enumerate() {
        for (j, cells) in head.chunks_exact(group).take(nk).enumerate() {
            for (t, &x) in cells.iter().enumerate() {
                scores[(kv * group + t) * nk + j] = x;
            }
        }
    }
    for srow in scores.chunks_exact_mut(nk.max(1)) {
        softmax(srow);
    }

    // Weighted value rows by (KV head, strip of dimensions), in parallel.
    let strips = hd.div_ceil(DIM_STRIP);
    let sums: Vec<(usize, std::ops::Range<usize>, Vec<f32>)> =
        team::map(s.kv_heads * strips, |task| {
            let (kv, strip) = (task / strips, task % strips);
            let dims = strip * DIM_STRIP..(strip * DIM_STRIP + DIM_STRIP).min(hd);
            let h0 = kv * group;
            let p = &scores[h0 * nk..(h0 + group) * nk];
            let mut o = vec![0.0f32; group * dims.len()];
            // The KV head's columns of the value rows, read in place.
            let cols = kv * hd + dims.start..kv * hd + dims.end;
            for part in &parts {
                weighted_rows(
                    &mut o,
                    &part.weights(p, nk),
                    &part.values(row, cols.clone()),
                );
            }
            (h0, dims, o)
        });
    for (h0, dims, o) in sums {
        for (h, o) in o.chunks_exact(dims.len()).enumerate() {
            out[(h0 + h) * hd + dims.start..][..dims.len()].copy_from_slice(o);
        }
    }
}

/// Blocks of queries per head: `S = Q K^T` and `O = P V` over the key range the block can see,
/// masked per query in between.
///
/// Where the AVX-512F kernels run, each KV head's keys are first packed once for the whole
/// call ([`KeyPanels`]: `K^T` in panels of [`KEY_PANEL`] keys), and a block's `S` is
/// [`scores_packed`]'s 12 x 32 register tiles over the panels holding its visible keys (the
/// keys of those panels it cannot see masked with the rest). Elsewhere `S` is [`matmul`] of
/// the block's queries with the key rows. `O` accumulates the value rows weighted by `P`
/// ([`weighted_rows`]), over the keys the block sees. Those two replaced two calls of the
/// `gemm` crate, whose kernels a stable compiler builds for AVX2 only: criterion
/// `attention/chunk32` 118 us / 0.79 ms / 1.78 ms -> 125 us / 0.57 ms / 1.33 ms at 64 / 512 /
/// 1024 keys (docs/BENCHMARKS.md, fourteenth pass).
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

    // Every key the chunk sees, numbered from the first, packed per KV head for all the tasks.
    let (first_key, last_key) = (s.first_visible(pos0), pos0 + n - 1);
    let packed: Option<Vec<KeyPanels>> = {
        let (all, keys) = visible(segments, row, first_key, last_key);
        // A key's column in the packed panels is its position less the first's.
        assert_eq!(
            keys,
            last_key + 1 - first_key,
            "attention: the segments hold a gap in positions {first_key}..={last_key}"
        );
        let runs: Vec<&[f32]> = all
            .iter()
            .map(|part| &part.seg.k[part.rows.start * row..part.rows.end * row])
            .collect();
        (0..s.kv_heads)
            .map(|kv| KeyPanels::pack(&runs, row, kv * hd, hd))
            .collect()
    };

    // Each task owns the output rows of one (block, head); collect them, then scatter.
    let results: Vec<(usize, usize, Vec<f32>)> = team::map(blocks * s.heads, |task| {
        let (b, h) = (task / s.heads, task % s.heads);
        let t0 = b * QUERY_BLOCK;
        let bq = QUERY_BLOCK.min(n - t0);
        let g = (h / group) * hd;
        let (first_q, last_q) = (pos0 + t0, pos0 + t0 + bq - 1);
        let lo = s.first_visible(first_q);
        let queries = &q[t0 * qrow + h * hd..];

        // S[bq, nk] = Q[t0.., h] . K^T over the keys at `key_lo..`: the block's visible keys,
        // widened to whole panels where they are packed.
        let (key_lo, parts, nk, mut scores) = match &packed {
            Some(keys) => {
                let panels = (lo - first_key) / KEY_PANEL..(last_q - first_key) / KEY_PANEL + 1;
                let key_lo = first_key + panels.start * KEY_PANEL;
                let key_hi = (first_key + panels.end * KEY_PANEL).min(last_key + 1) - 1;
                let (parts, nk) = visible(segments, row, key_lo, key_hi);
                let mut scores = vec![0.0f32; bq * nk];
                scores_packed(&mut scores, queries, qrow, bq, &keys[h / group], panels);
                (key_lo, parts, nk, scores)
            }
            None => {
                let (parts, nk) = visible(segments, row, lo, last_q);
                let qb: Vec<f32> = queries
                    .chunks(qrow)
                    .take(bq)
                    .flat_map(|t| &t[..hd])
                    .copied()
                    .collect();
                let scores = scores_by_parts(&qb, &parts, nk, row, g..g + hd);
                (lo, parts, nk, scores)
            }
        };

        // Scale, cap, mask and softmax each query's row. The keys a query sees in a part
        // are one run: its own visible rows of the segment, inside the block's.
        for (t, srow) in scores.chunks_exact_mut(nk).enumerate() {
            let qpos = first_q + t;
            let first = s.first_visible(qpos);
            for part in &parts {
                let r = &part.rows;
                let cells = &mut srow[part.col..part.col + r.len()];
                let seen = rows_in(part.seg, row, first, qpos);
                let (a, b) = (seen.start - r.start, seen.end - r.start);
                cells[..a].fill(f32::NEG_INFINITY);
                cells[b..].fill(f32::NEG_INFINITY);
                for x in &mut cells[a..b] {
                    *x *= s.scale;
                    if let Some(cap) = s.softcap {
                        *x = (*x / cap).tanh() * cap;
                    }
                }
            }
            softmax(srow);
        }

        // O[bq, hd] = P . V over the keys the block sees (the weights of any other are 0).
        let (mut seen, _) = visible(segments, row, lo, last_q);
        let mut o = vec![0.0f32; bq * hd];
        for part in &mut seen {
            part.col += lo - key_lo;
            weighted_rows(
                &mut o,
                &part.weights(&scores, nk),
                &part.values(row, g..g + hd),
            );
        }
        (t0, h, o)
    });

    for (t0, h, o) in results {
        for (t, o) in o.chunks_exact(hd).enumerate() {
            out[(t0 + t) * qrow + h * hd..][..hd].copy_from_slice(o);
        }
    }
}

/// `S[bq, nk] = Q . K^T` for the block's queries `qb` (`[bq, hd]`) over the keys of `parts`
/// (`nk` in all), a part at a time: [`matmul`] of the queries with the part's key rows (the
/// columns `cols` of each `row`-wide row), copied into the part's columns of the scores.
fn scores_by_parts(
    qb: &[f32],
    parts: &[Visible],
    nk: usize,
    row: usize,
    cols: std::ops::Range<usize>,
) -> Vec<f32> {
    let hd = cols.len();
    let bq = qb.len() / hd.max(1);
    let mut scores = vec![0.0f32; bq * nk];
    let mut sums = Vec::new();
    for part in parts {
        let (r, col) = (&part.rows, part.col);
        let keys = head_rows(part.seg.k, r, row, cols.start, hd);
        sums.resize(bq * r.len(), 0.0);
        matmul(&mut sums, qb, &keys, bq, hd, r.len());
        for (srow, prow) in scores.chunks_exact_mut(nk).zip(sums.chunks_exact(r.len())) {
            srow[col..col + r.len()].copy_from_slice(prow);
        }
    }
    scores
}

/// Key rows `r` of one KV head (columns `g..g + hd` of `row`-wide rows) as a contiguous
/// `[len, hd]` block, as the score products take them: borrowed where the layer has one KV
/// head (the rows are the block), else copied. (The value sums read their rows in place.)
fn head_rows<'a>(
    rows: &'a [f32],
    r: &std::ops::Range<usize>,
    row: usize,
    g: usize,
    hd: usize,
) -> std::borrow::Cow<'a, [f32]> {
    if row == hd {
        return std::borrow::Cow::Borrowed(&rows[r.start * hd..r.end * hd]);
    }
    std::borrow::Cow::Owned(
        r.clone()
            .flat_map(|k| &rows[k * row + g..][..hd])
            .copied()
            .collect(),
    )
}

/// `o[t] += sum_j p[t, j] v[j]` over the blocks `p` (`[bq, len]`, the weights) and `v`
/// (`[len, width]`, value rows), both read in place; `o` is `[bq, width]`.
///
/// Where the CPU has AVX-512F and `v`'s columns start and end on multiples of 64: tiles of four
/// queries by 64 dimensions, each value row's strip loaded once per tile and met by four
/// broadcast weights (16 accumulators). Where it has AVX2 and FMA instead, and the width is a
/// multiple of 16: the same tiles 16 dimensions wide (8 accumulators of 8 lanes).
fn weighted_rows(o: &mut [f32], p: &Strided, v: &Strided) {
    let (bq, len, width) = (p.rows(), v.rows(), v.cols.len());
    assert!(
        o.len() == bq * width && v.data.len() == len * v.stride && v.cols.end <= v.stride,
        "weighted_rows: o or v"
    );
    assert!(
        p.cols.len() == len && p.data.len() == bq * p.stride && p.cols.end <= p.stride,
        "weighted_rows: p"
    );
    if bq == 0 || len == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if v.cols.start.is_multiple_of(64) && width.is_multiple_of(64) && crate::kernels::avx512f() {
        // SAFETY: the CPU has AVX-512F; the shapes were checked above.
        unsafe { weighted_rows_tiled(o, p, v, AVX512_TILES) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if width.is_multiple_of(16) && crate::kernels::avx2() {
        // SAFETY: the CPU has AVX2 and FMA; the shapes were checked above.
        unsafe { weighted_rows_tiled(o, p, v, AVX2_TILES) };
        return;
    }
    for (o, p_row) in o.chunks_exact_mut(width).zip(p.data.chunks_exact(p.stride)) {
        for (&w, v_row) in p_row[p.cols.clone()]
            .iter()
            .zip(v.data.chunks_exact(v.stride))
        {
            for (o, &v) in o.iter_mut().zip(&v_row[v.cols.clone()]) {
                *o += w * v;
            }
        }
    }
}

/// A tile kernel of [`weighted_rows`]: `o[t, ..strip] += sum_j p[t, j] v[j, ..strip]` for a
/// fixed number of rows `t` (the kernel's), arguments as [`weighted_tile`]'s.
#[cfg(target_arch = "x86_64")]
type Tile = unsafe fn(*mut f32, *const f32, *const f32, usize, [usize; 2], usize);

/// AVX-512F tiles of 1 to 4 queries by 64 dimensions.
#[cfg(target_arch = "x86_64")]
const AVX512_TILES: (usize, [Tile; 4]) = (
    64,
    [
        weighted_tile::<1>,
        weighted_tile::<2>,
        weighted_tile::<3>,
        weighted_tile::<4>,
    ],
);

/// AVX2 and FMA tiles of 1 to 4 queries by 16 dimensions.
#[cfg(target_arch = "x86_64")]
const AVX2_TILES: (usize, [Tile; 4]) = (
    16,
    [
        weighted_tile_avx2::<1>,
        weighted_tile_avx2::<2>,
        weighted_tile_avx2::<3>,
        weighted_tile_avx2::<4>,
    ],
);

/// [`weighted_rows`] by `tiles` (their strip width, and the kernels for 1 to 4 query rows):
/// four queries at a time, then the one to three left, each strip of dimensions in turn.
///
/// # Safety
/// The CPU must have the tiles' instructions; the blocks' shapes are as [`weighted_rows`]
/// checks them, with at least one row each, and `v.cols.len()` is a multiple of the strip.
#[cfg(target_arch = "x86_64")]
unsafe fn weighted_rows_tiled(
    o: &mut [f32],
    p: &Strided,
    v: &Strided,
    (strip, tiles): (usize, [Tile; 4]),
) {
    let (bq, len, width) = (p.rows(), v.rows(), v.cols.len());
    let mut t = 0;
    while t < bq {
        let rows = (bq - t).min(4);
        for d in (0..width).step_by(strip) {
            tiles[rows - 1](
                o.as_mut_ptr().add(t * width + d),
                p.data.as_ptr().add(t * p.stride + p.cols.start),
                v.data.as_ptr().add(v.cols.start + d),
                p.stride,
                [width, v.stride],
                len,
            );
        }
        t += rows;
    }
}

/// `T` rows of `o` by 16 dimensions: `o[t, 0..16] += sum_j p[t, j] v[j, 0..16]`, the rows of
/// `o` and `v` `strides` apart ([`weighted_tile`] in AVX2).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `o` addresses `T` rows with 16 floats each, `p` `T` rows
/// of stride `nk` with `len` weights, `v` `len` rows with 16 floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn weighted_tile_avx2<const T: usize>(
    o: *mut f32,
    p: *const f32,
    v: *const f32,
    nk: usize,
    [os, vs]: [usize; 2],
    len: usize,
) {
    use std::arch::x86_64::*;
    let mut acc: [[__m256; 2]; T] =
        std::array::from_fn(|t| std::array::from_fn(|c| _mm256_loadu_ps(o.add(t * os + 8 * c))));
    for j in 0..len {
        // The row 8 ahead (from memory in a decode step; never faults).
        _mm_prefetch::<_MM_HINT_T0>(v.wrapping_add((j + 8) * vs).cast());
        let vv: [__m256; 2] = std::array::from_fn(|c| _mm256_loadu_ps(v.add(j * vs + 8 * c)));
        for (t, acc) in acc.iter_mut().enumerate() {
            let w = _mm256_set1_ps(*p.add(t * nk + j));
            for (acc, vv) in acc.iter_mut().zip(&vv) {
                *acc = _mm256_fmadd_ps(w, *vv, *acc);
            }
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        for (c, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(t * os + 8 * c), *acc);
        }
    }
}

/// `T` rows of `o` by 64 dimensions: `o[t, 0..64] += sum_j p[t, j] v[j, 0..64]`, the rows of
/// `o` and `v` `strides` apart.
///
/// # Safety
/// The CPU must have AVX-512F; `o` addresses `T` rows with 64 floats each, `p` `T` rows of
/// stride `nk` with `len` weights, `v` `len` rows with 64 floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn weighted_tile<const T: usize>(
    o: *mut f32,
    p: *const f32,
    v: *const f32,
    nk: usize,
    [os, vs]: [usize; 2],
    len: usize,
) {
    use std::arch::x86_64::*;
    let mut acc: [[__m512; 4]; T] =
        std::array::from_fn(|t| std::array::from_fn(|c| _mm512_loadu_ps(o.add(t * os + 16 * c))));
    for j in 0..len {
        // The strip of the row 8 ahead (from memory in a decode step; never faults).
        let ahead = v.wrapping_add((j + 8) * vs);
        for line in 0..4 {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * line).cast());
        }
        let vv: [__m512; 4] = std::array::from_fn(|c| _mm512_loadu_ps(v.add(j * vs + 16 * c)));
        for (t, acc) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_ps(*p.add(t * nk + j));
            for (acc, vv) in acc.iter_mut().zip(&vv) {
                *acc = _mm512_fmadd_ps(w, *vv, *acc);
            }
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        for (c, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.add(t * os + 16 * c), *acc);
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

    /// Runs a random sequence through `attention` in `chunks` (their sum is its length) over a
    /// real ring or full cache, and asserts that every chunk's output is within 1e-5 of the
    /// naive attention over the whole sequence.
    fn assert_chunked_matches_naive(s: AttnShape, chunks: &[usize], seed: u64) {
        let row = s.kv_heads * s.head_dim;
        let qrow = s.heads * s.head_dim;
        let total: usize = chunks.iter().sum();
        let k = values(total * row, seed);
        let v = values(total * row, seed + 1);
        let q = values(total * qrow, seed + 2);
        let mut want = vec![0.0; q.len()];
        attention_naive(&mut want, &q, 0, &k, &v, s);
        let mut cache = match s.window {
            Some(w) => LayerKv::Ring(crate::kv::RingKv::new(w)),
            None => LayerKv::Full(Default::default()),
        };
        let mut pos = 0;
        for &n in chunks {
            let (kc, vc) = (
                &k[pos * row..(pos + n) * row],
                &v[pos * row..(pos + n) * row],
            );
            let qc = &q[pos * qrow..(pos + n) * qrow];
            let mut segs = cache.segments(pos, row);
            segs.push(KvSegment {
                k: kc,
                v: vc,
                pos0: pos,
            });
            let mut got = vec![0.0; qc.len()];
            attention(&mut got, qc, pos, &segs, s);
            let err = got
                .iter()
                .zip(&want[pos * qrow..(pos + n) * qrow])
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err < 1e-5, "{s:?}, chunk at {pos}: {err}");
            cache.commit(pos, kc, vc, row);
            pos += n;
        }
    }

    /// A sequence split into chunks through a real ring or full cache gives the same outputs as
    /// the naive attention over the whole sequence.
    #[test]
    fn chunked_over_cache_matches_naive() {
        for window in [None, Some(1), Some(3), Some(5)] {
            assert_chunked_matches_naive(shape(window), &[1, 4, 2, 7, 1, 2], 1);
        }
    }

    /// The same at the real model's head size (one KV head, 256 dims) and at 64 dims with two
    /// KV heads: the AVX-512 or AVX2 tiles of `weighted_rows` and the borrowed and copied key
    /// rows, over chunks longer than a query block.
    #[test]
    fn chunked_at_model_head_sizes_matches_naive() {
        for (kv_heads, head_dim, window) in [(1, 256, None), (1, 256, Some(20)), (2, 64, Some(9))] {
            let s = AttnShape {
                heads: 4,
                kv_heads,
                head_dim,
                window,
                scale: 0.0625,
                softcap: None,
            };
            assert_chunked_matches_naive(s, &[3, 37, 1, 39], 7);
        }
    }

    /// Decode steps over more keys than a block of the scores' pass, from a ring that has
    /// wrapped (two segments) and a full cache, three heads to a KV head, soft-capped: the
    /// naive outputs, whatever the pool's size.
    #[test]
    fn decode_over_blocks_and_segments_matches_naive() {
        for window in [None, Some(100)] {
            let s = AttnShape {
                heads: 6,
                kv_heads: 2,
                head_dim: 64,
                window,
                scale: 0.125,
                softcap: Some(2.0),
            };
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("a pool");
                pool.install(|| assert_chunked_matches_naive(s, &[1, 70, 1, 1, 60, 1], 11));
            }
        }
    }

    /// `weighted_rows` and each of its x86 kernels the CPU has, whichever the dispatch picks:
    /// blocks read in place at column offsets and strides, 1 to 4 queries to a tile, within
    /// 1e-5 of f64 sums.
    #[test]
    fn weighted_rows_kernels_match_naive() {
        let (bq, nk, len, stride) = (7, 50, 40, 96);
        let scores = values(bq * nk, 21);
        let rows = values(len * stride, 22);
        let p = Strided {
            data: &scores,
            stride: nk,
            cols: 5..5 + len,
        };
        for cols in [0..64, 16..48, 32..96, 3..11] {
            let v = Strided {
                data: &rows,
                stride,
                cols: cols.clone(),
            };
            let width = cols.len();
            let want: Vec<f64> = (0..bq * width)
                .map(|e| {
                    let (t, d) = (e / width, cols.start + e % width);
                    (0..len)
                        .map(|j| {
                            f64::from(scores[t * nk + 5 + j]) * f64::from(rows[j * stride + d])
                        })
                        .sum()
                })
                .collect();
            let check = |what: &str, got: &[f32]| {
                for (g, w) in got.iter().zip(&want) {
                    assert!((f64::from(*g) - w).abs() < 1e-5, "{what}, columns {cols:?}");
                }
            };
            let mut got = vec![0.0; bq * width];
            weighted_rows(&mut got, &p, &v);
            check("dispatched", &got);
            #[cfg(target_arch = "x86_64")]
            {
                let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
                if avx2 && width % 16 == 0 {
                    let mut got = vec![0.0; bq * width];
                    // SAFETY: the CPU has AVX2 and FMA; the shapes are as checked above.
                    unsafe { weighted_rows_tiled(&mut got, &p, &v, AVX2_TILES) };
                    check("AVX2", &got);
                } else if !avx2 {
                    eprintln!("SKIPPED: the AVX2 tiles (the CPU has no AVX2 and FMA)");
                }
                let avx512 = is_x86_feature_detected!("avx512f");
                if avx512 && cols.start % 64 == 0 && width % 64 == 0 {
                    let mut got = vec![0.0; bq * width];
                    // SAFETY: the CPU has AVX-512F; the shapes are as checked above.
                    unsafe { weighted_rows_tiled(&mut got, &p, &v, AVX512_TILES) };
                    check("AVX-512", &got);
                } else if !avx512 {
                    eprintln!("SKIPPED: the AVX-512 tiles (the CPU has no AVX-512F)");
                }
            }
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
