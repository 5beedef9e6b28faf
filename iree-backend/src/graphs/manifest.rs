//! The manifest of a graphs module: every entry point with its arguments and results in order,
//! so the runtime binds buffers by role and name instead of by guessing positions.

use kvsnap_contract::{LayerKind, ModelConfig};
use serde::{Deserialize, Serialize};

/// Format name written into every manifest.
pub const MANIFEST_FORMAT: &str = "kvsnap-iree-graphs";
/// Version of the manifest layout and of the entry-point conventions it describes.
pub const MANIFEST_VERSION: u32 = 11;

/// Element type of an argument or result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 32-bit signed integer.
    I32,
    /// 8-bit signed integer (the screened head's int8 table).
    I8,
    /// A 32-bit signed integer passed by value, not as a tensor (`dims` empty): `head`,
    /// `pos0_host` and `valid_host`. The module's host program computes the KV rows written,
    /// the slice read and the branches taken from it, so a call reads nothing back to the host
    /// before its end.
    #[serde(rename = "host_i32")]
    HostI32,
}

/// What an argument or result is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// `ids: [C] i32` token ids of the chunk (padding rows: any valid id, e.g. 0).
    Ids,
    /// `emb: [C, hidden] f32` raw (unscaled) embedding rows of the chunk (padding rows: zeros).
    Embeddings,
    /// `pos0: [] i32` absolute position of the chunk's first row.
    Pos0,
    /// `valid: [] i32` number of real rows, `1..=C`; rows `valid..C` are padding.
    Valid,
    /// `head: i32` (by value): 1 computes the head (`next`, `logits`); 0 skips it and returns `next`
    /// 0 and zero logits (a prefill's chunks before its last need no head); 2, in a module
    /// with a screened head ([`Role::Screen`] arguments), computes `next` alone by the
    /// screen, with zero logits, and `next` -1 where the screen cannot settle it (the caller
    /// then runs the chunk again with 1).
    Head,
    /// `pos0_host: i32` (by value): `pos0` again, for the indices and branches the module's
    /// host program computes ([`DType::HostI32`]).
    Pos0Host,
    /// `valid_host: i32` (by value): `valid` again, likewise.
    ValidHost,
    /// A model weight; `name` is its HF tensor name, or for projections stacked into one
    /// argument a name of no HF tensor, with the HF tensors it holds in
    /// [`TensorSpec::parts`]. Vectors (norms) in the HF layout of `model.safetensors`,
    /// matrices (the embedding table and the projections) in the manifest's [`WeightLayout`].
    Weight,
    /// A tensor of the screened head, derived from `model.embed_tokens.weight` when the model
    /// is loaded ([`SCREEN_WEIGHTS`]): the int8 table in panels of [`TABLE_LANES`], each row's
    /// scale and each row's error bound, as `kvsnap_reference::head::TiedHead` computes them.
    Screen,
    /// A KV buffer (input: the state before the chunk; result: after it, updated in place):
    /// the K and V of each layer, then the `sliding.positions` table (i32).
    Kv,
    /// `next_out: [] i32`, the last argument: the storage [`Role::Next`] is written to and
    /// returned in (`iree.abi.output`). The runtime passes host memory the device writes, so
    /// that reading the token back is a read of that memory, not a queue operation and a wait
    /// after each call.
    NextOut,
    /// `tokens_out: [steps] i32`, after [`Role::NextOut`] in a multi-step decode entry point
    /// ([`EntryPoint::steps`]): the storage [`Role::Tokens`] is written to, host memory too.
    TokensOut,
    /// `next: [] i32` greedy argmax of the last valid row's logits (of a multi-step decode
    /// entry point: the last wanted step's token).
    Next,
    /// `tokens: [steps] i32` every step's token, of a multi-step decode entry point (in place
    /// of [`Role::Logits`]); those of the steps past `valid` repeat the last wanted one.
    Tokens,
    /// `logits: [vocab] f32` of the last valid row.
    Logits,
}

/// The `head` argument ([`Role::Head`]): no head (`next` 0, zero logits).
pub const HEAD_NONE: i32 = 0;
/// The `head` argument: the full head, `next` and the logits.
pub const HEAD_FULL: i32 = 1;
/// The `head` argument: the screened token alone (-1 where the screen cannot settle it), zero
/// logits.
pub const HEAD_SCREEN: i32 = 2;

/// Which head an entry point computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadMode {
    /// The one its `head` argument asks for (a branch, in the chunks that branch).
    Argument,
    /// The screened token, whatever `head` says: the decode step of a module with a screened
    /// head. Without a branch the step's head runs in the same queue submission as its
    /// layers; a branch splits the call in two, the second waiting on the first (0.4-0.6 ms
    /// a step on `local-task`, docs/BENCHMARKS.md, twenty-fifth pass).
    Screen,
    /// The full head, whatever `head` says: that decode step's variant for logits, and for a
    /// token the screen could not settle.
    Full,
}

impl HeadMode {
    /// Whether an entry point of this mode answers a call with the `head` argument `flag`
    /// (a call without a head takes any: it reads neither `next` nor the logits).
    pub fn serves(self, flag: i32) -> bool {
        match self {
            HeadMode::Argument => true,
            HeadMode::Screen => flag != HEAD_FULL,
            HeadMode::Full => flag != HEAD_SCREEN,
        }
    }
}

/// One argument or result of an entry point.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// HF tensor name for weights, `layers.{i}.k` / `layers.{i}.v` for KV buffers, the
    /// argument name otherwise.
    pub name: String,
    /// What the tensor is for.
    pub role: Role,
    /// Static shape.
    pub dims: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// For a weight that stacks HF matrices along its output rows ([`LAYER_WEIGHTS`]): their
    /// HF names in order, part `i` from row [`WeightLayout::stack_offsets`]`[i]`; empty for a
    /// tensor that is the one named `name`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<String>,
}

/// Lanes per panel of the embedding table (also the tied head) in [`WeightLayout::Panels`]:
/// one 64-byte vector of f32. The head's matvec streams these at the read limit (wider
/// panels were slower, see docs/IREE.md), and a chunk only gathers rows from the table.
pub const TABLE_LANES: usize = 16;

/// Lanes per panel of a layer's projection in [`WeightLayout::Panels`]: two 64-byte vectors
/// of f32. A prefill's `linalg.mmt4d` over 32-lane panels runs 8 x 32 register tiles (8
/// broadcasts and 2 loads per 16 FMAs), 1.1-2.5x IREE's 16 x 16 tiles over 16-lane panels
/// (16 broadcasts and 1 load per 16 FMAs); the decode step's matvecs stream them as fast.
pub const PROJECTION_LANES: usize = 32;

/// How the matrix weights (the embedding table, also the tied head, and every projection) are
/// passed; vectors (norms) are always passed as they are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightLayout {
    /// The HF layout `[rows, cols]` (`[out, in]` for a projection, `[vocab, hidden]` for the
    /// table).
    #[default]
    Rows,
    /// `[ceil(rows / L), cols, L]` with `L` lanes ([`TABLE_LANES`] for the table,
    /// [`PROJECTION_LANES`] for a projection): panel `p` holds rows `L p .. L p + L` as its
    /// lanes, `panels[p, k, j] = w[L p + j, k]`, zero past the last row. A matrix-vector
    /// product then reads whole vectors of `L` rows' weights in order, which IREE's llvm-cpu
    /// code streams up to half again as fast as its matvec over `[rows, cols]` (whose 16x16
    /// tiles restart 16 short streams every 640 columns); a prefill's matrix product over
    /// panels is a `linalg.mmt4d` with the panels as its packed right operand.
    Panels,
}

impl WeightLayout {
    /// The dims of the `[vocab, hidden]` embedding table in this layout.
    pub fn table_dims(self, vocab: usize, hidden: usize) -> Vec<usize> {
        self.dims(vocab, hidden, TABLE_LANES)
    }

    /// The dims of a `[out, in]` projection in this layout.
    pub fn projection_dims(self, rows: usize, cols: usize) -> Vec<usize> {
        self.dims(rows, cols, PROJECTION_LANES)
    }

    /// Where each of the matrices of `rows` output rows starts when they are stacked into one
    /// projection, then the stacked matrix's rows: in `Rows` one right after the other; in
    /// `Panels` each at a whole panel, its last panel zero-padded, so that a part's rows are
    /// packed exactly as they would be alone.
    pub fn stack_offsets(self, rows: &[usize]) -> Vec<usize> {
        let lanes = match self {
            WeightLayout::Rows => 1,
            WeightLayout::Panels => PROJECTION_LANES,
        };
        stack_offsets(rows, lanes)
    }

    fn dims(self, rows: usize, cols: usize, lanes: usize) -> Vec<usize> {
        match self {
            WeightLayout::Rows => vec![rows, cols],
            WeightLayout::Panels => vec![rows.div_ceil(lanes), cols, lanes],
        }
    }
}

/// Where each of the matrices of `rows` output rows starts when they are stacked, each at a
/// multiple of `lanes` (1: right after the previous one), then the stacked rows.
pub fn stack_offsets(rows: &[usize], lanes: usize) -> Vec<usize> {
    let mut offsets = vec![0];
    for r in rows {
        offsets.push(offsets.last().expect("starts with 0") + r.div_ceil(lanes) * lanes);
    }
    offsets
}

/// Writes a row-major `[rows, cols]` matrix into `out` as the `[ceil(rows / lanes), cols,
/// lanes]` panels of [`WeightLayout::Panels`], zero-padded past the last row, on all cores
/// (each panel is independent). `src` may be a slice of whole panels of a larger matrix (`out`
/// then holds those panels).
///
/// # Panics
/// If `out` is not `ceil(rows / lanes) * cols * lanes` long or `src` not a multiple of `cols`.
pub fn pack_panels<T: Copy + Default + Send + Sync>(
    src: &[T],
    cols: usize,
    lanes: usize,
    out: &mut [T],
) {
    assert!(
        cols > 0 && lanes > 0 && src.len().is_multiple_of(cols),
        "pack_panels: ragged rows"
    );
    let rows = src.len() / cols;
    let panel = cols * lanes;
    assert_eq!(
        out.len(),
        rows.div_ceil(lanes) * panel,
        "pack_panels: output length"
    );
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = rows.div_ceil(lanes).div_ceil(threads).max(1) * panel;
    std::thread::scope(|s| {
        for (t, part) in out.chunks_mut(per_thread).enumerate() {
            let first = t * per_thread / panel;
            s.spawn(move || {
                for (i, dst) in part.chunks_mut(panel).enumerate() {
                    let panel_rows = ((first + i) * lanes)..((first + i + 1) * lanes).min(rows);
                    dst.fill(T::default());
                    for (j, row) in panel_rows.enumerate() {
                        let src = &src[row * cols..(row + 1) * cols];
                        for (k, &x) in src.iter().enumerate() {
                            dst[k * lanes + j] = x;
                        }
                    }
                }
            });
        }
    });
}

/// The rows of the sliding layers' KV buffers for a module whose largest chunk is
/// `max_chunk`: chunk row `i` at `pos0` is written to row `pos0 % modulus + i`.
///
/// Between calls every position a ring holds is in row `p % modulus`: a chunk call whose rows
/// run past the modulus (into the `max_chunk` rows after it, so that its write is one in-place
/// `dynamic_update_slice`) attends over the whole ring, and the host then moves those rows to
/// `p % modulus` (`IreeKv::fold_ring`). So a decode step, which never runs past the modulus,
/// attends over the first `modulus` rows only ([`RingGeometry::rows_seen`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingGeometry {
    /// `window + max_chunk`: a chunk at `pos0` is written at rows
    /// `pos0 % modulus .. pos0 % modulus + C`.
    pub modulus: usize,
    /// `modulus + max_chunk`: the rows of each sliding-layer K/V buffer, so that a chunk's
    /// write never wraps (one in-place `dynamic_update_slice`).
    pub rows: usize,
}

impl RingGeometry {
    /// The geometry for `window` and the module's largest chunk.
    ///
    /// Writing the chunk BEFORE attending (which lets IREE update the buffer in place) is safe
    /// because `modulus >= window + C - 1`: a row the chunk overwrites held a position at most
    /// `pos0 + i - modulus`, older than any key a query of this or a later chunk can see.
    pub fn new(window: usize, max_chunk: usize) -> Self {
        let modulus = window + max_chunk;
        RingGeometry {
            modulus,
            rows: modulus + max_chunk,
        }
    }

    /// The largest chunk the ring was sized for.
    pub fn max_chunk(&self) -> usize {
        self.rows - self.modulus
    }

    /// The rows of the ring a chunk attends over in an entry point of `span`
    /// ([`EntryPoint::span`]): the first `span` where they fit within the modulus, else all.
    ///
    /// A chunk ending at or before `span <= modulus` runs on a state shorter than the
    /// modulus, so no chunk has wrapped yet: every position `p` it can see is in row `p`.
    pub fn rows_within(&self, span: usize) -> usize {
        if span <= self.modulus {
            span
        } else {
            self.rows
        }
    }

    /// The first rows of the ring that a chunk of `c` rows attends over, in an entry point of
    /// `span` if it has one: [`RingGeometry::rows_within`] the span, and for a decode step no
    /// more than the modulus (its one row never runs past it, and every other held position
    /// is in row `p % modulus`: see the type's docs).
    pub fn rows_seen(&self, c: usize, span: Option<usize>) -> usize {
        let rows = span.map_or(self.rows, |s| self.rows_within(s));
        if c == 1 {
            rows.min(self.modulus)
        } else {
            rows
        }
    }
}

/// How one layer's KV buffer is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvLayout {
    /// `[ring.rows, kv_heads, head_dim]`: chunk row `i` at `pos0` goes to row
    /// `pos0 % ring.modulus + i`; which position a row holds is kept in the shared
    /// `sliding.positions` buffer (`p + 1`, 0 for an empty row).
    Ring,
    /// `[capacity, kv_heads, head_dim]`: position `p` lives in row `p`.
    Full,
}

/// One entry point: `chunk_ids_c{C}` or `chunk_emb_c{C}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryPoint {
    /// Exported function name, `chunk_{ids,emb}_c{C}`, or `chunk_ids_c{C}_s{span}`; a
    /// [`HeadMode::Full`] step's ends in `_logits`.
    pub name: String,
    /// Rows per call (`C`); `C = 1` is the decode step.
    pub chunk: usize,
    /// Greedy decode steps per call: 1 for a chunk; more for a multi-step decode entry point
    /// (`decode_ids_k{steps}`), whose `valid` argument is the number of steps wanted and whose
    /// second result is every step's token ([`Role::Tokens`]).
    pub steps: usize,
    /// `Ids` or `Embeddings`: the role of the first argument.
    pub input: Role,
    /// The rows of the KV buffers it may attend over: a call's chunk must end at or before
    /// this row. The capacity, or a span of [`GraphOptions::spans`](super::GraphOptions::spans)
    /// over whose first rows the global layers attend, and the sliding layers too where the
    /// ring allows ([`RingGeometry::rows_seen`]).
    pub span: usize,
    /// Which head it computes.
    pub head: HeadMode,
    /// Arguments in call order: chunk input, `pos0`, `valid`, `head`, `pos0_host`,
    /// `valid_host`, weights, the screened head's tensors (if any), KV buffers, `next`'s
    /// storage ([`Role::NextOut`]).
    pub args: Vec<TensorSpec>,
    /// Results in order: `next`, `logits`, KV buffers (same order as the KV arguments).
    pub results: Vec<TensorSpec>,
}

/// Everything a runtime needs to call the module's entry points.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT`].
    pub format: String,
    /// [`MANIFEST_VERSION`] of the writer.
    pub version: u32,
    /// Chunk sizes compiled, ascending.
    pub chunks: Vec<usize>,
    /// KV layout of each layer, in layer order.
    pub kv_layouts: Vec<KvLayout>,
    /// Rows of the sliding layers' buffers.
    pub ring: RingGeometry,
    /// Layout of the projections (and of the embedding table, unless `table_layout` says
    /// otherwise).
    pub weight_layout: WeightLayout,
    /// Layout of the embedding table: [`WeightLayout::Rows`] in a module with a screened head
    /// (the f32 table is then read only by rows), else `weight_layout`.
    pub table_layout: WeightLayout,
    /// A chunk at `pos0` must satisfy `pos0 + C <= capacity` (full-layer buffers have
    /// `capacity` rows, and a dynamic update slice would clamp a write past the end).
    pub capacity: usize,
    /// Every entry point, by chunk size ascending: one input's per chunk size, the other's for
    /// the decode step and the largest size ([`Manifest::chunks_for`]).
    pub entry_points: Vec<EntryPoint>,
}

impl Manifest {
    /// The chunk sizes with a chunk entry point (not a multi-step decode's) for `input` (`Ids`
    /// or `Embeddings`), ascending.
    pub fn chunks_for(&self, input: Role) -> Vec<usize> {
        let mut chunks: Vec<usize> = self
            .entry_points
            .iter()
            .filter(|e| e.input == input && e.steps == 1)
            .map(|e| e.chunk)
            .collect();
        chunks.dedup();
        chunks
    }

    /// The entry point named `name`.
    pub fn entry(&self, name: &str) -> Option<&EntryPoint> {
        self.entry_points.iter().find(|e| e.name == name)
    }

    /// The entry point for a chunk of `chunk` rows of `input` (`Ids` or `Embeddings`) ending
    /// at row `end` with the `head` argument `head`: of those that may attend that far and
    /// compute that head ([`HeadMode::serves`]), the one with the shortest span.
    pub fn entry_for(
        &self,
        input: Role,
        chunk: usize,
        end: usize,
        head: i32,
    ) -> Option<&EntryPoint> {
        self.entry_index_for(input, chunk, end, head)
            .map(|i| &self.entry_points[i])
    }

    /// The index in [`Manifest::entry_points`] of [`Manifest::entry_for`]'s entry point.
    pub fn entry_index_for(
        &self,
        input: Role,
        chunk: usize,
        end: usize,
        head: i32,
    ) -> Option<usize> {
        self.entry_points
            .iter()
            .enumerate()
            .filter(|(_, e)| e.steps == 1 && e.input == input && e.chunk == chunk)
            .filter(|(_, e)| e.span >= end)
            .filter(|(_, e)| e.head.serves(head))
            // The shortest span; at one span, the mode that computes least.
            .min_by_key(|(_, e)| (e.span, e.head))
            .map(|(i, _)| i)
    }

    /// The index in [`Manifest::entry_points`] of the multi-step decode entry point whose steps
    /// (all of them, padding included) fit before row `span`, the shortest span first; `None`
    /// where the module has none or none fits.
    pub fn decode_entry_index(&self, pos0: usize) -> Option<usize> {
        self.entry_points
            .iter()
            .enumerate()
            .filter(|(_, e)| e.steps > 1 && pos0 + e.steps <= e.span)
            .min_by_key(|(_, e)| e.span)
            .map(|(i, _)| i)
    }
}

impl EntryPoint {
    /// The weight arguments, in call order.
    pub fn weights(&self) -> impl Iterator<Item = &TensorSpec> {
        self.args.iter().filter(|a| a.role == Role::Weight)
    }

    /// The KV arguments, in call order.
    pub fn kv(&self) -> impl Iterator<Item = &TensorSpec> {
        self.args.iter().filter(|a| a.role == Role::Kv)
    }

    /// The screened head's arguments, in call order ([`SCREEN_WEIGHTS`]); none without a
    /// screened head.
    pub fn screen(&self) -> impl Iterator<Item = &TensorSpec> {
        self.args.iter().filter(|a| a.role == Role::Screen)
    }
}

/// The weights every entry point takes, in call order, with their names and shapes:
/// `model.embed_tokens.weight` in `table`, then per layer the 10 arguments of
/// [`LAYER_WEIGHTS`] (the projections in `layout`, q, k and v stacked into one, gate and up
/// into another), then `model.norm.weight`.
pub fn weight_specs(
    cfg: &ModelConfig,
    table: WeightLayout,
    layout: WeightLayout,
) -> Vec<TensorSpec> {
    let h = cfg.hidden_size;
    let mut out = vec![weight(
        "model.embed_tokens.weight",
        &table.table_dims(cfg.vocab_size, h),
    )];
    for layer in 0..cfg.num_layers() {
        for (suffix, parts) in LAYER_WEIGHTS {
            let name = format!("model.layers.{layer}.{suffix}");
            let mut spec = match layer_weight_dims(cfg, parts[0])[..] {
                [_, cols] => {
                    let rows: Vec<usize> =
                        parts.iter().map(|p| layer_weight_dims(cfg, p)[0]).collect();
                    let stacked = *layout.stack_offsets(&rows).last().expect("one part");
                    weight(&name, &layout.projection_dims(stacked, cols))
                }
                ref vector => weight(&name, vector),
            };
            if parts != [suffix] {
                spec.parts = parts
                    .iter()
                    .map(|p| format!("model.layers.{layer}.{p}"))
                    .collect();
            }
            out.push(spec);
        }
    }
    out.push(weight("model.norm.weight", &[h]));
    out
}

/// The model's weight tensors the entry points read, as `model.safetensors` holds them (HF
/// names and shapes): the embedding table, every layer's 13 tensors, the final norm.
pub fn hf_weight_specs(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let h = cfg.hidden_size;
    let mut out = vec![weight("model.embed_tokens.weight", &[cfg.vocab_size, h])];
    for layer in 0..cfg.num_layers() {
        for suffix in LAYER_WEIGHTS.iter().flat_map(|(_, parts)| parts.iter()) {
            let name = format!("model.layers.{layer}.{suffix}");
            out.push(weight(&name, &layer_weight_dims(cfg, suffix)));
        }
    }
    out.push(weight("model.norm.weight", &[h]));
    out
}

/// Names of the screened head's tensors ([`Role::Screen`]), in call order.
pub const SCREEN_WEIGHTS: [&str; 3] = ["screen.q8", "screen.scale", "screen.slack"];

/// The screened head's tensors: the int8 table as `[ceil(vocab / TABLE_LANES), hidden,
/// TABLE_LANES]` panels (zero past the last row), then `[vocab]` f32 scales and bounds.
pub fn screen_specs(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let [q8, scale, slack] = SCREEN_WEIGHTS;
    let panels = WeightLayout::Panels.table_dims(cfg.vocab_size, cfg.hidden_size);
    let spec = |name: &str, dims: &[usize], dtype| TensorSpec {
        name: name.to_string(),
        role: Role::Screen,
        dims: dims.to_vec(),
        dtype,
        parts: Vec::new(),
    };
    vec![
        spec(q8, &panels, DType::I8),
        spec(scale, &[cfg.vocab_size], DType::F32),
        spec(slack, &[cfg.vocab_size], DType::F32),
    ]
}

/// Per-layer weight arguments (after `model.layers.{i}.`) in call order, each with the HF
/// tensors (after the same prefix) it holds. Projections that read the same input are stacked
/// along their output rows into one argument ([`WeightLayout::stack_offsets`]), so that one
/// product computes them: q, k and v as `self_attn.qkv_proj.weight` (`[(heads + 2 kv_heads)
/// head_dim, hidden]` in HF terms), gate and up as `mlp.gate_up_proj.weight` (`[2 ffn,
/// hidden]`); names of no HF tensor. A decode step then streams each stack as one matvec
/// (one dispatch, one long stream, where k's and v's short ones ran slower), 54 dispatches
/// fewer on Gemma 3 270M.
pub const LAYER_WEIGHTS: [(&str, &[&str]); 10] = [
    ("input_layernorm.weight", &["input_layernorm.weight"]),
    (
        "self_attn.qkv_proj.weight",
        &[
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
        ],
    ),
    ("self_attn.q_norm.weight", &["self_attn.q_norm.weight"]),
    ("self_attn.k_norm.weight", &["self_attn.k_norm.weight"]),
    ("self_attn.o_proj.weight", &["self_attn.o_proj.weight"]),
    (
        "post_attention_layernorm.weight",
        &["post_attention_layernorm.weight"],
    ),
    (
        "pre_feedforward_layernorm.weight",
        &["pre_feedforward_layernorm.weight"],
    ),
    (
        "mlp.gate_up_proj.weight",
        &["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    ),
    ("mlp.down_proj.weight", &["mlp.down_proj.weight"]),
    (
        "post_feedforward_layernorm.weight",
        &["post_feedforward_layernorm.weight"],
    ),
];

fn layer_weight_dims(cfg: &ModelConfig, suffix: &str) -> Vec<usize> {
    let (h, hd, f) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let q = cfg.num_attention_heads * hd;
    let kv = cfg.kv_row();
    match suffix {
        "self_attn.q_proj.weight" => vec![q, h],
        "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![kv, h],
        "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => vec![hd],
        "self_attn.o_proj.weight" => vec![h, q],
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![f, h],
        "mlp.down_proj.weight" => vec![h, f],
        _ => vec![h],
    }
}

fn weight(name: &str, dims: &[usize]) -> TensorSpec {
    TensorSpec {
        name: name.to_string(),
        role: Role::Weight,
        dims: dims.to_vec(),
        dtype: DType::F32,
        parts: Vec::new(),
    }
}

/// Name of the table of positions held by the sliding layers' rows.
pub const SLIDING_POSITIONS: &str = "sliding.positions";

/// The KV buffers: K then V per layer in layer order, then the `sliding.positions` table
/// `[ring.rows] i32` the sliding layers share.
pub fn kv_specs(cfg: &ModelConfig, ring: RingGeometry) -> Vec<TensorSpec> {
    let mut out = Vec::new();
    for (layer, kind) in cfg.layer_kinds.iter().enumerate() {
        let rows = match kind {
            LayerKind::Sliding => ring.rows,
            LayerKind::Global => cfg.context_capacity,
        };
        for kv in ["k", "v"] {
            out.push(TensorSpec {
                name: format!("layers.{layer}.{kv}"),
                role: Role::Kv,
                dims: vec![rows, cfg.num_key_value_heads, cfg.head_dim],
                dtype: DType::F32,
                parts: Vec::new(),
            });
        }
    }
    out.push(TensorSpec {
        name: SLIDING_POSITIONS.to_string(),
        role: Role::Kv,
        dims: vec![ring.rows],
        dtype: DType::I32,
        parts: Vec::new(),
    });
    out
}

/// The KV layout of each layer.
pub fn kv_layouts(cfg: &ModelConfig) -> Vec<KvLayout> {
    cfg.layer_kinds
        .iter()
        .map(|k| match k {
            LayerKind::Sliding => KvLayout::Ring,
            LayerKind::Global => KvLayout::Full,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_hold_their_lanes_rows_and_zeros_past_the_last_row() {
        // Three panels each, the last with 5 rows.
        for (lanes, dims) in [
            (TABLE_LANES, WeightLayout::Panels.table_dims(37, 3)),
            (
                PROJECTION_LANES,
                WeightLayout::Panels.projection_dims(69, 3),
            ),
        ] {
            let (rows, cols) = (2 * lanes + 5, 3);
            assert_eq!(dims, [3, cols, lanes]);
            let src: Vec<f32> = (0..rows * cols).map(|i| i as f32 + 1.0).collect();
            let mut out = vec![f32::NAN; dims.iter().product()];
            pack_panels(&src, cols, lanes, &mut out);
            for p in 0..3 {
                for k in 0..cols {
                    for j in 0..lanes {
                        let row = p * lanes + j;
                        let want = if row < rows { src[row * cols + k] } else { 0.0 };
                        let got = out[(p * cols + k) * lanes + j];
                        assert_eq!(got, want, "{lanes} lanes: panel {p} col {k} lane {j}");
                    }
                }
            }
        }
        assert_eq!(WeightLayout::Rows.table_dims(37, 3), [37, 3]);
        assert_eq!(WeightLayout::Rows.projection_dims(69, 3), [69, 3]);
    }

    #[test]
    fn stacked_parts_start_at_whole_panels_in_panels_and_back_to_back_in_rows() {
        let (rows, panels) = (WeightLayout::Rows, WeightLayout::Panels);
        assert_eq!(rows.stack_offsets(&[80, 40, 40]), [0, 80, 120, 160]);
        assert_eq!(panels.stack_offsets(&[80, 40, 40]), [0, 96, 160, 224]);
        assert_eq!(
            panels.stack_offsets(&[1024, 256, 256]),
            [0, 1024, 1280, 1536]
        );
        assert_eq!(stack_offsets(&[5, 1], 16), [0, 16, 32]);

        // Gemma 3 270M: q, k and v as 48 panels, gate and up as 128; the HF tensors unstacked.
        let cfg = kvsnap_reference::tiny::config(kvsnap_reference::tiny::Preset::RealShapes);
        let specs = weight_specs(&cfg, panels, panels);
        let dims = |name: &str| &specs.iter().find(|s| s.name == name).unwrap().dims;
        assert_eq!(
            dims("model.layers.3.self_attn.qkv_proj.weight"),
            &[48, 640, 32]
        );
        assert_eq!(
            dims("model.layers.3.mlp.gate_up_proj.weight"),
            &[128, 640, 32]
        );
        assert_eq!(specs.len(), 2 + 10 * 18);
        let hf = hf_weight_specs(&cfg);
        assert_eq!(hf.len(), 2 + 13 * 18);
        let k = hf
            .iter()
            .find(|s| s.name == "model.layers.3.self_attn.k_proj.weight")
            .unwrap();
        assert_eq!(k.dims, [256, 640]);
        // Every part of every argument is one of the HF tensors.
        for part in specs.iter().flat_map(|s| &s.parts) {
            assert!(hf.iter().any(|t| &t.name == part), "{part}");
        }
    }
}
