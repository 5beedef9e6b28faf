//! The Gemma 3 forward pass of one chunk as StableHLO, mirroring `kvsnap_reference`'s blocks.
//!
//! Activations are row-major `[C, features]` like the reference's. Every projection is
//! `x . W^T` ([`Forward::linear`]): with HF `[out, in]` weights, `W . x^T` with the weight as
//! the LEFT operand of `dot_general`, which IREE compiles without transposing the weight per
//! call (see IREE-NOTES), followed by a transpose of the small `[out, C]` result; with panels,
//! a reduction over the panels (one row) or a `linalg.mmt4d` (a chunk). Keeping features
//! innermost also keeps every reduction (norms, softmax) over the innermost dim: IREE 3.13's
//! SPIR-V code for a reduction over an outer dim fused with its broadcast consumer returned
//! garbage for all but the first 8 columns on lavapipe (an RMSNorm over dim 0 of `[64, 16]`).

use kvsnap_contract::{LayerKind, ModelConfig};

use super::manifest::{RingGeometry, WeightLayout, TABLE_LANES};
use super::GraphOptions;
use crate::emit::{
    Cmp, DotDims, ElemType, FuncBuilder, Reduction, Region, Scalar, TensorType, Value,
};
use crate::kernels::{self, SpirvKernels};

/// Mask value of invisible attention scores: finite, so that a padding row that sees no key gets
/// a uniform (finite) softmax instead of NaN, and `exp(MASKED - max)` is exactly 0 for a row
/// that sees at least one key.
const MASKED: f32 = -1.0e30;

/// Width of the inner stage of the two-stage argmax (see IREE-NOTES: a one-pass argmax over
/// 262144 logits hits lavapipe's shader loop limit).
const ARGMAX_INNER: usize = 512;

/// Rows per block of the screened head (the graphs' `Forward::screen`): the blocks whose best
/// upper bound reaches the best lower bound are recomputed in f32, every row of them.
pub const SCREEN_BLOCK: usize = TABLE_LANES;

/// Blocks the screened head recomputes at most; where more blocks hold candidates, `next` is
/// -1 and the caller runs the full head. On Gemma 3 270M a decode step leaves 1-26 candidate
/// rows (docs/BENCHMARKS.md, twelfth pass); 32 blocks of 16 rows are 1.3 MB of the f32 table.
pub const SCREEN_BLOCKS: usize = 32;

/// The screened head's tensors ([`Role::Screen`](super::Role)).
///
/// # Shapes
/// `q8`: `[ceil(vocab / TABLE_LANES), hidden, TABLE_LANES]` i8; `scale`, `slack`: `[vocab]`.
pub struct Screen {
    /// The int8 table in panels.
    pub q8: Value,
    /// Each row's scale: its int8 weights times this are its approximation.
    pub scale: Value,
    /// Each row's bound: `|f32 logit - approximate logit| <= |h| slack`.
    pub slack: Value,
}

/// Keys a block of [`Forward::attend_blocked`] spans at most: its softmax and weighted values
/// run in blocks of this many keys. On an H100 blocks of 32 and of 64 gave the same decode step
/// (7.0-7.4 and 7.1-7.2 ms, docs/BENCHMARKS.md, fortieth pass); when the scores were blocked
/// too, 32 had beaten 64 (thirty-ninth pass).
pub(super) const KEY_BLOCK: usize = 32;

/// Query rows (chunk rows x query heads of a KV head) up to which [`Forward::attend`] takes
/// its keys in blocks: the decode step's and the chunks' of up to 24 rows (the catalog's
/// extend runs as one 24-row call: on an H200 its dispatches took 4.2 ms a call in blocks,
/// 4.8 ms whole, fortieth pass).
pub(super) const KEY_BLOCK_ROWS: usize = 96;

/// The keys of each of [`Forward::attend_blocked`]'s blocks for `rows` keys: the largest
/// divisor of `rows` of at most [`KEY_BLOCK`] keys that leaves two blocks or more, or `None`
/// where that is under 4 keys (too small to be worth a batch).
pub(super) fn key_block(rows: usize) -> Option<usize> {
    (4..=KEY_BLOCK.min(rows / 2))
        .rev()
        .find(|b| rows.is_multiple_of(*b))
}

/// The row spans a global layer's attention of a `c`-row chunk may run over (see
/// [`Forward::attend_live`]): an eighth, a quarter and half of `capacity` where they hold at
/// least `c` rows, then `capacity` itself.
pub(super) fn global_spans(capacity: usize, c: usize) -> Vec<usize> {
    let mut spans: Vec<usize> = [8, 4, 2]
        .iter()
        .map(|d| capacity / d)
        .filter(|&s| s >= c && s < capacity)
        .collect();
    spans.dedup();
    spans.push(capacity);
    spans
}

/// The deepest `linalg.mmt4d` [`Forward::panel_matmul`] emits: 640 positions, an 8-row tile of
/// 20 KiB. On two cores of an AVX-512 Xeon (`iree-benchmark-module`, 64 rows, 8 weights),
/// `[640, 2048]` (down) ran 102-137 GFLOP/s in one `mmt4d`, 129-172 in two and 133-169 in four;
/// `[640, 1024]` (o) 139-163 in one, 147-221 in two; the 640-deep products gained nothing.
const MMT4D_MAX_DEPTH: usize = 640;

/// The depth `k` in `ceil(k / MMT4D_MAX_DEPTH)` blocks as even as may be, as `(start, end)`.
fn depth_blocks(k: usize) -> Vec<(usize, usize)> {
    let n = k.div_ceil(MMT4D_MAX_DEPTH).max(1);
    (0..n).map(|i| (i * k / n, (i + 1) * k / n)).collect()
}

/// One layer's weights as function arguments, in [`super::LAYER_WEIGHTS`] order; the HF
/// shapes are given, the matrices come in the module's [`WeightLayout`], stacked ones with
/// each part at [`WeightLayout::stack_offsets`].
pub(super) struct LayerWeights {
    pub input_layernorm: Value,            // [hidden]
    pub qkv_proj: Value,                   // q, k, v: [(heads + 2 kv_heads) * hd, hidden]
    pub q_norm: Value,                     // [hd]
    pub k_norm: Value,                     // [hd]
    pub o_proj: Value,                     // [hidden, heads * hd]
    pub post_attention_layernorm: Value,   // [hidden]
    pub pre_feedforward_layernorm: Value,  // [hidden]
    pub gate_up_proj: Value,               // gate, up: [2 ffn, hidden]
    pub down_proj: Value,                  // [hidden, ffn]
    pub post_feedforward_layernorm: Value, // [hidden]
}

impl LayerWeights {
    /// Takes the 10 weights of one layer from `args` (in call order).
    pub fn from_args(args: &mut impl Iterator<Item = Value>) -> Self {
        let mut next = || args.next().expect("10 weights per layer");
        LayerWeights {
            input_layernorm: next(),
            qkv_proj: next(),
            q_norm: next(),
            k_norm: next(),
            o_proj: next(),
            post_attention_layernorm: next(),
            pre_feedforward_layernorm: next(),
            gate_up_proj: next(),
            down_proj: next(),
            post_feedforward_layernorm: next(),
        }
    }
}

/// Where a layer stores a chunk's K and V rows and which rows kvsnap's attention kernels
/// divide among their workgroups.
#[derive(Clone, Copy)]
struct LayerRows<'a> {
    /// The row of the layer's buffers the chunk's first row goes to: `[]` i32.
    start: &'a Value,
    /// The buffers' first `rows` rows (the visible ones among them are read).
    rows: usize,
    /// The sliding window for a sliding layer (its rows' positions in the ring's table), 0
    /// for a global layer (row `r` holds position `r`).
    window: usize,
}

/// The decode step's heads as the SPIR-V attention takes them, before their norms and RoPE.
struct SpirvHeads<'a> {
    /// The query heads, then the key heads: `[1, heads + kvh, hd]`.
    qk: &'a Value,
    /// The value heads: `[1, kvh, hd]`.
    v: &'a Value,
    /// The layer's `q_norm` and `k_norm` weights (`[hd]`, the scale less one).
    norms: [&'a Value; 2],
    /// The layer kind's RoPE tables.
    rope: &'a RopeTables,
}

/// cos and sin tables of one RoPE base for the chunk's positions.
struct RopeTables {
    cos: Value, // [C, hd / 2]
    /// `-sin` then `sin`: `[C, 2, hd / 2]`.
    sin: Value,
}

/// Per-chunk values shared by all layers: positions, masks and RoPE tables.
pub(super) struct Chunk {
    pub c: usize,
    /// `pos0` and `valid` by value: what branch predicates derive from, and the rows written
    /// and read unless [`GraphOptions::device_rows`].
    pos0_host: Scalar,
    valid_host: Scalar,
    /// Where the global layers write: `pos0` (from the host scalar unless
    /// [`GraphOptions::device_rows`]).
    global_start: Value,
    rope_local: RopeTables,
    rope_global: RopeTables,
    /// Row at which the chunk is written into the sliding layers' buffers: `pos0 % modulus`.
    ring_start: Value,
    /// The first rows of the sliding layers' ring the chunk attends over
    /// ([`RingGeometry::rows_seen`]): all of them, a decode step's modulus, or those of the
    /// entry point's span.
    sliding_rows: usize,
    /// Visibility of those rows (after the chunk's write) to each query: `[C, sliding_rows]` i1.
    sliding_mask: Value,
    /// Position of each query row: `[C]` i32.
    qpos: Value,
    /// The chunk's valid rows: `[]` i32.
    valid: Value,
    /// First position after the chunk's valid rows: `[]` i32.
    end: Value,
    /// The sliding rows' positions after the chunk's write (`p + 1`, 0 for an empty row):
    /// `[ring rows]` i32.
    positions: Value,
    /// `{first query position, end}`: `[2]` i32, the attention kernel's limits.
    bounds: Value,
    /// Whether chunk row `i` is real (`i < valid`), per column: `[C]` i1.
    row_valid: Value,
}

/// The decoder layers' output: the last residual, and its rows normed by the final norm where
/// the last layer's kernel ran that norm too (on Vulkan: [`GraphOptions::spirv_kernels`]).
pub(super) struct Hidden {
    /// `[C, hidden]`.
    pub x: Value,
    /// `[C, hidden]`.
    pub final_normed: Option<Value>,
}

/// The graph of one entry point under construction.
pub(super) struct Forward<'a> {
    pub b: FuncBuilder,
    pub cfg: &'a ModelConfig,
    /// The matrices' layout and whether to branch.
    pub opts: GraphOptions,
    /// The entry point's span ([`GraphOptions::spans`]): attention runs over the first `span`
    /// rows of the global layers' buffers, without branches, and of the sliding layers' ring
    /// as [`RingGeometry::rows_seen`] allows. `None`: the global layers attend over their
    /// live span chosen by branches, or over the whole capacity without them; the sliding
    /// layers over the whole ring (a decode step over its modulus).
    pub span: Option<usize>,
}

impl<'a> Forward<'a> {
    // ---- small helpers --------------------------------------------------------------------

    fn f32(&mut self, v: f32, dims: &[usize]) -> Value {
        self.b.const_f32(v, dims)
    }

    fn i32(&mut self, v: i32, dims: &[usize]) -> Value {
        self.b.const_i32(v, dims)
    }

    /// `x` (scalar) broadcast to `dims`.
    fn splat(&mut self, x: &Value, dims: &[usize]) -> Value {
        self.b.splat(x, dims)
    }

    /// `x . W^T` for a `[out, in]` weight `w` in the module's [`WeightLayout`] and `[C, in]`
    /// rows `x`: `[C, out]`.
    fn linear(&mut self, w: &Value, x: &Value, out: usize) -> Value {
        let [y] = self.linear_stack(w, x, [out]);
        y
    }

    /// `x . W_i^T` for each of the `N` matrices of `outs[i]` output rows stacked into `w`
    /// ([`WeightLayout::stack_offsets`]) and `[C, in]` rows `x`: `[C, outs[i]]` each.
    ///
    /// - `Rows`: one product over the stack, `transpose(W . x^T)` with the weight as the left
    ///   operand of `dot_general`, which IREE compiles without transposing the weight per
    ///   call (see IREE-NOTES); on Vulkan the decode step's row in kvsnap's `matvec` kernel
    ///   and a chunk's rows in its `matmul`, where they take them ([`Forward::spirv_matvec`],
    ///   [`Forward::spirv_matmul`]).
    /// - `Panels`: the decode step's row as one [`Forward::panel_matvec`] over the stack; a
    ///   chunk of rows as one [`Forward::panel_matmul`] per part, over its panels (a slice of
    ///   the argument, which IREE reads in place). One `mmt4d` over the stack would need its
    ///   whole result unpacked before the parts are sliced off, where each part's unpack
    ///   fuses into its consumer: a 128-row chunk ran 169 ms that way against 163
    ///   (docs/BENCHMARKS.md, twenty-third pass). Rows a part's last panel pads are cut off.
    /// - `Panels` with kvsnap's kernels ([`GraphOptions::own_kernels`]), for chunks of a
    ///   multiple of 8 rows: one [`Forward::object_matmul`] over the stack, parts sliced off.
    fn linear_stack<const N: usize>(
        &mut self,
        w: &Value,
        x: &Value,
        outs: [usize; N],
    ) -> [Value; N] {
        let c = x.dims()[0];
        let offsets = self.opts.layout.stack_offsets(&outs);
        let rows = match self.opts.layout {
            WeightLayout::Rows => w.dims()[0],
            WeightLayout::Panels => w.dims()[0] * w.dims()[2],
        };
        assert_eq!(
            rows, offsets[N],
            "linear: weight {} for outputs {outs:?}",
            w.ty
        );
        let object = self.object_product_fits(w, c);
        if self.opts.layout == WeightLayout::Panels && c > 1 && !object {
            let (cols, lanes) = (w.dims()[1], w.dims()[2]);
            return std::array::from_fn(|i| {
                let panels = (offsets[i] / lanes, offsets[i + 1] / lanes);
                let part = if panels == (0, w.dims()[0]) {
                    w.clone()
                } else {
                    self.b.slice(w, &[panels.0, 0, 0], &[panels.1, cols, lanes])
                };
                let y = self.panel_matmul(&part, x);
                if y.dims()[1] == outs[i] {
                    y
                } else {
                    self.b.slice(&y, &[0, 0], &[c, outs[i]])
                }
            });
        }
        let y = match self.opts.layout {
            WeightLayout::Rows => {
                match (
                    self.spirv_matvec_fits(c, w.dims()[1]),
                    self.spirv_matmul_fits(x, w),
                ) {
                    (Some(kernels), _) => self.spirv_matvec(kernels.matvec.name, w, x),
                    (None, Some(kernels)) => self.spirv_matmul(kernels.matmul.name, w, x),
                    (None, None) => {
                        let t = self.b.dot_general(w, x, &DotDims::contract(1, 1)); // [rows, C]
                        self.b.transpose(&t, &[1, 0])
                    }
                }
            }
            WeightLayout::Panels if object => self.object_matmul(w, x),
            WeightLayout::Panels => {
                let v = self.b.reshape(x, &[x.dims()[1]]);
                let y = self.panel_matvec(w, &v);
                let n = y.dims()[0];
                self.b.reshape(&y, &[1, n])
            }
        };
        std::array::from_fn(|i| {
            let (start, end) = (offsets[i], offsets[i] + outs[i]);
            if (start, end) == (0, rows) {
                y.clone()
            } else {
                self.b.slice(&y, &[0, start], &[c, end])
            }
        })
    }

    /// `W . v` for panels `w` (`[P, in, L]`) and `v` (`[in]`): `[L P]`, as a reduction over
    /// the middle dim of `w * v`. IREE keeps the `L` lanes as one or two vectors and accumulates
    /// along the panel, one 64-byte load per FMA in address order (the tuning spec of
    /// [`super::llvm_cpu_tuning_spec`] runs four panels per tile); `dot_general` would become a
    /// matvec over a transposed copy of the weight.
    fn panel_matvec(&mut self, w: &Value, v: &Value) -> Value {
        let dims = w.dims().to_vec();
        let v = self.b.broadcast_in_dim(v, &dims, &[1]);
        let products = self.b.mul(w, &v);
        let y = self.b.reduce(&products, Reduction::Sum, &[1]); // [P, 16]
        self.b.reshape(&y, &[dims[0] * dims[2]])
    }

    /// `x . W^T` for panels `w` (`[P, in, L]`) and `C > 1` rows `x` (`[C, in]`): `[C, L P]`,
    /// as a `linalg.mmt4d` whose right operand is the panels as they are (they are its packed
    /// `[N1, K, N0 = L, K0 = 1]` layout) and whose left operand packs `x` into tiles of `m0`
    /// rows (8 when `C` allows: with 32-lane panels, 8 x 32 register tiles, 16 accumulators).
    /// The pack and unpack of the small activations are transposes; the weight is read once,
    /// in order. IREE's mmt4d microkernel is off (see `Target::flags`): it has no 8 x 32 tile,
    /// and its 16 x 16 tile over 16-lane panels (one load per FMA) ran the model's products
    /// 1.1-2.5x slower than the compiler's 8 x 32 code.
    ///
    /// A depth over [`MMT4D_MAX_DEPTH`] is split into equal blocks, one `mmt4d` each, summed:
    /// IREE runs each register tile over the whole depth, and an 8-row tile of o's 1024 or
    /// down's 2048 positions (32-64 KiB) no longer stays in L1 beside the panel it meets.
    fn panel_matmul(&mut self, w: &Value, x: &Value) -> Value {
        let (c, k) = (x.dims()[0], x.dims()[1]);
        let (panels, lanes) = (w.dims()[0], w.dims()[2]);
        let m0 = [8, 4, 2, 1]
            .into_iter()
            .find(|m| c % m == 0)
            .expect("1 divides everything");
        let m1 = c / m0;
        let lhs = self.pack_row_tiles(x, m0);
        let rhs = self.b.reshape(w, &[panels, k, lanes, 1]);
        let mut y: Option<Value> = None; // [m1, panels, m0, lanes]
        for (start, end) in depth_blocks(k) {
            let part = if (start, end) == (0, k) {
                self.b.mmt4d(&lhs, &rhs)
            } else {
                let l = self.b.slice(&lhs, &[0, start, 0, 0], &[m1, end, m0, 1]);
                let r = self
                    .b
                    .slice(&rhs, &[0, start, 0, 0], &[panels, end, lanes, 1]);
                self.b.mmt4d(&l, &r)
            };
            y = Some(match y {
                None => part,
                Some(sum) => self.b.add(&sum, &part),
            });
        }
        let y = y.expect("a depth has at least one block");
        self.unpack_row_tiles(&y)
    }

    /// `x` (`[C, in]`) packed in tiles of `m0` rows as a product's left operand
    /// (`[C / m0, in, m0, 1]`): a transpose of each tile.
    fn pack_row_tiles(&mut self, x: &Value, m0: usize) -> Value {
        let (c, k) = (x.dims()[0], x.dims()[1]);
        let lhs = self.b.reshape(x, &[c / m0, m0, k]);
        let lhs = self.b.transpose(&lhs, &[0, 2, 1]);
        self.b.reshape(&lhs, &[c / m0, k, m0, 1])
    }

    /// A product of row tiles by panels (`[C / m0, P, m0, L]`) as rows: `[C, L P]`.
    fn unpack_row_tiles(&mut self, y: &Value) -> Value {
        let [m1, panels, m0, lanes] = y.dims()[..] else {
            panic!("unpack_row_tiles: {} is not a tiled product", y.ty)
        };
        let y = self.b.transpose(y, &[0, 2, 1, 3]);
        self.b.reshape(&y, &[m1 * m0, panels * lanes])
    }

    /// Whether `x . W^T` for panels `w` and `c` rows runs in kvsnap's panel-product kernel
    /// ([`GraphOptions::own_kernels`]): weights in panels of its lane count, rows in whole
    /// tiles (so more than one).
    fn object_product_fits(&self, w: &Value, c: usize) -> bool {
        self.opts.own_kernels.is_some()
            && self.opts.layout == WeightLayout::Panels
            && c.is_multiple_of(kernels::MMT4D_ROWS)
            && w.dims()[2] == kernels::MMT4D_LANES
    }

    /// `x . W^T` for panels `w` (`[P, in, 32]`) and `C` rows `x` (`[C, in]`, `C` a multiple of
    /// 8): `[C, 32 P]`, by kvsnap's kernel ([`kernels`]), one call over a stack of weights
    /// (q, k and v; gate and up) whose outputs are then sliced. `x` is packed in 8-row tiles
    /// as for `mmt4d` (`[C / 8, in, 8, 1]`); the product comes as `[C / 8, P, 8, 32]`; the
    /// whole depth in one pass (the kernel keeps its 8-row tile in L2 while it streams).
    fn object_matmul(&mut self, w: &Value, x: &Value) -> Value {
        let (c, k) = (x.dims()[0], x.dims()[1]);
        let (rows, lanes) = (kernels::MMT4D_ROWS, kernels::MMT4D_LANES);
        let panels = w.dims()[0];
        let m1 = c / rows;
        let lhs = self.pack_row_tiles(x, rows);
        let groups = kernels::mmt4d_groups(panels);
        let y = self.b.dispatch(
            kernels::MMT4D_ENTRY,
            &[groups],
            &[&lhs, w],
            &[m1, panels, k, groups],
            TensorType::f32(&[m1, panels, rows, lanes]),
        );
        self.unpack_row_tiles(&y)
    }

    /// `[vocab]` scores `x` as `[blocks, SCREEN_BLOCK]`, the last block padded with -inf.
    fn in_blocks(&mut self, x: &Value, blocks: usize) -> Value {
        let vocab = x.dims()[0];
        let x = if blocks * SCREEN_BLOCK > vocab {
            let pad = self.f32(f32::NEG_INFINITY, &[blocks * SCREEN_BLOCK - vocab]);
            self.b.concatenate(&[x, &pad], 0)
        } else {
            x.clone()
        };
        self.b.reshape(&x, &[blocks, SCREEN_BLOCK])
    }

    /// `q8 . h` for the screen's int8 panels `q8` (`[P, in, 16]`) and `h` (`[in]`): `[16 P]`
    /// f32 sums, by kvsnap's kernel ([`kernels`]) in runs of [`kernels::screen_run`] panels.
    /// The same sums as [`Forward::panel_matvec`] over the table widened to f32, in another
    /// order, which the screen's bound allows.
    fn object_screen(&mut self, q8: &Value, h: &Value) -> Value {
        let (panels, depth, lanes) = (q8.dims()[0], q8.dims()[1], q8.dims()[2]);
        assert_eq!(lanes, kernels::SCREEN_LANES, "screen: int8 table {}", q8.ty);
        let run = kernels::screen_run(panels);
        let y = self.b.dispatch(
            kernels::SCREEN_ENTRY,
            &[panels, run],
            &[q8, h],
            &[panels, depth, run],
            TensorType::f32(&[panels, lanes]),
        );
        self.b.reshape(&y, &[panels * lanes])
    }

    /// The rows of `table` (`[rows, width]`) in the blocks of [`SCREEN_BLOCK`] that `blocks`
    /// (`[k]` i32) names: `[k * SCREEN_BLOCK, width]`, a row past the table's last clamped to
    /// it, as `gather_rows` of those row indices gives them, by kvsnap's kernel ([`kernels`]).
    fn object_gather(&mut self, table: &Value, blocks: &Value) -> Value {
        let (rows, width, k) = (table.dims()[0], table.dims()[1], blocks.dims()[0]);
        assert_eq!(
            SCREEN_BLOCK,
            kernels::SCREEN_LANES,
            "gather: blocks of the kernel's rows"
        );
        self.b.dispatch(
            kernels::GATHER_ENTRY,
            &[k],
            &[table, blocks],
            &[rows, width, k],
            TensorType::f32(&[k * SCREEN_BLOCK, width]),
        )
    }

    /// `x * rsqrt(mean(x^2) + eps) * (1 + w)` over the last dim of `x`, in f32 as the
    /// reference: the mean is the sum of squares divided by the dim, and `1 / sqrt` is taken
    /// explicitly.
    fn rms_norm(&mut self, x: &Value, w: &Value) -> Value {
        let dims = x.dims().to_vec();
        let dim = dims.len() - 1;
        let inv = self.inv_rms(x, &[dim]);
        let one_w = self.f32(1.0, &[dims[dim]]);
        let scale = self.b.add(&one_w, w);
        let scale = self.b.broadcast_in_dim(&scale, &dims, &[dim]);
        let y = self.b.mul(x, &inv);
        self.b.mul(&y, &scale)
    }

    /// [`Forward::rms_norm`]'s `1 / sqrt(mean(x^2) + eps)` over the dims `over` of `x`,
    /// broadcast back to the dims of `x`.
    fn inv_rms(&mut self, x: &Value, over: &[usize]) -> Value {
        let dims = x.dims().to_vec();
        let n: usize = over.iter().map(|&d| dims[d]).product();
        let sq = self.b.mul(x, x);
        let sum = self.b.reduce(&sq, Reduction::Sum, over);
        let rest = sum.dims().to_vec();
        let count = self.f32(n as f32, &rest);
        let mean = self.b.div(&sum, &count);
        let eps = self.f32(self.cfg.rms_norm_eps as f32, &rest);
        let var = self.b.add(&mean, &eps);
        let root = self.b.sqrt(&var);
        let one = self.f32(1.0, &rest);
        let inv = self.b.div(&one, &root);
        let keep: Vec<usize> = (0..dims.len()).filter(|d| !over.contains(d)).collect();
        self.b.broadcast_in_dim(&inv, &dims, &keep)
    }

    /// A chunk's query and key heads, `x` `[C, heads + kvh, hd]` (the first `heads` the
    /// queries'), each normed as [`Forward::rms_norm`] (by `q_norm` or `k_norm`) and rotated by
    /// rotate-half RoPE: with `x = [x1, x2]` halves, `[x1 cos - x2 sin, x2 cos + x1 sin]`,
    /// written as `x * [cos, cos] + [x2, x1] * [-sin, sin]` (bit for bit the same: `a - b` is
    /// `a + (-b)`).
    ///
    /// All of it runs on `[C, heads + kvh, 2, hd / 2]`, the halves a dimension of their own
    /// and each head's weights chosen by a select, so that IREE makes it one reduction and one
    /// elementwise dispatch for both kinds of head: the queries and the keys normed, then
    /// rotated, each in its own shape, took six dispatches a layer (Gemma 3 270M's Vulkan
    /// decode step 374 -> 302 dispatches, docs/BENCHMARKS.md, fortieth pass). RoPE as one
    /// expression with a reverse had already replaced slices and a concatenation (four
    /// dispatches).
    fn norm_rotate_heads(
        &mut self,
        x: &Value,
        (q_norm, k_norm): (&Value, &Value),
        heads: usize,
        t: &RopeTables,
    ) -> Value {
        let dims = x.dims().to_vec();
        let half = dims[2] / 2;
        let split = [dims[0], dims[1], 2, half];
        let xs = self.b.reshape(x, &split);
        let inv = self.inv_rms(&xs, &[2, 3]);
        let one = self.f32(1.0, &[dims[2]]);
        let [q_scale, k_scale] = [q_norm, k_norm].map(|w| {
            let scale = self.b.add(&one, w);
            let scale = self.b.reshape(&scale, &[2, half]);
            self.b.broadcast_in_dim(&scale, &split, &[2, 3])
        });
        let head = self.b.iota(&split, 1);
        let queries = self.i32(heads as i32, &split);
        let is_query = self.b.compare(Cmp::Lt, &head, &queries);
        let scale = self.b.select(&is_query, &q_scale, &k_scale);
        let y = self.b.mul(&xs, &inv);
        let y = self.b.mul(&y, &scale);
        let swapped = self.b.reverse(&y, &[2]);
        let cos = self.b.broadcast_in_dim(&t.cos, &split, &[0, 3]);
        let sin = self.b.broadcast_in_dim(&t.sin, &split, &[0, 2, 3]);
        let a = self.b.mul(&y, &cos);
        let b = self.b.mul(&swapped, &sin);
        let y = self.b.add(&a, &b);
        self.b.reshape(&y, &dims)
    }

    // ---- per-chunk values -------------------------------------------------------------------

    /// Positions, masks and RoPE tables of a chunk of `c` rows at `pos0` with `valid` real rows,
    /// given both as `[]` i32 tensors and as host scalars (the same values: the tensors for the
    /// graph's arithmetic, the scalars for the rows written and every branch).
    ///
    /// `positions` (`[ring.rows]` i32, `p + 1` per row, 0 when empty) is the table of the
    /// positions the sliding layers' rows hold; the chunk's entries are written first (in
    /// place) and the updated table is returned with the chunk.
    pub fn chunk(
        &mut self,
        c: usize,
        (pos0, valid): (Value, Value),
        (pos0_host, valid_host): (Scalar, Scalar),
        positions: &Value,
        ring: RingGeometry,
    ) -> (Chunk, Value) {
        let cfg = self.cfg;

        // Query positions qp[i] = pos0 + i.
        let iota_c = self.b.iota(&[c], 0);
        let pos0_c = self.splat(&pos0, &[c]);
        let qpos = self.b.add(&pos0_c, &iota_c); // [C]
        let end = self.b.add(&pos0, &valid); // [] first position after the chunk
        let valid_c = self.splat(&valid, &[c]);
        let row_valid = self.b.compare(Cmp::Lt, &iota_c, &valid_c);

        // Sliding rows: write p + 1 (0 for padding) at pos0 % modulus, then read positions.
        let (ring_start, global_start) = if self.opts.device_rows {
            let modulus = self.i32(ring.modulus as i32, &[]);
            (self.b.remainder(&pos0, &modulus), pos0.clone())
        } else {
            let modulus = self.b.scalar_i32(ring.modulus as i32);
            let ring_start = self.b.scalar_rem(&pos0_host, &modulus);
            (self.b.tensor_of(&ring_start), self.b.tensor_of(&pos0_host))
        };
        let one = self.i32(1, &[c]);
        let stored = self.b.add(&qpos, &one);
        let empty = self.i32(0, &[c]);
        let stored = self.b.select(&row_valid, &stored, &empty);
        let positions = self.write_at(positions, &stored, &ring_start);
        let sliding_rows = ring.rows_seen(c, self.span);
        let seen = if sliding_rows < ring.rows {
            self.b.slice(&positions, &[0], &[sliding_rows])
        } else {
            positions.clone()
        };
        let one = self.i32(1, &[sliding_rows]);
        let ring_pos = self.b.sub(&seen, &one);
        let sliding_mask = self.visibility(&qpos, &ring_pos, &end, Some(cfg.sliding_window));

        let rope_local = self.rope_tables(&qpos, cfg.rope_theta_local, 1.0);
        let rope_global =
            self.rope_tables(&qpos, cfg.rope_theta_global, cfg.rope_linear_factor_global);
        let first = self.b.slice(&qpos, &[0], &[1]);
        let end_1 = self.b.reshape(&end, &[1]);
        let bounds = self.b.concatenate(&[&first, &end_1], 0);
        let chunk = Chunk {
            c,
            pos0_host,
            valid_host,
            global_start,
            rope_local,
            rope_global,
            ring_start,
            sliding_rows,
            sliding_mask,
            qpos,
            valid,
            end,
            positions: positions.clone(),
            bounds,
            row_valid,
        };
        (chunk, positions)
    }

    /// `[C, K]` i1: query at `qpos[i]` sees key at `kpos[j]` iff `0 <= kp <= qp`, `kp < end`
    /// and, with a window, `kp > qp - window`.
    fn visibility(
        &mut self,
        qpos: &Value,
        kpos: &Value,
        end: &Value,
        window: Option<usize>,
    ) -> Value {
        let (c, k) = (qpos.dims()[0], kpos.dims()[0]);
        let dims = [c, k];
        let qp = self.b.broadcast_in_dim(qpos, &dims, &[0]);
        let kp = self.b.broadcast_in_dim(kpos, &dims, &[1]);
        let zero = self.i32(0, &dims);
        let end = self.splat(end, &dims);
        let nonneg = self.b.compare(Cmp::Ge, &kp, &zero);
        let causal = self.b.compare(Cmp::Le, &kp, &qp);
        let written = self.b.compare(Cmp::Lt, &kp, &end);
        let mut mask = self.b.and(&nonneg, &causal);
        mask = self.b.and(&mask, &written);
        if let Some(w) = window {
            let wv = self.i32(w as i32, &dims);
            let lo = self.b.sub(&qp, &wv);
            let inside = self.b.compare(Cmp::Gt, &kp, &lo);
            mask = self.b.and(&mask, &inside);
        }
        mask
    }

    /// cos/sin of `angle = f32(inv_freq * f32(pos))` as the reference builds them.
    ///
    /// The reference takes cos/sin of the f32 angle in f64; IREE's f32 cos/sin lose about
    /// `3e-8 * angle` on large angles, so the angle is first reduced modulo 2 pi with a
    /// three-part (Cody-Waite) split of 2 pi whose first two parts have 11 significant bits:
    /// `k * C1` and `k * C2` are exact for `k < 2^13` (positions up to ~51000 at inv_freq 1).
    fn rope_tables(&mut self, qpos: &Value, theta: f64, factor: f64) -> RopeTables {
        let hd = self.cfg.head_dim;
        let c = qpos.dims()[0];
        let inv_freq: Vec<f32> = (0..hd / 2)
            .map(|k| {
                let exponent = (2 * k) as f32 / hd as f32;
                let f = 1.0 / (theta as f32).powf(exponent);
                f / factor as f32
            })
            .collect();
        let dims = [c, hd / 2];
        let f = self.b.const_f32_vec(&inv_freq);
        let f = self.b.broadcast_in_dim(&f, &dims, &[1]);
        let p = self.b.convert(qpos, ElemType::F32);
        let p = self.b.broadcast_in_dim(&p, &dims, &[0]);
        let angle = self.b.mul(&f, &p);

        let two_pi = std::f64::consts::TAU;
        let mask = 0xFFFF_E000u32; // 11 significant bits
        let c1 = f32::from_bits((two_pi as f32).to_bits() & mask);
        let c2 = f32::from_bits(((two_pi - c1 as f64) as f32).to_bits() & mask);
        let c3 = (two_pi - c1 as f64 - c2 as f64) as f32;
        let inv = self.f32((1.0 / two_pi) as f32, &dims);
        let k = self.b.mul(&angle, &inv);
        let k = self.b.round_nearest_even(&k);
        let mut r = angle;
        for part in [c1, c2, c3] {
            let pc = self.f32(part, &dims);
            let kp = self.b.mul(&k, &pc);
            r = self.b.sub(&r, &kp);
        }
        let sin = self.b.sin(&r);
        let neg = self.b.neg(&sin);
        let sin = self.b.concatenate(&[&neg, &sin], 1);
        let sin = self.b.reshape(&sin, &[c, 2, hd / 2]);
        RopeTables {
            cos: self.b.cos(&r),
            sin,
        }
    }

    // ---- the model ------------------------------------------------------------------------

    /// Scaled input embeddings.
    ///
    /// # Shapes
    /// `rows`: `[C, hidden]` raw rows; returns `[C, hidden]`.
    fn embed(&mut self, rows: &Value) -> Value {
        let scale = self.f32(self.cfg.embed_scale(), rows.dims());
        self.b.mul(rows, &scale)
    }

    /// Rows of `embed_tokens` for `ids`.
    ///
    /// # Shapes
    /// `ids`: `[C]` i32; `embed`: the table in [`GraphOptions::table_layout`]; returns
    /// `[C, hidden]`.
    pub fn gather(&mut self, embed: &Value, ids: &Value) -> Value {
        let c = ids.dims()[0];
        match self.opts.table_layout() {
            WeightLayout::Rows => {
                let idx = self.b.reshape(ids, &[c, 1]);
                self.b.gather_rows(embed, &idx)
            }
            WeightLayout::Panels => {
                let lanes = self.i32(TABLE_LANES as i32, &[c]);
                let panel = self.b.div(ids, &lanes);
                let lane = self.b.remainder(ids, &lanes);
                let panel = self.b.reshape(&panel, &[c, 1]);
                let lane = self.b.reshape(&lane, &[c, 1]);
                let idx = self.b.concatenate(&[&panel, &lane], 1);
                self.b.gather_lanes(embed, &idx)
            }
        }
    }

    /// One decoder layer with sandwich norms over the chunk's residual `x` and its normed
    /// input `h`; returns the residual after the layer, the next layer's normed input where
    /// `next_norm` (that layer's `input_layernorm`) is given, and the updated buffers.
    ///
    /// # Shapes
    /// `x`, `h`: `[C, hidden]`; `k_buf`, `v_buf`: `[ring rows or capacity, kv_heads, hd]`.
    fn layer(
        &mut self,
        (layer, w): (usize, &LayerWeights),
        ch: &Chunk,
        (x, h): (&Value, &Value),
        next_norm: Option<&Value>,
        (k_buf, v_buf): (&Value, &Value),
    ) -> (Value, Option<Value>, Value, Value) {
        let (o, k_buf, v_buf) = self.attention(layer, w, ch, h, k_buf, v_buf);
        let (post_attention, pre_ffn) = (&w.post_attention_layernorm, &w.pre_feedforward_layernorm);
        let (x, h) = match self.spirv_residual_fits(ch, o.dims()[1]) {
            Some(kernels) => {
                let product = (kernels.matvec_norm.name, &w.o_proj, &o);
                self.spirv_residual(product, x, (post_attention, pre_ffn))
            }
            None => {
                let a = self.linear(&w.o_proj, &o, self.cfg.hidden_size);
                self.residual(ch, (x, &a), (post_attention, Some(pre_ffn)))
            }
        };
        let h = h.expect("the MLP's normed input");
        let post_ffn = &w.post_feedforward_layernorm;
        let ffn = self.cfg.intermediate_size;
        let (x, h) = match (self.spirv_residual_fits(ch, ffn), next_norm) {
            (Some(kernels), Some(next)) => {
                let gu = self.linear(&w.gate_up_proj, &h, 2 * ffn);
                let product = (kernels.geglu_down_norm.name, &w.down_proj, &gu);
                self.spirv_residual(product, &x, (post_ffn, next))
            }
            _ => {
                let m = self.mlp(w, &h);
                self.residual(ch, (&x, &m), (post_ffn, next_norm))
            }
        };
        (x, h, k_buf, v_buf)
    }

    /// `x + rms_norm(a, norm)` and, with `next`, that sum normed by `next`: in one dispatch
    /// of kvsnap's kernel on Vulkan ([`Forward::spirv_add_norm`]).
    fn residual(
        &mut self,
        ch: &Chunk,
        (x, a): (&Value, &Value),
        (norm, next): (&Value, Option<&Value>),
    ) -> (Value, Option<Value>) {
        if let (Some(kernels), Some(next)) = (self.spirv_norm_fits(ch), next) {
            let (x, h) = self.spirv_add_norm(kernels.add_norm_rows.name, (x, a), (norm, next));
            return (x, Some(h));
        }
        let a = self.rms_norm(a, norm);
        let x = self.b.add(x, &a);
        let h = next.map(|w| self.rms_norm(&x, w));
        (x, h)
    }

    /// The SPIR-V kernels of a product of `k`-long rows by a chunk of `c` rows
    /// ([`Forward::spirv_matvec`]), with [`GraphOptions::spirv_kernels`]: the decode step's
    /// row, the matrices in rows and `k` a multiple of 4.
    fn spirv_matvec_fits(&self, c: usize, k: usize) -> Option<SpirvKernels> {
        let fits = c == 1 && self.opts.layout == WeightLayout::Rows && k.is_multiple_of(4);
        self.opts.spirv_kernels.filter(|_| fits)
    }

    /// The SPIR-V kernels of a chunk's product `x . m^T` ([`Forward::spirv_matmul`]), with
    /// [`GraphOptions::spirv_kernels`] and [`GraphOptions::spirv_chunks`]: chunks of more
    /// than one row, the matrices in rows, their rows a multiple of 4 long, and at most
    /// [`kernels::SPIRV_MAX_GROUPS`] tiles each way.
    fn spirv_matmul_fits(&self, x: &Value, m: &Value) -> Option<SpirvKernels> {
        let [c, n, k] = [x.dims()[0], m.dims()[0], m.dims()[1]];
        let [tile_c, tile_n] = kernels::SPIRV_MATMUL_TILE;
        let fits = c > 1
            && self.opts.spirv_chunks
            && self.opts.layout == WeightLayout::Rows
            && k.is_multiple_of(4)
            && c.div_ceil(tile_c) <= kernels::SPIRV_MAX_GROUPS
            && n.div_ceil(tile_n) <= kernels::SPIRV_MAX_GROUPS;
        self.opts.spirv_kernels.filter(|_| fits)
    }

    /// `x . m^T` for a chunk's rows `x` (`[c, k]`) and a matrix `m` in rows (`[n, k]`), in one
    /// dispatch of the SPIR-V kernel `object` (`matmul`): a workgroup every tile of
    /// [`kernels::SPIRV_MATMUL_TILE`]. `[c, n]`.
    fn spirv_matmul(&mut self, object: &str, m: &Value, x: &Value) -> Value {
        let [c, n, k] = [x.dims()[0], m.dims()[0], m.dims()[1]];
        let [tile_c, tile_n] = kernels::SPIRV_MATMUL_TILE;
        let [y]: [Value; 1] = self
            .b
            .dispatch_spirv(
                object,
                [n.div_ceil(tile_n), c.div_ceil(tile_c), 1],
                &[c as u32, n as u32, k as u32],
                (&[x, m], &[]),
                &[TensorType::f32(&[c, n])],
            )
            .try_into()
            .expect("one result");
        y
    }

    /// The SPIR-V kernels of a chunk's norms, a workgroup a row
    /// ([`Forward::spirv_embed_norm`], [`Forward::spirv_add_norm`]), with
    /// [`GraphOptions::spirv_kernels`]: hidden sizes up to [`kernels::SPIRV_MAX_HIDDEN`].
    fn spirv_norm_fits(&self, ch: &Chunk) -> Option<SpirvKernels> {
        let fits =
            self.cfg.hidden_size <= kernels::SPIRV_MAX_HIDDEN && ch.c <= kernels::SPIRV_MAX_GROUPS;
        self.opts.spirv_kernels.filter(|_| fits)
    }

    /// `x + rms_norm(a, norm)` and that sum normed by `next`, in one dispatch of the SPIR-V
    /// kernel `object` (`add_norm_rows`), a workgroup a row. `[C, hidden]` each.
    fn spirv_add_norm(
        &mut self,
        object: &str,
        (x, a): (&Value, &Value),
        (norm, next): (&Value, &Value),
    ) -> (Value, Value) {
        let (c, n) = (x.dims()[0], self.cfg.hidden_size);
        let eps = (self.cfg.rms_norm_eps as f32).to_bits();
        let [sum, normed]: [Value; 2] = self
            .b
            .dispatch_spirv(
                object,
                [c, 1, 1],
                &[n as u32, eps],
                (&[x, a, norm, next], &[]),
                &[x.ty.clone(), x.ty.clone()],
            )
            .try_into()
            .expect("the sum and its norm");
        (sum, normed)
    }

    /// The SPIR-V kernels of a residual whose layer half ends in a product of `k`-long rows
    /// in one dispatch ([`Forward::spirv_residual`]): [`Forward::spirv_matvec_fits`] (the
    /// decode step's row) and [`Forward::spirv_norm_fits`].
    fn spirv_residual_fits(&self, ch: &Chunk, k: usize) -> Option<SpirvKernels> {
        self.spirv_matvec_fits(ch.c, k)
            .and(self.spirv_norm_fits(ch))
    }

    /// The SPIR-V kernels of the tied head ([`Forward::spirv_head`]), which takes one row (a
    /// chunk's last valid one): [`Forward::spirv_matvec_fits`] for the table's rows, a model
    /// without a final logit softcap, and a vocabulary of at most
    /// [`kernels::SPIRV_MAX_GROUPS`] workgroups.
    fn spirv_head_fits(&self) -> Option<SpirvKernels> {
        let groups = self.cfg.vocab_size.div_ceil(kernels::SPIRV_HEAD_ROWS);
        let fits = self.opts.table_layout() == WeightLayout::Rows
            && self.cfg.final_logit_softcapping.is_none()
            && groups <= kernels::SPIRV_MAX_GROUPS;
        self.spirv_matvec_fits(1, self.cfg.hidden_size)
            .filter(|_| fits)
    }

    /// The first residual, the embedding rows scaled ([`Forward::embed`]), and those normed
    /// by `norm` (the first layer's input norm), in one dispatch of the SPIR-V kernel
    /// `object` (`embed_norm`), a workgroup a row. `[C, hidden]` each.
    fn spirv_embed_norm(&mut self, object: &str, rows: &Value, norm: &Value) -> (Value, Value) {
        let (c, n) = (rows.dims()[0], self.cfg.hidden_size);
        let eps = (self.cfg.rms_norm_eps as f32).to_bits();
        let scale = self.cfg.embed_scale().to_bits();
        let [x, h]: [Value; 2] = self
            .b
            .dispatch_spirv(
                object,
                [c, 1, 1],
                &[n as u32, eps, scale],
                (&[rows, norm], &[]),
                &[rows.ty.clone(), rows.ty.clone()],
            )
            .try_into()
            .expect("the residual and its norm");
        (x, h)
    }

    /// The tied head's logits `embed . h` and the greedy token, in one dispatch of the SPIR-V
    /// kernel `object` (`head`): a workgroup every [`kernels::SPIRV_HEAD_ROWS`] rows, the
    /// last to finish taking the token from each workgroup's best (as
    /// [`Forward::argmax`]). Returns `next: []` i32 and `logits: [vocab]`.
    pub fn spirv_head(&mut self, object: &str, embed: &Value, h: &Value) -> (Value, Value) {
        let (n, k) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let groups = n.div_ceil(kernels::SPIRV_HEAD_ROWS);
        let h = self.b.reshape(h, &[1, k]);
        let [logits, _, _, next]: [Value; 4] = self
            .counted_dispatch(
                object,
                [groups, 1, 1],
                &[n as u32, k as u32],
                &[&h, embed],
                &[
                    TensorType::f32(&[n]),
                    TensorType::f32(&[groups]),
                    TensorType::i32(&[groups]),
                    TensorType::i32(&[1]),
                ],
            )
            .try_into()
            .expect("the logits, the workgroups' best and the token");
        (self.b.reshape(&next, &[]), logits)
    }

    /// `m . v` for a matrix `m` in rows (`[n, k]`) and one row `v` (`[1, k]`), in one
    /// dispatch of the SPIR-V kernel `object` (`matvec`, or `geglu_down` with `v` the gate/up
    /// product's row, `[1, 2 * k]`): a workgroup every [`kernels::SPIRV_MATVEC_ROWS`] rows,
    /// `vec4` loads. `[1, n]`.
    fn spirv_matvec(&mut self, object: &str, m: &Value, v: &Value) -> Value {
        let [n, k] = [m.dims()[0], m.dims()[1]];
        let [y]: [Value; 1] = self
            .b
            .dispatch_spirv(
                object,
                [n.div_ceil(kernels::SPIRV_MATVEC_ROWS), 1, 1],
                &[n as u32, k as u32],
                (&[v, m], &[]),
                &[TensorType::f32(&[1, n])],
            )
            .try_into()
            .expect("one result");
        y
    }

    /// A layer half's last product, `a = m . v`, then `x + rms_norm(a, norm)` and that sum
    /// normed by `next`, in one dispatch of the SPIR-V kernel `object` (`matvec_norm`, or
    /// `geglu_down_norm` with `v` the gate/up product's row): a workgroup every
    /// [`kernels::SPIRV_MATVEC_ROWS`] rows of `m`, the last to finish running the residual.
    /// Returns the sum and its norm.
    fn spirv_residual(
        &mut self,
        (object, m, v): (&str, &Value, &Value),
        x: &Value,
        (norm, next): (&Value, &Value),
    ) -> (Value, Option<Value>) {
        let [n, k] = [m.dims()[0], m.dims()[1]];
        let eps = (self.cfg.rms_norm_eps as f32).to_bits();
        let [_, sum, normed]: [Value; 3] = self
            .counted_dispatch(
                object,
                [n.div_ceil(kernels::SPIRV_MATVEC_ROWS), 1, 1],
                &[n as u32, k as u32, eps],
                &[v, m, x, norm, next],
                &[x.ty.clone(), x.ty.clone(), x.ty.clone()],
            )
            .try_into()
            .expect("the product, the sum and its norm");
        (sum, Some(normed))
    }

    /// [`FuncBuilder::dispatch_spirv`] of a kernel whose workgroups count themselves on the
    /// module's counters ([`kernels::SPIRV_COUNTERS_GLOBAL`]): `args`, then the counters in
    /// place, loaded from the global before and stored back after. Returns the results.
    fn counted_dispatch(
        &mut self,
        object: &str,
        groups: [usize; 3],
        constants: &[u32],
        args: &[&Value],
        results: &[TensorType],
    ) -> Vec<Value> {
        let name = kernels::SPIRV_COUNTERS_GLOBAL;
        let counters = self
            .b
            .global_load(name, &TensorType::i32(&[kernels::SPIRV_COUNTERS]));
        let mut operands = args.to_vec();
        operands.push(&counters);
        let mut out = self.b.dispatch_spirv(
            object,
            groups,
            constants,
            (&operands, &[args.len()]),
            results,
        );
        let counters = out.pop().expect("the counters, in place");
        self.b.global_store(&counters, name);
        out
    }

    /// The decoder layers over the chunk's embedding rows `rows` (raw: scaled here), each
    /// with its K and V buffers in `kv` (K then V per layer); returns the last residual and
    /// the updated buffers, in `kv`'s order. On Vulkan kvsnap's kernels scale and norm the
    /// rows in one dispatch, and end the last layer in `final_norm` too
    /// ([`Hidden::final_normed`]).
    pub fn layers(
        &mut self,
        weights: &[LayerWeights],
        ch: &Chunk,
        rows: &Value,
        kv: &[Value],
        final_norm: &Value,
    ) -> (Hidden, Vec<Value>) {
        let mut kv_out = Vec::with_capacity(kv.len());
        let (mut x, mut h) = match (self.spirv_norm_fits(ch), weights.first()) {
            (Some(kernels), Some(first)) => {
                let (x, h) =
                    self.spirv_embed_norm(kernels.embed_norm.name, rows, &first.input_layernorm);
                (x, Some(h))
            }
            (_, first) => {
                let x = self.embed(rows);
                let h = first.map(|w| self.rms_norm(&x, &w.input_layernorm));
                (x, h)
            }
        };
        for (layer, w) in weights.iter().enumerate() {
            let input = h.take().expect("each layer's normed input");
            let next_norm = match weights.get(layer + 1) {
                Some(next) => Some(&next.input_layernorm),
                None => self.spirv_norm_fits(ch).map(|_| final_norm),
            };
            let buffers = (&kv[2 * layer], &kv[2 * layer + 1]);
            let (nx, nh, k, v) = self.layer((layer, w), ch, (&x, &input), next_norm, buffers);
            (x, h) = (nx, nh);
            kv_out.extend([k, v]);
        }
        let hidden = Hidden { x, final_normed: h };
        (hidden, kv_out)
    }

    /// `down(gelu_tanh(gate(x)) * up(x))`, GELU written as the reference's `gelu_tanh`. The
    /// decode step's GeGLU and down product run in one dispatch of kvsnap's SPIR-V kernel
    /// where it takes them ([`GraphOptions::spirv_kernels`], the matrices in rows, `ffn` a
    /// multiple of 4).
    fn mlp(&mut self, w: &LayerWeights, x: &Value) -> Value {
        let ffn = self.cfg.intermediate_size;
        if let Some(kernels) = self.spirv_matvec_fits(x.dims()[0], ffn) {
            let gu = self.linear(&w.gate_up_proj, x, 2 * ffn);
            return self.spirv_matvec(kernels.geglu_down.name, &w.down_proj, &gu);
        }
        let [g, u] = self.linear_stack(&w.gate_up_proj, x, [ffn, ffn]);
        let dims = g.dims().to_vec();
        // 0.5 * x * (1 + tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
        let c = self.f32(0.044715, &dims);
        let t = self.b.mul(&c, &g);
        let t = self.b.mul(&t, &g);
        let t = self.b.mul(&t, &g);
        let t = self.b.add(&g, &t);
        let s = self.f32(0.797_884_6, &dims);
        let t = self.b.mul(&s, &t);
        let t = self.b.tanh(&t);
        let one = self.f32(1.0, &dims);
        let t = self.b.add(&one, &t);
        let half = self.f32(0.5, &dims);
        let y = self.b.mul(&half, &g);
        let y = self.b.mul(&y, &t);
        let y = self.b.mul(&y, &u);
        self.linear(&w.down_proj, &y, self.cfg.hidden_size)
    }

    /// Self-attention of the chunk: projections, q/k norms, RoPE, attention over the cache and
    /// the chunk, then the chunk's K/V rows stored; the output projection is the caller's.
    ///
    /// # Shapes
    /// `x`: `[C, hidden]` (normed); returns the heads' outputs `[C, heads * hd]` and the
    /// updated buffers.
    fn attention(
        &mut self,
        layer: usize,
        w: &LayerWeights,
        ch: &Chunk,
        x: &Value,
        k_buf: &Value,
        v_buf: &Value,
    ) -> (Value, Value, Value) {
        let cfg = self.cfg;
        let (c, hd, kvh) = (ch.c, cfg.head_dim, cfg.num_key_value_heads);
        let g = cfg.group_size();
        let heads = cfg.num_attention_heads;
        let (qk, v) = self.qk_and_v(&w.qkv_proj, x, [heads * hd, kvh * hd, kvh * hd]);
        let v = self.b.reshape(&v, &[c, kvh, hd]);
        let kind = cfg.layer_kinds[layer];
        let tables = match kind {
            LayerKind::Sliding => &ch.rope_local,
            LayerKind::Global => &ch.rope_global,
        };
        let qk = self.b.reshape(&qk, &[c, heads + kvh, hd]);
        // kvsnap's kernels read the visible rows only, whatever the span.
        let at = match kind {
            LayerKind::Sliding => LayerRows {
                start: &ch.ring_start,
                rows: ch.sliding_rows,
                window: cfg.sliding_window,
            },
            LayerKind::Global => LayerRows {
                start: &ch.global_start,
                rows: self.span.unwrap_or(cfg.context_capacity),
                window: 0,
            },
        };
        let spirv = self.spirv_attention_fits(c);
        let (k_buf, v_buf, o) = if let Some(objects) = spirv.filter(|_| c == 1) {
            let heads = SpirvHeads {
                qk: &qk,
                v: &v,
                norms: [&w.q_norm, &w.k_norm],
                rope: tables,
            };
            let (o, [k_buf, v_buf]) = self.spirv_attend(objects, heads, [k_buf, v_buf], ch, at);
            (k_buf, v_buf, o)
        } else {
            let qk = self.norm_rotate_heads(&qk, (&w.q_norm, &w.k_norm), heads, tables);
            let q = self.b.slice(&qk, &[0, 0, 0], &[c, heads, hd]);
            let q = self.b.reshape(&q, &[c, kvh, g, hd]);
            let k = self.b.slice(&qk, &[0, heads, 0], &[c, heads + kvh, hd]);
            // Padding rows are zeroed, so that whatever they computed never reaches a cache.
            let k = self.zero_padding(&k, ch);
            let v = self.zero_padding(&v, ch);
            let (k_buf, v_buf) = self.write_rows(&k, &v, k_buf, v_buf, at.start);
            let o = if let Some(kernels) = spirv.filter(|_| self.opts.spirv_chunks) {
                self.spirv_attend_rows(kernels.attend_rows.name, &q, [&k_buf, &v_buf], ch, at)
            } else if self.object_attention_fits(c) {
                self.object_attend(&q, &k_buf, &v_buf, ch, at)
            } else {
                match kind {
                    LayerKind::Sliding => {
                        let (keys, values) = self.first_rows(&k_buf, &v_buf, at.rows);
                        self.attend(&q, &keys, &values, &ch.sliding_mask)
                    }
                    LayerKind::Global => {
                        let spans = match self.span {
                            Some(span) => vec![span],
                            None if self.opts.branches_for(c) => {
                                global_spans(cfg.context_capacity, c)
                            }
                            None => vec![cfg.context_capacity],
                        };
                        self.attend_live(&q, &k_buf, &v_buf, ch, &spans)
                    }
                }
            };
            (k_buf, v_buf, o)
        };
        // [kvh, C, g, hd] -> [C, kvh, g, hd] -> [C, heads * hd]
        let o = self.b.transpose(&o, &[1, 0, 2, 3]);
        let o = self.b.reshape(&o, &[c, kvh * g * hd]);
        (o, k_buf, v_buf)
    }

    /// The q, k and v stack's product (`outs` its parts' rows) as the query and key heads
    /// together, `[C, q + k rows]`, and the values: one part of the stack where the queries'
    /// rows end where the keys' begin (always in `Rows`; in `Panels` where the queries fill
    /// whole panels, as Gemma 3's do), else the three parts, q and k concatenated.
    fn qk_and_v(&mut self, w: &Value, x: &Value, outs: [usize; 3]) -> (Value, Value) {
        if self.opts.layout.stack_offsets(&outs)[1] == outs[0] {
            let [qk, v] = self.linear_stack(w, x, [outs[0] + outs[1], outs[2]]);
            (qk, v)
        } else {
            let [q, k, v] = self.linear_stack(w, x, outs);
            (self.b.concatenate(&[&q, &k], 1), v)
        }
    }

    /// Whether a `c`-row chunk's attention runs in kvsnap's kernels ([`Forward::object_attend`]):
    /// with [`GraphOptions::own_kernels`], where the model has no score soft-capping and its
    /// heads fit the kernel (16-lane head dims; for the decode step's one row at most
    /// [`kernels::ATTEND_MAX_GROUP`] query heads a key/value head, for a chunk head dims of at
    /// most [`kernels::ATTEND_MAX_HEAD_DIM`]).
    fn object_attention_fits(&self, c: usize) -> bool {
        let cfg = self.cfg;
        let heads_fit = if c == 1 {
            cfg.group_size() <= kernels::ATTEND_MAX_GROUP
        } else {
            cfg.head_dim <= kernels::ATTEND_MAX_HEAD_DIM
        };
        self.opts.own_kernels.is_some()
            && cfg.attn_logit_softcapping.is_none()
            && cfg.head_dim.is_multiple_of(16)
            && heads_fit
    }

    /// The SPIR-V attention kernels for a `c`-row chunk (the decode step's
    /// [`Forward::spirv_attend`], a chunk's [`Forward::spirv_attend_rows`]), with
    /// [`GraphOptions::spirv_kernels`]: where the model has no score soft-capping, at most
    /// [`kernels::SPIRV_MAX_GROUP`] query heads a key/value head, head dims of at most
    /// [`kernels::SPIRV_MAX_HEAD_DIM`] and at most [`kernels::SPIRV_MAX_GROUPS`] rows and
    /// key/value heads.
    fn spirv_attention_fits(&self, c: usize) -> Option<SpirvKernels> {
        let cfg = self.cfg;
        let fits = c <= kernels::SPIRV_MAX_GROUPS
            && cfg.num_key_value_heads <= kernels::SPIRV_MAX_GROUPS
            && cfg.attn_logit_softcapping.is_none()
            && cfg.group_size() <= kernels::SPIRV_MAX_GROUP
            && cfg.head_dim <= kernels::SPIRV_MAX_HEAD_DIM;
        self.opts.spirv_kernels.filter(|_| fits)
    }

    /// The decode step's attention over the first `at.rows` rows of the layer's buffers by
    /// kvsnap's SPIR-V kernels ([`SpirvKernels`]), reading only the visible rows (a
    /// sliding layer's by the ring's positions, a global layer's up to the query): a split's
    /// workgroup every [`kernels::SPIRV_SPLIT_ROWS`] rows and key/value head, then one a
    /// query head to merge them. The split takes the step's heads as the projection gives
    /// them, norms and rotates them as [`Forward::norm_rotate_heads`] and stores the key and
    /// value rows at row `at.start` of the buffers, in place, as [`Forward::write_rows`]
    /// would before it.
    ///
    /// Returns the attention `[kvh, 1, g, hd]`, as [`Forward::attend`], and the buffers.
    fn spirv_attend(
        &mut self,
        objects: SpirvKernels,
        heads: SpirvHeads,
        [k_buf, v_buf]: [&Value; 2],
        ch: &Chunk,
        at: LayerRows,
    ) -> (Value, [Value; 2]) {
        let cfg = self.cfg;
        let (kvh, g, hd) = (cfg.num_key_value_heads, cfg.group_size(), cfg.head_dim);
        let (rows, window) = (at.rows, at.window);
        let splits = rows.div_ceil(kernels::SPIRV_SPLIT_ROWS);
        let scale = cfg.attn_scale().to_bits();
        let [kvh_, g_, hd_, splits_] = [kvh, g, hd, splits].map(|x| x as u32);
        let eps = (cfg.rms_norm_eps as f32).to_bits();
        let [q_norm, k_norm] = heads.norms;
        let args = [
            heads.qk,
            heads.v,
            q_norm,
            k_norm,
            &heads.rope.cos,
            &heads.rope.sin,
            &ch.positions,
            &ch.bounds,
            at.start,
            k_buf,
            v_buf,
        ];
        // The buffers, last, are written in place.
        let in_place = [args.len() - 2, args.len() - 1];
        let [part, k_buf, v_buf]: [Value; 3] = self
            .b
            .dispatch_spirv(
                objects.split.name,
                [splits, kvh, 1],
                &[
                    kvh_,
                    g_,
                    hd_,
                    rows as u32,
                    window as u32,
                    scale,
                    splits_,
                    eps,
                ],
                (&args, &in_place),
                &[TensorType::f32(&[splits, kvh, g, hd + 2])],
            )
            .try_into()
            .expect("the parts and the two buffers");
        let [o]: [Value; 1] = self
            .b
            .dispatch_spirv(
                objects.merge.name,
                [kvh * g, 1, 1],
                &[kvh_, g_, hd_, splits_],
                (&[&part], &[]),
                &[TensorType::f32(&[kvh, g, hd])],
            )
            .try_into()
            .expect("one result");
        (self.b.reshape(&o, &[kvh, 1, g, hd]), [k_buf, v_buf])
    }

    /// A chunk's attention of `q` (`[C, kvh, g, hd]`, normed and rotated) over the first
    /// `at.rows` rows of the layer's buffers (the chunk's rows written) in one dispatch of
    /// the SPIR-V kernel `object` (`attend_rows`): a workgroup a row and key/value head, over
    /// the rows its query sees in blocks, online, as the C kernel's (a sliding layer's rows
    /// by the ring's positions, a global layer's up to the query). Returns `[kvh, C, g, hd]`,
    /// as [`Forward::attend`].
    fn spirv_attend_rows(
        &mut self,
        object: &str,
        q: &Value,
        [k_buf, v_buf]: [&Value; 2],
        ch: &Chunk,
        at: LayerRows,
    ) -> Value {
        let cfg = self.cfg;
        let (kvh, g, hd) = (cfg.num_key_value_heads, cfg.group_size(), cfg.head_dim);
        let scale = cfg.attn_scale().to_bits();
        let constants = [kvh, g, hd, at.rows, at.window].map(|x| x as u32);
        let [o]: [Value; 1] = self
            .b
            .dispatch_spirv(
                object,
                [ch.c, kvh, 1],
                &[&constants[..], &[scale, ch.c as u32]].concat(),
                (&[q, k_buf, v_buf, &ch.positions, &ch.bounds], &[]),
                &[TensorType::f32(&[kvh, ch.c, g, hd])],
            )
            .try_into()
            .expect("one result");
        o
    }

    /// The decode step's attention of `q` (`[1, kvh, g, hd]`) over the layer's buffers by
    /// kvsnap's kernel ([`kernels`]): [`kernels::ATTEND_SPLITS`] workgroups, each over a
    /// split of the first `at.rows` rows, read only where visible (a sliding layer's by the
    /// ring's positions, a global layer's up to the query), where the graph's attention
    /// reads every row and masks. Each split gives its unnormalised
    /// weighted sums `acc`, its maximum score `m` and its sum of weights `l` per query head;
    /// they merge as `sum(e^(m - M) acc) / sum(e^(m - M) l)`, `M` the maximum of the `m`.
    /// Returns `[kvh, 1, g, hd]`, as [`Forward::attend`].
    ///
    /// A chunk of more than one row runs in one dispatch of the chunk kernel instead, a
    /// workgroup for every [`kernels::ATTEND_CHUNK_LANES`] of a key/value head's `C x g`
    /// (row, query head) pairs, over the rows any of them sees, masked per pair; it returns
    /// the normalised `[kvh, C, g, hd]`.
    fn object_attend(
        &mut self,
        q: &Value,
        k_buf: &Value,
        v_buf: &Value,
        ch: &Chunk,
        at: LayerRows,
    ) -> Value {
        let (rows, window) = (at.rows, at.window);
        let cfg = self.cfg;
        let (kvh, g, hd) = (cfg.num_key_value_heads, cfg.group_size(), cfg.head_dim);
        let scale = cfg.attn_scale().to_bits() as usize;
        let (buf_rows, pos_rows) = (k_buf.dims()[0], ch.positions.dims()[0]);
        if ch.c > 1 {
            let groups = kvh * (ch.c * g).div_ceil(kernels::ATTEND_CHUNK_LANES);
            return self.b.dispatch(
                kernels::ATTEND_CHUNK_ENTRY,
                &[groups],
                &[q, k_buf, v_buf, &ch.positions, &ch.bounds],
                &[
                    kvh, g, hd, rows, window, scale, buf_rows, pos_rows, ch.c, groups,
                ],
                TensorType::f32(&[kvh, ch.c, g, hd]),
            );
        }
        let splits = kernels::ATTEND_SPLITS;
        let part = self.b.dispatch(
            kernels::ATTEND_ENTRY,
            &[splits],
            &[q, k_buf, v_buf, &ch.positions, &ch.bounds],
            &[kvh, g, hd, rows, window, scale, buf_rows, pos_rows, splits],
            TensorType::f32(&[splits, kvh, g, hd + 2]),
        );
        let heads = [splits, kvh, g];
        let field = |f: &mut Self, at: usize| {
            let x = f.b.slice(&part, &[0, 0, 0, at], &[splits, kvh, g, at + 1]);
            f.b.reshape(&x, &heads)
        };
        let (m, l) = (field(self, hd), field(self, hd + 1));
        let acc = self.b.slice(&part, &[0, 0, 0, 0], &[splits, kvh, g, hd]);
        let top = self.b.reduce(&m, Reduction::Max, &[0]);
        let top = self.b.broadcast_in_dim(&top, &heads, &[1, 2]);
        let weight = self.b.sub(&m, &top);
        let weight = self.b.exp(&weight);
        let l = self.b.mul(&weight, &l);
        let sum = self.b.reduce(&l, Reduction::Sum, &[0]);
        let weight = self
            .b
            .broadcast_in_dim(&weight, &[splits, kvh, g, hd], &[0, 1, 2]);
        let acc = self.b.mul(&acc, &weight);
        let acc = self.b.reduce(&acc, Reduction::Sum, &[0]);
        let sum = self.b.broadcast_in_dim(&sum, &[kvh, g, hd], &[0, 1]);
        let o = self.b.div(&acc, &sum);
        self.b.reshape(&o, &[kvh, 1, g, hd])
    }

    /// `select(i < valid, x[i, ...], 0)` over the first (chunk) dim; `x` itself in a one-row
    /// chunk, which has no padding (`valid` is 1). (The decode step's v, a slice of the
    /// stacked q/k/v product, would otherwise take a dispatch of its own for the select.)
    fn zero_padding(&mut self, x: &Value, ch: &Chunk) -> Value {
        if ch.c == 1 {
            return x.clone();
        }
        let dims = x.dims().to_vec();
        let keep = self.b.broadcast_in_dim(&ch.row_valid, &dims, &[0]);
        let zero = self.f32(0.0, &dims);
        self.b.select(&keep, x, &zero)
    }

    /// `q . k^T` scores of `q [C, kvh, g, hd]` against cached rows `[rows, kvh, hd]`:
    /// `[kvh, C, g, rows]`.
    fn scores_rows(&mut self, q: &Value, rows: &Value) -> Value {
        self.b.dot_general(q, rows, &DotDims::batched(1, 1, 3, 2))
    }

    /// Scale, soft-cap, mask (`[C, K]` broadcast over heads) and softmax over the last dim, in
    /// f32 as the reference: `exp(x - max)`, then multiplied by `1 / sum`.
    fn softmax_scores(&mut self, s: &Value, mask: &Value) -> Value {
        self.softmax_over(s, mask, &[1, 3], &[3])
    }

    /// [`Forward::softmax_scores`] of scores whose keys are the dims `keys` of `s`, under a
    /// mask whose dims are `s`'s dims `mask_dims`.
    fn softmax_over(
        &mut self,
        s: &Value,
        mask: &Value,
        mask_dims: &[usize],
        keys: &[usize],
    ) -> Value {
        let dims = s.dims().to_vec();
        let kept: Vec<usize> = (0..dims.len()).filter(|d| !keys.contains(d)).collect();
        let scale = self.f32(self.cfg.attn_scale(), &dims);
        let mut s = self.b.mul(s, &scale);
        if let Some(cap) = self.cfg.attn_logit_softcapping {
            s = self.softcap(&s, cap as f32);
        }
        let mask = self.b.broadcast_in_dim(mask, &dims, mask_dims);
        let masked = self.f32(MASKED, &dims);
        let s = self.b.select(&mask, &s, &masked);
        let max = self.b.reduce(&s, Reduction::Max, keys);
        let max = self.b.broadcast_in_dim(&max, &dims, &kept);
        let e = self.b.sub(&s, &max);
        let e = self.b.exp(&e);
        let sum = self.b.reduce(&e, Reduction::Sum, keys);
        let one = self.f32(1.0, sum.dims());
        let inv = self.b.div(&one, &sum);
        let inv = self.b.broadcast_in_dim(&inv, &dims, &kept);
        self.b.mul(&e, &inv)
    }

    /// `tanh(x / cap) * cap`.
    fn softcap(&mut self, x: &Value, cap: f32) -> Value {
        let capv = self.f32(cap, x.dims());
        let t = self.b.div(x, &capv);
        let t = self.b.tanh(&t);
        self.b.mul(&t, &capv)
    }

    /// Writes the chunk's K/V rows at row `start` of the layer's buffers.
    ///
    /// Writing before anything reads the buffers lets IREE update them in place (a read of an
    /// argument before its `dynamic_update_slice` makes the update copy the whole buffer).
    /// Global layers write at `pos0` (padding rows land past the valid end, masked until
    /// overwritten); sliding layers at `pos0 % modulus`, where the rows they overwrite are
    /// never visible again (see [`RingGeometry::new`]).
    ///
    /// # Shapes
    /// `k`, `v`: `[C, kvh, hd]`; buffers `[rows, kvh, hd]`; returns the updated buffers.
    fn write_rows(
        &mut self,
        k: &Value,
        v: &Value,
        k_buf: &Value,
        v_buf: &Value,
        start: &Value,
    ) -> (Value, Value) {
        let k_buf = self.write_at(k_buf, k, start);
        let v_buf = self.write_at(v_buf, v, start);
        (k_buf, v_buf)
    }

    /// `x` with its rows `start..start + C` replaced by `rows` (`[C, d...]`; `start` a `[]`
    /// i32): a `dynamic_update_slice`, or with [`GraphOptions::device_rows`] a scatter at
    /// indices computed on the device. The rows stay within `x` either way: the ring has
    /// the largest chunk's rows past its modulus, and a call's padding never runs past the
    /// capacity (`plan_chunks`).
    fn write_at(&mut self, x: &Value, rows: &Value, start: &Value) -> Value {
        if self.opts.device_rows {
            let c = rows.dims()[0];
            let iota = self.b.iota(&[c, 1], 0);
            let start = self.splat(start, &[c, 1]);
            let indices = self.b.add(&start, &iota);
            return self.b.scatter_rows(x, &indices, rows);
        }
        let zero = self.i32(0, &[]);
        let mut starts = vec![start];
        starts.resize(x.ty.rank(), &zero);
        self.b.dynamic_update_slice(x, rows, &starts)
    }

    /// Attention of `q` over every row of `keys`/`values` with `mask` (`[C, rows]`).
    ///
    /// # Shapes
    /// `q`: `[C, kvh, g, hd]`; `keys`, `values`: `[rows, kvh, hd]`; returns `[kvh, C, g, hd]`.
    ///
    /// With [`GraphOptions::key_blocks`], where the `C x g` query rows are at most
    /// [`KEY_BLOCK_ROWS`], the keys are taken in blocks ([`Forward::attend_blocked`]).
    fn attend(&mut self, q: &Value, keys: &Value, values: &Value, mask: &Value) -> Value {
        let (c, g, rows) = (q.dims()[0], q.dims()[2], keys.dims()[0]);
        let block = key_block(rows).filter(|_| self.opts.key_blocks && c * g <= KEY_BLOCK_ROWS);
        if let Some(block) = block {
            return self.attend_blocked(q, keys, values, mask, block);
        }
        let s = self.scores_rows(q, keys); // [kvh, C, g, rows]
        let p = self.softmax_scores(&s, mask);
        self.b
            .dot_general(&p, values, &DotDims::batched(0, 1, 3, 0))
    }

    /// [`Forward::attend`] for a few query rows against many keys, which IREE's SPIR-V code ran
    /// in a couple of workgroups on an H100 (it distributes a product over its batch and output
    /// dims only).
    ///
    /// - The scores come from the keys as the product's left side, `[rows, hd] . [hd, C g]`
    ///   batched over the KV heads: the keys are its output rows, so the product spreads over
    ///   them. The sliding layers' decode-step scores `[4, 256] . [256, 640]` took 125 us in 5
    ///   workgroups (thirty-seventh pass), 14.8 us with the keys in blocks of 32 as a batch
    ///   dimension (thirty-ninth), 5.2 us this way in 2560 workgroups, with 18 dispatches a
    ///   step fewer (the step 7.2-7.9 -> 6.7-7.4 ms on an H100 and an H200, docs/BENCHMARKS.md,
    ///   fortieth pass).
    /// - The weighted values take the keys in blocks of `block`, a batch dimension: the decode
    ///   step's `[4, rows] . [rows, 256]` took 533 us over 4096 keys and 86 us over 640, 8.5
    ///   us in blocks (thirty-seventh pass). The blocks' partial sums are summed after: the
    ///   same terms added in another order.
    ///
    /// The softmax runs on the scores reshaped to `[kvh, C, g, blocks, block]`, its keys the
    /// last two dims: softmax and mask over key dims that are not adjacent (`[kvh, blocks, C,
    /// g, block]`, the mask transposed to match) gave wrong logits for chunks of several rows
    /// on lavapipe.
    fn attend_blocked(
        &mut self,
        q: &Value,
        keys: &Value,
        values: &Value,
        mask: &Value,
        block: usize,
    ) -> Value {
        let (c, kvh, g, hd) = (q.dims()[0], q.dims()[1], q.dims()[2], q.dims()[3]);
        let rows = keys.dims()[0];
        let blocks = rows / block;
        // Batch kvh, contracting the head dims: [kvh, rows, C, g], then [kvh, C, g, rows].
        let s = self.b.dot_general(keys, q, &DotDims::batched(1, 1, 2, 3));
        let s = self.b.transpose(&s, &[0, 2, 3, 1]);
        let s = self.b.reshape(&s, &[kvh, c, g, blocks, block]);
        let mask = self.b.reshape(mask, &[c, blocks, block]);
        let p = self.softmax_over(&s, &mask, &[1, 3, 4], &[3, 4]);
        let values = self.b.reshape(values, &[blocks, block, kvh, hd]);
        // Batch (kvh, blocks), contracting a block's keys: [kvh, blocks, C, g, hd].
        let dims = DotDims {
            lhs_batch: vec![0, 3],
            rhs_batch: vec![2, 0],
            lhs_contract: vec![4],
            rhs_contract: vec![1],
        };
        let parts = self.b.dot_general(&p, &values, &dims);
        self.b.reduce(&parts, Reduction::Sum, &[1])
    }

    /// The first `rows` rows of a layer's K and V buffers (`[rows, kvh, hd]`; the buffers
    /// themselves when they have no more).
    fn first_rows(&mut self, k_buf: &Value, v_buf: &Value, rows: usize) -> (Value, Value) {
        let dims = k_buf.dims().to_vec();
        if rows == dims[0] {
            return (k_buf.clone(), v_buf.clone());
        }
        let keys = self.b.slice(k_buf, &[0, 0, 0], &[rows, dims[1], dims[2]]);
        let values = self.b.slice(v_buf, &[0, 0, 0], &[rows, dims[1], dims[2]]);
        (keys, values)
    }

    /// Attention over the first rows of a global layer's buffers only: the first of `spans`
    /// (ascending, the last the capacity) that holds every row the chunk can see
    /// (`pos0 + C <= span`), chosen at run time by nested `stablehlo.if`s whose untaken
    /// branches do not run. Rows past `pos0 + valid` are masked either way; the 860-token
    /// catalog then attends over 1024 rows instead of the 4096 of the capacity.
    ///
    /// # Shapes
    /// As [`Forward::attend`], buffers `[capacity, kvh, hd]`.
    fn attend_live(
        &mut self,
        q: &Value,
        k_buf: &Value,
        v_buf: &Value,
        ch: &Chunk,
        spans: &[usize],
    ) -> Value {
        let span = spans[0];
        let attend_span = |f: &mut Self| {
            let (keys, values) = f.first_rows(k_buf, v_buf, span);
            // The mask is built for the span (IREE's SPIR-V code cannot slice an i1 tensor).
            let rows = f.b.iota(&[span], 0);
            let mask = f.visibility(&ch.qpos, &rows, &ch.end, None);
            f.attend(q, &keys, &values, &mask)
        };
        if spans.len() == 1 {
            return attend_span(self);
        }
        let c = self.b.scalar_i32(ch.c as i32);
        let end = self.b.scalar_add(&ch.pos0_host, &c);
        let limit = self.b.scalar_i32(span as i32);
        let fits = self.b.scalar_compare(Cmp::Le, &end, &limit);
        let fits = self.b.tensor_of(&fits);
        let open = self.b.open_region();
        let o = attend_span(self);
        let then = self.b.close_region(open, &[&o]);
        let open = self.b.open_region();
        let o = self.attend_live(q, k_buf, v_buf, ch, &spans[1..]);
        let otherwise = self.b.close_region(open, &[&o]);
        let mut out = self.b.if_else(&fits, then, otherwise);
        out.pop().expect("one result")
    }

    /// The head as the `head` argument `flag` asks: 1 [`Forward::head`]; 0
    /// `next` 0 and zero logits; 2, with a `screen`, [`Forward::screen`]'s `next` and zero
    /// logits. Only the taken branch runs. Where the chunk does not branch
    /// ([`GraphOptions::branches_for`]), 0 runs the head too; the screen's choice is a branch
    /// in every entry point that takes its head from the argument (the token-id decode step
    /// comes in both heads instead, without it: `graphs::head_modes`).
    pub fn head_if(
        &mut self,
        flag: &Scalar,
        ch: &Chunk,
        x: &Hidden,
        norm: &Value,
        embed: &Value,
        screen: Option<&Screen>,
    ) -> (Value, Value) {
        let Some(screen) = screen else {
            return self.head_or_none(flag, ch, x, norm, embed);
        };
        let two = self.b.scalar_i32(2);
        let pred = self.b.scalar_compare(Cmp::Eq, flag, &two);
        let pred = self.b.tensor_of(&pred);
        let open = self.b.open_region();
        let (next, no_logits) = self.screened(screen, ch, x, norm, embed);
        let then = self.b.close_region(open, &[&next, &no_logits]);
        let open = self.b.open_region();
        let (next, logits) = self.head_or_none(flag, ch, x, norm, embed);
        let otherwise = self.b.close_region(open, &[&next, &logits]);
        self.next_and_logits(&pred, then, otherwise)
    }

    /// [`Forward::screen`]'s token for the last valid row, and zero logits.
    pub fn screened(
        &mut self,
        screen: &Screen,
        ch: &Chunk,
        x: &Hidden,
        norm: &Value,
        embed: &Value,
    ) -> (Value, Value) {
        let h = self.final_norm(ch, x, norm);
        let next = self.screen(screen, embed, &h);
        let no_logits = self.f32(0.0, &[self.cfg.vocab_size]);
        (next, no_logits)
    }

    /// The `(next, logits)` of a head's `stablehlo.if` on `pred`.
    fn next_and_logits(&mut self, pred: &Value, then: Region, otherwise: Region) -> (Value, Value) {
        let mut out = self.b.if_else(pred, then, otherwise).into_iter();
        let next = out.next().expect("two results");
        let logits = out.next().expect("two results");
        (next, logits)
    }

    /// [`Forward::head`] where `flag` is nonzero, else `next` 0 and zero logits;
    /// only the taken branch runs. Where the chunk does not branch
    /// ([`GraphOptions::branches_for`]), the head, whatever `flag`.
    fn head_or_none(
        &mut self,
        flag: &Scalar,
        ch: &Chunk,
        x: &Hidden,
        norm: &Value,
        embed: &Value,
    ) -> (Value, Value) {
        if !self.opts.branches_for(ch.c) {
            return self.head(ch, x, norm, embed);
        }
        let zero = self.b.scalar_i32(0);
        let pred = self.b.scalar_compare(Cmp::Ne, flag, &zero);
        let pred = self.b.tensor_of(&pred);
        let open = self.b.open_region();
        let (next, logits) = self.head(ch, x, norm, embed);
        let then = self.b.close_region(open, &[&next, &logits]);
        let open = self.b.open_region();
        let no_next = self.i32(0, &[]);
        let no_logits = self.f32(0.0, &[self.cfg.vocab_size]);
        let otherwise = self.b.close_region(open, &[&no_next, &no_logits]);
        self.next_and_logits(&pred, then, otherwise)
    }

    /// The final norm of the last valid row (the layers' own, where their kernel ran it).
    ///
    /// # Shapes
    /// Returns `[hidden]`.
    fn final_norm(&mut self, ch: &Chunk, x: &Hidden, norm: &Value) -> Value {
        let hidden = self.cfg.hidden_size;
        let (x, normed) = match &x.final_normed {
            Some(h) => (h, true),
            None => (&x.x, false),
        };
        let h = if ch.c == 1 {
            x.clone()
        } else if self.opts.device_rows {
            let one = self.i32(1, &[]);
            let last = self.b.sub(&ch.valid, &one);
            let last = self.b.reshape(&last, &[1, 1]);
            self.b.gather_rows(x, &last)
        } else {
            let zero = self.i32(0, &[]);
            let one = self.b.scalar_i32(1);
            let last = self.b.scalar_sub(&ch.valid_host, &one);
            let last = self.b.tensor_of(&last);
            self.b.dynamic_slice(x, &[&last, &zero], &[1, hidden])
        };
        let h = if normed { h } else { self.rms_norm(&h, norm) };
        self.b.reshape(&h, &[hidden])
    }

    /// Final norm, tied head and greedy argmax of the last valid row; the head and argmax on
    /// Vulkan in one dispatch of kvsnap's kernel ([`Forward::spirv_head`]).
    ///
    /// # Shapes
    /// `embed`: the table in [`GraphOptions::table_layout`]; returns `next: []` i32 and
    /// `logits: [vocab]`.
    pub fn head(&mut self, ch: &Chunk, x: &Hidden, norm: &Value, embed: &Value) -> (Value, Value) {
        let h = self.final_norm(ch, x, norm);
        match self.spirv_head_fits() {
            Some(kernels) => self.spirv_head(kernels.head.name, embed, &h),
            None => self.tied_head(embed, &h),
        }
    }

    /// The tied head's logits `embed . h` (softcapped where the model says) and the greedy
    /// token, in IREE's code.
    ///
    /// # Shapes
    /// `embed`: the table in [`GraphOptions::table_layout`]; `h`: `[hidden]`; returns
    /// `next: []` i32 and `logits: [vocab]`.
    fn tied_head(&mut self, embed: &Value, h: &Value) -> (Value, Value) {
        let hidden = self.cfg.hidden_size;
        let vocab = self.cfg.vocab_size;
        let mut logits = match self.opts.table_layout() {
            WeightLayout::Rows => {
                let h = self.b.reshape(h, &[1, hidden]);
                let logits = self.b.dot_general(embed, &h, &DotDims::contract(1, 1)); // [vocab, 1]
                self.b.reshape(&logits, &[vocab])
            }
            WeightLayout::Panels => {
                let logits = self.panel_matvec(embed, h);
                if logits.dims()[0] > vocab {
                    self.b.slice(&logits, &[0], &[vocab])
                } else {
                    logits
                }
            }
        };
        if let Some(cap) = self.cfg.final_logit_softcapping {
            logits = self.softcap(&logits, cap as f32);
        }
        let next = self.argmax(&logits);
        (next, logits)
    }

    /// The greedy token of the tied head for the normalised row `h`, by the screen of
    /// `kvsnap_reference::head` (whose module documentation derives the bound), or -1 where
    /// it cannot be settled here.
    ///
    /// Every row's approximate logit `a = scale (q8 . h)` and bound `b = |h| slack` give the
    /// best lower bound `L = max (a - b)`; a row with `a + b < L` can be neither the maximum
    /// nor tie with it. The rows are taken in blocks of [`SCREEN_BLOCK`]: each block whose best
    /// `a + b` reaches `L` is found by a prefix sum over the blocks (the `j`-th such block is
    /// the number of blocks whose prefix count is at most `j`), the first [`SCREEN_BLOCKS`] of
    /// them are gathered from the f32 table and recomputed, and the argmax of the candidates'
    /// f32 logits (lowest id on a tie) is the token. `next` is -1 where more blocks hold
    /// candidates, or where `L` is not finite (a NaN or infinite score: the bound says
    /// nothing).
    ///
    /// In f32 throughout: the bound's margins (1 % of the residual, twice the rounding term)
    /// cover the f32 rounding of `|h|`, `b` and `a +- b`, which are within a few units of
    /// `2^-24` of the scores. With [`GraphOptions::own_kernels`] the scores and the candidate
    /// rows come from kvsnap's kernels ([`Forward::object_screen`], [`Forward::object_gather`]).
    ///
    /// # Shapes
    /// `embed`: `[vocab, hidden]` (rows); `h`: `[hidden]`; returns `[]` i32.
    pub fn screen(&mut self, screen: &Screen, embed: &Value, h: &Value) -> Value {
        let (hidden, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let mut scores = if self.opts.own_kernels.is_some() {
            self.object_screen(&screen.q8, h)
        } else {
            let q = self.b.convert(&screen.q8, ElemType::F32);
            self.panel_matvec(&q, h)
        };
        if scores.dims()[0] > vocab {
            scores = self.b.slice(&scores, &[0], &[vocab]);
        }
        let scores = self.b.mul(&scores, &screen.scale);
        let squares = self.b.mul(h, h);
        let norm = self.b.reduce(&squares, Reduction::Sum, &[0]);
        let norm = self.b.sqrt(&norm);
        let norm = self.splat(&norm, &[vocab]);
        let bound = self.b.mul(&norm, &screen.slack);
        // The bounds in blocks, padded with -inf to whole blocks. `lower` is taken block by
        // block, then over the blocks: IREE runs a reduction of the whole vocab to one value
        // in one workgroup (150 us a step on Gemma 3 270M, against 50 in two stages).
        let blocks = vocab.div_ceil(SCREEN_BLOCK);
        let lows = self.b.sub(&scores, &bound);
        let lows = self.in_blocks(&lows, blocks);
        let lows = self.b.reduce(&lows, Reduction::Max, &[1]);
        let lower = self.b.reduce(&lows, Reduction::Max, &[0]);
        let upper = self.b.add(&scores, &bound);
        let upper = self.in_blocks(&upper, blocks);

        // Blocks whose best upper bound reaches `lower`.
        let block_best = self.b.reduce(&upper, Reduction::Max, &[1]);
        let lower_b = self.splat(&lower, &[blocks]);
        let hit = self.b.compare(Cmp::Ge, &block_best, &lower_b);
        let hit = self.b.convert(&hit, ElemType::I32);
        let count = self.b.reduce(&hit, Reduction::Sum, &[0]);
        let prefix = self.b.cumsum(&hit);

        // The j-th candidate block: how many blocks have a prefix count of at most j.
        let k = SCREEN_BLOCKS.min(blocks);
        let prefix = self.b.broadcast_in_dim(&prefix, &[k, blocks], &[1]);
        let j = self.b.iota(&[k, blocks], 0);
        let before = self.b.compare(Cmp::Le, &prefix, &j);
        let before = self.b.convert(&before, ElemType::I32);
        let found = self.b.reduce(&before, Reduction::Sum, &[1]); // [k], `blocks` past the last

        // Their rows: ids, upper bounds, f32 logits.
        let dims = [k, SCREEN_BLOCK];
        let block = self.b.broadcast_in_dim(&found, &dims, &[0]);
        let width = self.i32(SCREEN_BLOCK as i32, &dims);
        let lane = self.b.iota(&dims, 1);
        let ids = self.b.mul(&block, &width);
        let ids = self.b.add(&ids, &lane);
        let n = k * SCREEN_BLOCK;
        let ids = self.b.reshape(&ids, &[n]);
        let last = self.i32(vocab as i32 - 1, &[n]);
        let rows = self.b.min(&ids, &last);
        let rows = self.b.reshape(&rows, &[n, 1]);
        let table = if self.opts.own_kernels.is_some() {
            self.object_gather(embed, &found) // [n, hidden], the same rows
        } else {
            self.b.gather_rows(embed, &rows) // [n, hidden]
        };
        let hrow = self.b.reshape(h, &[1, hidden]);
        let exact = self.b.dot_general(&table, &hrow, &DotDims::contract(1, 1)); // [n, 1]
        let exact = self.b.reshape(&exact, &[n]);
        let flat = self.b.reshape(&upper, &[blocks * SCREEN_BLOCK, 1]);
        let their_upper = self.b.gather_rows(&flat, &rows);
        let their_upper = self.b.reshape(&their_upper, &[n]);

        // Candidates: a found block's real rows whose upper bound reaches `lower`.
        let lower_n = self.splat(&lower, &[n]);
        let reach = self.b.compare(Cmp::Ge, &their_upper, &lower_n);
        let vocab_n = self.i32(vocab as i32, &[n]);
        let real = self.b.compare(Cmp::Lt, &ids, &vocab_n);
        let cand = self.b.and(&reach, &real);
        let ninf = self.f32(f32::NEG_INFINITY, &[n]);
        let exact = self.b.select(&cand, &exact, &ninf);
        let best = self.b.reduce(&exact, Reduction::Max, &[0]);
        let best = self.splat(&best, &[n]);
        let top = self.b.compare(Cmp::Eq, &exact, &best);
        let top = self.b.and(&top, &cand);
        let none = self.i32(i32::MAX, &[n]);
        let ids = self.b.select(&top, &ids, &none);
        let token = self.b.reduce(&ids, Reduction::Min, &[0]);

        // Settled: 1..=k candidate blocks and a finite `lower`.
        let one = self.i32(1, &[]);
        let most = self.i32(k as i32, &[]);
        let some = self.b.compare(Cmp::Ge, &count, &one);
        let few = self.b.compare(Cmp::Le, &count, &most);
        let inf = self.f32(f32::INFINITY, &[]);
        let ninf = self.f32(f32::NEG_INFINITY, &[]);
        let below = self.b.compare(Cmp::Lt, &lower, &inf);
        let above = self.b.compare(Cmp::Gt, &lower, &ninf);
        let settled = self.b.and(&some, &few);
        let settled = self.b.and(&settled, &below);
        let settled = self.b.and(&settled, &above);
        let unsettled = self.i32(-1, &[]);
        self.b.select(&settled, &token, &unsettled)
    }

    /// Two-stage argmax of `[vocab]` logits: NaN counts as -inf (never wins), ties go to the
    /// lowest index, as `kvsnap_contract::argmax`.
    ///
    /// Written as plain single-operand reductions, each over the `[outer, ARGMAX_INNER]` rows
    /// and then the outer dim: the maximum, then the lowest index holding it (a min over the
    /// indices whose value equals the maximum). IREE's llvm-cpu code for the (value, index) pair
    /// reduction this replaces took 1.15 ms of a decode step; these two take 0.15 ms.
    /// If every logit is NaN or -inf, every entry equals the maximum and index 0 wins.
    pub fn argmax(&mut self, logits: &Value) -> Value {
        let vocab = logits.dims()[0];
        let outer = vocab.div_ceil(ARGMAX_INNER);
        let nan = self.b.compare(Cmp::Ne, logits, logits);
        let ninf = self.f32(f32::NEG_INFINITY, &[vocab]);
        let mut x = self.b.select(&nan, &ninf, logits);
        let padded = outer * ARGMAX_INNER;
        if padded > vocab {
            let pad = self.f32(f32::NEG_INFINITY, &[padded - vocab]);
            x = self.b.concatenate(&[&x, &pad], 0);
        }
        let dims = [outer, ARGMAX_INNER];
        let x = self.b.reshape(&x, &dims);
        let row_max = self.b.reduce(&x, Reduction::Max, &[1]);
        let max = self.b.reduce(&row_max, Reduction::Max, &[0]);
        let max = self.splat(&max, &dims);
        let hit = self.b.compare(Cmp::Eq, &x, &max);

        let row = self.b.iota(&dims, 0);
        let col = self.b.iota(&dims, 1);
        let inner = self.i32(ARGMAX_INNER as i32, &dims);
        let idx = self.b.mul(&row, &inner);
        let idx = self.b.add(&idx, &col);
        let none = self.i32(i32::MAX, &dims);
        let idx = self.b.select(&hit, &idx, &none);
        let row_min = self.b.reduce(&idx, Reduction::Min, &[1]);
        self.b.reduce(&row_min, Reduction::Min, &[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_blocks_cover_the_depth_in_blocks_of_at_most_the_limit() {
        assert_eq!(depth_blocks(64), [(0, 64)]);
        assert_eq!(depth_blocks(640), [(0, 640)]);
        assert_eq!(depth_blocks(1024), [(0, 512), (512, 1024)]);
        assert_eq!(
            depth_blocks(2048),
            [(0, 512), (512, 1024), (1024, 1536), (1536, 2048)]
        );
        for k in 1..3000 {
            let blocks = depth_blocks(k);
            assert_eq!(blocks.first().unwrap().0, 0);
            assert_eq!(blocks.last().unwrap().1, k);
            for pair in blocks.windows(2) {
                assert_eq!(pair[0].1, pair[1].0, "depth {k}: {blocks:?}");
            }
            assert!(
                blocks
                    .iter()
                    .all(|(a, b)| a < b && b - a <= MMT4D_MAX_DEPTH),
                "depth {k}: {blocks:?}"
            );
        }
    }
}
