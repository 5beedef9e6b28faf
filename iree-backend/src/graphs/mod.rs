//! The Gemma 3 graphs: ONE StableHLO module with a chunk entry point per chunk size and input
//! kind, all taking the same weights (HF names; the matrices in the module's [`WeightLayout`])
//! and the KV buffers, all computing what `kvsnap_reference` computes.
//!
//! # Entry points
//! For each chunk size `C` in the module's chunk set:
//!
//! ```text
//! chunk_ids_c{C}(ids: tensor<Cxi32>, pos0: tensor<i32>, valid: tensor<i32>, head: i32,
//!                pos0_host: i32, valid_host: i32, weights..., kv...)
//!     -> (next: tensor<i32>, logits: tensor<{vocab}xf32>, kv...)
//! chunk_emb_c{C}(emb: tensor<Cx{hidden}xf32>, pos0, valid, head, pos0_host, valid_host,
//!                weights..., kv...) -> (same)
//! ```
//!
//! - `head`, `pos0_host` and `valid_host` are integers passed by value ([`DType::HostI32`]),
//!   the last two the same values as the tensors `pos0` and `valid`. The module's host program
//!   computes the rows a call writes, the row its head reads and the branches it takes from
//!   the integers, the device the positions, masks and RoPE tables from the tensors: a call
//!   reads nothing back to the host before its end. (IREE 3.13 cannot schedule the dispatch
//!   that would make the tensors from the integers where a branch reads them, hence both.)
//! - A module with the screened head has each token-id decode step twice ([`head_modes`]):
//!   screened whatever `head` says, and with the full head (`_logits`); the host picks by
//!   the head it wants ([`Manifest::entry_for`]).
//! - Rows `0..valid` of the chunk are positions `pos0..pos0 + valid`; rows `valid..C` are
//!   padding and change nothing (`1 <= valid <= C`, `pos0 + C <= capacity`).
//! - `emb` rows are raw embedding rows; the graph multiplies them by `sqrt(hidden)` (rounded to
//!   f32), as it does the gathered rows of `ids`.
//! - Weights in [`weight_specs`] order: `model.embed_tokens.weight`, 10 per layer
//!   ([`LAYER_WEIGHTS`]: q, k and v stacked into one matrix, gate and up into another),
//!   `model.norm.weight`; the matrices in the module's [`WeightLayout`], the norms as in
//!   `model.safetensors`.
//! - KV in [`kv_specs`] order (K then V per layer, then the `sliding.positions` table): global
//!   layers `[capacity, kv_heads, head_dim]` (position `p` in row `p`); sliding layers
//!   `[ring.rows, kv_heads, head_dim]` with the chunk written at row `pos0 % ring.modulus`
//!   ([`RingGeometry`]) and the held positions in `sliding.positions` (`[ring.rows]` i32,
//!   `p + 1`, 0 for an empty row; zero-initialised like every KV buffer). Every KV buffer is
//!   written by one `dynamic_update_slice` BEFORE anything reads it, so IREE updates it in
//!   place: the results are the argument buffers, updated, and an input KV buffer must never be
//!   kept as a snapshot (copy it).
//! - `next` is the argmax of the last valid row's logits (lowest index wins ties), computed on
//!   the device in two stages; `logits` are that row's only. No `C x vocab` tensor exists.
//! - `head` 0 skips the head (a `stablehlo.if`, in the chunks that branch,
//!   [`GraphOptions::branches_for`]): `next` is 0 and `logits` zeros. The head streams the whole
//!   embedding table, as much as the 18 layers' weights: a prefill asks for it in its last chunk
//!   only.
//!
//! RoPE tables, masks and ring positions are computed inside the graph from `pos0` and `valid`.

mod forward;
mod manifest;
mod tuning;

use kvsnap_contract::ModelConfig;

use crate::compile::LinkedObject;
use crate::emit::{Cmp, ElemType, FuncBuilder, Module, Scalar, TensorType, Value};
use crate::kernels::{self, SpirvKernels};
use forward::{Forward, LayerWeights, Screen};
pub use forward::{SCREEN_BLOCK, SCREEN_BLOCKS};
pub use manifest::{
    hf_weight_specs, kv_layouts, kv_specs, pack_panels, screen_specs, stack_offsets, weight_specs,
    DType, EntryPoint, HeadMode, KvLayout, Manifest, RingGeometry, Role, TensorSpec, WeightLayout,
    HEAD_FULL, HEAD_NONE, HEAD_SCREEN, LAYER_WEIGHTS, MANIFEST_FORMAT, MANIFEST_VERSION,
    PROJECTION_LANES, SCREEN_WEIGHTS, SLIDING_POSITIONS, TABLE_LANES,
};
pub use tuning::llvm_cpu_tuning_spec;

/// Chunk sizes compiled by default: the decode step and six prefill/extend chunks. The model
/// splits rows into the calls of least modelled cost (`plan_chunks` in `model.rs`: a call costs
/// its padded rows plus a pass over the weights), so sizes 8 apart keep an utterance's padding
/// small: a 22-token extend runs as 24 rows, not 32 (84-98 ms against 102-108 for the 32-row
/// chunk, docs/BENCHMARKS.md, twentieth pass), 36 tokens as 32 + 8, not a padded 64. A long
/// prefill runs 128-row chunks, each weight panel read once per 128 rows: the 860-token
/// catalog prefix 1.29-1.32 -> 1.18-1.20 s on an AVX-512 Xeon (twenty-first pass), for a
/// sliding ring of 768 rows instead of 640 (window + twice the largest chunk).
pub const DEFAULT_CHUNKS: [usize; 7] = [1, 8, 16, 24, 32, 64, 128];

/// The steps of Vulkan's multi-step decode entry points ([`GraphOptions::decode_steps`]).
pub const DECODE_STEPS: usize = 16;

/// Which input an entry point takes (in a module's description: `ids`, `embeddings`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Input {
    /// Token ids; the graph gathers the embedding rows.
    Ids,
    /// Raw embedding rows gathered on the host.
    Embeddings,
}

impl Input {
    /// Both input kinds, ids first.
    pub const ALL: [Input; 2] = [Input::Ids, Input::Embeddings];

    /// `ids` or `embeddings`, as a module's description names it.
    pub fn name(self) -> &'static str {
        match self {
            Input::Ids => "ids",
            Input::Embeddings => "embeddings",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Input::Ids => "ids",
            Input::Embeddings => "emb",
        }
    }
}

/// The name of the entry point for `input` and chunk size `chunk`: `chunk_ids_c16`.
pub fn entry_name(input: Input, chunk: usize) -> String {
    format!("chunk_{}_c{chunk}", input.tag())
}

/// The name of the entry point for `input` and chunks of `chunk` rows that attends over the
/// first `span` rows of the KV buffers only ([`GraphOptions::spans`]): `chunk_ids_c1_s512`.
pub fn span_entry_name(input: Input, chunk: usize, span: usize) -> String {
    format!("{}_s{span}", entry_name(input, chunk))
}

/// The name of the multi-step decode entry point of `steps` steps that attends over the first
/// `span` rows of the KV buffers (none: the capacity): `decode_ids_k16`, `decode_ids_k16_s1024`.
pub fn decode_entry_name(steps: usize, span: Option<usize>) -> String {
    match span {
        Some(span) => format!("decode_ids_k{steps}_s{span}"),
        None => format!("decode_ids_k{steps}"),
    }
}

/// The head modes of the token-id entry points for chunks of `c` rows: the decode step of a
/// module with a screened head comes as a [`HeadMode::Screen`] entry point and a
/// [`HeadMode::Full`] one (for logits) at each span, without a branch; every other chunk
/// computes the head its `head` argument asks for.
pub fn head_modes(opts: GraphOptions, c: usize) -> Vec<HeadMode> {
    if opts.screen && c == 1 {
        vec![HeadMode::Screen, HeadMode::Full]
    } else {
        vec![HeadMode::Argument]
    }
}

/// The target-dependent choices of a module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphOptions {
    /// Layout of the matrix arguments (the embedding table and the projections).
    pub layout: WeightLayout,
    /// Skip work with `stablehlo.if` in chunks of more than one row ([`GraphOptions::branches_for`]):
    /// the head where the `head` argument is 0, and global attention beyond the live span
    /// (`Forward::attend_live`). Without branches the head always runs (`head` is ignored) and
    /// global layers attend over the whole capacity, or their entry point's span
    /// ([`GraphOptions::spans`], which need no branch). Each branch splits a call into queue
    /// submissions that wait on each other (its predicate comes from the host program; until
    /// the twenty-fifth pass it was read back from the device, and on Vulkan that cost more
    /// than the work it skipped: the H200's decode step took 63 ms with branches instead of
    /// 42); on llvm-cpu it pays off where the skipped work is large.
    pub branches: bool,
    /// Compute the greedy token alone (the `head` argument 2) by a screen of the tied head
    /// ([`Role::Screen`] arguments, `kvsnap_reference::head`): an int8 copy of the table
    /// scores every row, and only the rows whose error bound reaches the best one are
    /// recomputed in f32. The f32 table is then passed in rows ([`GraphOptions::table_layout`]):
    /// a step reads it only for those rows, for embedding rows, and in full only when logits
    /// are asked for. Requires [`WeightLayout::Panels`] (the int8 table is in panels) and a
    /// config without a final logit softcap (whose rounding can tie logits the screen tells
    /// apart).
    pub screen: bool,
    /// The input the model's prefill, extend and step go through: its entry points come in
    /// every chunk size. The other input (`prefill_embeddings` on the CPU, token ids on
    /// Vulkan) gets the decode step and the largest chunk only: each entry point of the real
    /// model adds about 5 s to llvm-cpu's compile.
    pub input: Input,
    /// Run the chunks' panel products (rows in tiles of [`kernels::MMT4D_ROWS`], panels of
    /// [`kernels::MMT4D_LANES`] lanes), the screened head's scores and candidate rows and the
    /// decode step's attention in kvsnap's kernels, this object linked into the module,
    /// instead of IREE's code ([`kernels`]). Requires [`WeightLayout::Panels`].
    pub own_kernels: Option<LinkedObject>,
    /// Run the decode step in kvsnap's SPIR-V kernels ([`SpirvKernels`]): the embedding's
    /// norm, the layers' products, attention (with its q/k norms, RoPE and K/V row writes),
    /// GeGLU and residual norms, six dispatches a layer instead of IREE's eighteen, and the
    /// head with its argmax; and the chunks' norms and head. For Vulkan modules, where this
    /// build compiled the kernels ([`kernels::spirv_kernels`]).
    pub spirv_kernels: Option<SpirvKernels>,
    /// With [`GraphOptions::spirv_kernels`], run the chunks' products and attention in them
    /// too (`matmul`, `attend_rows`): for IREE's generic SPIR-V target, whose own code for
    /// them is slow (on an H100 a 64-row extend took 40.1 ms with it, 14.6 with the kernels,
    /// the catalog's prefix 517 against 94 ms). A module compiled for a named GPU
    /// (`--iree-vulkan-target`) keeps IREE's code there, the faster (`ampere`: the extend
    /// 8.9 against 13.7 ms; docs/BENCHMARKS.md, forty-eighth pass).
    pub spirv_chunks: bool,
    /// Where the chunk has few query rows, take the scores with the keys as the product's
    /// output rows and the weighted values in blocks of keys (`Forward::attend_blocked`): IREE
    /// distributes a product over its batch and output dims only, and a few query rows'
    /// scores and weighted values are otherwise a few workgroups on a GPU.
    pub key_blocks: bool,
    /// Write the chunk's K/V rows and ring positions by a scatter at rows computed on the
    /// device from the `pos0` tensor, and take the last valid row by a gather, instead of at
    /// offsets computed from the host scalars. A call's command buffer then captures no value
    /// of the call (only constants and bindings), so IREE records it once, when the module
    /// loads, and replays it with each call's buffers (`hal.device.queue.execute.indirect`);
    /// with host offsets every call records each of its dispatches again (on an H100 the
    /// host's work was most of a decode step's time). Off on llvm-cpu, whose branches
    /// capture the host's predicates anyway and whose step it did not change
    /// (docs/BENCHMARKS.md, forty-first pass).
    pub device_rows: bool,
    /// Steps of the multi-step decode entry points ([`decode_entry_name`]), 0 for none: each
    /// runs up to this many greedy steps in one call, every step's id the previous step's
    /// token on the device, so the steps are one queue submission and the host waits once.
    /// On Vulkan a call's host work and the wake-ups around it were about half of a decode
    /// step (docs/BENCHMARKS.md, forty-second to forty-fourth passes).
    pub decode_steps: usize,
}

impl GraphOptions {
    /// What llvm-cpu runs best: panel matrices, branches, the screened head, and kvsnap's
    /// kernels where this host and build have them ([`kernels::kernel_object`]).
    pub fn llvm_cpu() -> Self {
        GraphOptions {
            layout: WeightLayout::Panels,
            branches: true,
            screen: true,
            input: Input::Ids,
            own_kernels: kernels::kernel_object(),
            spirv_kernels: None,
            spirv_chunks: false,
            key_blocks: false,
            device_rows: false,
            decode_steps: 0,
        }
    }

    /// What Vulkan runs best: HF matrices, no branches, the full head, few query rows'
    /// attention in blocks of keys, the rows written at offsets computed on the device.
    pub fn vulkan() -> Self {
        GraphOptions {
            layout: WeightLayout::Rows,
            branches: false,
            screen: false,
            input: Input::Embeddings,
            own_kernels: None,
            spirv_kernels: kernels::spirv_kernels(),
            spirv_chunks: true,
            key_blocks: true,
            device_rows: true,
            decode_steps: DECODE_STEPS,
        }
    }

    /// These options for `cfg`: without the screen where `cfg` has a final logit softcap.
    pub fn for_config(self, cfg: &ModelConfig) -> Self {
        GraphOptions {
            screen: self.screen && cfg.final_logit_softcapping.is_none(),
            ..self
        }
    }

    /// The layout of the embedding table: rows with the screen, else [`GraphOptions::layout`].
    pub fn table_layout(self) -> WeightLayout {
        if self.screen {
            WeightLayout::Rows
        } else {
            self.layout
        }
    }

    /// Whether the entry point for chunks of `c` rows branches: with [`GraphOptions::branches`],
    /// from two rows up. A decode step's one row skips little (the head is always wanted, and a
    /// global layer's whole capacity is a few MB of keys and values) while its predicates cost
    /// a queue round trip each, about seven per step at the catalog's length: on 2 cores of a
    /// Zen 5 host its step ran 1-12 ms faster without them (docs/BENCHMARKS.md, eleventh pass).
    /// A prefill chunk of 64 rows skips a 671 MB head and three quarters of three global
    /// layers' attention, so there they stay.
    pub fn branches_for(self, c: usize) -> bool {
        self.branches && c > 1
    }

    /// The spans below `capacity` of the extra entry points of [`GraphOptions::input`] for
    /// chunks of `c` rows ([`span_entry_name`]), on every target. Each attends over the first
    /// `span` rows of the global layers' buffers, and of the sliding layers' ring where `span`
    /// is within its modulus ([`RingGeometry::rows_seen`]); the host picks the shortest that
    /// holds the call ([`Manifest::entry_for`]), so no predicate is read back and no branch is
    /// taken: Vulkan, whose graphs do not branch, has them too. There a step at the catalog's
    /// length reads a quarter of the global layers' keys and values; on an H100, where the
    /// blocked value sums ([`GraphOptions::key_blocks`]) had already made that attention
    /// cheap, the step took the same time either way (8.6 / 8.5 ms, docs/BENCHMARKS.md,
    /// thirty-seventh pass): a GPU of less bandwidth is where the span should tell.
    ///
    /// - The decode step: an eighth, a quarter and half of the capacity, as a chunk's branches
    ///   choose from. At the catalog's length a step attends over 1024 of Gemma 3 270M's 4096
    ///   global rows; its three global layers' attention took about 2.3 ms of a 27 ms step over
    ///   the whole capacity (docs/BENCHMARKS.md, nineteenth pass).
    /// - The largest chunk (a long prefill's): twice and four times its rows, and so on up to
    ///   the ring's modulus. A prefill's first chunks then attend over the rows written so far
    ///   instead of the whole ring: the 128-row chunk's sliding attention took 37 ms over the
    ///   768 rows of Gemma 3 270M's ring (twenty-fourth pass), and the prefix's first four
    ///   chunks run over 256, 256, 512 and 512 rows.
    pub fn spans(self, c: usize, capacity: usize, ring: RingGeometry) -> Vec<usize> {
        let mut spans = if c == 1 {
            forward::global_spans(capacity, 1)
        } else if c == ring.max_chunk() {
            std::iter::successors(Some(2 * c), |s| Some(2 * s))
                .take_while(|&s| s <= ring.modulus)
                .collect()
        } else {
            Vec::new()
        };
        spans.retain(|&s| s < capacity);
        spans
    }
}

/// An emitted module: its MLIR text and the manifest of its entry points.
#[derive(Clone, Debug)]
pub struct Graphs {
    /// The module's MLIR text (StableHLO in generic syntax).
    pub mlir: String,
    /// Its entry points, argument and result order.
    pub manifest: Manifest,
    /// The IREE tuning spec to compile it with, if any ([`llvm_cpu_tuning_spec`]: graphs with
    /// [`WeightLayout::Panels`] are meant for llvm-cpu).
    pub tuning_spec: Option<String>,
    /// The objects the module links ([`GraphOptions::own_kernels`]).
    pub objects: Vec<LinkedObject>,
}

/// Builds the module for `cfg` with an entry point of `opts.input` per size in `chunks`
/// (deduplicated and sorted) and of the other input for the decode step and the largest size,
/// with the choices of `opts`.
///
/// # Panics
/// If `chunks` is empty or holds 0, or a chunk is longer than the context capacity; if
/// `opts.screen` is set without [`WeightLayout::Panels`] or for a softcapped config.
pub fn build(cfg: &ModelConfig, chunks: &[usize], opts: GraphOptions) -> Graphs {
    assert!(
        !opts.screen
            || (opts.layout == WeightLayout::Panels && cfg.final_logit_softcapping.is_none()),
        "graphs: the screened head needs panels and no logit softcap"
    );
    let mut chunks = chunks.to_vec();
    chunks.sort_unstable();
    chunks.dedup();
    assert!(
        !chunks.is_empty() && chunks[0] > 0,
        "graphs: chunk sizes {chunks:?} must be positive"
    );
    assert!(
        *chunks.last().unwrap() <= cfg.context_capacity,
        "graphs: chunk sizes {chunks:?} exceed the context capacity {}",
        cfg.context_capacity
    );
    let ring = RingGeometry::new(cfg.sliding_window, *chunks.last().unwrap());
    let mut module = Module::new("kvsnap");
    let mut objects: Vec<LinkedObject> = opts.own_kernels.into_iter().collect();
    for object in &objects {
        module.push_executable(kernels::executable(object));
    }
    // Each of its dispatches carries its own executable (`hal.dispatch.extern`).
    objects.extend(opts.spirv_kernels.iter().flat_map(|k| k.objects()));
    if opts.spirv_kernels.is_some() {
        push_spirv_counters(&mut module);
    }
    let mut entry_points = Vec::new();
    let largest = *chunks.last().unwrap();
    for &c in &chunks {
        for input in Input::ALL {
            if input != opts.input && c != 1 && c != largest {
                continue;
            }
            let heads = match input {
                Input::Ids => head_modes(opts, c),
                Input::Embeddings => vec![HeadMode::Argument],
            };
            for head in heads {
                let (text, entry) = entry_point(cfg, input, c, ring, opts, None, head);
                module.push(text);
                entry_points.push(entry);
            }
        }
        for span in opts.spans(c, cfg.context_capacity, ring) {
            for head in head_modes(opts, c) {
                let (text, entry) = entry_point(cfg, opts.input, c, ring, opts, Some(span), head);
                module.push(text);
                entry_points.push(entry);
            }
        }
    }
    if opts.decode_steps > 0 {
        for span in decode_spans(cfg.context_capacity, opts.decode_steps) {
            let (text, entry) = decode_entry_point(cfg, opts.decode_steps, ring, opts, span);
            module.push(text);
            entry_points.push(entry);
        }
    }
    let attention = attention_products(cfg, &chunks, ring, opts);
    Graphs {
        mlir: module.text(),
        tuning_spec: llvm_cpu_tuning_spec(cfg, opts.table_layout(), opts.layout, &attention),
        objects,
        manifest: Manifest {
            format: MANIFEST_FORMAT.to_string(),
            version: MANIFEST_VERSION,
            chunks,
            kv_layouts: kv_layouts(cfg),
            ring,
            weight_layout: opts.layout,
            table_layout: opts.table_layout(),
            capacity: cfg.context_capacity,
            entry_points,
        },
    }
}

/// The spans of the multi-step decode entry points of `steps` steps: a quarter of the capacity
/// (where it holds a call's steps) and `None`, the capacity. Each such entry point is `steps`
/// decode steps to compile (with two, the real shapes' Vulkan MLIR grew from 5.8 to 19.6 MB,
/// docs/BENCHMARKS.md, forty-fourth pass), and on an H100 a step took the same time over a
/// span as over the whole capacity (thirty-seventh pass): two spans, not the decode step's
/// four.
fn decode_spans(capacity: usize, steps: usize) -> Vec<Option<usize>> {
    let quarter = capacity / 4;
    let mut spans: Vec<Option<usize>> = (quarter >= steps && quarter < capacity)
        .then_some(Some(quarter))
        .into_iter()
        .collect();
    spans.push(None);
    spans
}

/// The `(M, rows)` of each attention product `P [M, rows] . V [rows, head_dim]` the chunks of
/// a multiple of 8 query rows, and the decode step, run as a `linalg.matmul` (one KV head; `M`
/// = chunk x query heads): over the sliding ring, and over the global layers' live spans (or
/// their whole capacity); span entry points over their span of each.
fn attention_products(
    cfg: &ModelConfig,
    chunks: &[usize],
    ring: RingGeometry,
    opts: GraphOptions,
) -> Vec<(usize, usize)> {
    if cfg.num_key_value_heads != 1 {
        return Vec::new(); // batched over KV heads: a linalg.batch_matmul
    }
    let mut products = Vec::new();
    for &c in chunks {
        let m = c * cfg.group_size();
        if c > 1 && !m.is_multiple_of(8) {
            continue;
        }
        let mut rows = if opts.branches_for(c) {
            forward::global_spans(cfg.context_capacity, c)
        } else {
            vec![cfg.context_capacity]
        };
        rows.push(ring.rows_seen(c, None));
        for span in opts.spans(c, cfg.context_capacity, ring) {
            rows.extend([span, ring.rows_seen(c, Some(span))]);
        }
        products.extend(rows.into_iter().map(|rows| (m, rows)));
    }
    products.sort_unstable();
    products.dedup();
    products
}

/// A module `@argmax(logits: tensor<{vocab}xf32>) -> tensor<i32>` holding the head's two-stage
/// argmax alone, to test it with planted maxima on each target (a one-pass argmax over 262144
/// logits returned the argmax of the first 65535 on lavapipe; see IREE-NOTES).
pub fn argmax_module(cfg: &ModelConfig) -> String {
    let mut b = FuncBuilder::new("argmax");
    let logits = b.arg(TensorType::f32(&[cfg.vocab_size]));
    let mut f = Forward {
        b,
        cfg,
        opts: GraphOptions::vulkan(),
        span: None,
    };
    let next = f.argmax(&logits);
    let mut module = Module::new("argmax");
    module.push(f.b.finish(&[&next]));
    module.text()
}

/// Declares the counters the SPIR-V kernels' last workgroups count on
/// ([`kernels::SPIRV_COUNTERS_GLOBAL`]) in `module`.
fn push_spirv_counters(module: &mut Module) {
    module.push_global(
        kernels::SPIRV_COUNTERS_GLOBAL,
        &TensorType::i32(&[kernels::SPIRV_COUNTERS]),
    );
}

/// A module `@head(table, h) -> (tensor<i32>, tensor<vocab x f32>)` holding the tied head
/// alone after the final norm (`h: [hidden]` the normalised row, the f32 table in rows): the
/// greedy token and the logits, for Vulkan, to test them with planted tables: the decode
/// step's head, in the kernels' `head` (the module links their objects, returned with the
/// text).
pub fn head_module(cfg: &ModelConfig, kernels: SpirvKernels) -> (String, Vec<LinkedObject>) {
    let mut b = FuncBuilder::new("head");
    let table = b.arg(TensorType::f32(&[cfg.vocab_size, cfg.hidden_size]));
    let h = b.arg(TensorType::f32(&[cfg.hidden_size]));
    let mut f = Forward {
        b,
        cfg,
        opts: GraphOptions {
            spirv_kernels: Some(kernels),
            ..GraphOptions::vulkan()
        },
        span: None,
    };
    let mut module = Module::new("head");
    push_spirv_counters(&mut module);
    let (next, logits) = f.spirv_head(kernels.head.name, &table, &h);
    module.push(f.b.finish(&[&next, &logits]));
    let objects = kernels.objects().to_vec();
    (module.text(), objects)
}

/// A module `@screen(q8, scale, slack, table, h) -> tensor<i32>` holding the screened head's
/// token alone (`Forward::screen`, after the final norm: `h` is the normalised row), for
/// llvm-cpu, to test it against `kvsnap_reference::head::TiedHead` with planted tables: the
/// arguments are [`screen_specs`]'s, the f32 table in rows, and `h: [hidden]`. Its scores and
/// candidate rows run in kvsnap's kernels where `own_kernels` gives their object (which the
/// module then links).
pub fn screen_module(cfg: &ModelConfig, own_kernels: Option<LinkedObject>) -> String {
    let mut b = FuncBuilder::new("screen");
    let specs = screen_specs(cfg);
    let q8 = b.arg(arg_type(&specs[0]));
    let scale = b.arg(arg_type(&specs[1]));
    let slack = b.arg(arg_type(&specs[2]));
    let table = b.arg(TensorType::f32(&[cfg.vocab_size, cfg.hidden_size]));
    let h = b.arg(TensorType::f32(&[cfg.hidden_size]));
    let mut f = Forward {
        b,
        cfg,
        opts: GraphOptions {
            own_kernels,
            ..GraphOptions::llvm_cpu()
        },
        span: None,
    };
    let screen = Screen { q8, scale, slack };
    let next = f.screen(&screen, &table, &h);
    let mut module = Module::new("screen");
    if let Some(object) = &own_kernels {
        module.push_executable(kernels::executable(object));
    }
    module.push(f.b.finish(&[&next]));
    module.text()
}

/// The tensor type of a tensor argument.
///
/// # Panics
/// For a [`DType::HostI32`] argument, which is no tensor.
fn arg_type(spec: &TensorSpec) -> TensorType {
    match spec.dtype {
        DType::F32 => TensorType::f32(&spec.dims),
        DType::I32 => TensorType::i32(&spec.dims),
        DType::I8 => TensorType::new(&spec.dims, ElemType::I8),
        DType::HostI32 => panic!("arg_type: `{}` is passed by value", spec.name),
    }
}

fn spec(name: &str, role: Role, dims: &[usize], dtype: DType) -> TensorSpec {
    TensorSpec {
        name: name.to_string(),
        role,
        dims: dims.to_vec(),
        dtype,
        parts: Vec::new(),
    }
}

/// The function text and manifest entry of one entry point: with a `span`
/// ([`GraphOptions::spans`]) attention runs over the first `span` rows of the global layers'
/// buffers and as many of the ring's as [`RingGeometry::rows_seen`] allows, else as the
/// options say.
fn entry_point(
    cfg: &ModelConfig,
    input: Input,
    c: usize,
    ring: RingGeometry,
    opts: GraphOptions,
    span: Option<usize>,
    head_mode: HeadMode,
) -> (String, EntryPoint) {
    let first = match input {
        Input::Ids => spec("ids", Role::Ids, &[c], DType::I32),
        Input::Embeddings => spec("emb", Role::Embeddings, &[c, cfg.hidden_size], DType::F32),
    };
    let mut args = common_args(cfg, first, ring, opts);
    args.push(spec("next_out", Role::NextOut, &[], DType::I32));
    let mut results = vec![
        spec("next", Role::Next, &[], DType::I32),
        spec("logits", Role::Logits, &[cfg.vocab_size], DType::F32),
    ];
    results.extend(kv_specs(cfg, ring));

    let mut name = match span {
        Some(span) => span_entry_name(input, c, span),
        None => entry_name(input, c),
    };
    if head_mode == HeadMode::Full {
        name.push_str("_logits");
    }
    let mut b = FuncBuilder::new(&name);
    let a = EntryArgs::bind(&mut b, cfg, opts, &args);
    let mut f = Forward { b, cfg, opts, span };
    let (ch, positions) = f.chunk(
        c,
        (a.pos0, a.valid),
        (a.pos0_host, a.valid_host),
        &a.positions,
        ring,
    );
    let rows = match input {
        Input::Ids => f.gather(&a.embed, &a.input),
        Input::Embeddings => a.input,
    };
    let (x, kv_out) = f.layers(&a.layers, &ch, &rows, &a.kv, &a.norm);
    let (next, logits) = match (head_mode, &a.screen) {
        (HeadMode::Screen, Some(screen)) => f.screened(screen, &ch, &x, &a.norm, &a.embed),
        (HeadMode::Full, _) => f.head(&ch, &x, &a.norm, &a.embed),
        _ => f.head_if(&a.head, &ch, &x, &a.norm, &a.embed, a.screen.as_ref()),
    };
    let mut outs = vec![&next, &logits];
    outs.extend(kv_out.iter());
    outs.push(&positions);
    let text = f.b.finish(&outs);
    (
        text,
        EntryPoint {
            name,
            chunk: c,
            steps: 1,
            input: args[0].role,
            span: span.unwrap_or(cfg.context_capacity),
            head: head_mode,
            args,
            results,
        },
    )
}

/// The function text and manifest entry of the multi-step decode entry point of `steps`
/// steps ([`decode_entry_name`]): `steps` one-row chunks with the full head, step `i` at
/// `pos0 + i` fed the token of step `i - 1` (step 0 the `ids` argument), all in one call.
///
/// Its `valid` argument is the number of steps wanted, `1..=steps`: the steps past it run as
/// padding rows (`valid` 0: the ring's positions table marks their rows empty, their global
/// rows lie past the valid end, masked until overwritten) and repeat the last wanted token,
/// so `next` is always the last wanted step's token. `tokens` holds every step's token.
/// A call must fit `pos0 + steps <= span`, padding included.
fn decode_entry_point(
    cfg: &ModelConfig,
    steps: usize,
    ring: RingGeometry,
    opts: GraphOptions,
    span: Option<usize>,
) -> (String, EntryPoint) {
    let mut args = common_args(cfg, spec("ids", Role::Ids, &[1], DType::I32), ring, opts);
    args.push(spec("next_out", Role::NextOut, &[], DType::I32));
    args.push(spec("tokens_out", Role::TokensOut, &[steps], DType::I32));
    let mut results = vec![
        spec("next", Role::Next, &[], DType::I32),
        spec("tokens", Role::Tokens, &[steps], DType::I32),
    ];
    results.extend(kv_specs(cfg, ring));

    let name = decode_entry_name(steps, span);
    let mut b = FuncBuilder::new(&name);
    let a = EntryArgs::bind(&mut b, cfg, opts, &args);
    let mut f = Forward { b, cfg, opts, span };
    let mut ids = a.input.clone();
    let mut kv = a.kv.clone();
    let mut positions = a.positions.clone();
    let mut next: Option<Value> = None;
    let mut tokens = Vec::with_capacity(steps);
    for i in 0..steps {
        // Step i's position and whether it is wanted (`valid` 1) or padding (0).
        let offset = f.b.const_i32(i as i32, &[]);
        let pos0 = f.b.add(&a.pos0, &offset);
        let wanted = f.b.compare(Cmp::Gt, &a.valid, &offset);
        let [one, zero] = [1, 0].map(|v| f.b.const_i32(v, &[]));
        let valid = f.b.select(&wanted, &one, &zero);
        let host_offset = f.b.scalar_i32(i as i32);
        let pos0_host = f.b.scalar_add(&a.pos0_host, &host_offset);
        let (ch, written) = f.chunk(
            1,
            (pos0, valid),
            (pos0_host, a.valid_host.clone()),
            &positions,
            ring,
        );
        positions = written;
        let rows = f.gather(&a.embed, &ids);
        let (x, kv_out) = f.layers(&a.layers, &ch, &rows, &kv, &a.norm);
        kv = kv_out;
        let (token, _) = f.head(&ch, &x, &a.norm, &a.embed);
        let token = match &next {
            Some(previous) => f.b.select(&wanted, &token, previous),
            None => token,
        };
        ids = f.b.reshape(&token, &[1]);
        tokens.push(ids.clone());
        next = Some(token);
    }
    let next = next.expect("steps >= 1");
    let token_refs: Vec<&Value> = tokens.iter().collect();
    let tokens = f.b.concatenate(&token_refs, 0);
    let mut outs = vec![&next, &tokens];
    outs.extend(kv.iter());
    outs.push(&positions);
    let text = f.b.finish(&outs);
    (
        text,
        EntryPoint {
            name,
            chunk: 1,
            steps,
            input: Role::Ids,
            span: span.unwrap_or(cfg.context_capacity),
            head: HeadMode::Full,
            args,
            results,
        },
    )
}

/// The arguments of every entry point before its results' storage: `first` (the chunk's
/// input), the chunk's scalars, the weights, the screened head's tensors (if any) and the KV
/// buffers.
fn common_args(
    cfg: &ModelConfig,
    first: TensorSpec,
    ring: RingGeometry,
    opts: GraphOptions,
) -> Vec<TensorSpec> {
    let mut args = vec![
        first,
        spec("pos0", Role::Pos0, &[], DType::I32),
        spec("valid", Role::Valid, &[], DType::I32),
        spec("head", Role::Head, &[], DType::HostI32),
        spec("pos0_host", Role::Pos0Host, &[], DType::HostI32),
        spec("valid_host", Role::ValidHost, &[], DType::HostI32),
    ];
    args.extend(weight_specs(cfg, opts.table_layout(), opts.layout));
    if opts.screen {
        args.extend(screen_specs(cfg));
    }
    args.extend(kv_specs(cfg, ring));
    args
}

/// An entry point's arguments as values of its function.
struct EntryArgs {
    input: Value,
    pos0: Value,
    valid: Value,
    head: Scalar,
    pos0_host: Scalar,
    valid_host: Scalar,
    embed: Value,
    layers: Vec<LayerWeights>,
    norm: Value,
    screen: Option<Screen>,
    /// K then V of each layer.
    kv: Vec<Value>,
    /// The sliding layers' positions table.
    positions: Value,
}

impl EntryArgs {
    /// Declares `args` ([`common_args`], then the storage of results `0..`: the arguments of
    /// [`Role::NextOut`] and [`Role::TokensOut`]) as `b`'s arguments.
    fn bind(
        b: &mut FuncBuilder,
        cfg: &ModelConfig,
        opts: GraphOptions,
        args: &[TensorSpec],
    ) -> Self {
        let input = b.arg(arg_type(&args[0]));
        let pos0 = b.arg(arg_type(&args[1]));
        let valid = b.arg(arg_type(&args[2]));
        let [head, pos0_host, valid_host] = [(); 3].map(|()| b.scalar_arg());
        let storage = args
            .iter()
            .filter(|a| matches!(a.role, Role::NextOut | Role::TokensOut))
            .count();
        let (tensors, outputs) = args[6..].split_at(args.len() - 6 - storage);
        let values: Vec<Value> = tensors.iter().map(|a| b.arg(arg_type(a))).collect();
        for (result, out) in outputs.iter().enumerate() {
            b.output_arg(arg_type(out), result);
        }
        let mut it = values.into_iter();
        let embed = it.next().expect("embed_tokens");
        let layers: Vec<LayerWeights> = (0..cfg.num_layers())
            .map(|_| LayerWeights::from_args(&mut it))
            .collect();
        let norm = it.next().expect("model.norm");
        let screen = opts.screen.then(|| Screen {
            q8: it.next().expect("screen.q8"),
            scale: it.next().expect("screen.scale"),
            slack: it.next().expect("screen.slack"),
        });
        let mut kv: Vec<Value> = it.collect();
        let positions = kv.pop().expect("sliding.positions");
        assert_eq!(kv.len(), 2 * cfg.num_layers(), "one K and V per layer");
        EntryArgs {
            input,
            pos0,
            valid,
            head,
            pos0_host,
            valid_host,
            embed,
            layers,
            norm,
            screen,
            kv,
            positions,
        }
    }
}
