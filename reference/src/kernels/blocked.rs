//! The blocked GEMM behind [`super::matmul`] on AVX-512 CPUs: `out[n, o] = x[n, i] . w[o, i]^T`
//! with 12 x 32 register tiles.
//!
//! `x` is first interleaved in bands of 12 rows (`[n / 12, i, 12]`, zero past the last row), so
//! that a tile's broadcasts read one sequential stream (12 rows read where they lie are 12
//! streams whose lines share L1 sets: with `i = 2048` all 12 fall in one set). The output's
//! columns (the weight's rows) are split into panels of 32, one task each ([`crate::team`]): a
//! task copies its panel's weights into a block laid out as the tile reads it (`[i, 32]`, cache-line
//! aligned; 80 KiB at `i = 640`, in L2), then runs every band against it over the whole depth:
//! per input position two 16-lane loads of the block and 12 broadcasts of the band, 24 FMAs into
//! 24 accumulators, and one store of the finished tile. `out` is written in place, each task its
//! own columns.
//!
//! A weight packed once at load ([`Panels`], the model's layers, several of them stacked into
//! one product) skips the per-call copy, its tasks runs of consecutive panels, and a single row
//! runs [`matvec_panels_avx512`] over the same panels: broadcasts of `x` into 32 column sums,
//! each panel streamed once in order.
//!
//! An attention call packs each KV head's keys the same way ([`KeyPanels`], `K^T` in panels of
//! 32 keys), and each of its (query block, head) tasks runs the same tiles over the panels its
//! queries see ([`scores_avx512`], on the task's thread).
//!
//! The `gemm` crate this replaces ran AVX2 code on this target (its AVX-512 kernels need a
//! nightly compiler): half the FMA width. Splitting the depth into L1-sized blocks (128-512
//! positions) was measured too: reloading the output tile per block cost more than the block's
//! reads from L2 (docs/BENCHMARKS.md, seventh pass).

use rayon::prelude::*;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::ops::Range;

use crate::buffer::LargeBuffer;
use crate::team;

/// Rows of `x` in a register tile (and in a band).
const MR: usize = 12;
/// Output columns in a register tile: two 16-lane vectors.
const NR: usize = 32;
// A panel of keys is a panel of a weight: one register tile wide.
const _: () = assert!(NR == super::KEY_PANEL);
/// Floats in a cache line: the slack that lets a block start on one.
const LINE: usize = 16;
/// Runs of consecutive panels a packed product is cut into, per thread: one, each thread
/// streaming its share in order (and prefetching its own next panel). On the catalog
/// (2-vCPU Xeon, docs/BENCHMARKS.md, twenty-seventh pass), against two runs a thread: the
/// decode step's matvecs 0.2-0.4 ms faster in three pairs of runs (four runs lost 0.5-1.5 ms),
/// the 22-token extend faster in five pairs of six (by about 1 ms in the median).
const RUNS: usize = 1;
/// Deepest input [`matmul_avx512`] takes: the gathers' 32-bit offsets reach `15 * i`.
pub(super) const MAX_DEPTH: usize = i32::MAX as usize / 16;

/// `out` as a pointer the column tasks share: each writes only its own columns.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: tasks write disjoint columns of `out` (see `matmul_avx512`), and `out` outlives them.
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

impl Out {
    /// The pointer (a method, so that a closure captures the `Sync` wrapper, not the field).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// `out[n, o] = x[n, i] . w[o, i]^T` (shapes checked by the caller).
///
/// # Safety
/// The CPU must have AVX-512F; `out`, `x`, `w` hold `n * o`, `n * i`, `o * i` floats, and
/// `i <= MAX_DEPTH`.
pub(super) unsafe fn matmul_avx512(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    n: usize,
    i: usize,
    o: usize,
) {
    thread_local! {
        /// A thread's copy of the panel it works on (reused across calls).
        static BLOCK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    let bands = bands(x, i, n, i);
    let dst = Out(out.as_mut_ptr());
    team::for_each(o.div_ceil(NR), |panel| {
        BLOCK.with_borrow_mut(|block| {
            block.resize(i * NR + LINE, 0.0);
            let cols = panel_cols(panel, o);
            // Unaligned, every 16-lane load of the block would span two cache lines.
            let at = block.as_ptr().align_offset(64).min(LINE);
            let block = &mut block[at..at + i * NR];
            // SAFETY: the CPU has AVX-512F; `cols` are rows of `w` (`o * i` floats).
            unsafe { pack_avx512(block, w, cols.clone(), i) };
            // SAFETY: the CPU has AVX-512F (the caller's contract); this task alone writes the
            // columns `cols` of `out`, which holds `n * o` floats.
            unsafe { panel_avx512(dst, &bands, block, None, cols, n, o) };
        })
    });
}

/// [`matmul_avx512`] with a weight packed at load: the same tiles over `w`'s panels, without
/// the copy of each panel per call.
///
/// # Safety
/// The CPU must have AVX-512F; `out` and `x` hold `n * w.o` and `n * w.i` floats.
pub(super) unsafe fn matmul_panels_avx512(out: &mut [f32], x: &[f32], w: &Panels, n: usize) {
    // SAFETY: the CPU has AVX-512F; `x` holds `n` rows of `w.i` floats.
    let bands = unsafe { bands(x, w.i, n, w.i) };
    // SAFETY: as the caller's contract; `bands` holds `x`'s rows.
    unsafe { bands_by_panels(out, &bands, w, n) }
}

/// [`matmul_panels_avx512`] of `geglu(gate_up)` (`n` rows of `[gate, up]`, `2 w.i` floats):
/// each band's rows go through [`super::geglu`]'s kernel into a band-sized scratch and are
/// interleaved from there (one band a task), so the GeGLU's `[n, w.i]` output is never
/// written to memory and read back. The same floats as [`super::geglu`] then
/// [`matmul_panels_avx512`].
///
/// # Safety
/// The CPU must have AVX-512F; `out` and `gate_up` hold `n * w.o` and `n * 2 * w.i` floats.
pub(super) unsafe fn geglu_matmul_panels_avx512(
    out: &mut [f32],
    gate_up: &[f32],
    w: &Panels,
    n: usize,
) {
    thread_local! {
        /// A thread's GeGLU of one band's rows (reused across calls).
        static ROWS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    let f = w.i;
    let fill = |rows: Range<usize>, band: &mut [MaybeUninit<f32>]| {
        let gate_up = &gate_up[rows.start * 2 * f..rows.end * 2 * f];
        ROWS.with_borrow_mut(|scratch| {
            scratch.resize(MR * f, 0.0);
            for (row, gate_up) in scratch.chunks_exact_mut(f).zip(gate_up.chunks_exact(2 * f)) {
                let (gate, up) = gate_up.split_at(f);
                // SAFETY: the CPU has AVX-512F (the caller's contract).
                unsafe { super::geglu_avx512(row, gate, up) };
            }
            // SAFETY: as above; `scratch` holds the band's rows, `f` floats each.
            unsafe { interleave_avx512(band, scratch, rows.len(), f) }
        })
    };
    // SAFETY: `fill` writes every float of its band (`interleave_avx512` does).
    let bands = unsafe { bands_of(n, f, fill) };
    // SAFETY: as the caller's contract; `bands` holds the GeGLU's rows.
    unsafe { bands_by_panels(out, &bands, w, n) }
}

/// `out[n, w.o] = rows . w^T` for the `n` rows interleaved in `bands` ([`bands`]).
///
/// # Safety
/// The CPU must have AVX-512F; `out` holds `n * w.o` floats and `bands` `n` rows of `w.i`.
unsafe fn bands_by_panels(out: &mut [f32], bands: &[f32], w: &Panels, n: usize) {
    let o = w.o;
    let dst = Out(out.as_mut_ptr());
    let panels = w.cols.len();
    // Each task a run of consecutive panels, so that the next one it prefetches is its own.
    let tasks = team::tasks(RUNS).min(panels);
    team::for_each(tasks, |t| {
        let run = team::part(panels, tasks, t);
        for panel in run.clone() {
            let cols = w.cols[panel].clone();
            let next = (panel + 1 < run.end).then(|| w.panel(panel + 1));
            // SAFETY: the CPU has AVX-512F (the caller's contract); this task alone writes the
            // columns `cols` of `out`, which holds `n * o` floats; the panel is `[i, NR]`.
            unsafe { panel_avx512(dst, bands, w.panel(panel), next, cols, n, o) };
        }
    });
}

/// `out[o] = w[o, i] . x[i]` over a packed weight: each panel streamed once, in order, by one
/// core, as broadcasts of `x` into 32 column sums (no horizontal reductions); runs of
/// consecutive panels are the tasks.
///
/// # Safety
/// The CPU must have AVX-512F; `out` and `x` hold `w.o` and `w.i` floats.
pub(super) unsafe fn matvec_panels_avx512(out: &mut [f32], x: &[f32], w: &Panels) {
    let dst = Out(out.as_mut_ptr());
    let panels = w.cols.len();
    let tasks = team::tasks(RUNS).min(panels);
    team::for_each(tasks, |t| {
        for panel in team::part(panels, tasks, t) {
            let cols = w.cols[panel].clone();
            // SAFETY: the CPU has AVX-512F; this task alone writes `out[cols]`; the panel is
            // `[i, NR]` and `x` holds `i` floats.
            unsafe {
                panel_dot_avx512(
                    dst.ptr().add(cols.start),
                    lane_masks(cols.len()),
                    w.panel(panel),
                    x,
                )
            };
        }
    });
}

/// Weights `[o_k, i]` packed once as [`panel_avx512`] reads them, stacked along the output
/// (their rows numbered on from one weight to the next, `o` in all): each weight's rows in
/// panels of `[i, NR]` (row `NR p + j` of the weight at lane `j` of its panel `p`, zero past
/// its last row), every panel on a cache-line boundary. A panel holds one weight's rows only,
/// so a weight of fewer than a multiple of [`NR`] rows ends in a partial panel.
///
/// The panels live in a [`LargeBuffer`] (page-aligned, on transparent huge pages where the OS
/// offers them): a decode step streams every layer's panels once.
pub struct Panels {
    data: LargeBuffer<f32>,
    i: usize,
    o: usize,
    /// The output columns of each panel.
    cols: Vec<Range<usize>>,
}

impl Panels {
    /// Packs the weights `parts` (each `[o_k, i]`), the panels in parallel.
    ///
    /// # Errors
    /// The OS's error when it cannot map the packed copy.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; each part holds a whole number of rows of `i` floats and
    /// `i <= MAX_DEPTH`.
    pub(super) unsafe fn pack(parts: &[&[f32]], i: usize) -> std::io::Result<Panels> {
        // Each panel: its output columns, its weight and the weight's rows in it.
        let mut panels = Vec::new();
        let mut o = 0;
        for (part, w) in parts.iter().enumerate() {
            let rows = w.len() / i.max(1);
            for p in 0..rows.div_ceil(NR) {
                let local = panel_cols(p, rows);
                panels.push((o + local.start..o + local.end, part, local));
            }
            o += rows;
        }
        let mut data = LargeBuffer::zeroed(panels.len() * i * NR)?;
        data.par_chunks_mut((i * NR).max(1))
            .zip(&panels)
            .for_each(|(block, (_, part, rows))| {
                // SAFETY: the CPU has AVX-512F; `rows` are rows of `parts[part]`; `block` is
                // `[i, NR]`.
                unsafe { pack_avx512(block, parts[*part], rows.clone(), i) };
            });
        let cols = panels.into_iter().map(|(cols, ..)| cols).collect();
        Ok(Panels { data, i, o, cols })
    }

    /// Panel `p` as `[i, NR]`.
    fn panel(&self, p: usize) -> &[f32] {
        &self.data[p * self.i * NR..][..self.i * NR]
    }

    /// The addresses of the panels' buffer.
    pub(super) fn addresses(&self) -> std::ops::Range<usize> {
        self.data.addresses()
    }

    /// The packed weights' `[out, in]` shape (`out` summed over them).
    pub(super) fn shape(&self) -> (usize, usize) {
        (self.o, self.i)
    }
}

/// The keys of one KV head as [`panel_avx512`] reads a weight: `K^T` in panels of [`NR`]
/// consecutive keys (`[i, NR]` each, key `NR p + j` at lane `j` of panel `p`, zero past the
/// last key), every panel on a cache-line boundary. Packed once per attention call, read by
/// every (query block, head) task of the call ([`scores_avx512`]).
pub(super) struct KeyPanels {
    data: Vec<f32>,
    /// The first float of panel 0 in `data` (cache-line aligned).
    at: usize,
    i: usize,
    keys: usize,
}

impl KeyPanels {
    /// Packs the keys of `runs`, in order: each run's rows `stride` floats apart, the key
    /// being the `i` floats at `col` of a row (a KV head's columns); the panels in parallel.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; each run holds whole rows of `stride` floats, `col + i <=
    /// stride` and `stride <= MAX_DEPTH`.
    pub(super) unsafe fn pack(runs: &[&[f32]], stride: usize, col: usize, i: usize) -> KeyPanels {
        let keys: usize = runs.iter().map(|run| run.len() / stride).sum();
        let size = (i * NR).max(1);
        let len = keys.div_ceil(NR) * size;
        let mut data = Vec::<f32>::with_capacity(len + LINE);
        let at = data.as_ptr().align_offset(64).min(LINE);
        data.resize(at, 0.0);
        // Each run's first key, numbered on from one run to the next.
        let starts: Vec<usize> = runs
            .iter()
            .scan(0, |next, run| {
                let start = *next;
                *next += run.len() / stride;
                Some(start)
            })
            .collect();
        let pack = |p: usize, panel: &mut [MaybeUninit<f32>]| {
            let first = p * NR;
            // The runs' keys in this panel: lanes `a..b` from the rows of one run each.
            let pieces = runs.iter().zip(&starts).filter_map(|(run, &start)| {
                let rows = run.len() / stride;
                let (a, b) = (first.max(start), (first + NR).min(start + rows));
                (a < b).then(|| {
                    // Lane `j` of the piece reads row `first + j - start` of the run: the base
                    // is lane 0's row, outside the run for a piece not starting at lane 0
                    // (formed with wrapping arithmetic, never read).
                    let base = run
                        .as_ptr()
                        .wrapping_add(col)
                        .wrapping_add(first.wrapping_sub(start).wrapping_mul(stride));
                    let bits = ((1u64 << (b - first)) - (1u64 << (a - first))) as u32;
                    (base, [bits as __mmask16, (bits >> 16) as __mmask16])
                })
            });
            let pieces: Vec<(*const f32, [__mmask16; 2])> = pieces.collect();
            // SAFETY: the CPU has AVX-512F; every lane a piece's masks set lies on a row of
            // its run; `panel` is `[i, NR]`.
            unsafe { pack_keys_avx512(panel, &pieces, stride) };
        };
        // SAFETY: `pack` writes every float of its panel (`pack_keys_avx512` does).
        unsafe { append_written(&mut data, len, size, pack) };
        KeyPanels { data, at, i, keys }
    }

    /// How many keys it holds.
    pub(super) fn keys(&self) -> usize {
        self.keys
    }

    /// The floats of a key.
    pub(super) fn i(&self) -> usize {
        self.i
    }

    /// Panel `p` as `[i, NR]`.
    fn panel(&self, p: usize) -> &[f32] {
        &self.data[self.at + p * self.i * NR..][..self.i * NR]
    }
}

/// One panel of [`KeyPanels`] from its pieces (lane 0's row address, the lanes each half
/// takes from it): per input position two 16-lane gathers a piece, merged; every float of the
/// panel written (zero in the lanes no piece sets).
///
/// # Safety
/// The CPU must have AVX-512F; a lane `j` set in a piece's masks addresses `i = panel.len() /
/// NR` floats at `base + j * stride`; `stride <= MAX_DEPTH`.
#[target_feature(enable = "avx512f")]
unsafe fn pack_keys_avx512(
    panel: &mut [MaybeUninit<f32>],
    pieces: &[(*const f32, [__mmask16; 2])],
    stride: usize,
) {
    let at = _mm512_mullo_epi32(lanes(), _mm512_set1_epi32(stride as i32));
    for (k, dst) in panel.chunks_exact_mut(NR).enumerate() {
        let (mut a, mut b) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for &(base, [lo, hi]) in pieces {
            // SAFETY: a lane reads only where its mask bit is set, on a row of the run.
            let base = base.wrapping_add(k);
            a = _mm512_mask_i32gather_ps::<4>(a, lo, at, base);
            b = _mm512_mask_i32gather_ps::<4>(b, hi, at, base.wrapping_add(16 * stride));
        }
        _mm512_storeu_ps(dst.as_mut_ptr().cast(), a);
        _mm512_storeu_ps(dst.as_mut_ptr().cast::<f32>().add(16), b);
    }
}

/// `out[r, c] = x[r] . key[NR * panels.start + c]` for `n` rows of `x` (`i` floats each,
/// `stride` apart) and the keys of `panels`: `out` is `[n, keys]` for the keys those panels
/// hold. On the calling thread (a task of the attention's): the rows interleaved into bands,
/// then each panel's 12 x 32 tiles, the next panel fetched into L2 meanwhile.
///
/// # Safety
/// The CPU must have AVX-512F; `x` holds `n` rows of `keys.i` floats `stride` apart, `stride
/// <= MAX_DEPTH`, `panels` are panels of `keys` and `out` holds `n` rows of their keys.
pub(super) unsafe fn scores_avx512(
    out: &mut [f32],
    x: &[f32],
    stride: usize,
    n: usize,
    keys: &KeyPanels,
    panels: Range<usize>,
) {
    let first = panels.start * NR;
    let width = (panels.end * NR).min(keys.keys) - first;
    // SAFETY: the CPU has AVX-512F; `x` holds `n` rows of `keys.i` floats `stride` apart.
    let bands = unsafe { bands(x, stride, n, keys.i) };
    let dst = Out(out.as_mut_ptr());
    for p in panels.clone() {
        let cols = p * NR - first..(p * NR + NR).min(keys.keys) - first;
        let next = (p + 1 < panels.end).then(|| keys.panel(p + 1));
        // SAFETY: the CPU has AVX-512F; `out` is `[n, width]` and `cols` lie in `0..width`;
        // the panel is `[i, NR]` and `bands` holds `x`'s rows as `[n / MR, i, MR]`.
        unsafe { panel_avx512(dst, &bands, keys.panel(p), next, cols, n, width) };
    }
}

/// The output columns of panel `panel` of a weight with `o` rows: [`NR`], fewer in the last.
fn panel_cols(panel: usize, o: usize) -> Range<usize> {
    panel * NR..(panel * NR + NR).min(o)
}

/// `n` rows of `x` (`i` floats each, `stride` apart) interleaved in bands of [`MR`] rows (`[n /
/// MR, i, MR]`, zero past the last row), in parallel (in place from inside a task).
///
/// # Safety
/// The CPU must have AVX-512F; `x` holds `n` rows of `i` floats `stride` apart (the last one
/// may end the slice), and `stride <= MAX_DEPTH`.
unsafe fn bands(x: &[f32], stride: usize, n: usize, i: usize) -> Vec<f32> {
    let fill = |rows: Range<usize>, band: &mut [MaybeUninit<f32>]| {
        // SAFETY: the CPU has AVX-512F; the rows `rows` of `x` exist.
        unsafe { interleave_avx512(band, &x[rows.start * stride..], rows.len(), stride) }
    };
    // SAFETY: `fill` writes every float of its band (`interleave_avx512` does).
    unsafe { bands_of(n, i, fill) }
}

/// `n` rows of `i` floats in bands of [`MR`] rows (`[n / MR, i, MR]`), one band a task (in
/// parallel, as [`append_written`]): `fill(rows, band)` writes the band of the rows `rows`.
///
/// # Safety
/// `fill` writes every float of its band.
unsafe fn bands_of(
    n: usize,
    i: usize,
    fill: impl Fn(Range<usize>, &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    let band = |b: usize, band: &mut [MaybeUninit<f32>]| fill(b * MR..n.min(b * MR + MR), band);
    let mut bands = Vec::new();
    // SAFETY: `fill` writes every float of its band (the caller's contract).
    unsafe { append_written(&mut bands, n.div_ceil(MR) * i * MR, (i * MR).max(1), band) };
    bands
}

/// Appends `len` floats to `v`, written by `fill(c, chunk)` in chunks of `size` (in parallel,
/// as [`team::for_each_chunk`]) where they lie, not zeroed first: the interleaved rows and
/// packed keys of an 860-token prefill are some 16 MB a layer, which the calling thread zeroed
/// while the team waited.
///
/// # Safety
/// `fill` writes every element of its chunk.
unsafe fn append_written(
    v: &mut Vec<f32>,
    len: usize,
    size: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync,
) {
    // No reallocation where the caller reserved the room (`KeyPanels` aligns to its buffer).
    v.reserve(len);
    let start = v.len();
    team::for_each_chunk(&mut v.spare_capacity_mut()[..len], size, fill);
    // SAFETY: `fill` wrote the `len` floats past the old length (the caller's contract).
    unsafe { v.set_len(start + len) };
}

/// The 32 sums `out[j] = panel[.., j] . x` of one panel (`[i, NR]`), the lanes set in the
/// masks stored: four positions per iteration into eight accumulators, the panel prefetched
/// 8 KiB ahead.
///
/// # Safety
/// The CPU must have AVX-512F; `panel` holds `i * NR` floats for `i = x.len()`, `out` the
/// lanes set in the masks.
#[target_feature(enable = "avx512f")]
unsafe fn panel_dot_avx512(out: *mut f32, [lo, hi]: [__mmask16; 2], panel: &[f32], x: &[f32]) {
    let (p, i) = (panel.as_ptr(), x.len());
    let mut acc = [_mm512_setzero_ps(); 8];
    let mut k = 0;
    while k + 4 <= i {
        // 4 positions are 512 bytes of the panel: prefetch the 8 lines 8 KiB ahead (past the
        // panel's end: the next panel, or nothing; a prefetch never faults).
        let ahead = p.wrapping_add(k * NR + 2048);
        for line in 0..8 {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * line).cast());
        }
        for u in 0..4 {
            let b = _mm512_set1_ps(x[k + u]);
            acc[2 * u] = _mm512_fmadd_ps(_mm512_loadu_ps(p.add((k + u) * NR)), b, acc[2 * u]);
            acc[2 * u + 1] =
                _mm512_fmadd_ps(_mm512_loadu_ps(p.add((k + u) * NR + 16)), b, acc[2 * u + 1]);
        }
        k += 4;
    }
    while k < i {
        let b = _mm512_set1_ps(x[k]);
        acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(p.add(k * NR)), b, acc[0]);
        acc[1] = _mm512_fmadd_ps(_mm512_loadu_ps(p.add(k * NR + 16)), b, acc[1]);
        k += 1;
    }
    let s0 = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[4], acc[6]));
    let s1 = _mm512_add_ps(_mm512_add_ps(acc[1], acc[3]), _mm512_add_ps(acc[5], acc[7]));
    _mm512_mask_storeu_ps(out, lo, s0);
    _mm512_mask_storeu_ps(out.add(16), hi, s1);
}

/// Writes `count` rows (at most [`MR`], `stride` floats apart in `rows`) into `band` as `[i,
/// MR]` for `i = band.len() / MR`, zero past the last row: one 12-lane gather per input
/// position.
///
/// # Safety
/// The CPU must have AVX-512F; `rows` holds `count` rows of `i` floats `stride` apart (the
/// last one may end the slice), and `stride <= MAX_DEPTH`.
#[target_feature(enable = "avx512f")]
unsafe fn interleave_avx512(
    band: &mut [MaybeUninit<f32>],
    rows: &[f32],
    count: usize,
    stride: usize,
) {
    let mask: __mmask16 = (1 << count) - 1;
    let at = _mm512_mullo_epi32(lanes(), _mm512_set1_epi32(stride as i32));
    for (k, dst) in band.chunks_exact_mut(MR).enumerate() {
        // SAFETY: lane `m < count` reads `rows[m * stride + k]` (the others are zero); the
        // store writes `dst`'s MR floats.
        let v = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, at, rows.as_ptr().add(k));
        _mm512_mask_storeu_ps(dst.as_mut_ptr().cast(), (1 << MR) - 1, v);
    }
}

/// Copies `w[cols, ..]` into `block` as `[i, NR]` (weight row `cols.start + j` at lane `j`),
/// zero past the panel's last column: two 16-lane gathers per input position.
///
/// # Safety
/// The CPU must have AVX-512F; `cols` are rows of `w` (each `i` long), `block` holds `i * NR`
/// floats, and `i <= MAX_DEPTH`.
#[target_feature(enable = "avx512f")]
unsafe fn pack_avx512(block: &mut [f32], w: &[f32], cols: Range<usize>, i: usize) {
    let [lo, hi] = lane_masks(cols.len());
    let at = _mm512_mullo_epi32(lanes(), _mm512_set1_epi32(i as i32));
    // The second half may start past the end of `w` (a panel of at most 16 rows): its address
    // is formed with wrapping arithmetic and never read (the mask is empty).
    let base = w.as_ptr().add(cols.start * i);
    let half = base.wrapping_add(16 * i);
    for (k, dst) in block.chunks_exact_mut(NR).enumerate() {
        // SAFETY: lane `j` of a gather reads `w[(cols.start + j) * i + k]` only where its mask
        // bit is set, that is for rows in `cols`.
        let a = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), lo, at, base.add(k));
        let b = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), hi, at, half.wrapping_add(k));
        _mm512_storeu_ps(dst.as_mut_ptr(), a);
        _mm512_storeu_ps(dst.as_mut_ptr().add(16), b);
    }
}

/// Bytes a tile prefetches into L2 as it goes: `step` per input position from `at`, none
/// where `at` is null.
#[derive(Clone, Copy)]
struct Ahead {
    at: *const u8,
    /// At most two cache lines.
    step: usize,
}

/// The lanes of a panel `width` columns wide (at most [`NR`]), as the masks of its two 16-lane
/// halves.
fn lane_masks(width: usize) -> [__mmask16; 2] {
    let bits = if width >= NR {
        u32::MAX
    } else {
        (1u32 << width) - 1
    };
    [bits as __mmask16, (bits >> 16) as __mmask16]
}

/// `[0, 1, ..., 15]` as 32-bit lanes.
#[target_feature(enable = "avx512f")]
fn lanes() -> __m512i {
    _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
}

/// The output columns `cols` (at most [`NR`]) of every row: one tile per band. While they
/// run, the first two bands' tiles fetch `next` (the panel the task likely takes next, `[i,
/// NR]`) into L2: a band from L2 then overlaps the next panel's stream from memory, which a
/// panel's first band alone cannot hide (for 12 rows its FMAs take about as long as its bytes
/// from memory). Two bands' time is about what the panel takes from memory; later bands, in a
/// long prefill, skip the prefetches. On 2 cores of an AVX-512 Xeon the catalog's 22-token
/// extend went from 56 to 46.5 ms, the prefill unchanged (docs/BENCHMARKS.md, twenty-second
/// pass).
///
/// # Safety
/// The CPU must have AVX-512F; no other thread touches the columns `cols` of `out` (`n * o`
/// floats); `bands` holds `x` as `[n / MR, i, MR]`, `block` the panel as `[i, NR]`.
#[target_feature(enable = "avx512f")]
unsafe fn panel_avx512(
    out: Out,
    bands: &[f32],
    block: &[f32],
    next: Option<&[f32]>,
    cols: Range<usize>,
    n: usize,
    o: usize,
) {
    let i = block.len() / NR;
    let masks = lane_masks(cols.len());
    // Each position of the first bands' tiles prefetches `step` bytes of `next`: two lines
    // where one band does it all, else one, band `b` taking the `b`-th part of the panel.
    let spread = n.div_ceil(MR).min(2);
    let step = 4 * NR / spread;
    let mut r = 0;
    while r < n {
        let band = r / MR;
        let ahead = Ahead {
            at: match next {
                Some(p) if band < spread => p.as_ptr().cast::<u8>().wrapping_add(band * i * step),
                _ => std::ptr::null(),
            },
            step,
        };
        let rows = MR.min(n - r);
        // SAFETY: band `r / MR` starts at `r * i` of `bands`; the tile writes rows
        // `r..r + rows`, columns `cols` of `out`.
        let x = bands.as_ptr().add(r * i);
        let c = out.0.add(r * o + cols.start);
        macro_rules! tile {
            ($($m:literal)*) => {
                match rows {
                    $($m => tile_avx512::<$m>(c, o, x, block.as_ptr(), i, masks, ahead),)*
                    _ => unreachable!("rows is 1..=MR"),
                }
            };
        }
        tile!(1 2 3 4 5 6 7 8 9 10 11 12);
        r += rows;
    }
}

/// `R` rows of `out` at `c` (row stride `o`, the lanes set in the two half masks) = the first
/// `R` rows of the band at `x` (`[i, MR]`) times the packed block (`[i, NR]`), prefetching
/// `i` steps of `ahead` into L2.
///
/// # Safety
/// The CPU must have AVX-512F; `x` addresses `i * MR` floats, `block` `i * NR`, `c` `R` rows
/// of the lanes set in the masks.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile_avx512<const R: usize>(
    c: *mut f32,
    o: usize,
    x: *const f32,
    block: *const f32,
    i: usize,
    [lo, hi]: [__mmask16; 2],
    ahead: Ahead,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    for k in 0..i {
        if !ahead.at.is_null() {
            // Prefetches never fault: `ahead` may point past a buffer's end.
            let at = ahead.at.wrapping_add(k * ahead.step);
            _mm_prefetch::<_MM_HINT_T1>(at.cast());
            if ahead.step > 64 {
                _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(64).cast());
            }
        }
        // A packed weight's panel comes from memory on its first band: 8 KiB ahead (one line
        // of the two each position reads; the hardware fetches the other).
        _mm_prefetch::<_MM_HINT_T0>(block.wrapping_add(k * NR + 2048).cast());
        let b0 = _mm512_loadu_ps(block.add(k * NR));
        let b1 = _mm512_loadu_ps(block.add(k * NR + 16));
        for (m, acc) in acc.iter_mut().enumerate() {
            let a = _mm512_set1_ps(*x.add(k * MR + m));
            acc[0] = _mm512_fmadd_ps(a, b0, acc[0]);
            acc[1] = _mm512_fmadd_ps(a, b1, acc[1]);
        }
    }
    for (m, acc) in acc.iter().enumerate() {
        _mm512_mask_storeu_ps(c.add(m * o), lo, acc[0]);
        _mm512_mask_storeu_ps(c.add(m * o + 16), hi, acc[1]);
    }
}
