//! kvsnap's own kernels, linked into llvm-cpu modules as one object where IREE's code falls
//! short (`kernels/avx512.c`, compiled by the build script; on AVX-512 hosts):
//!
//! - The chunks' panel products. IREE runs a `linalg.mmt4d` of 8-row tiles by 32-lane panels
//!   one tile at a time over the whole depth, so each panel comes from memory in its first
//!   tile and the other tiles run from cache while memory idles; the kernel runs the same
//!   tiles, with the same sums in the same order (its results are IREE's bit for bit), and
//!   prefetches the next panel while it runs them.
//! - The screened head's scores, the int8 table's matvec (168 MB a decode step on Gemma 3
//!   270M): eight panels at a time, each prefetched ahead, where IREE's code left the reads
//!   and the widening of the weights to f32 poorly overlapped; and its candidate rows, the
//!   f32 table's blocks it recomputes, copied a vector at a time where IREE's gather went
//!   element by element.
//! - The decode step's attention: one dispatch a layer, in splits of the key rows that read
//!   only the visible ones, where the graph's attention reads and masks all of them
//!   ([`ATTEND_SPLITS`]; merged by the graph).
//! - A chunk's attention: one dispatch a layer, each workgroup 16 of a key/value head's
//!   (row, query head) pairs in the lanes of register tiles, over the key rows any of them
//!   sees, where IREE's matmuls ran at about a third of the SGEMM rate over every row of the
//!   ring or the span ([`ATTEND_CHUNK_LANES`]).
//!
//! The graphs call them through `flow.dispatch` of an executable whose
//! `hal.executable.objects` name the object ([`executable`]); the compiler finds the object
//! by name in the directory given with `--iree-hal-executable-object-search-path`
//! ([`crate::compile::Compiler::compile_tuned`]).
//!
//! Vulkan modules dispatch SPIR-V kernels of their own for the decode step ([`SpirvKernels`];
//! `kernels/*.comp`, GLSL compiled by the build script): its attention in two dispatches a
//! layer (`attend_split.comp`, `attend_merge.comp`), where IREE's code took nine (the heads'
//! norms and RoPE, the K and V rows' writes, the scores, their maximum and sum, the weighted
//! values in blocks and the blocks' sum); the q/k/v and gate/up products, and the
//! attention's output projection with its residual and the next norm in one dispatch, the
//! MLP's GeGLU and down product with theirs in one (`matvec.comp`, whose last workgroup runs
//! the residual), where IREE's took three and four; the embedding's scale and first norm in
//! one (`embed_norm.comp`), and the tied head with its argmax in one (`matvec.comp`, whose
//! last workgroup takes the token from each workgroup's best). A chunk's residuals with their
//! norms and its embedding rows' norm run a workgroup a row (`add_norm_rows.comp`,
//! `embed_norm.comp`), its head in the step's; for IREE's generic SPIR-V target its products
//! too (`matmul.comp`, tiles of 32 chunk rows by 32 matrix rows staged in shared memory) and
//! its attention (`attend_rows.comp`, a workgroup a row and key/value head, online over the
//! visible rows), where a named GPU's module keeps IREE's code
//! (`GraphOptions::spirv_chunks`). Each dispatch is a drain of the queue before the next.

use std::sync::OnceLock;

use sha2::{Digest, Sha256};

use crate::compile::{hex, LinkedObject};

/// Rows of the panel product's left-operand tiles.
pub const MMT4D_ROWS: usize = 8;
/// Lanes of the weight panels it takes.
pub const MMT4D_LANES: usize = 32;
/// Most workgroups of one product: a weight's panels are split into this many runs of
/// consecutive panels (fewer for a weight of fewer panels), as even as integer division makes
/// them: 16 of 8 panels for gate and up, of 3 for q/k/v, of 1 or 2 for o and down. IREE's
/// workers claim the workgroups of a dispatch of at least 8 per worker 8 at a time, so on a
/// 2-worker host each runs 8 consecutive runs, and the next panel the kernel prefetches is
/// the one its worker computes next (with 10 runs of 2, claimed one at a time, it was another
/// worker's half the time).
pub const MMT4D_MAX_GROUPS: usize = 16;
/// The panel product's entry point.
pub const MMT4D_ENTRY: &str = "kvsnap_kernels::@mmt4d_8x32";

/// Lanes of the int8 panels the screen takes.
pub const SCREEN_LANES: usize = 16;
/// Workgroups the screen's panels are split into, at most (runs of a multiple of 8 panels).
pub const SCREEN_GROUPS: usize = 256;
/// The screen's entry point.
pub const SCREEN_ENTRY: &str = "kvsnap_kernels::@screen_16";
/// The candidate rows' entry point.
pub const GATHER_ENTRY: &str = "kvsnap_kernels::@gather_16";

/// Workgroups of the decode step's attention, each a contiguous split of a layer's key rows:
/// fewer than 16, so that IREE's workers claim them one at a time on a 2-worker host (a
/// sliding layer's visible rows are one or two runs of its ring; claimed 8 at a time, one
/// worker could get most of them). 8 splits ran a layer 2-3 us faster than 12 and 6 (docs/IREE.md).
pub const ATTEND_SPLITS: usize = 8;
/// Most query heads a key/value head serves in the attention kernel.
pub const ATTEND_MAX_GROUP: usize = 8;
/// The decode step's attention entry point.
pub const ATTEND_ENTRY: &str = "kvsnap_kernels::@attend_1";
/// Query rows (a chunk's row and query head pairs) a workgroup of a chunk's attention takes.
pub const ATTEND_CHUNK_LANES: usize = 16;
/// Largest head dimension the chunk's attention kernel holds (its per-workgroup buffers).
pub const ATTEND_MAX_HEAD_DIM: usize = 256;
/// A chunk's attention entry point.
pub const ATTEND_CHUNK_ENTRY: &str = "kvsnap_kernels::@attend_c";

/// Most key rows a workgroup of the Vulkan attention takes (`SPLIT_ROWS` in
/// attend_split.comp): a layer's rows come in at least `rows / SPIRV_SPLIT_ROWS` splits.
pub const SPIRV_SPLIT_ROWS: usize = 16;
/// Most query heads a key/value head serves in the Vulkan attention (`MAX_GROUP`).
pub const SPIRV_MAX_GROUP: usize = 8;
/// Largest head dimension the Vulkan attention holds (`MAX_HEAD_DIM`: the query heads of a
/// key/value head in shared memory).
pub const SPIRV_MAX_HEAD_DIM: usize = 256;

/// Largest hidden size the Vulkan norms take (`THREADS * NORM_PER_THREAD` in norm.glsl: each
/// of its threads holds its dims in registers).
pub const SPIRV_MAX_HIDDEN: usize = 3072;

/// Rows of the product a workgroup of the Vulkan matvec kernels takes (`ROWS` in
/// matvec.comp).
pub const SPIRV_MATVEC_ROWS: usize = 4;
/// Rows of the tied head a workgroup of the Vulkan head takes (`ROWS` in matvec.comp with
/// `ARGMAX`): 8, so that Gemma 3's 262144 rows come in 32768 workgroups, within the 65535
/// that every Vulkan device dispatches.
pub const SPIRV_HEAD_ROWS: usize = 8;
/// Chunk rows and matrix rows of a tile of the Vulkan chunk product (`TILE_C`, `TILE_N` in
/// matmul.comp): a workgroup each.
pub const SPIRV_MATMUL_TILE: [usize; 2] = [32, 32];
/// Most workgroups of one dimension of a Vulkan dispatch that every device takes
/// (`maxComputeWorkGroupCount`'s least value).
pub const SPIRV_MAX_GROUPS: usize = 65535;

/// The module global of the Vulkan kernels whose last workgroup finishes the work of all
/// (`geglu_down_norm`, `matvec_norm`, `head`): `[SPIRV_COUNTERS]` i32, zeros at load, each a counter
/// of the workgroups done that its kernel sets back to zero.
pub const SPIRV_COUNTERS_GLOBAL: &str = "kvsnap_counters";
/// Counters in [`SPIRV_COUNTERS_GLOBAL`].
pub const SPIRV_COUNTERS: usize = 1;

/// The decode step's kernels on Vulkan, SPIR-V objects dispatched by
/// [`crate::emit::FuncBuilder::dispatch_spirv`]:
///
/// - `split` takes the step's query and key heads before their norms (`[1, heads + kv_heads,
///   head_dim]`), its value heads (`[1, kv_heads, head_dim]`), the layer's `q_norm` and
///   `k_norm` weights (`[head_dim]` each), the RoPE tables (cos `[1, head_dim / 2]`, `-sin,
///   sin` `[1, 2, head_dim / 2]`), the ring's positions (`[pos_rows]` i32), `{query
///   position, end}` (`[2]` i32), the row the step's K and V go to (`[]` i32) and a layer's
///   K and V buffers (`[buf_rows, kv_heads, head_dim]`, in place), with the push constants
///   `kv_heads, group, head_dim, rows, window, scale bits, splits, eps bits`; workgroups
///   `(splits, kv_heads)`, each a split of the first `rows` rows, read only where visible,
///   as [`ATTEND_ENTRY`]'s. It norms and rotates the heads, stores the step's key and value
///   rows in the buffers and returns `[splits, kv_heads, group, head_dim + 2]`, each
///   split's unnormalised sums, maximum score and sum of weights, then the buffers;
/// - `merge` takes those and `kv_heads, group, head_dim, splits`, one workgroup a query head,
///   and returns the attention `[kv_heads, group, head_dim]`;
/// - `geglu_down` takes the gate/up product's row (`[1, 2 * ffn]`, gate then up) and the
///   down matrix (`[hidden, ffn]`, rows), with the push constants `hidden, ffn`, a workgroup
///   every [`SPIRV_MATVEC_ROWS`] rows, and returns `down . (gelu_tanh(gate) * up)` (`[1,
///   hidden]`);
/// - `matvec` takes a row `v` (`[1, k]`) and a matrix `m` (`[n, k]`, rows), with the push
///   constants `n, k`, a workgroup every [`SPIRV_MATVEC_ROWS`] rows, and returns `m . v`
///   (`[1, n]`);
/// - `matvec_norm` takes a row `v` (`[1, k]`), a matrix `m` (`[n, k]`, rows), a residual `x`
///   (`[1, n]`), two norms' weights (`[n]` each, the scale less one) and the counters
///   ([`SPIRV_COUNTERS_GLOBAL`], in place), with the push constants `n, k, eps bits`, a
///   workgroup every [`SPIRV_MATVEC_ROWS`] rows, and returns `a = m . v`, `x + rms_norm(a,
///   w_a)` and that sum normed by `w_h` (`[1, n]` each), then the counters: the workgroup
///   that finishes last runs the residual;
/// - `geglu_down_norm` is `matvec_norm` with `geglu_down`'s product: `v` the gate/up row
///   (`[1, 2 * k]`), `m` the down matrix;
/// - `embed_norm` takes the chunk's embedding rows (`[c, n]`) and the first layer's input
///   norm (`[n]`), with the push constants `n, eps bits, scale bits`, a workgroup a row, and
///   returns the rows scaled (the first residual) and those normed (`[c, n]` each);
/// - `add_norm_rows` takes a chunk's residual `x` and a layer half's output `a` (`[c, n]`
///   each) and two norms' weights (`[n]` each), with the push constants `n, eps bits`, a
///   workgroup a row, and returns `x + rms_norm(a, w_a)` and that sum normed by `w_h`;
/// - `attend_rows` takes a chunk's queries (`[c, kv_heads, group, head_dim]`, normed and
///   rotated), a layer's K and V buffers (the chunk's rows written), the ring's positions and
///   `{first query position, end}`, with the push constants `kv_heads, group, head_dim, rows,
///   window, scale bits, c`, workgroups `(c, kv_heads)`, and returns the attention `[kv_heads,
///   c, group, head_dim]`;
/// - `head` takes the final norm's row `v` (`[1, k]`), the tied table `m` (`[n, k]`, rows)
///   and the counters (in place), with the push constants `n, k`, a workgroup every
///   [`SPIRV_HEAD_ROWS`] rows, and returns the logits `m . v` (`[n]`), each workgroup's best
///   logit and its id (`[groups]` f32 and i32, scratch), the greedy token (`[1]` i32: NaN
///   never wins, the lowest id on a tie), then the counters: the workgroup that finishes
///   last takes the token from the workgroups' best;
/// - `matmul` takes a chunk's rows `x` (`[c, k]`) and a matrix `m` (`[n, k]`, rows), with
///   the push constants `c, n, k`, workgroups `(n, c)` in tiles of [`SPIRV_MATMUL_TILE`], and
///   returns `x . m^T` (`[c, n]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpirvKernels {
    /// The attention splits' kernel.
    pub split: LinkedObject,
    /// The attention merge's kernel.
    pub merge: LinkedObject,
    /// The MLP's GeGLU and down product.
    pub geglu_down: LinkedObject,
    /// The MLP's GeGLU and down product, then the residual and the next norm.
    pub geglu_down_norm: LinkedObject,
    /// A product (the q/k/v and gate/up projections).
    pub matvec: LinkedObject,
    /// A product, then the residual and the next norm (the attention's output projection).
    pub matvec_norm: LinkedObject,
    /// The embedding row's scale and the first layer's input norm.
    pub embed_norm: LinkedObject,
    /// The tied head's logits and the greedy token.
    pub head: LinkedObject,
    /// A chunk's product.
    pub matmul: LinkedObject,
    /// A chunk's residual and next norm.
    pub add_norm_rows: LinkedObject,
    /// A chunk's attention.
    pub attend_rows: LinkedObject,
}

impl SpirvKernels {
    /// The objects, each dispatch's executable.
    pub fn objects(&self) -> [LinkedObject; 11] {
        [
            self.split,
            self.merge,
            self.geglu_down,
            self.geglu_down_norm,
            self.matvec,
            self.matvec_norm,
            self.embed_norm,
            self.head,
            self.matmul,
            self.add_norm_rows,
            self.attend_rows,
        ]
    }
}

#[cfg(kvsnap_spirv_kernels)]
const SPIRV: Option<[&[u8]; 11]> = Some([
    include_bytes!(concat!(env!("OUT_DIR"), "/attend_split.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/attend_merge.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/geglu_down.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/geglu_down_norm.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/matvec.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/matvec_norm.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/embed_norm.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/head.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/matmul.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/add_norm_rows.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/attend_rows.spv")),
]);
#[cfg(not(kvsnap_spirv_kernels))]
const SPIRV: Option<[&[u8]; 11]> = None;

/// The Vulkan decode step's kernels, when this build compiled them, each named by its
/// content.
pub fn spirv_kernels() -> Option<SpirvKernels> {
    static NAMES: OnceLock<[String; 11]> = OnceLock::new();
    let bytes = SPIRV?;
    let names = NAMES.get_or_init(|| {
        let kinds = [
            "attend_split",
            "attend_merge",
            "geglu_down",
            "geglu_down_norm",
            "matvec",
            "matvec_norm",
            "embed_norm",
            "head",
            "matmul",
            "add_norm_rows",
            "attend_rows",
        ];
        std::array::from_fn(|i| {
            let tag = hex(&Sha256::digest(bytes[i])[..8]);
            format!("kvsnap_{}_{tag}.spv", kinds[i])
        })
    });
    let objects: [LinkedObject; 11] = std::array::from_fn(|i| LinkedObject {
        name: &names[i],
        bytes: bytes[i],
    });
    let [split, merge, geglu_down, geglu_down_norm, matvec, matvec_norm, embed_norm, head, matmul, add_norm_rows, attend_rows] =
        objects;
    Some(SpirvKernels {
        split,
        merge,
        geglu_down,
        geglu_down_norm,
        matvec,
        matvec_norm,
        embed_norm,
        head,
        matmul,
        add_norm_rows,
        attend_rows,
    })
}

#[cfg(kvsnap_kernel_object)]
const OBJECT: Option<&[u8]> = Some(include_bytes!(concat!(env!("OUT_DIR"), "/avx512.o")));
#[cfg(not(kvsnap_kernel_object))]
const OBJECT: Option<&[u8]> = None;

/// The kernels' object, when this build has it and this host runs AVX-512 (llvm-cpu compiles
/// for the host's CPU). Named by its content, so that a changed kernel is a changed module
/// (and cache key).
pub fn kernel_object() -> Option<LinkedObject> {
    static NAME: OnceLock<String> = OnceLock::new();
    let bytes = OBJECT?;
    if !host_has_avx512() {
        return None;
    }
    let name = NAME.get_or_init(|| {
        let tag = hex(&Sha256::digest(bytes)[..8]);
        format!("kvsnap_avx512_{tag}.o")
    });
    Some(LinkedObject { name, bytes })
}

#[cfg(target_arch = "x86_64")]
fn host_has_avx512() -> bool {
    std::is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
fn host_has_avx512() -> bool {
    false
}

/// The `stream.executable` of the kernels, linking `object`:
///
/// - `mmt4d_8x32` takes the packed rows (`[m1, depth, 8, 1]`), the panels
///   (`[panels, depth, 32]`) and the index operands `m1, panels, depth, groups`, and returns
///   `[m1, panels, 8, 32]`; workgroup `wg` of `groups` computes panels
///   `[wg * panels / groups, (wg + 1) * panels / groups)`;
/// - `screen_16` takes the int8 panels (`[panels, depth, 16]`), the row (`[depth]`) and
///   `panels, depth, run`, and returns the f32 sums `[panels, 16]`; `panels / run` (rounded
///   up) workgroups compute `run` consecutive panels each;
/// - `gather_16` takes a table (`[rows, width]` f32), block indices (`[blocks]` i32) and
///   `rows, width, blocks`, and returns each block's 16 rows (`[blocks * 16, width]`), a row
///   index past the table's last row clamped to it; one workgroup a block;
/// - `attend_1` takes a decode step's query row (`[kv_heads, group, head_dim]`), a layer's K
///   and V buffers (`[buf_rows, kv_heads, head_dim]`), the ring's positions (`[pos_rows]`
///   i32), `{query position, end}` (`[2]` i32) and `kv_heads, group, head_dim, rows, window,
///   scale bits, buf_rows, pos_rows, splits`, and returns each split's unnormalised sums,
///   maximum score and sum of weights per query head (`[splits, kv_heads, group,
///   head_dim + 2]`): see `kvsnap_attend_1` in the C source;
/// - `attend_c` takes a chunk's query rows (`[chunk, kv_heads, group, head_dim]`), the same K,
///   V, positions and `{first query position, end}`, and `kv_heads, group, head_dim, rows,
///   window, scale bits, buf_rows, pos_rows, chunk, workgroups`, and returns the normalised
///   attention `[kv_heads, chunk, group, head_dim]`; one workgroup for every
///   [`ATTEND_CHUNK_LANES`] of a key/value head's `chunk x group` (row, query head) pairs: see
///   `kvsnap_attend_c` in the C source.
pub fn executable(object: &LinkedObject) -> String {
    format!(
        r#"  stream.executable private @kvsnap_kernels attributes {{
    hal.executable.objects = #hal.executable.objects<{{
      #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [
        #hal.executable.object<{{path = "{name}"}}>
      ]
    }}>
  }} {{
    stream.executable.export public @mmt4d_8x32 workgroups(%groups: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %groups, %c1, %c1 : index, index, index
    }}
    stream.executable.export public @screen_16 workgroups(%panels: index, %run: index) -> (index, index, index) {{
      %x = arith.ceildivui %panels, %run : index
      %c1 = arith.constant 1 : index
      stream.return %x, %c1, %c1 : index, index, index
    }}
    stream.executable.export public @gather_16 workgroups(%blocks: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %blocks, %c1, %c1 : index, index, index
    }}
    stream.executable.export public @attend_1 workgroups(%splits: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %splits, %c1, %c1 : index, index, index
    }}
    stream.executable.export public @attend_c workgroups(%groups: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %groups, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @kvsnap_mmt4d_8x32(memref<?xf32>, memref<?xf32>, memref<?xf32>, index, index, index, index, index) attributes {{hal.import.static}}
      func.func private @kvsnap_screen_16(memref<?xi8>, memref<?xf32>, memref<?xf32>, index, index, index, index) attributes {{hal.import.static}}
      func.func private @kvsnap_gather_16(memref<?xf32>, memref<?xi32>, memref<?xf32>, index, index, index) attributes {{hal.import.static}}
      func.func private @kvsnap_attend_1(memref<?xf32>, memref<?xf32>, memref<?xf32>, memref<?xi32>, memref<?xi32>, memref<?xf32>, index, index, index, index, index, index, index, index) attributes {{hal.import.static}}
      func.func private @kvsnap_attend_c(memref<?xf32>, memref<?xf32>, memref<?xf32>, memref<?xi32>, memref<?xi32>, memref<?xf32>, index, index, index, index, index, index, index, index) attributes {{hal.import.static}}
      func.func @mmt4d_8x32(%lhs: !stream.binding, %rhs: !stream.binding, %m1: index, %panels: index, %depth: index, %groups: index, %out: !stream.binding) {{
        %c0 = arith.constant 0 : index
        %rows = arith.constant {rows} : index
        %lanes = arith.constant {lanes} : index
        %wg = stream.dispatch.workgroup.id[0] : index
        %lhs_tiles = arith.muli %m1, %depth : index
        %lhs_n = arith.muli %lhs_tiles, %rows : index
        %rhs_rows = arith.muli %panels, %depth : index
        %rhs_n = arith.muli %rhs_rows, %lanes : index
        %out_tiles = arith.muli %m1, %panels : index
        %out_rows = arith.muli %out_tiles, %rows : index
        %out_n = arith.muli %out_rows, %lanes : index
        %a = stream.binding.subspan %lhs[%c0] : !stream.binding -> memref<?xf32>{{%lhs_n}}
        %b = stream.binding.subspan %rhs[%c0] : !stream.binding -> memref<?xf32>{{%rhs_n}}
        %o = stream.binding.subspan %out[%c0] : !stream.binding -> memref<?xf32>{{%out_n}}
        func.call @kvsnap_mmt4d_8x32(%a, %b, %o, %m1, %panels, %depth, %wg, %groups) : (memref<?xf32>, memref<?xf32>, memref<?xf32>, index, index, index, index, index) -> ()
        return
      }}
      func.func @screen_16(%q: !stream.binding, %h: !stream.binding, %panels: index, %depth: index, %run: index, %out: !stream.binding) {{
        %c0 = arith.constant 0 : index
        %lanes = arith.constant {screen_lanes} : index
        %wg = stream.dispatch.workgroup.id[0] : index
        %q_rows = arith.muli %panels, %depth : index
        %q_n = arith.muli %q_rows, %lanes : index
        %out_n = arith.muli %panels, %lanes : index
        %a = stream.binding.subspan %q[%c0] : !stream.binding -> memref<?xi8>{{%q_n}}
        %b = stream.binding.subspan %h[%c0] : !stream.binding -> memref<?xf32>{{%depth}}
        %o = stream.binding.subspan %out[%c0] : !stream.binding -> memref<?xf32>{{%out_n}}
        func.call @kvsnap_screen_16(%a, %b, %o, %panels, %depth, %wg, %run) : (memref<?xi8>, memref<?xf32>, memref<?xf32>, index, index, index, index) -> ()
        return
      }}
      func.func @gather_16(%table: !stream.binding, %ids: !stream.binding, %rows: index, %width: index, %blocks: index, %out: !stream.binding) {{
        %c0 = arith.constant 0 : index
        %lanes = arith.constant {screen_lanes} : index
        %wg = stream.dispatch.workgroup.id[0] : index
        %table_n = arith.muli %rows, %width : index
        %out_rows = arith.muli %blocks, %lanes : index
        %out_n = arith.muli %out_rows, %width : index
        %a = stream.binding.subspan %table[%c0] : !stream.binding -> memref<?xf32>{{%table_n}}
        %b = stream.binding.subspan %ids[%c0] : !stream.binding -> memref<?xi32>{{%blocks}}
        %o = stream.binding.subspan %out[%c0] : !stream.binding -> memref<?xf32>{{%out_n}}
        func.call @kvsnap_gather_16(%a, %b, %o, %rows, %width, %wg) : (memref<?xf32>, memref<?xi32>, memref<?xf32>, index, index, index) -> ()
        return
      }}
      func.func @attend_1(%q: !stream.binding, %k: !stream.binding, %v: !stream.binding, %pos: !stream.binding, %lim: !stream.binding, %kvh: index, %group: index, %hd: index, %rows: index, %window: index, %scale: index, %buf_rows: index, %pos_rows: index, %splits: index, %out: !stream.binding) {{
        %c0 = arith.constant 0 : index
        %c2 = arith.constant 2 : index
        %wg = stream.dispatch.workgroup.id[0] : index
        %heads = arith.muli %kvh, %group : index
        %q_n = arith.muli %heads, %hd : index
        %row_n = arith.muli %kvh, %hd : index
        %kv_n = arith.muli %buf_rows, %row_n : index
        %slot = arith.addi %hd, %c2 : index
        %slots = arith.muli %heads, %slot : index
        %out_n = arith.muli %splits, %slots : index
        %qm = stream.binding.subspan %q[%c0] : !stream.binding -> memref<?xf32>{{%q_n}}
        %km = stream.binding.subspan %k[%c0] : !stream.binding -> memref<?xf32>{{%kv_n}}
        %vm = stream.binding.subspan %v[%c0] : !stream.binding -> memref<?xf32>{{%kv_n}}
        %pm = stream.binding.subspan %pos[%c0] : !stream.binding -> memref<?xi32>{{%pos_rows}}
        %lm = stream.binding.subspan %lim[%c0] : !stream.binding -> memref<?xi32>{{%c2}}
        %om = stream.binding.subspan %out[%c0] : !stream.binding -> memref<?xf32>{{%out_n}}
        func.call @kvsnap_attend_1(%qm, %km, %vm, %pm, %lm, %om, %kvh, %group, %hd, %rows, %window, %scale, %wg, %splits) : (memref<?xf32>, memref<?xf32>, memref<?xf32>, memref<?xi32>, memref<?xi32>, memref<?xf32>, index, index, index, index, index, index, index, index) -> ()
        return
      }}
      func.func @attend_c(%q: !stream.binding, %k: !stream.binding, %v: !stream.binding, %pos: !stream.binding, %lim: !stream.binding, %kvh: index, %group: index, %hd: index, %rows: index, %window: index, %scale: index, %buf_rows: index, %pos_rows: index, %chunk: index, %groups: index, %out: !stream.binding) {{
        %c0 = arith.constant 0 : index
        %c2 = arith.constant 2 : index
        %wg = stream.dispatch.workgroup.id[0] : index
        %heads = arith.muli %kvh, %group : index
        %q_row = arith.muli %heads, %hd : index
        %q_n = arith.muli %chunk, %q_row : index
        %row_n = arith.muli %kvh, %hd : index
        %kv_n = arith.muli %buf_rows, %row_n : index
        %qm = stream.binding.subspan %q[%c0] : !stream.binding -> memref<?xf32>{{%q_n}}
        %km = stream.binding.subspan %k[%c0] : !stream.binding -> memref<?xf32>{{%kv_n}}
        %vm = stream.binding.subspan %v[%c0] : !stream.binding -> memref<?xf32>{{%kv_n}}
        %pm = stream.binding.subspan %pos[%c0] : !stream.binding -> memref<?xi32>{{%pos_rows}}
        %lm = stream.binding.subspan %lim[%c0] : !stream.binding -> memref<?xi32>{{%c2}}
        %om = stream.binding.subspan %out[%c0] : !stream.binding -> memref<?xf32>{{%q_n}}
        func.call @kvsnap_attend_c(%qm, %km, %vm, %pm, %lm, %om, %kvh, %group, %hd, %rows, %window, %scale, %chunk, %wg) : (memref<?xf32>, memref<?xf32>, memref<?xf32>, memref<?xi32>, memref<?xi32>, memref<?xf32>, index, index, index, index, index, index, index, index) -> ()
        return
      }}
    }}
  }}
"#,
        name = object.name,
        rows = MMT4D_ROWS,
        lanes = MMT4D_LANES,
        screen_lanes = SCREEN_LANES,
    )
}

/// Workgroups of a product over `panels` panels: [`MMT4D_MAX_GROUPS`], or one a panel
/// where there are fewer (the kernel prefetches within and just past a workgroup's run).
pub fn mmt4d_groups(panels: usize) -> usize {
    panels.clamp(1, MMT4D_MAX_GROUPS)
}

/// Panels per workgroup for the screen over `panels` panels: at most [`SCREEN_GROUPS`]
/// workgroups, each a multiple of the kernel's eight panels at a time (64 for Gemma 3 270M's
/// 16,384 panels: 256 workgroups, which IREE's workers claim eight at a time, evenly on 2 or
/// 4 of them).
pub fn screen_run(panels: usize) -> usize {
    panels.div_ceil(SCREEN_GROUPS).next_multiple_of(8).max(8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_run_in_sixteen_groups_or_one_a_panel() {
        for (panels, groups) in [
            (128, 16),
            (48, 16),
            (20, 16),
            (17, 16),
            (16, 16),
            (5, 5),
            (1, 1),
        ] {
            assert_eq!(mmt4d_groups(panels), groups, "{panels} panels");
        }
    }

    #[test]
    fn screen_runs_are_whole_octets_in_at_most_256_groups() {
        let cases = [(16384, 64), (16385, 72), (257, 8), (64, 8), (1, 8)];
        for (panels, run) in cases {
            assert_eq!(screen_run(panels), run, "{panels} panels");
            assert!(panels.div_ceil(run) <= SCREEN_GROUPS);
        }
    }

    #[test]
    fn the_object_is_named_by_its_content() {
        let Some(object) = kernel_object() else {
            eprintln!("SKIPPED: no AVX-512 kernel object on this build or host");
            return;
        };
        assert_eq!(&object.bytes[..4], b"\x7fELF", "an ELF object");
        // The tag is the first 8 bytes of the object's sha256, written out by hand here.
        let digest = Sha256::digest(object.bytes);
        let tag: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(object.name, format!("kvsnap_avx512_{tag}.o"));
        assert_eq!(tag.len(), 16);
    }
}
