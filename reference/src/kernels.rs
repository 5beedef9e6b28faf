//! Numeric kernels of the forward pass: small free functions, output first, each with a naive
//! version beside it that serves as its test oracle.

use crate::team;

#[cfg(target_arch = "x86_64")]
mod blocked;

/// The environment variable that keeps the x86 kernels (AVX-512, and AVX2 where AVX-512 is
/// missing) off: set (to anything but `0`), the reference runs the portable kernels a CPU
/// without them runs (an ARM phone's), so that the suite can test them on a machine that has
/// them. Read once per process.
pub const PORTABLE_KERNELS_ENV: &str = "KVSNAP_PORTABLE_KERNELS";

/// Whether [`PORTABLE_KERNELS_ENV`] asks for the portable kernels.
pub fn portable_kernels() -> bool {
    static PORTABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PORTABLE.get_or_init(|| std::env::var_os(PORTABLE_KERNELS_ENV).is_some_and(|v| v != "0"))
}

/// The kernels the forward pass runs on this CPU, as chosen at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// AVX-512F: the layers' weights packed into panels, the blocked GEMM's 12 x 32 tiles, the
    /// int8 screen in AVX-512BW where the CPU has it.
    Avx512,
    /// AVX2 and FMA (no AVX-512F): row-major weights, `matmul_few`'s 4 x 1 tiles, the `gemm`
    /// crate for a prefill.
    Avx2,
    /// Neither (an ARM phone's CPU, or [`PORTABLE_KERNELS_ENV`] set): plain loops the compiler
    /// vectorises, and the `gemm` crate for a prefill.
    Portable,
}

impl Kernels {
    /// The kernels this process runs.
    pub fn active() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512f() {
                return Kernels::Avx512;
            }
            if avx2() {
                return Kernels::Avx2;
            }
        }
        Kernels::Portable
    }

    /// Their name: `avx512`, `avx2` or `portable`.
    pub fn name(self) -> &'static str {
        match self {
            Kernels::Avx512 => "avx512",
            Kernels::Avx2 => "avx2",
            Kernels::Portable => "portable",
        }
    }
}

/// Whether the AVX-512F kernels run: the CPU has AVX-512F and [`portable_kernels`] is off.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512f() -> bool {
    !portable_kernels() && std::arch::is_x86_feature_detected!("avx512f")
}

/// Whether the AVX-512BW kernels run: as [`avx512f`], with AVX-512BW too.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512bw() -> bool {
    avx512f() && std::arch::is_x86_feature_detected!("avx512bw")
}

/// Whether the AVX2 kernels run (where the AVX-512 ones do not): the CPU has AVX2 and FMA and
/// [`portable_kernels`] is off.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2() -> bool {
    !portable_kernels()
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
}

/// `out[n, o] = x[n, i] . w[o, i]^T`: a batch of rows times an HF `[out, in]` weight.
///
/// Where the AVX-512F kernels run, one row is [`matvec`] and up to [`FEW_ROWS`] rows are
/// [`matmul_few`]; where the AVX2 ones do, `matmul_few` takes one row too (its 4 x 1 tiles and
/// prefetch against `matvec`'s baseline dot products: the 18 layers' decode matvecs from
/// memory 5% faster in the median of 40 interleaved rounds on a Zen 3 host, docs/BENCHMARKS.md,
/// eighteenth pass). More (a prefill) are a blocked GEMM with 12 x 32 AVX-512 register tiles
/// (the private `blocked` module) where the CPU has AVX-512F. Everything else goes to the
/// `gemm` crate, whose NEON and AVX2 kernels beat `matmul_few`'s portable dot products
/// (through the portable kernels on an AVX-512 host, the catalog's 22-token extend 173 -> 93
/// ms, its prefill 1.82 -> 1.52 s) but not its AVX2 tiles on a few rows (a Zen 3 host, 22 rows:
/// the layers' products 1.4-2.8x faster, docs/BENCHMARKS.md, seventeenth pass). All parallel
/// over [`crate::team`] (the `gemm` crate over rayon's pool).
///
/// # Shapes
/// `out`: `[n, o]`, `x`: `[n, i]`, `w`: `[o, i]`.
pub fn matmul(out: &mut [f32], x: &[f32], w: &[f32], n: usize, i: usize, o: usize) {
    assert_eq!(out.len(), n * o, "matmul: out");
    assert_eq!(x.len(), n * i, "matmul: x");
    assert_eq!(w.len(), o * i, "matmul: w");
    if n == 0 || o == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() && !avx512f() && n <= FEW_ROWS {
        return matmul_few(out, x, w, n, i, o);
    }
    if n == 1 {
        return matvec(out, x, w, i, o);
    }
    #[cfg(target_arch = "x86_64")]
    if avx512f() {
        if n <= FEW_ROWS {
            return matmul_few(out, x, w, n, i, o);
        }
        if i <= blocked::MAX_DEPTH {
            // SAFETY: the CPU has AVX-512F, the lengths are asserted above, the depth checked.
            return unsafe { blocked::matmul_avx512(out, x, w, n, i, o) };
        }
    }
    matmul_gemm_crate(out, x, w, n, i, o)
}

/// A weight `[o, i]` packed once, at load, into the panels the AVX-512 kernels read (`[i, 32]`
/// each, 32 weight rows side by side): [`matmul_packed`] then multiplies it without the
/// per-call copy of [`matmul`]'s blocked GEMM, and a single row streams each panel in order.
///
/// Against the row-major kernels over 18 layers of distinct weights (a throwaway sweep from
/// memory, docs/BENCHMARKS.md, fourteenth pass): a 22-row extend's products 40-41 -> 31 ms,
/// the decode step's matvecs 13.4-14.1 -> 12.2-12.8 ms.
pub struct PackedWeight {
    #[cfg(target_arch = "x86_64")]
    panels: blocked::Panels,
}

impl PackedWeight {
    /// `w` (`[o, i]`) packed, or `None` where the CPU lacks AVX-512F (or `i` exceeds the
    /// blocked GEMM's depth): the row-major kernels then serve it.
    pub fn new(w: &[f32], i: usize, o: usize) -> Option<Self> {
        assert_eq!(w.len(), o * i, "PackedWeight: w");
        Self::stacked(&[w], i)
    }

    /// The weights `parts` (each `[o_k, i]`, all of depth `i`) packed as one `[sum o_k, i]`:
    /// one product gives their outputs side by side in each row, as one parallel pass (a
    /// layer's q, k and v projections, its gate and up). `None` as for [`PackedWeight::new`],
    /// and where the OS cannot map the packed copy: the row-major kernels serve the weights
    /// where they are, slower but the same products.
    pub fn stacked(parts: &[&[f32]], i: usize) -> Option<Self> {
        for (k, w) in parts.iter().enumerate() {
            assert!(
                w.len().is_multiple_of(i),
                "PackedWeight: part {k} is not whole rows of {i}"
            );
        }
        #[cfg(target_arch = "x86_64")]
        if avx512f() && i <= blocked::MAX_DEPTH {
            // SAFETY: the CPU has AVX-512F, each part holds whole rows of `i` floats, the
            // depth is checked.
            let panels = unsafe { blocked::Panels::pack(parts, i) };
            return panels.ok().map(|panels| PackedWeight { panels });
        }
        None
    }

    /// The addresses of the packed copy (see [`crate::buffer::huge_page_bytes`]).
    pub fn addresses(&self) -> std::ops::Range<usize> {
        #[cfg(target_arch = "x86_64")]
        return self.panels.addresses();
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("PackedWeight::new returns None off x86-64")
    }

    /// The weight's `(out, in)` shape.
    pub fn shape(&self) -> (usize, usize) {
        #[cfg(target_arch = "x86_64")]
        return self.panels.shape();
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("PackedWeight::new returns None off x86-64")
    }
}

/// `out[n, o] = x[n, i] . w[o, i]^T` for a packed weight: one row by a panel matvec, more by
/// the blocked GEMM's tiles over the packed panels.
///
/// # Shapes
/// `out`: `[n, o]`, `x`: `[n, i]` for `w`'s `(o, i)`.
pub fn matmul_packed(out: &mut [f32], x: &[f32], w: &PackedWeight, n: usize) {
    let (o, i) = w.shape();
    assert_eq!(out.len(), n * o, "matmul_packed: out");
    assert_eq!(x.len(), n * i, "matmul_packed: x");
    // SAFETY: a `PackedWeight` exists only where the CPU has AVX-512F; the lengths are
    // asserted above.
    #[cfg(target_arch = "x86_64")]
    match n {
        0 => {}
        1 => unsafe { blocked::matvec_panels_avx512(out, x, &w.panels) },
        _ => unsafe { blocked::matmul_panels_avx512(out, x, &w.panels, n) },
    }
}

/// `out = geglu(gate_up) . w^T`: the same floats as [`geglu`] then [`matmul_packed`]. For two
/// rows or more the GeGLU of each band of rows the blocked GEMM interleaves is computed into a
/// small per-thread scratch as the band is made, so its `[n, f]` output never goes to memory
/// and back (7 MB a layer of the 860-token prefill). A single row takes the two calls (there
/// is no band), its GeGLU in a vector of its own: callers with a buffer for it call them
/// directly.
///
/// # Shapes
/// `out`: `[n, o]`, `gate_up`: `[n, 2 i]` for `w`'s `(o, i)` (each row its gate, then its up).
pub fn geglu_matmul_packed(out: &mut [f32], gate_up: &[f32], w: &PackedWeight, n: usize) {
    let (o, i) = w.shape();
    assert_eq!(out.len(), n * o, "geglu_matmul_packed: out");
    assert_eq!(gate_up.len(), n * 2 * i, "geglu_matmul_packed: gate_up");
    match n {
        0 => {}
        1 => {
            let mut ffn = vec![0.0; i];
            geglu(&mut ffn, gate_up, i);
            matmul_packed(out, &ffn, w, 1);
        }
        // SAFETY: a `PackedWeight` exists only where the CPU has AVX-512F; the lengths are
        // asserted above.
        #[cfg(target_arch = "x86_64")]
        _ => unsafe { blocked::geglu_matmul_panels_avx512(out, gate_up, &w.panels, n) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("PackedWeight::new returns None off x86-64"),
    }
}

/// Keys a panel of [`KeyPanels`] holds: [`scores_packed`] scores whole panels.
pub const KEY_PANEL: usize = 32;

/// The keys of one KV head packed as the blocked GEMM packs a weight (`K^T` in panels of
/// [`KEY_PANEL`] consecutive keys), once per attention call: each (query block, head) of the
/// call then scores its visible panels with [`scores_packed`]'s 12 x 32 register tiles, where
/// [`matmul`] took each task's keys as they lie (up to 64 rows of queries by dot products,
/// each ending in a horizontal sum, then a transpose and a copy into the scores): those ran at
/// about a third of the value sums' rate and took 13% of a prefill's samples. On a 2-core
/// AVX-512 Xeon, criterion `attention/chunk32` 78 / 453 / 865 -> 63 / 357 / 725 us at 64 / 512 /
/// 1024 keys, the catalog's 860-token prefill 0.85-0.89 -> 0.80-0.81 s in three alternating
/// pairs (docs/BENCHMARKS.md, thirty-fifth pass).
pub struct KeyPanels {
    #[cfg(target_arch = "x86_64")]
    panels: blocked::KeyPanels,
}

impl KeyPanels {
    /// The keys of `runs`, in order: in each run, rows `stride` floats apart whose `i`
    /// floats at `col` are the key (a KV head's columns of the cached rows). `None` where the
    /// AVX-512F kernels do not run: the attention then scores with [`matmul`].
    pub fn pack(runs: &[&[f32]], stride: usize, col: usize, i: usize) -> Option<Self> {
        assert!(
            col + i <= stride,
            "KeyPanels: columns {col}..{} of {stride}",
            col + i
        );
        for (r, run) in runs.iter().enumerate() {
            assert!(
                run.len().is_multiple_of(stride),
                "KeyPanels: run {r} is not whole rows of {stride}"
            );
        }
        #[cfg(target_arch = "x86_64")]
        if avx512f() && stride <= blocked::MAX_DEPTH {
            // SAFETY: the CPU has AVX-512F; the runs hold whole rows, the columns and the
            // stride are checked above.
            let panels = unsafe { blocked::KeyPanels::pack(runs, stride, col, i) };
            return Some(KeyPanels { panels });
        }
        None
    }

    /// How many keys it holds.
    pub fn keys(&self) -> usize {
        #[cfg(target_arch = "x86_64")]
        return self.panels.keys();
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("KeyPanels::pack returns None off x86-64")
    }
}

/// `out[r, c] = x[r] . key[KEY_PANEL * panels.start + c]`: `n` rows of `x` (`i` floats each,
/// `stride` apart, as a head's queries lie in a chunk's) scored against the keys of the
/// panels `panels` of `keys`, on the calling thread.
///
/// # Shapes
/// `out`: `[n, k]` for the `k` keys of those panels; `x`: `n` rows of the keys' `i` floats.
pub fn scores_packed(
    out: &mut [f32],
    x: &[f32],
    stride: usize,
    n: usize,
    keys: &KeyPanels,
    panels: std::ops::Range<usize>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        let i = keys.panels.i();
        let first = panels.start * KEY_PANEL;
        let end = (panels.end * KEY_PANEL).min(keys.keys());
        assert!(first < end || n == 0, "scores_packed: panels {panels:?}");
        assert_eq!(out.len(), n * (end - first), "scores_packed: out");
        assert!(
            n == 0
                || (i <= stride && stride <= blocked::MAX_DEPTH && x.len() >= (n - 1) * stride + i),
            "scores_packed: x"
        );
        if n > 0 {
            // SAFETY: a `KeyPanels` exists only where the CPU has AVX-512F (and the stride of
            // its packing, checked there, is at least `i`); the shapes are asserted above.
            unsafe { blocked::scores_avx512(out, x, stride, n, &keys.panels, panels) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (out, x, stride, n, panels);
        unreachable!("KeyPanels::pack returns None off x86-64")
    }
}

/// [`matmul`] by the `gemm` crate (blocked SIMD GEMM, rayon): what [`matmul`] runs for a
/// prefill where the CPU lacks AVX-512F, and the second SGEMM of `kvsnap bench limits`.
///
/// # Shapes
/// `out`: `[n, o]`, `x`: `[n, i]`, `w`: `[o, i]`.
pub fn matmul_gemm_crate(out: &mut [f32], x: &[f32], w: &[f32], n: usize, i: usize, o: usize) {
    assert_eq!(out.len(), n * o, "matmul_gemm_crate: out");
    assert_eq!(x.len(), n * i, "matmul_gemm_crate: x");
    assert_eq!(w.len(), o * i, "matmul_gemm_crate: w");
    // SAFETY: the three buffers have the asserted lengths, and the strides below address
    // exactly `[n, o]`, `[n, i]` and the transpose of `[o, i]` (column stride `i`).
    unsafe {
        gemm::gemm(
            n,
            o,
            i,
            out.as_mut_ptr(),
            1,
            o as isize,
            false,
            x.as_ptr(),
            1,
            i as isize,
            w.as_ptr(),
            i as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
}

/// Rows up to which [`matmul`] runs [`matmul_few`] rather than a blocked GEMM: an extend's
/// utterance. Against the `gemm` crate (which packs each weight per call) the tiles won clearly
/// on the model's projections (criterion, a 2-core Xeon: 22 rows of `[2048, 640]` 1.18 -> 0.63
/// ms, 64 rows 2.59 -> 1.31 ms). Against the AVX-512 blocked GEMM (`blocked`) a 22-row chunk
/// is a draw: faster for q and gate/up, slower for k/v and down in cache, and the catalog's
/// 22-token extend took 114-129 ms with either (docs/BENCHMARKS.md, seventh pass). With the
/// weights packed at load ([`PackedWeight`]) the blocked tiles win: the model's layers run
/// [`matmul_packed`] where the CPU has AVX-512F, and `matmul` serves the attention's scores
/// and CPUs without it. With AVX2 only (a Zen 3 host), 64 rows are still at least a draw with
/// the `gemm` crate (gate/up `[4096, 640]`: 4.0 vs 3.7 ms; down 2.6 -> 1.7 ms).
pub const FEW_ROWS: usize = 64;

/// Rows of a norm a task takes where a prefill's many rows run on the team; a decode step's
/// one row, or a short extend's few, run on the calling thread as one task.
const ROW_TASK: usize = 32;

/// Elements of a residual add a task takes: [`ROW_TASK`] rows of Gemma 3 270M's width (640).
/// [`add_inplace`] sees flat slices; a model of another width only splits them elsewhere.
const ADD_TASK: usize = ROW_TASK * 640;

/// How many groups of four weight rows ahead [`matmul_few`] prefetches.
#[cfg(target_arch = "x86_64")]
const FEW_AHEAD_GROUPS: usize = 2;

/// `out[n, o] = x[n, i] . w[o, i]^T` for a few rows, weight-stationary like [`matvec`]: each
/// group of four weight rows is read from memory once, in order, and multiplied with every row
/// of `x` (which stays in cache) as tiles of dot products ([`few_rows`]); blocks of 64
/// weight rows are the tasks ([`crate::team`]). A group's first tile prefetches the group two
/// ahead: without it a group's rows arrived only as its first tile read them (a 22-token
/// extend after an 860-token prefix, when the layers still ran here: five interleaved runs of
/// 30, p50 74.7-85.5 -> 66.3-80.5 ms, faster in each; docs/BENCHMARKS.md, fourteenth pass).
/// Computed as `out^T` (each task owns whole rows of it), then transposed (one row is its own
/// transpose, computed in place).
pub fn matmul_few(out: &mut [f32], x: &[f32], w: &[f32], n: usize, i: usize, o: usize) {
    assert_eq!(out.len(), n * o, "matmul_few: out");
    assert_eq!(x.len(), n * i, "matmul_few: x");
    assert_eq!(w.len(), o * i, "matmul_few: w");
    if n == 0 || o == 0 {
        return;
    }
    const ROWS: usize = 64;
    // `[o, n]`; one row is its own transpose, computed in `out`.
    let mut transposed = Vec::new();
    let t: &mut [f32] = if n == 1 {
        out
    } else {
        transposed.resize(o * n, 0.0f32);
        &mut transposed
    };
    team::for_each_chunk_zip(t, ROWS * n, w, ROWS * i, |t, w| few_rows(t, x, w, n, i));
    if n > 1 {
        for (r, out) in out.chunks_exact_mut(o).enumerate() {
            for (c, out) in out.iter_mut().enumerate() {
                *out = transposed[c * n + r];
            }
        }
    }
}

/// `t[r, c] = w[r] . x[c]` on the calling thread: [`matmul_few`]'s transposed product for
/// one block of weight rows, by tiles of dot products where the CPU has AVX-512F (4 x 4) or
/// AVX2 and FMA (4 x 3). The attention's decode step scores blocks of keys (`w`) against a KV
/// head's queries (`x`) with it.
///
/// # Shapes
/// `t`: `[rows, n]`, `x`: `[n, i]`, `w`: `[rows, i]`.
pub fn few_rows(t: &mut [f32], x: &[f32], w: &[f32], n: usize, i: usize) {
    assert!(
        x.len() == n * i && w.len().is_multiple_of(i.max(1)) && t.len() * i == w.len() * n,
        "few_rows: shapes"
    );
    #[cfg(target_arch = "x86_64")]
    if i > 0 {
        let tiles = if avx512f() {
            Some(&AVX512_DOT_TILES)
        } else if avx2() {
            Some(&AVX2_DOT_TILES)
        } else {
            None
        };
        if let Some(tiles) = tiles {
            // SAFETY: the CPU has the tiles' instructions; `t` is `[rows, n]` for the
            // `[rows, i]` block `w`, and `x` is `[n, i]` (asserted above).
            unsafe { few_rows_tiled(t, x, w, n, i, tiles) };
            return;
        }
    }
    for (t, row) in t.chunks_exact_mut(n.max(1)).zip(w.chunks_exact(i.max(1))) {
        for (t, xr) in t.iter_mut().zip(x.chunks_exact(i.max(1))) {
            *t = dot_plain(row, xr);
        }
    }
}

/// A tile kernel of [`few_rows`]: `t[r * n + c] = w[r] . x[c]` for the kernel's `R` weight
/// rows at `w` and `C` rows of `x` at `x`, each `i` long, prefetching `R` rows at `ahead`
/// unless it is null.
#[cfg(target_arch = "x86_64")]
type DotTile =
    unsafe fn(w: *const f32, x: *const f32, i: usize, ahead: *const f32, t: *mut f32, n: usize);

/// The tiles of one instruction set for [`few_rows_tiled`]: `four[c - 1]` multiplies four
/// weight rows by `c` rows of `x`, `one[c - 1]` one weight row; both as wide as each other.
#[cfg(target_arch = "x86_64")]
struct DotTiles {
    four: &'static [DotTile],
    one: &'static [DotTile],
}

/// AVX-512F tiles: up to 4 x 4 accumulators of 16 lanes.
#[cfg(target_arch = "x86_64")]
const AVX512_DOT_TILES: DotTiles = DotTiles {
    four: &[
        tile_avx512::<4, 1>,
        tile_avx512::<4, 2>,
        tile_avx512::<4, 3>,
        tile_avx512::<4, 4>,
    ],
    one: &[
        tile_avx512::<1, 1>,
        tile_avx512::<1, 2>,
        tile_avx512::<1, 3>,
        tile_avx512::<1, 4>,
    ],
};

/// AVX2 and FMA tiles: up to 4 x 3 accumulators of 8 lanes (with the three rows of `x`, 15
/// of the 16 registers).
#[cfg(target_arch = "x86_64")]
const AVX2_DOT_TILES: DotTiles = DotTiles {
    four: &[tile_avx2::<4, 1>, tile_avx2::<4, 2>, tile_avx2::<4, 3>],
    one: &[tile_avx2::<1, 1>, tile_avx2::<1, 2>, tile_avx2::<1, 3>],
};

/// [`few_rows`] by `tiles`: four weight rows at a time (then one), each against as many rows
/// of `x` as the widest tile takes (then the rest). A group's first tile also prefetches the
/// group [`FEW_AHEAD_GROUPS`] ahead (past the block's end: the next block in memory).
///
/// # Safety
/// The CPU must have the tiles' instructions; `i > 0`, `t` is `[rows, n]`, `w` `[rows, i]`,
/// `x` `[n, i]`.
#[cfg(target_arch = "x86_64")]
unsafe fn few_rows_tiled(
    t: &mut [f32],
    x: &[f32],
    w: &[f32],
    n: usize,
    i: usize,
    tiles: &DotTiles,
) {
    let rows = w.len() / i;
    let mut r = 0;
    while r < rows {
        let (step, kernels) = if r + 4 <= rows {
            (4, tiles.four)
        } else {
            (1, tiles.one)
        };
        let mut c = 0;
        while c < n {
            let width = (n - c).min(kernels.len());
            let ahead = if c == 0 {
                w.as_ptr().wrapping_add((r + 4 * FEW_AHEAD_GROUPS) * i)
            } else {
                std::ptr::null()
            };
            kernels[width - 1](
                w.as_ptr().add(r * i),
                x.as_ptr().add(c * i),
                i,
                ahead,
                t.as_mut_ptr().add(r * n + c),
                n,
            );
            c += width;
        }
        r += step;
    }
}

/// `R x C` dot products of `R` weight rows at `w` with `C` rows of `x` at `x`, each `i` long,
/// into `t` (rows `n` apart): `R * C` 16-lane accumulators, a masked load for the tail.
///
/// # Safety
/// The CPU must have AVX-512F; `w` and `x` address `R` and `C` rows of `i` floats, `t` `R`
/// rows of stride `n` with `C` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const R: usize, const C: usize>(
    w: *const f32,
    x: *const f32,
    i: usize,
    ahead: *const f32,
    t: *mut f32,
    n: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let mut k = 0;
    while k < i {
        if !ahead.is_null() {
            for r in 0..R {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(r * i + k).cast());
            }
        }
        // SAFETY (all loads): 16 floats at `k < i - 15` of each row, or the `i - k` that exist.
        let mask: __mmask16 = if k + 16 <= i {
            u16::MAX
        } else {
            (1u16 << (i - k)) - 1
        };
        let xv: [__m512; C] =
            std::array::from_fn(|c| _mm512_maskz_loadu_ps(mask, x.add(c * i + k)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let wv = _mm512_maskz_loadu_ps(mask, w.add(r * i + k));
            for (acc, xv) in acc.iter_mut().zip(&xv) {
                *acc = _mm512_fmadd_ps(wv, *xv, *acc);
            }
        }
        k += 16;
    }
    for (r, acc) in acc.iter().enumerate() {
        for (c, acc) in acc.iter().enumerate() {
            *t.add(r * n + c) = _mm512_reduce_add_ps(*acc);
        }
    }
}

/// [`tile_avx512`] in AVX2 and FMA: `R * C` 8-lane accumulators, a masked load
/// (`vmaskmovps`, which reads no lane it masks) for the tail, a prefetch per 16 floats.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `w` and `x` address `R` and `C` rows of `i` floats, `t`
/// `R` rows of stride `n` with `C` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize, const C: usize>(
    w: *const f32,
    x: *const f32,
    i: usize,
    ahead: *const f32,
    t: *mut f32,
    n: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let fma = |acc: &mut [[__m256; C]; R], wv: [__m256; R], xv: [__m256; C]| {
        for (acc, wv) in acc.iter_mut().zip(wv) {
            for (acc, xv) in acc.iter_mut().zip(xv) {
                *acc = _mm256_fmadd_ps(wv, xv, *acc);
            }
        }
    };
    let mut k = 0;
    // SAFETY (all loads): 8 floats at `k + 8 <= i` of each row.
    while k + 8 <= i {
        if !ahead.is_null() && k % 16 == 0 {
            for r in 0..R {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(r * i + k).cast());
            }
        }
        let xv = std::array::from_fn(|c| _mm256_loadu_ps(x.add(c * i + k)));
        let wv = std::array::from_fn(|r| _mm256_loadu_ps(w.add(r * i + k)));
        fma(&mut acc, wv, xv);
        k += 8;
    }
    if k < i {
        // SAFETY: the mask's lanes below `i - k` only, the floats that exist.
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((i - k) as i32), lanes);
        let xv = std::array::from_fn(|c| _mm256_maskload_ps(x.add(c * i + k), mask));
        let wv = std::array::from_fn(|r| _mm256_maskload_ps(w.add(r * i + k), mask));
        fma(&mut acc, wv, xv);
    }
    for (r, acc) in acc.iter().enumerate() {
        for (c, acc) in acc.iter().enumerate() {
            let half = _mm_add_ps(
                _mm256_castps256_ps128(*acc),
                _mm256_extractf128_ps::<1>(*acc),
            );
            let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
            let one = _mm_add_ss(pair, _mm_movehdup_ps(pair));
            *t.add(r * n + c) = _mm_cvtss_f32(one);
        }
    }
}

/// Rows of a streamed matrix-vector product per task: runs of at least 64 rows, a few per
/// thread (each claim of a task costs a cache line's round trip between cores).
fn stream_rows(o: usize) -> usize {
    o.div_ceil(team::tasks(4)).next_multiple_of(64).max(64)
}

/// `out[o] = w[o, i] . x[i]`: weight-stationary matrix-vector product for decode.
///
/// Each weight row is read once, in order, by one core; runs of rows are the tasks
/// ([`crate::team`]). The tied head's full logits run it on every CPU (each row's sum
/// as [`dot`] computes it, which `crate::head`'s f32 recomputation relies on), and so does a
/// one-row [`matmul`] where neither the AVX2 tiles nor the packed AVX-512 panels apply.
pub fn matvec(out: &mut [f32], x: &[f32], w: &[f32], i: usize, o: usize) {
    assert_eq!(out.len(), o, "matvec: out");
    assert_eq!(x.len(), i, "matvec: x");
    assert_eq!(w.len(), o * i, "matvec: w");
    let rows = stream_rows(o);
    team::for_each_chunk_zip(out, rows, w, rows * i, |out, w| {
        #[cfg(target_arch = "x86_64")]
        if avx512f() {
            for (o, row) in out.iter_mut().zip(w.chunks_exact(i)) {
                // SAFETY: the CPU has AVX-512F.
                *o = unsafe { dot_avx512::<STREAM_AHEAD>(row, x) };
            }
            return;
        }
        for (o, row) in out.iter_mut().zip(w.chunks_exact(i)) {
            *o = dot_plain(row, x);
        }
    });
}

/// `out[o] = q[o, i] . x[i]`: int8 weights against int16 activations, each row summed exactly
/// in i32. The approximate pass of the tied head (`crate::head`), which reads a quarter of the
/// bytes of the f32 table.
///
/// The sums are exact as long as `i * 127 * max |x|` fits in an i32 ([`q8_i16_limit`] gives the
/// largest `|x|` that does; asserted). Where the CPU has AVX-512BW, 32 weights are widened to
/// int16 in one instruction and meet `x` in one `vpmaddwd` (adjacent products summed into i32
/// lanes). It replaced a kernel that converted each weight to f32 for an FMA: on a Zen 4 host,
/// whose 512-bit instructions run as two 256-bit halves, that one computed at 20 GB/s of
/// weights where a two-thread sum streams 30; this one keeps up with the stream
/// (docs/BENCHMARKS.md, thirteenth pass).
///
/// # Shapes
/// `out`: `[o]`, `x`: `[i]`, `q`: `[o, i]`.
pub fn matvec_q8_i16(out: &mut [i32], x: &[i16], q: &[i8], i: usize, o: usize) {
    assert_eq!(out.len(), o, "matvec_q8_i16: out");
    assert_eq!(x.len(), i, "matvec_q8_i16: x");
    assert_eq!(q.len(), o * i, "matvec_q8_i16: q");
    let peak = x.iter().map(|v| v.unsigned_abs()).max().unwrap_or(0);
    assert!(
        peak <= q8_i16_limit(i).unsigned_abs(),
        "matvec_q8_i16: |x| up to {peak} could overflow an i32 sum of {i} products"
    );
    let rows = stream_rows(o);
    team::for_each_chunk_zip(out, rows, q, rows * i, |out, q| {
        #[cfg(target_arch = "x86_64")]
        if avx512bw() {
            for (o, row) in out.iter_mut().zip(q.chunks_exact(i)) {
                // SAFETY: the CPU has AVX-512F and BW; `row` and `x` hold `i` elements.
                *o = unsafe { dot_q8_i16_avx512(row, x) };
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if avx2() {
            for (o, row) in out.iter_mut().zip(q.chunks_exact(i)) {
                // SAFETY: the CPU has AVX2; `row` and `x` hold `i` elements.
                *o = unsafe { dot_q8_i16_avx2(row, x) };
            }
            return;
        }
        matvec_q8_i16_naive(out, x, q, i, out.len());
    });
}

/// The largest `|x|` for which [`matvec_q8_i16`]'s i32 sums of `i` products cannot overflow:
/// `i32::MAX / (127 i)`, at most `i16::MAX` (26420 for Gemma 3 270M's 640).
pub fn q8_i16_limit(i: usize) -> i16 {
    let limit = i32::MAX as usize / (127 * i.max(1));
    limit.min(i16::MAX as usize) as i16
}

/// Dot product of int8 weights with int16 `x`, exact in i32 (no overflow: the caller's
/// bound), prefetching the weights like [`matvec`].
///
/// # Safety
/// The CPU must have AVX-512F and AVX-512BW; `row.len() == x.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn dot_q8_i16_avx512(row: &[i8], x: &[i16]) -> i32 {
    use std::arch::x86_64::*;
    let n = row.len();
    let (pq, px) = (row.as_ptr(), x.as_ptr());
    let mut acc = [_mm512_setzero_si512(); 2];
    let mut k = 0;
    // SAFETY (all loads): 32 weights (32 bytes) and 32 activations at `k + 32 <= n`.
    while k + 64 <= n {
        _mm_prefetch::<_MM_HINT_T0>(pq.add(k).wrapping_add(STREAM_AHEAD));
        for (j, acc) in acc.iter_mut().enumerate() {
            let w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(pq.add(k + 32 * j).cast()));
            let xv = _mm512_loadu_si512(px.add(k + 32 * j).cast());
            *acc = _mm512_add_epi32(*acc, _mm512_madd_epi16(w, xv));
        }
        k += 64;
    }
    let mut sum = _mm512_reduce_add_epi32(_mm512_add_epi32(acc[0], acc[1]));
    for (&q, &x) in row[k..].iter().zip(&x[k..]) {
        sum += i32::from(q) * i32::from(x);
    }
    sum
}

/// [`dot_q8_i16_avx512`] on CPUs with AVX2 and without AVX-512BW: 16 weights widened to
/// int16 at a time, four such `vpmaddwd`s an iteration. The naive loop the compiler vectorizes
/// for the x86-64 baseline (SSE2, which has no sign extension of bytes) screened the head at 9
/// GB/s of weights on a Zen 3 host whose two threads read 26 (docs/BENCHMARKS.md, sixteenth
/// pass).
///
/// # Safety
/// The CPU must have AVX2; `row.len() == x.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_q8_i16_avx2(row: &[i8], x: &[i16]) -> i32 {
    use std::arch::x86_64::*;
    let n = row.len();
    let (pq, px) = (row.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_si256(); 4];
    let mut k = 0;
    // SAFETY (all loads): 16 weights (16 bytes) and 16 activations at `k + 16 * (j + 1) <= n`.
    while k + 64 <= n {
        _mm_prefetch::<_MM_HINT_T0>(pq.add(k).wrapping_add(STREAM_AHEAD));
        for (j, acc) in acc.iter_mut().enumerate() {
            let w = _mm256_cvtepi8_epi16(_mm_loadu_si128(pq.add(k + 16 * j).cast()));
            let xv = _mm256_loadu_si256(px.add(k + 16 * j).cast());
            *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(w, xv));
        }
        k += 64;
    }
    let sum = _mm256_add_epi32(
        _mm256_add_epi32(acc[0], acc[1]),
        _mm256_add_epi32(acc[2], acc[3]),
    );
    let half = _mm_add_epi32(
        _mm256_castsi256_si128(sum),
        _mm256_extracti128_si256::<1>(sum),
    );
    let mut lanes = [0i32; 4];
    _mm_storeu_si128(lanes.as_mut_ptr().cast(), half);
    let mut total = lanes.iter().sum::<i32>();
    for (&q, &x) in row[k..].iter().zip(&x[k..]) {
        total += i32::from(q) * i32::from(x);
    }
    total
}

/// Naive oracle of [`matvec_q8_i16`]: each row summed in order in i32. The sums are exact, so
/// the two agree exactly.
pub fn matvec_q8_i16_naive(out: &mut [i32], x: &[i16], q: &[i8], i: usize, o: usize) {
    for (out, row) in out.iter_mut().zip(q.chunks_exact(i)).take(o) {
        *out = row
            .iter()
            .zip(x)
            .map(|(&q, &x)| i32::from(q) * i32::from(x))
            .sum();
    }
}

/// How far ahead of its loads [`matvec`]'s dot prefetches the weights, in bytes. The hardware
/// prefetchers stop at 4 KiB page boundaries; prefetching two pages ahead kept the stream going
/// (the real head and layers: 23-24 -> 25-26 GB/s on 2 cores of an Ice Lake server).
#[cfg(target_arch = "x86_64")]
const STREAM_AHEAD: usize = 8192;

/// Naive oracle of [`matmul`] with f64 accumulation.
pub fn matmul_naive(out: &mut [f32], x: &[f32], w: &[f32], n: usize, i: usize, o: usize) {
    for r in 0..n {
        for c in 0..o {
            let mut acc = 0.0f64;
            for k in 0..i {
                acc += x[r * i + k] as f64 * w[c * i + k] as f64;
            }
            out[r * o + c] = acc as f32;
        }
    }
}

/// Dot product: four 16-lane FMA accumulators where the CPU has AVX-512F, otherwise eight
/// independent accumulators (so that the baseline build vectorises).
///
/// [`matvec`] runs this loop (with a prefetch) over weights from memory. On an
/// Ice Lake server the baseline's single 4-lane add chain keeps a core at about 6 GB/s, below
/// what memory delivers; the AVX-512 loop streams the real head and layers at 17-19 GB/s on 2
/// cores, against 11-12 GB/s (docs/BENCHMARKS.md, fourth pass).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if avx512f() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { dot_avx512::<0>(a, b) };
    }
    dot_plain(a, b)
}

/// [`dot`] with AVX-512F intrinsics: 64 products per iteration into four accumulators, a
/// masked load for the tail. With `AHEAD > 0` it also prefetches `a` that many bytes ahead
/// (prefetches never fault, so running past the end of `a` is harmless).
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512<const AHEAD: usize>(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut k = 0;
    // SAFETY (all loads): each reads 16 floats at `k + 16 j < n` of slices of length >= n;
    // the masked load reads only the `n - k < 16` lanes that exist.
    while k + 64 <= n {
        if AHEAD > 0 {
            let ahead = pa.add(k).cast::<i8>().wrapping_add(AHEAD);
            for line in 0..4 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line));
            }
        }
        for (j, acc) in acc.iter_mut().enumerate() {
            let (x, y) = (pa.add(k + 16 * j), pb.add(k + 16 * j));
            *acc = _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(y), *acc);
        }
        k += 64;
    }
    while k + 16 <= n {
        acc[0] = _mm512_fmadd_ps(
            _mm512_loadu_ps(pa.add(k)),
            _mm512_loadu_ps(pb.add(k)),
            acc[0],
        );
        k += 16;
    }
    if k < n {
        let mask: __mmask16 = (1u16 << (n - k)) - 1;
        let x = _mm512_maskz_loadu_ps(mask, pa.add(k));
        let y = _mm512_maskz_loadu_ps(mask, pb.add(k));
        acc[1] = _mm512_fmadd_ps(x, y, acc[1]);
    }
    let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(sum)
}

#[inline(always)]
fn dot_plain(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut tail = 0.0;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]) + tail
}

/// `out = x * rsqrt(mean(x^2) + eps) * (1 + w)` row by row, in f32 as transformers'
/// `Gemma3RMSNorm` computes it. `w` is the HF weight (not `1 + w`).
///
/// # Shapes
/// `out`, `x`: `[rows, dim]`; `w`: `[dim]`.
pub fn rms_norm(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let dim = w.len();
    assert_eq!(out.len(), x.len(), "rms_norm: out");
    assert_eq!(x.len() % dim, 0, "rms_norm: x");
    let rows = ROW_TASK * dim;
    team::for_each_chunk_zip(out, rows, x, rows, |out, x| {
        for (o, x) in out.chunks_exact_mut(dim).zip(x.chunks_exact(dim)) {
            let inv = inverse_rms(x, eps);
            for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                *o = x * inv * (1.0 + w);
            }
        }
    });
}

/// In-place [`rms_norm`].
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    team::for_each_chunk(x, ROW_TASK * dim, |_, x| {
        for x in x.chunks_exact_mut(dim) {
            let inv = inverse_rms(x, eps);
            for (x, &w) in x.iter_mut().zip(w) {
                *x = *x * inv * (1.0 + w);
            }
        }
    });
}

/// `1 / sqrt(mean(x^2) + eps)` of one row, the scale of [`rms_norm`].
#[inline]
fn inverse_rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt()
}

/// Naive oracle of [`rms_norm`] in f64.
pub fn rms_norm_naive(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let dim = w.len();
    for (o, x) in out.chunks_exact_mut(dim).zip(x.chunks_exact(dim)) {
        let mean = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
        let inv = 1.0 / (mean + eps as f64).sqrt();
        for k in 0..dim {
            o[k] = (x[k] as f64 * inv * (1.0 + w[k] as f64)) as f32;
        }
    }
}

/// GELU with the tanh approximation (`gelu_pytorch_tanh`),
/// `0.5 x (1 + tanh(u))` with `u = sqrt(2 / pi) (x + 0.044715 x^3)`.
///
/// Computed as the identical `x / (1 + exp(-2u))` (since `1 + tanh(u) = 2 sigmoid(2u)`) with
/// [`exp_approx`], so that a loop of it vectorises: libm's `tanhf` is a call per element and
/// took 10% of a 22-token extend. Within a few ulps of the f64 formula where `1 + tanh(u)` in
/// f32 has no digits left (tested below).
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    x / (1.0 + exp_approx(-2.0 * u))
}

/// `e^z` without a libm call, branch-free so that loops of it vectorise: `z = n ln 2 + r`
/// with `|r| <= ln 2 / 2` (Cody-Waite split of ln 2), then `2^n` times the degree-7 Taylor
/// polynomial of `e^r` (truncation below 6e-9 relative). Below `z = -87` it is 0 (the true
/// value is under f32's normal range, so masked scores of `-inf` weigh nothing); above 88 it
/// stays at `e^88`, finite; NaN stays NaN.
#[inline(always)]
pub fn exp_approx(z: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4; // exactly representable high part of ln 2
    const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 - LN2_HI
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let low = z < -87.0;
    let z = z.clamp(-87.0, 88.0);
    let shifted = z * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = z - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
    // The low bits of `shifted` hold n (|n| <= 127); 2^n is n + 127 in the exponent field.
    let n = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    let e = p * f32::from_bits(((n + 127) as u32) << 23);
    if low {
        0.0
    } else {
        e
    }
}

/// `out = gelu_tanh(gate) * up`, element-wise (the GeGLU of Gemma's MLP), for rows of
/// `gate_up` that hold a row's gate and then its up (the output of the stacked gate and up
/// projections).
///
/// # Shapes
/// `out`: `[n, f]`, `gate_up`: `[n, 2 f]`.
pub fn geglu(out: &mut [f32], gate_up: &[f32], f: usize) {
    assert_eq!(gate_up.len(), 2 * out.len(), "geglu: gate_up");
    if f == 0 {
        return;
    }
    assert!(out.len().is_multiple_of(f), "geglu: out is not rows of {f}");
    // Tasks of at least 4096 outputs: one for a decode step's single row.
    let rows = 4096usize.div_ceil(f);
    team::for_each_chunk_zip(out, rows * f, gate_up, rows * 2 * f, |out, gate_up| {
        for (out, gate_up) in out.chunks_exact_mut(f).zip(gate_up.chunks_exact(2 * f)) {
            let (gate, up) = gate_up.split_at(f);
            #[cfg(target_arch = "x86_64")]
            if avx512f() {
                // SAFETY: the CPU has AVX-512F.
                unsafe { geglu_avx512(out, gate, up) };
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            if avx2() {
                // SAFETY: the CPU has AVX2 and FMA.
                unsafe { geglu_avx2(out, gate, up) };
                continue;
            }
            geglu_plain(out, gate, up)
        }
    });
}

/// [`geglu_plain`] compiled for AVX-512 (16 lanes instead of the baseline's 4).
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn geglu_avx512(out: &mut [f32], gate: &[f32], up: &[f32]) {
    geglu_plain(out, gate, up)
}

/// [`geglu_plain`] compiled for AVX2 (8 lanes). The same operations in the same order: no
/// FMA contraction, so its results equal the plain loop's.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn geglu_avx2(out: &mut [f32], gate: &[f32], up: &[f32]) {
    geglu_plain(out, gate, up)
}

#[inline(always)]
fn geglu_plain(out: &mut [f32], gate: &[f32], up: &[f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = gelu_tanh(g) * u;
    }
}

/// Rows `ids` of a `[rows, width]` row-major table, concatenated: the embedding gather.
/// Every id must be a row of the table (callers check ids against the vocab first).
///
/// # Shapes
/// `table`: `[rows, width]`; returns `[ids.len(), width]`.
pub fn gather_rows(table: &[f32], width: usize, ids: &[u32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(ids.len() * width);
    for &id in ids {
        let start = id as usize * width;
        out.extend_from_slice(&table[start..start + width]);
    }
    out
}

/// In-place softmax in f32 with max subtraction; exponentials by [`exp_approx`], vectorised
/// (16 lanes where the CPU has AVX-512F, 8 where it has AVX2).
pub fn softmax(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx512f() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { softmax_avx512(x) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { softmax_avx2(x) };
    }
    softmax_plain(x)
}

/// [`softmax_plain`] compiled for AVX-512.
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_avx512(x: &mut [f32]) {
    softmax_plain(x)
}

/// [`softmax_plain`] compiled for AVX2 (8 lanes), with the same results.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(x: &mut [f32]) {
    softmax_plain(x)
}

#[inline(always)]
fn softmax_plain(x: &mut [f32]) {
    // Sixteen partial maxima and sums, so that both reductions vectorise.
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = m.max(v);
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let mut sums = [0.0f32; LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (s, v) in sums.iter_mut().zip(c) {
            *v = exp_approx(*v - max);
            *s += *v;
        }
    }
    let mut sum = 0.0f32;
    for v in chunks.into_remainder() {
        *v = exp_approx(*v - max);
        sum += *v;
    }
    let inv = 1.0 / (sum + sums.iter().sum::<f32>());
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `out += x`, element-wise (residual connections).
pub fn add_inplace(out: &mut [f32], x: &[f32]) {
    assert_eq!(out.len(), x.len(), "add_inplace");
    team::for_each_chunk_zip(out, ADD_TASK, x, ADD_TASK, |out, x| {
        for (o, &x) in out.iter_mut().zip(x) {
            *o += x;
        }
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
        crate::tiny::uniform(n, seed)
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn matvec_q8_i16_matches_naive_exactly() {
        // 640: the AVX-512 path, 64 weights an iteration; 96: a 32-weight tail; 40: an
        // 8-weight tail after none of the wide loop.
        for &(i, o) in &[(640, 300), (96, 70), (40, 9)] {
            let q: Vec<i8> = values(o * i, 3)
                .iter()
                .map(|&v| (v * 127.0) as i8)
                .collect();
            let limit = f32::from(q8_i16_limit(i));
            let x: Vec<i16> = values(i, 4).iter().map(|&v| (v * limit) as i16).collect();
            let (mut got, mut want) = (vec![0; o], vec![0; o]);
            matvec_q8_i16(&mut got, &x, &q, i, o);
            matvec_q8_i16_naive(&mut want, &x, &q, i, o);
            assert_eq!(got, want, "{i}x{o}: exact sums");
            // Each x86 kernel the CPU has, whichever the dispatch above picked.
            #[cfg(target_arch = "x86_64")]
            {
                let rows = || q.chunks_exact(i).zip(&want);
                if std::arch::is_x86_feature_detected!("avx2") {
                    for (row, &want) in rows() {
                        // SAFETY: the CPU has AVX2; the lengths are equal.
                        assert_eq!(unsafe { dot_q8_i16_avx2(row, &x) }, want, "{i}x{o}: AVX2");
                    }
                } else {
                    eprintln!("SKIPPED: the AVX2 kernel (the CPU has no AVX2)");
                }
                if std::arch::is_x86_feature_detected!("avx512bw") {
                    for (row, &want) in rows() {
                        // SAFETY: the CPU has AVX-512F and BW; the lengths are equal.
                        let got = unsafe { dot_q8_i16_avx512(row, &x) };
                        assert_eq!(got, want, "{i}x{o}: AVX-512");
                    }
                } else {
                    eprintln!("SKIPPED: the AVX-512 kernel (the CPU has no AVX-512BW)");
                }
            }
            assert!(
                got.iter().any(|&v| v.unsigned_abs() > 1 << 20),
                "{i}x{o}: not trivially small"
            );
        }
    }

    /// At the limit, every product at its largest and of one sign: the sum is still exact.
    #[test]
    fn matvec_q8_i16_does_not_overflow_at_the_limit() {
        let (i, o) = (640, 3);
        let limit = q8_i16_limit(i);
        assert_eq!(limit, 26420);
        let q = vec![-127i8; o * i];
        let x = vec![-limit; i];
        let mut got = vec![0; o];
        matvec_q8_i16(&mut got, &x, &q, i, o);
        let exact = 127 * i32::from(limit) * i as i32;
        assert_eq!(got, vec![exact; o]);
        assert!(
            exact > i32::MAX - 127 * i as i32,
            "one more step would overflow"
        );
    }

    #[test]
    fn matmul_matches_naive_for_model_shapes() {
        for &(n, i, o) in &[
            (1, 640, 1024),
            (7, 640, 256),
            (22, 640, 130), // matmul_few: 4x4 and 4x2 tiles, a partial block of weight rows
            (FEW_ROWS, 100, 67), // matmul_few: a masked tail, 1x4 tiles
            (7, 100, 9),    // matmul_few: 4x4, 4x3, 1x4 and 1x3 tiles
            (3, 33, 6),     // matmul_few: 4x3 and 1x3 tiles over a masked tail
            (2, 16, 4),
            (33, 256, 640),
            (1, 2048, 640),
            (1, 33, 7), // one row: a 4x1 tile and three 1x1 over a masked tail
            (5, 3, 1),
            (FEW_ROWS + 1, 3, 5), // the blocked GEMM: one partial panel, a 5-row band
            (97, 640, 1024),      // eight 12-row bands and a 1-row one, three depth blocks
            (130, 2048, 40),      // a full and a partial column panel, eight depth blocks
            (860, 640, 256),      // the prefill's band count
        ] {
            let x = values(n * i, 1);
            let w = values(o * i, 2);
            let mut fast = vec![0.0; n * o];
            let mut slow = vec![0.0; n * o];
            matmul(&mut fast, &x, &w, n, i, o);
            matmul_naive(&mut slow, &x, &w, n, i, o);
            let mut crate_gemm = vec![0.0; n * o];
            matmul_gemm_crate(&mut crate_gemm, &x, &w, n, i, o);
            assert!(max_diff(&crate_gemm, &slow) < i as f32 * 1.2e-7 * 4.0);
            // f32 accumulation over i terms of size <= 1: error bound ~ i * eps.
            let bound = i as f32 * 1.2e-7 * 4.0;
            assert!(
                max_diff(&fast, &slow) < bound,
                "{n}x{i}x{o}: {}",
                max_diff(&fast, &slow)
            );
        }
    }

    /// Every tile set of `few_rows` this CPU has, called directly whichever one `few_rows`
    /// picks, against f64 dot products: groups of four weight rows and the one to three left,
    /// every tile width, depths with and without a tail. The blocks are cut from buffers that go
    /// on with NaN, so a read past a row of the last weight or `x` row shows.
    #[test]
    fn few_rows_tiles_match_f64_dots() {
        #[cfg(target_arch = "x86_64")]
        let sets = {
            let mut sets: Vec<(&str, &DotTiles)> = Vec::new();
            if is_x86_feature_detected!("avx512f") {
                sets.push(("AVX-512", &AVX512_DOT_TILES));
            } else {
                eprintln!("SKIPPED: the AVX-512 dot tiles (the CPU has no AVX-512F)");
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                sets.push(("AVX2", &AVX2_DOT_TILES));
            } else {
                eprintln!("SKIPPED: the AVX2 dot tiles (the CPU has no AVX2 and FMA)");
            }
            sets
        };
        for (rows, n, i) in [
            (4, 4, 256),
            (9, 7, 640),
            (6, 5, 33),
            (3, 2, 7),
            (8, 1, 8),
            (5, 22, 100),
            (1, 3, 16),
        ] {
            let with_nan = |len: usize, seed: u64| {
                let mut v = values(len, seed);
                v.extend([f32::NAN; 16]);
                v
            };
            let (w, x) = (with_nan(rows * i, 1), with_nan(n * i, 2));
            let (w, x) = (&w[..rows * i], &x[..n * i]);
            let want: Vec<f32> = w
                .chunks_exact(i)
                .flat_map(|row| {
                    x.chunks_exact(i).map(move |xr| {
                        row.iter()
                            .zip(xr)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>() as f32
                    })
                })
                .collect();
            let bound = i as f32 * 1.2e-7 * 4.0;
            let mut got = vec![f32::NAN; rows * n];
            // `max_diff` passes NaN over: each check also asks for finite values.
            let close =
                |got: &[f32]| got.iter().all(|v| v.is_finite()) && max_diff(got, &want) < bound;
            few_rows(&mut got, x, w, n, i);
            assert!(close(&got), "{rows}x{n}x{i}: few_rows {got:?}");
            #[cfg(target_arch = "x86_64")]
            for (name, tiles) in &sets {
                let mut got = vec![f32::NAN; rows * n];
                // SAFETY: the CPU has the set's instructions (checked above); the shapes hold.
                unsafe { few_rows_tiled(&mut got, x, w, n, i, tiles) };
                assert!(close(&got), "{rows}x{n}x{i}: {name} {got:?}");
            }
        }
    }

    /// Whether weights are packed here (the AVX-512F kernels run); prints that the test is
    /// skipped where not. Packing is for the AVX-512 kernels only: without them every layer
    /// keeps the row-major kernels the other tests cover.
    fn weights_are_packed() -> bool {
        if PackedWeight::new(&[0.0], 1, 1).is_some() {
            return true;
        }
        #[cfg(target_arch = "x86_64")]
        assert!(
            !avx512f(),
            "the AVX-512 kernels run, yet nothing was packed"
        );
        eprintln!(
            "SKIPPED: weights are not packed (no AVX-512F, or {PORTABLE_KERNELS_ENV} is set)"
        );
        false
    }

    /// A packed weight multiplies as the row-major one does: one row (the panel matvec, with
    /// a depth not a multiple of its 4-position steps) and more (the blocked tiles over the
    /// packed panels), partial panels included, and weights stacked into one. Where the
    /// AVX-512F kernels do not run, nothing is packed (asserted) and the rest is skipped.
    #[test]
    fn matmul_packed_matches_naive() {
        if !weights_are_packed() {
            return;
        }
        for &(n, i, o) in &[
            (1, 640, 1024),
            (1, 2048, 640),
            (1, 7, 45),
            (22, 640, 256),
            (22, 1024, 640),
            (3, 33, 70),
            (97, 640, 40),
        ] {
            let x = values(n * i, 1);
            let w = values(o * i, 2);
            let packed = PackedWeight::new(&w, i, o).expect("packed");
            assert_eq!(packed.shape(), (o, i));
            let mut fast = vec![f32::NAN; n * o];
            let mut slow = vec![0.0; n * o];
            matmul_packed(&mut fast, &x, &packed, n);
            matmul_naive(&mut slow, &x, &w, n, i, o);
            assert!(
                fast.iter().all(|v| v.is_finite()),
                "{n}x{i}x{o}: an output not written"
            );
            let bound = i as f32 * 1.2e-7 * 4.0;
            assert!(
                max_diff(&fast, &slow) < bound,
                "{n}x{i}x{o}: {}",
                max_diff(&fast, &slow)
            );
        }
        // Stacked weights whose parts end in partial panels: the same product as the weight
        // of their rows one after another.
        let (i, parts) = (33, [45, 7, 64]);
        let w = values(parts.iter().sum::<usize>() * i, 3);
        let (a, rest) = w.split_at(parts[0] * i);
        let (b, c) = rest.split_at(parts[1] * i);
        let packed = PackedWeight::stacked(&[a, b, c], i).expect("packed");
        assert_eq!(packed.shape(), (116, i));
        for n in [1, 13] {
            let x = values(n * i, 4);
            let mut fast = vec![f32::NAN; n * 116];
            let mut slow = vec![0.0; n * 116];
            matmul_packed(&mut fast, &x, &packed, n);
            matmul_naive(&mut slow, &x, &w, n, i, 116);
            assert!(max_diff(&fast, &slow) < 1e-5, "stacked, n {n}");
        }
    }

    /// The GeGLU fused into a packed product's bands gives the very floats of [`geglu`] then
    /// [`matmul_packed`]: one row, one band, a band and a partial one, many bands; depths with
    /// and without a whole number of lanes. Skipped, as packing itself, without the AVX-512F
    /// kernels.
    #[test]
    fn geglu_into_the_bands_is_geglu_then_the_product() {
        if !weights_are_packed() {
            return;
        }
        for &(n, f, o) in &[
            (1, 64, 40),
            (2, 64, 40),
            (12, 33, 70),
            (13, 2048, 64),
            (97, 48, 33),
        ] {
            // Gates across GELU's whole range, up to +-8.
            let gate_up: Vec<f32> = values(n * 2 * f, 5).iter().map(|v| 8.0 * v).collect();
            let packed = PackedWeight::new(&values(o * f, 6), f, o).expect("packed");
            let mut ffn = vec![0.0; n * f];
            geglu(&mut ffn, &gate_up, f);
            let mut want = vec![0.0; n * o];
            matmul_packed(&mut want, &ffn, &packed, n);
            let mut got = vec![f32::NAN; n * o];
            geglu_matmul_packed(&mut got, &gate_up, &packed, n);
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{n}x{f}x{o}: {}", max_diff(&got, &want));
        }
    }

    /// Keys packed from runs of strided rows (a KV head's columns of each row; the first
    /// panel filled from three runs, not in memory order, the last one partial) score as f64
    /// dot products do, for any range of panels and rows of queries strided as a chunk's heads
    /// are (more than one band of 12, the last partial). Skipped, as packing itself, without
    /// the AVX-512F kernels.
    #[test]
    fn scores_packed_matches_naive() {
        let (i, stride, col) = (40, 96, 48);
        let rows = values(120 * stride, 31);
        // The runs' first rows in `rows`, and their lengths: keys 0..20, 20, 21..70.
        let runs = [(60, 20), (5, 1), (70, 49)];
        let key_row: Vec<usize> = runs.iter().flat_map(|&(at, len)| at..at + len).collect();
        let runs: Vec<&[f32]> = runs
            .iter()
            .map(|&(at, len)| &rows[at * stride..(at + len) * stride])
            .collect();
        let Some(keys) = KeyPanels::pack(&runs, stride, col, i) else {
            #[cfg(target_arch = "x86_64")]
            assert!(
                !avx512f(),
                "the AVX-512 kernels run, yet no keys were packed"
            );
            eprintln!(
                "SKIPPED: keys are not packed (no AVX-512F, or {PORTABLE_KERNELS_ENV} is set)"
            );
            return;
        };
        assert_eq!(keys.keys(), 70);
        let (n, qstride) = (29, 130);
        let x = values((n - 1) * qstride + i, 32);
        for panels in [0..3, 1..3, 0..1, 2..3] {
            let first = panels.start * KEY_PANEL;
            let width = (panels.end * KEY_PANEL).min(70) - first;
            let mut got = vec![f32::NAN; n * width];
            scores_packed(&mut got, &x, qstride, n, &keys, panels.clone());
            for (e, got) in got.iter().enumerate() {
                let (r, key) = (e / width, first + e % width);
                let want: f64 = (0..i)
                    .map(|d| {
                        f64::from(x[r * qstride + d])
                            * f64::from(rows[key_row[key] * stride + col + d])
                    })
                    .sum();
                assert!(
                    (f64::from(*got) - want).abs() < 1e-5,
                    "panels {panels:?}, query {r}, key {key}: {got} against {want}"
                );
            }
        }
    }

    #[test]
    fn rms_norm_matches_naive_and_uses_one_plus_w() {
        let x = values(3 * 640, 3);
        let w = values(640, 4);
        let (mut fast, mut slow) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        rms_norm(&mut fast, &x, &w, 1e-6);
        rms_norm_naive(&mut slow, &x, &w, 1e-6);
        assert!(max_diff(&fast, &slow) < 1e-5);
        let mut inplace = x.clone();
        rms_norm_inplace(&mut inplace, &w, 1e-6);
        assert_eq!(inplace, fast);
        // w = 0 gives a unit-RMS row: [3, 4] has mean square 12.5.
        let mut out = [0.0; 2];
        rms_norm(&mut out, &[3.0, 4.0], &[0.0, 1.0], 0.0);
        let r = 12.5f32.sqrt();
        assert_eq!(out, [3.0 / r, 2.0 * 4.0 / r]);
    }

    /// A prefill's rows go to the team in tasks of [`ROW_TASK`] rows (the last one short): each
    /// row's norm and sum are the row-by-row ones, bit for bit, for rows of 640 and of 256.
    #[test]
    fn row_kernels_split_over_tasks_give_each_row_its_own_result() {
        for dim in [640, 256] {
            let rows = 3 * ROW_TASK + 5;
            let x = values(rows * dim, 7);
            let w = values(dim, 8);
            let mut out = vec![f32::NAN; x.len()];
            rms_norm(&mut out, &x, &w, 1e-6);
            let mut inplace = x.clone();
            rms_norm_inplace(&mut inplace, &w, 1e-6);
            let mut sum = x.clone();
            let y = values(rows * dim, 9);
            add_inplace(&mut sum, &y);
            for r in 0..rows {
                let at = r * dim..(r + 1) * dim;
                let mut one = vec![0.0; dim];
                rms_norm(&mut one, &x[at.clone()], &w, 1e-6);
                assert_eq!(out[at.clone()], one[..], "dim {dim}, row {r}");
                assert_eq!(inplace[at.clone()], one[..], "dim {dim}, row {r}");
                for k in at {
                    assert_eq!(sum[k], x[k] + y[k], "dim {dim}, element {k}");
                }
            }
        }
    }

    #[test]
    fn exp_approx_matches_f64_exp() {
        let mut z = -87.0f32;
        while z <= 88.0 {
            let want = (z as f64).exp();
            let got = exp_approx(z) as f64;
            assert!(
                ((got - want) / want).abs() < 3e-7,
                "exp({z}) = {got}, want {want}"
            );
            z += 0.013;
        }
        assert_eq!(exp_approx(0.0), 1.0);
        assert_eq!(exp_approx(-87.5), 0.0);
        assert_eq!(exp_approx(f32::NEG_INFINITY), 0.0);
        assert!(exp_approx(1000.0).is_finite());
        assert!(exp_approx(f32::NAN).is_nan());
    }

    #[test]
    fn gelu_tanh_matches_the_f64_formula() {
        // 0.5 x (1 + tanh(u)) in f64, written as x / (1 + e^(-2u)) where 1 + tanh(u) would lose
        // f64's digits too (u < -18).
        let gelu64 = |x: f64| {
            let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3));
            if u > -5.0 {
                0.5 * x * (1.0 + u.tanh())
            } else {
                x / (1.0 + (-2.0 * u).exp())
            }
        };
        let mut x = -12.0f32;
        while x <= 12.0 {
            let want = gelu64(x as f64);
            let got = gelu_tanh(x) as f64;
            // f32 rounding of u (a few ulps) moves exp(-2u) by |2u| times that: bound the error
            // by that conditioning. (The f32 `1 + tanh(u)` of the plain formula loses far
            // more: all its digits once tanh(u) rounds to -1.)
            let u = 0.797_884_6 * (x as f64 + 0.044715 * (x as f64).powi(3));
            let bound = (4.0 + 2.0 * u.abs()) * 2.4e-7;
            let err = (got - want).abs() / want.abs();
            // Where exp(-2u) reaches its clamp at e^88 (x < -9.4), GELU is below 1e-37.
            assert!(
                err < bound || (got - want).abs() < 1e-37,
                "gelu({x}) = {got}, want {want}"
            );
            x += 0.0007;
        }
        // The vectorised GeGLU computes the same values.
        let gate = values(10_000, 8)
            .iter()
            .map(|v| v * 8.0)
            .collect::<Vec<_>>();
        let up = values(10_000, 9);
        // Rows of 2000 gates then 2000 ups: tasks of three rows, the last of two.
        let gate_up: Vec<f32> = gate
            .chunks(2000)
            .zip(up.chunks(2000))
            .flat_map(|(g, u)| g.iter().chain(u).copied())
            .collect();
        let mut fast = vec![f32::NAN; gate.len()];
        geglu(&mut fast, &gate_up, 2000);
        for ((f, g), u) in fast.iter().zip(&gate).zip(&up) {
            assert_eq!(*f, gelu_tanh(*g) * u);
        }
    }

    #[test]
    fn gelu_tanh_known_values() {
        // torch.nn.functional.gelu(x, approximate="tanh") for x = 1, -1, 3.
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-6);
        assert!((gelu_tanh(-1.0) + 0.158_808).abs() < 1e-6);
        assert!((gelu_tanh(3.0) - 2.996_363).abs() < 1e-6);
        assert_eq!(gelu_tanh(0.0), 0.0);
    }

    /// The AVX-512 and AVX2 builds of the softmax and the GeGLU loop (whichever this CPU has)
    /// give the plain loop's results bit for bit: the same operations in the same order.
    #[test]
    fn softmax_and_geglu_builds_equal_the_plain_loops() {
        #[cfg(target_arch = "x86_64")]
        {
            type Builds = (
                &'static str,
                unsafe fn(&mut [f32]),
                unsafe fn(&mut [f32], &[f32], &[f32]),
            );
            let mut builds: Vec<Builds> = Vec::new();
            if is_x86_feature_detected!("avx512f") {
                builds.push(("AVX-512", softmax_avx512, geglu_avx512));
            } else {
                eprintln!("SKIPPED: the AVX-512 builds (the CPU has no AVX-512F)");
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                builds.push(("AVX2", softmax_avx2, geglu_avx2));
            } else {
                eprintln!("SKIPPED: the AVX2 builds (the CPU has no AVX2 and FMA)");
            }
            for len in [1, 7, 16, 33, 1000] {
                let mut x: Vec<f32> = values(len, 11).iter().map(|v| 30.0 * v).collect();
                x[len / 2] = f32::NEG_INFINITY;
                let (gate, up) = (x.clone(), values(len, 12));
                let mut want = x.clone();
                softmax_plain(&mut want);
                let mut want_geglu = vec![0.0; len];
                geglu_plain(&mut want_geglu, &gate, &up);
                for (name, softmax, geglu) in &builds {
                    let mut got = x.clone();
                    let mut got_geglu = vec![0.0; len];
                    // SAFETY: the CPU has the build's instructions (checked above).
                    unsafe {
                        softmax(&mut got);
                        geglu(&mut got_geglu, &gate, &up);
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{name} softmax, {len}");
                    assert_eq!(bits(&got_geglu), bits(&want_geglu), "{name} geglu, {len}");
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        eprintln!("SKIPPED: the x86 builds of softmax and GeGLU (not an x86-64 CPU)");
    }

    #[test]
    fn softmax_matches_f64_with_masked_entries() {
        for n in [1usize, 5, 16, 17, 100, 1000] {
            let mut x: Vec<f32> = values(n, 10 + n as u64).iter().map(|v| v * 30.0).collect();
            // Masked keys, as attention writes them, every third entry (never all of them).
            for v in x.iter_mut().skip(1).step_by(3) {
                *v = f32::NEG_INFINITY;
            }
            let max = x
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, |m, v| m.max(v as f64));
            let exps: Vec<f64> = x.iter().map(|&v| (v as f64 - max).exp()).collect();
            let total: f64 = exps.iter().sum();
            softmax(&mut x);
            for (k, (&got, e)) in x.iter().zip(&exps).enumerate() {
                let want = e / total;
                if *e == 0.0 {
                    assert_eq!(got, 0.0, "n={n} [{k}]: a masked key weighs nothing");
                }
                assert!(
                    (got as f64 - want).abs() < 1e-6 * want.max(1e-3),
                    "n={n} [{k}]: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn softmax_sums_to_one_and_is_shift_invariant() {
        let mut a = vec![1.0, 2.0, 3.0];
        let mut b = vec![1001.0, 1002.0, 1003.0];
        softmax(&mut a);
        softmax(&mut b);
        assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(max_diff(&a, &b) < 1e-6);
        assert!((a[2] - 0.665_240_9).abs() < 1e-6);
    }

    #[test]
    fn gather_rows_concatenates_rows() {
        let table: Vec<f32> = (0..12).map(|i| i as f32).collect(); // [4, 3]
        assert_eq!(
            gather_rows(&table, 3, &[2, 0, 2]),
            [6.0, 7.0, 8.0, 0.0, 1.0, 2.0, 6.0, 7.0, 8.0]
        );
        assert!(gather_rows(&table, 3, &[]).is_empty());
    }

    #[test]
    fn dot_handles_tails() {
        // Every branch of both paths: the 64-wide body, 16-wide steps, the masked tail.
        for n in [
            0,
            1,
            7,
            8,
            9,
            15,
            16,
            17,
            31,
            63,
            64,
            65,
            100,
            256,
            640,
            2048 + 13,
        ] {
            let a = values(n, 5);
            let b = values(n, 6);
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "n={n}");
            assert!(
                (dot_plain(&a, &b) as f64 - want).abs() < 1e-5,
                "plain n={n}"
            );
            // The AVX-512 kernel where the CPU has it, whichever `dot` picked.
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F.
                let got = unsafe { dot_avx512::<0>(&a, &b) };
                assert!((got as f64 - want).abs() < 1e-5, "AVX-512 n={n}");
            } else {
                eprintln!("SKIPPED: the AVX-512 dot (the CPU has no AVX-512F)");
            }
        }
    }

    #[test]
    fn dot_reads_only_its_slices() {
        // A dot over a prefix of longer buffers must ignore what follows the prefix.
        let (a, mut b) = (values(100, 7), values(100, 8));
        let want = dot(&a[..37], &b[..37]);
        b[37..].fill(f32::NAN);
        assert_eq!(dot(&a[..37], &b[..37]), want);
    }
}
