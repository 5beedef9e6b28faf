//! `IreeModel`: the [`KvModel`] contract on IREE (llvm-cpu or Vulkan), running the graphs of
//! [`crate::graphs`] with the KV state in device buffers.
//!
//! One module holds every entry point; the weights are imported once from the memory-mapped
//! `model.safetensors` (zero-copy on the CPU device where the tensor's address allows it, else
//! uploaded once; stacked projections and, on llvm-cpu, every matrix from copies assembled in
//! the module's [`WeightLayout`](graphs::WeightLayout)) and passed to every call. A sequence
//! of `n` tokens runs as the chunk calls of least modelled cost (`plan_chunks`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvsnap_contract::{check, Error, KvModel, Logits, ModelConfig, Next, Result};
use kvsnap_reference::kernels::gather_rows;
use kvsnap_reference::{LargeBuffer, Tensor, Weights};

use crate::compile::{CompileProgress, Compiler, Target};
use crate::graphs::{
    self, DType, Input, Manifest, Role, DEFAULT_CHUNKS, HEAD_FULL, HEAD_NONE, HEAD_SCREEN,
};
pub use crate::kv::IreeKv;
use crate::kv::KvPool;
use crate::resident::{self, Lease};
use crate::runtime::{
    as_bytes, Arg, BufferView, Device, DeviceKind, ElementType, ImportMode, ImportStats, Pending,
};

/// How to load an [`IreeModel`].
#[derive(Clone, Debug)]
pub struct IreeOptions {
    /// `Target::LlvmCpu` (device `local-task`) or `Target::VulkanSpirv`.
    pub target: Target,
    /// Vulkan device ordinal (ignored on the CPU).
    pub device: usize,
    /// A directory written by `kvsnap export` to load the compiled module from, instead of
    /// compiling (no IREE compiler needed); it must match this model's config.
    pub module_dir: Option<std::path::PathBuf>,
    /// Chunk sizes to compile; 1 (the decode step) is always added.
    pub chunks: Vec<usize>,
    /// Context capacity in tokens (rows of the global layers' KV buffers); `None` keeps the
    /// config's default.
    pub capacity: Option<usize>,
    /// Print compile progress to stderr.
    pub verbose: bool,
    /// Which entry points `prefill`/`extend`/`step` call: `None` picks by target, the
    /// embeddings-input graphs on Vulkan (rows gathered on the host from the memory-mapped
    /// weights, as the Mali path needs) and the ids-input graphs on the CPU.
    pub input: Option<Input>,
    /// Link kvsnap's own kernels into the module where this build and host have them
    /// ([`crate::kernels`]: on llvm-cpu the chunks' panel products, the head's screen and the
    /// attention on AVX-512; on Vulkan the decode step's products, attention, norms and GeGLU
    /// in SPIR-V); `false` keeps IREE's code for everything.
    pub own_kernels: bool,
}

impl IreeOptions {
    /// CPU, default chunks and capacity, quiet.
    pub fn cpu() -> Self {
        IreeOptions {
            target: Target::LlvmCpu,
            device: 0,
            module_dir: None,
            chunks: DEFAULT_CHUNKS.to_vec(),
            capacity: None,
            verbose: false,
            input: None,
            own_kernels: true,
        }
    }

    /// Vulkan device 0, default chunks and capacity, quiet.
    pub fn vulkan() -> Self {
        IreeOptions {
            target: Target::VulkanSpirv,
            ..Self::cpu()
        }
    }

    /// The input `prefill`/`extend`/`step` go through: [`IreeOptions::input`] or the target's
    /// default. The module has its entry points in every chunk size, the other input's in
    /// the decode step's and the largest size only ([`graphs::GraphOptions::input`]).
    pub fn chosen_input(&self) -> Input {
        self.input.unwrap_or(match self.target {
            Target::VulkanSpirv => Input::Embeddings,
            Target::LlvmCpu => Input::Ids,
        })
    }
}

/// What loading cost: the module size, the compile (or cache hit) and the weight imports.
#[derive(Clone, Debug)]
pub struct LoadReport {
    /// Bytes of MLIR text of the module.
    pub mlir_bytes: usize,
    /// Wall time of the compile step (a cache hit costs a hash and a read).
    pub compile: Duration,
    /// Whether the vmfb came from the compile cache.
    pub cache_hit: bool,
    /// How this model's weights reached the device.
    pub imports: ImportStats,
    /// The objects the module links (kvsnap's own kernels, [`IreeOptions::own_kernels`]), by
    /// file name.
    pub objects: Vec<String>,
}

/// Gemma 3 on IREE. Immutable after loading; KV states are [`IreeKv`] values.
pub struct IreeModel {
    cfg: ModelConfig,
    target: Target,
    manifest: Manifest,
    device: Device,
    /// The resident module, shared with every model that loaded the same one (a VM context runs
    /// one call at a time: see [`crate::runtime::Session`]).
    session: Lease,
    weights: Vec<BufferView>, // manifest weight order
    /// The storage every call writes its token to ([`graphs::Role::NextOut`]): host memory
    /// the device writes where the driver offers it ([`BufferView::host_result`]). Calls run
    /// one at a time under the session's lock, and each reads its token before releasing it.
    next_out: BufferView,
    /// `[vocab, hidden]`, memory-mapped (no second copy in RAM): the host gathers rows from it
    /// when `input` is `Input::Embeddings`.
    embed_tokens: Tensor,
    /// The entry points token ids go through.
    input: Input,
    report: LoadReport,
    /// KV results that came back in a new buffer instead of the argument's (see
    /// [`IreeModel::kv_copies`]).
    kv_copies: AtomicU64,
    /// Test hook: 0 = off, k + 1 = fail the next call after its chunk `k` (see
    /// [`IreeModel::set_fault_after_chunk`]).
    fault_after_chunk: AtomicU64,
    /// Whether the module's screened head can give the greedy token alone (it has one, and
    /// every weight of the table is finite).
    screen: bool,
    /// Calls whose screen could not settle the token and ran the full head again.
    screen_fallbacks: AtomicU64,
    /// Calls of each entry point, in manifest order (see [`IreeModel::entry_calls`]).
    entry_calls: Vec<AtomicU64>,
    /// Buffer sets of released states, for the next ones (see [`crate::kv`]).
    kv_pool: Arc<KvPool>,
}

/// A weight tensor as host bytes for [`BufferView::import_host`]; owns the mapping (or the
/// widened copy) for as long as IREE uses it.
struct TensorBytes(Tensor);

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        as_bytes(&self.0)
    }
}

/// Imports one weight argument of the manifest onto `device` (`hf`: the shapes of the
/// model's tensors by HF name): zero-copy from the memory-mapped file where the device allows
/// it and the argument is one tensor as the file holds it; otherwise (a matrix in panels,
/// projections stacked into one argument) from a copy assembled part by part, each part's
/// file pages released once copied (the host later reads only rows of the embedding table).
fn import_weight(
    device: &Device,
    file: &Weights,
    hf: &HashMap<String, Vec<usize>>,
    spec: &graphs::TensorSpec,
) -> Result<(BufferView, ImportMode)> {
    let parts = if spec.parts.is_empty() {
        std::slice::from_ref(&spec.name)
    } else {
        &spec.parts[..]
    };
    let mismatch = |what: String| Error::Backend {
        backend: device.backend(),
        op: format!("import weight {}", spec.name),
        status: what,
    };
    let dims = parts
        .iter()
        .map(|name| {
            hf.get(name).map(Vec::as_slice).ok_or_else(|| {
                mismatch(format!(
                    "the module asks for `{name}`, which the model's config does not describe"
                ))
            })
        })
        .collect::<Result<Vec<&[usize]>>>()?;
    if let [one] = dims[..] {
        if one == spec.dims {
            let t = file.tensor(&parts[0], one)?;
            let imported =
                BufferView::import_host(device, TensorBytes(t), &spec.dims, ElementType::F32)?;
            if let ImportMode::Copied { .. } = imported.1 {
                // The device has its copy (Vulkan): the pages the upload read need not stay in
                // this process's RSS (the host later reads only embedding rows).
                let _ = file.tensor(&parts[0], one)?.release_resident_pages();
            }
            return Ok(imported);
        }
    }
    // Matrices: `[rows, cols]` (stacked along rows) or `[panels, cols, lanes]`.
    let (cols, lanes) = match spec.dims[..] {
        [_, cols] => (cols, 1),
        [_, cols, lanes] => (cols, lanes),
        _ => return Err(mismatch(format!("{:?} is not a matrix", spec.dims))),
    };
    let rows: Vec<usize> = dims.iter().map(|d| d[0]).collect();
    let offsets = graphs::stack_offsets(&rows, lanes);
    let elems = spec.dims.iter().product::<usize>();
    if dims.iter().any(|d| d.len() != 2 || d[1] != cols) || offsets[rows.len()] * cols != elems {
        return Err(mismatch(format!(
            "{:?} cannot hold the tensors {parts:?} of shapes {dims:?}",
            spec.dims
        )));
    }
    // On huge pages where the OS offers them: a decode step streams every matrix once.
    let mut out = LargeBuffer::<f32>::zeroed(elems).map_err(|e| Error::Backend {
        backend: device.backend(),
        op: format!("assemble weight {}", spec.name),
        status: format!("cannot map {} bytes: {e}", elems * 4),
    })?;
    for ((name, &part_rows), &offset) in parts.iter().zip(&rows).zip(&offsets) {
        let t = file.tensor(name, &[part_rows, cols])?;
        let padded = part_rows.div_ceil(lanes) * lanes;
        let dst = &mut out[offset * cols..(offset + padded) * cols];
        // Copied a slice of rows at a time, each slice's file pages released once copied, so
        // that the load's RSS holds the assembled matrix plus one slice, not two copies.
        let rows_per_slice = PACK_SLICE_PANELS * lanes;
        for (i, dst) in dst.chunks_mut(rows_per_slice * cols).enumerate() {
            let first = i * rows_per_slice;
            let end = (first + rows_per_slice).min(part_rows);
            let src = first * cols..end * cols;
            if lanes == 1 {
                dst.copy_from_slice(&t[src.clone()]);
            } else {
                graphs::pack_panels(&t[src.clone()], cols, lanes, dst);
            }
            let _ = t.release_resident_range(src);
        }
    }
    BufferView::import_host(device, out, &spec.dims, ElementType::F32)
}

/// Builds the screened head's tensors ([`graphs::screen_specs`]) from the f32 table, as
/// `kvsnap_reference::head::TiedHead` computes them, and uploads them; returns them in call
/// order and whether every weight of the table is finite (else the screen must not be used).
/// The table's pages, all read here, are released from this process's RSS afterwards. The
/// int8 panels' import counts in `imports`; the scales and bounds (8 bytes a row) are uploads.
fn import_screen(
    device: &Device,
    table: &Tensor,
    cfg: &ModelConfig,
    specs: &[graphs::TensorSpec],
    imports: &mut ImportStats,
) -> Result<(Vec<BufferView>, bool)> {
    let hidden = cfg.hidden_size;
    let mapping = |op: &str, e: std::io::Error| Error::Backend {
        backend: device.backend(),
        op: op.into(),
        status: e.to_string(),
    };
    let head = kvsnap_reference::head::TiedHead::new(table, hidden)
        .map_err(|e| mapping("round the head to int8", e))?;
    let _ = table.release_resident_pages();
    let bytes = specs[0].dims.iter().product::<usize>();
    let mut panels = LargeBuffer::<i8>::zeroed(bytes)
        .map_err(|e| mapping("pack the screened head's int8 table", e))?;
    graphs::pack_panels(head.q(), hidden, graphs::TABLE_LANES, &mut panels);
    let (q8, mode) = BufferView::import_host(device, panels, &specs[0].dims, ElementType::I8)?;
    imports.add(&mode, q8.byte_length() as u64);
    let scale = BufferView::from_f32(device, &specs[1].dims, head.scale())?;
    let slack = BufferView::from_f32(device, &specs[2].dims, head.slack())?;
    Ok((vec![q8, scale, slack], head.is_finite()))
}

/// Panels (rows, in `Rows`) copied per slice when assembling a weight (2048 panels: 84 MB of a
/// 640-wide matrix).
const PACK_SLICE_PANELS: usize = 2048;

/// HF name of the embedding table (also the tied head).
const EMBED_TOKENS: &str = "model.embed_tokens.weight";

/// What one chunk call computes on: its input rows, and `pos0` and `valid` both as tensors
/// (for the graph) and by value (for the module's host program).
struct ChunkRows<'a> {
    input: &'a BufferView,
    pos0: (&'a BufferView, i32),
    valid: (&'a BufferView, i32),
}

/// What [`IreeModel::decode_queued`] has queued: each call's inputs and results, kept alive
/// until the last call is done; each call's tokens; the last call.
#[derive(Default)]
struct Queue {
    kept: Vec<([BufferView; 3], Vec<BufferView>)>,
    /// Each call's token storage and the tokens wanted of it.
    tokens: Vec<(BufferView, usize)>,
    last: Option<Pending>,
}

/// The rows of one chunk call.
#[derive(Clone, Copy)]
enum ChunkInput<'a> {
    Ids(&'a [u32]),
    Embeddings(&'a [f32]),
}

impl IreeModel {
    /// Loads `config.json` and `model.safetensors` from an HF checkpoint directory, builds and
    /// compiles (cached) the graphs, opens the device and imports the weights. With
    /// [`IreeOptions::module_dir`] the capacity (unless `opts` gives one), chunk sizes, input
    /// and kernels are those the module was exported with ([`crate::module::load_options`]).
    pub fn load(dir: &Path, opts: &IreeOptions) -> Result<Self> {
        let opts = crate::module::load_options(opts, opts.capacity)?;
        Self::load_resolved(dir, ModelConfig::from_dir(dir, opts.capacity)?, &opts)
    }

    /// Like [`IreeModel::load`] with an already parsed config (whose capacity a module of
    /// [`IreeOptions::module_dir`] must have been exported with).
    pub fn load_config(dir: &Path, cfg: ModelConfig, opts: &IreeOptions) -> Result<Self> {
        let opts = crate::module::load_options(opts, Some(cfg.context_capacity))?;
        Self::load_resolved(dir, cfg, &opts)
    }

    /// [`IreeModel::load_config`] with `opts` already as [`crate::module::load_options`]
    /// gives them.
    fn load_resolved(dir: &Path, cfg: ModelConfig, opts: &IreeOptions) -> Result<Self> {
        // The GPU the module is (to be) compiled for: its description's, or the compiler's.
        let vulkan_target = match (&opts.module_dir, opts.target) {
            (_, Target::LlvmCpu) => None,
            (Some(module_dir), _) => crate::module::info(module_dir, opts.target)?.vulkan_target,
            (None, _) => crate::compile::vulkan_target_from_env()?,
        };
        let g = model_graphs(&cfg, opts, vulkan_target.as_deref());

        // The device first: a machine without one fails fast, before a long compile. Devices and
        // modules stay resident for the process (see `crate::resident`).
        let device = match opts.target {
            Target::LlvmCpu => resident::device(DeviceKind::Cpu, 0)?,
            Target::VulkanSpirv => resident::device(DeviceKind::Vulkan, opts.device)?,
        };
        let start = Instant::now();
        let (vmfb, cache_hit) = match &opts.module_dir {
            Some(module_dir) => (crate::module::read(module_dir, opts.target, &g.mlir)?, true),
            None => {
                let compiled = compile_graphs(&g, opts.target, opts.verbose)?;
                (compiled.vmfb, compiled.cache_hit)
            }
        };
        let compile = start.elapsed();
        let session = resident::session(&device, &vmfb)?;

        let file = Weights::open(&dir.join("model.safetensors"))?;
        let first = &g.manifest.entry_points[0];
        let hf: HashMap<String, Vec<usize>> = graphs::hf_weight_specs(&cfg)
            .into_iter()
            .map(|t| (t.name, t.dims))
            .collect();
        let mut imports = ImportStats::default();
        let weights = first
            .weights()
            .map(|spec| {
                let (view, mode) = import_weight(&device, &file, &hf, spec)?;
                imports.add(&mode, view.byte_length() as u64);
                Ok(view)
            })
            .collect::<Result<Vec<_>>>()?;
        let embed_tokens = file.tensor(EMBED_TOKENS, &[cfg.vocab_size, cfg.hidden_size])?;
        let screen_specs: Vec<_> = first.screen().cloned().collect();
        let mut screen = false;
        let mut weights = weights;
        if !screen_specs.is_empty() {
            let (views, finite) =
                import_screen(&device, &embed_tokens, &cfg, &screen_specs, &mut imports)?;
            weights.extend(views);
            screen = finite;
        }
        let input = opts.chosen_input();
        let report = LoadReport {
            mlir_bytes: g.mlir.len(),
            compile,
            cache_hit,
            imports,
            objects: g.objects.iter().map(|o| o.name.to_string()).collect(),
        };
        let kv_specs = first
            .kv()
            .map(|spec| {
                let elem = match spec.dtype {
                    DType::F32 => ElementType::F32,
                    DType::I32 | DType::HostI32 => ElementType::I32,
                    DType::I8 => ElementType::I8,
                };
                (spec.dims.clone(), elem)
            })
            .collect();
        let kv_pool = KvPool::new(
            kv_specs,
            &g.manifest.kv_layouts,
            g.manifest.capacity,
            g.manifest.ring,
        );
        let next_out = BufferView::host_result(&device, &[], ElementType::I32)?;
        Ok(IreeModel {
            cfg,
            target: opts.target,
            device,
            session,
            weights,
            next_out,
            embed_tokens,
            input,
            report,
            kv_copies: AtomicU64::new(0),
            fault_after_chunk: AtomicU64::new(0),
            screen,
            screen_fallbacks: AtomicU64::new(0),
            entry_calls: g
                .manifest
                .entry_points
                .iter()
                .map(|_| AtomicU64::new(0))
                .collect(),
            manifest: g.manifest,
            kv_pool,
        })
    }

    /// The entry points token ids go through (see [`IreeOptions::input`]).
    pub fn input(&self) -> Input {
        self.input
    }

    /// Raw (unscaled) embedding rows of `ids`, gathered on the host from the memory-mapped
    /// weights: what `prefill_embeddings` takes.
    ///
    /// # Shapes
    /// returns `[ids.len(), hidden]`.
    pub fn embedding_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        check::tokens(&self.cfg, "embedding_rows", 0, ids)?;
        Ok(gather_rows(&self.embed_tokens, self.cfg.hidden_size, ids))
    }

    /// Runs `ids` through the configured entry points: as ids, or as host-gathered rows.
    fn forward_ids(
        &self,
        op: &'static str,
        kv: &mut IreeKv,
        ids: &[u32],
        logits: Logits,
    ) -> Result<Next> {
        match self.input {
            Input::Ids => self.forward(op, kv, ChunkInput::Ids(ids), logits),
            Input::Embeddings => {
                let rows = gather_rows(&self.embed_tokens, self.cfg.hidden_size, ids);
                self.forward(op, kv, ChunkInput::Embeddings(&rows), logits)
            }
        }
    }

    /// `steps` greedy decode steps from `id`, queued on the device one after another: the
    /// same tokens and the same state as `steps` calls of [`KvModel::step`], each fed the
    /// previous one's token, but the host does not wait between them. Each step takes its id
    /// from the previous step's token storage on the device and waits for the previous call
    /// there, so the host queues step k+1 while the device runs step k; the tokens are read
    /// once the last step is done. Returns the `steps` tokens, in order.
    ///
    /// Each call runs a multi-step decode entry point where the module has one whose steps fit
    /// (Vulkan's, [`graphs::GraphOptions::decode_steps`]: up to 16 steps in one queue
    /// submission, the last call's surplus steps padding), else one ids-input decode step
    /// with the full head: on Vulkan `chunk_ids_c1` (over the whole capacity), on llvm-cpu
    /// the span entry points, but not the screened head (an unsettled screen reruns its
    /// chunk, which a queued step cannot).
    ///
    /// Errors: as [`KvModel::step`] for `id`, [`Error::EmptyInput`] for no steps and
    /// [`Error::ContextOverflow`] where the steps would not fit, all before anything runs; a
    /// device failure poisons `kv` ([`Error::Poisoned`] afterwards).
    pub fn decode_queued(&self, kv: &mut IreeKv, id: u32, steps: usize) -> Result<Vec<u32>> {
        const OP: &str = "decode";
        check::decode(&self.cfg, kv.len, id, steps)?;
        if let Some(cause) = &kv.poisoned {
            return Err(Error::Poisoned {
                op: OP,
                cause: cause.clone(),
            });
        }
        let result = self.queue_steps(kv, id, steps);
        if let Err(e) = &result {
            kv.poisoned = Some(e.to_string());
        }
        result
    }

    /// [`IreeModel::decode_queued`] after its checks.
    fn queue_steps(&self, kv: &mut IreeKv, id: u32, steps: usize) -> Result<Vec<u32>> {
        let session = self
            .session
            .session()
            .lock()
            .map_err(|_| self.backend_error("lock session", "a previous call panicked"))?;
        let first = BufferView::input_i32(&self.device, &[1], &[id as i32])?;
        let mut queue = Queue::default();
        let queued = self.queue_each(&session, kv, first, steps, &mut queue);
        // Wait for what was queued even after a failure, so that nothing the device may still
        // use is released under it.
        let waited = queue.last.take().map_or(Ok(()), |last| last.wait());
        queued?;
        waited?;
        let mut tokens = Vec::with_capacity(steps);
        for (storage, n) in &queue.tokens {
            tokens.extend(storage.to_i32_vec()?[..*n].iter().map(|&t| t as u32));
        }
        Ok(tokens)
    }

    /// Queues [`IreeModel::queue_steps`]'s `steps` calls into `queue`, the first fed `input`.
    fn queue_each(
        &self,
        session: &crate::runtime::Session,
        kv: &mut IreeKv,
        mut input: BufferView,
        steps: usize,
        queue: &mut Queue,
    ) -> Result<()> {
        let mut left = steps;
        while left > 0 {
            // A multi-step call where one fits, padding included; else one step.
            let entry = match self.manifest.decode_entry_index(kv.len) {
                Some(entry) => entry,
                None => self.entry_for(Role::Ids, 1, kv.len + 1, HEAD_FULL)?,
            };
            let width = self.manifest.entry_points[entry].steps;
            let n = left.min(width);
            let name = self.manifest.entry_points[entry].name.as_str();
            self.entry_calls[entry].fetch_add(1, Ordering::Relaxed);
            let pos0 = kv.len as i32;
            let pos0_view = BufferView::input_i32(&self.device, &[], &[pos0])?;
            let valid_view = BufferView::input_i32(&self.device, &[], &[n as i32])?;
            let next = BufferView::host_result(&self.device, &[], ElementType::I32)?;
            let tokens = (width > 1)
                .then(|| BufferView::host_result(&self.device, &[width], ElementType::I32))
                .transpose()?;
            kv.will_write_steps(width);
            let rows = ChunkRows {
                input: &input,
                pos0: (&pos0_view, pos0),
                valid: (&valid_view, n as i32),
            };
            let mut args = self.arguments(&rows, HEAD_FULL, kv, &next);
            args.extend(tokens.as_ref().map(Arg::View));
            let (mut outs, pending) = session.call_queued(name, &args, queue.last.as_ref())?;
            drop(args);
            kv.bufs = outs.split_off(2);
            kv.len += n;
            left -= n;
            // The next call's `[1]` ids are this call's `next` storage.
            let following = next.reshaped(&[1])?;
            let inputs = [
                std::mem::replace(&mut input, following),
                pos0_view,
                valid_view,
            ];
            queue.kept.push((inputs, outs));
            queue.tokens.push((tokens.unwrap_or(next), n));
            queue.last = Some(pending);
        }
        Ok(())
    }

    /// Test-only fault injection: the next operation (on any thread) fails with
    /// [`Error::Backend`] right after its chunk call `chunk` (or its last one, if it has fewer)
    /// has updated the KV buffers on the device, i.e. midway through an update of the state, which
    /// is then poisoned. One-shot; `None` disarms. kvsnap-reliability's atomicity rows use it.
    #[doc(hidden)]
    pub fn set_fault_after_chunk(&self, chunk: Option<usize>) {
        self.fault_after_chunk
            .store(chunk.map_or(0, |c| c as u64 + 1), Ordering::SeqCst);
    }

    /// What loading cost.
    pub fn load_report(&self) -> &LoadReport {
        &self.report
    }

    /// The manifest of the compiled module.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Whether calls write their token to host memory that the host reads through a mapping
    /// (no queue operation after a call): where the driver offers such memory
    /// ([`BufferView::host_result`]), which lavapipe, NVIDIA's driver and the CPU device do.
    pub fn token_read_mapped(&self) -> bool {
        self.next_out.host_readable()
    }

    /// How many KV results so far were new buffers rather than their argument updated in place.
    /// The graphs write every KV buffer before reading it so that IREE updates it in place; a
    /// non-zero count means a whole-buffer copy per call crept back in.
    pub fn kv_copies(&self) -> u64 {
        self.kv_copies.load(Ordering::Relaxed)
    }

    /// Buffer sets of released states this model keeps for its next states (at most
    /// [`crate::kv::MAX_FREE_SETS`]; none once its last state is released).
    pub fn kv_free_sets(&self) -> usize {
        self.kv_pool.free_sets()
    }

    /// Bytes this model's snapshots and restores have copied so far (zero fills not counted):
    /// a restore into the set of an earlier copy of the same snapshot moves only the rows that
    /// copy's state wrote (`kvsnap_iree::kv`).
    pub fn kv_copied_bytes(&self) -> u64 {
        self.kv_pool.copied_bytes()
    }

    /// How many calls so far asked for the greedy token alone, found that the screened head
    /// could not settle it (more candidate blocks than it recomputes) and ran the chunk again
    /// with the full head.
    pub fn screen_fallbacks(&self) -> u64 {
        self.screen_fallbacks.load(Ordering::Relaxed)
    }

    /// How many times each entry point has run so far (a screened head's rerun counts again),
    /// by name, in manifest order: which chunk sizes and spans the calls went through.
    pub fn entry_calls(&self) -> Vec<(&str, u64)> {
        self.manifest
            .entry_points
            .iter()
            .zip(&self.entry_calls)
            .map(|(e, n)| (e.name.as_str(), n.load(Ordering::Relaxed)))
            .collect()
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A fresh, zeroed KV state for a prefill of `rows` tokens.
    fn new_kv(&self, rows: usize) -> Result<IreeKv> {
        self.kv_pool.zeros(&self.device, rows)
    }

    /// The chunk calls of `input`'s entry points for `n` rows starting at position `pos`
    /// ([`plan_chunks`]).
    fn plan(&self, input: Role, pos: usize, n: usize) -> Vec<(usize, usize)> {
        let call_rows = match self.target {
            Target::LlvmCpu => CALL_ROWS_CPU,
            Target::VulkanSpirv => CALL_ROWS_GPU,
        };
        let chunks = self.manifest.chunks_for(input);
        plan_chunks(&chunks, self.cfg.context_capacity, call_rows, pos, n)
    }

    /// Runs `input` (`n` rows) at the end of `kv` and returns the last row's next token.
    fn forward(
        &self,
        op: &'static str,
        kv: &mut IreeKv,
        input: ChunkInput,
        want: Logits,
    ) -> Result<Next> {
        if let Some(cause) = &kv.poisoned {
            return Err(Error::Poisoned {
                op,
                cause: cause.clone(),
            });
        }
        match self.run_chunks(kv, input, want) {
            Ok(next) => Ok(next),
            Err(e) => {
                kv.poisoned = Some(e.to_string());
                Err(e)
            }
        }
    }

    fn run_chunks(&self, kv: &mut IreeKv, input: ChunkInput, want: Logits) -> Result<Next> {
        let h = self.cfg.hidden_size;
        let (n, role) = match input {
            ChunkInput::Ids(ids) => (ids.len(), Role::Ids),
            ChunkInput::Embeddings(rows) => (rows.len() / h, Role::Embeddings),
        };
        let session = self
            .session
            .session()
            .lock()
            .map_err(|_| self.backend_error("lock session", "a previous call panicked"))?;
        let mut last = None;
        let mut done = 0;
        let plan = self.plan(role, kv.len, n);
        let fault = match self.fault_after_chunk.swap(0, Ordering::SeqCst) {
            0 => None,
            k => Some((k as usize - 1).min(plan.len() - 1)),
        };
        let chunks = plan.len();
        for (index, (c, valid)) in plan.into_iter().enumerate() {
            let first = match input {
                ChunkInput::Ids(ids) => {
                    let mut part = vec![0i32; c];
                    for (p, &id) in part.iter_mut().zip(&ids[done..done + valid]) {
                        *p = id as i32;
                    }
                    BufferView::input_i32(&self.device, &[c], &part)?
                }
                ChunkInput::Embeddings(rows) => {
                    let mut part = vec![0f32; c * h];
                    part[..valid * h].copy_from_slice(&rows[done * h..(done + valid) * h]);
                    BufferView::input_f32(&self.device, &[c, h], &part)?
                }
            };
            // Only the last chunk's next token and logits are returned: the others skip the head.
            // Without logits the screened head finds the token alone, else the full head.
            let head = match (index + 1 == chunks, want) {
                (false, _) => HEAD_NONE,
                (true, Logits::Skip) if self.screen => HEAD_SCREEN,
                (true, _) => HEAD_FULL,
            };
            // The entry point of the shortest span that holds the call and computes that head.
            let end = kv.len + c;
            let entry = self.entry_for(role, c, end, head)?;
            let name = self.manifest.entry_points[entry].name.as_str();
            let pos0 = kv.len as i32;
            let pos0_view = BufferView::input_i32(&self.device, &[], &[pos0])?;
            // The call writes `c` rows at the state's end, padding included.
            kv.will_write(c);
            let valid_view = BufferView::input_i32(&self.device, &[], &[valid as i32])?;
            let rows = ChunkRows {
                input: &first,
                pos0: (&pos0_view, pos0),
                valid: (&valid_view, valid as i32),
            };
            let mut outs = self.call(&session, entry, &rows, head, kv)?;
            if head == HEAD_SCREEN && outs[0].to_i32_vec()?[0] < 0 {
                // Unsettled: the same chunk again (it writes the same K/V rows at the same
                // positions, and reads what the first call read) with the full head.
                self.screen_fallbacks.fetch_add(1, Ordering::Relaxed);
                let full = self.entry_for(role, c, end, HEAD_FULL)?;
                outs = self.call(&session, full, &rows, HEAD_FULL, kv)?;
            }
            if outs.len() != 2 + kv.bufs.len() {
                return Err(self.backend_error(
                    &format!("call {name}"),
                    &format!("{} results, expected {}", outs.len(), 2 + kv.bufs.len()),
                ));
            }
            let new_bufs = outs.split_off(2);
            let copied = new_bufs
                .iter()
                .zip(&kv.bufs)
                .filter(|(new, old)| !new.shares_storage_with(old))
                .count();
            self.kv_copies.fetch_add(copied as u64, Ordering::Relaxed);
            kv.bufs = new_bufs;
            kv.fold_ring(&self.device, c)?;
            kv.len += valid;
            done += valid;
            last = Some(outs);
            if fault == Some(index) {
                return Err(self.backend_error(
                    &format!("call {name}"),
                    &format!("injected fault after chunk {index} (test hook)"),
                ));
            }
        }
        let outs = last.expect("at least one chunk: inputs are non-empty");
        let token = outs[0].to_i32_vec()?[0];
        let logits = match want {
            Logits::Return => Some(outs[1].to_f32_vec()?),
            Logits::Skip => None,
        };
        Ok(Next {
            token: token as u32,
            logits,
        })
    }

    /// The index of the entry point for a chunk of `c` rows of `role` ending at row `end` with
    /// the `head` argument `head` ([`graphs::Manifest::entry_for`]).
    fn entry_for(&self, role: Role, c: usize, end: usize, head: i32) -> Result<usize> {
        self.manifest
            .entry_index_for(role, c, end, head)
            .ok_or_else(|| {
                let status =
                    format!("no {role:?} entry point for {c} rows ending at {end}, head {head}");
                self.backend_error("choose entry point", &status)
            })
    }

    /// Calls entry point `entry` (its index in the manifest, counted in
    /// [`IreeModel::entry_calls`]) with the chunk's `rows`, the `head` flag, the weights and
    /// `kv`'s buffers.
    fn call(
        &self,
        session: &crate::runtime::Session,
        entry: usize,
        rows: &ChunkRows,
        head: i32,
        kv: &IreeKv,
    ) -> Result<Vec<BufferView>> {
        let name = self.manifest.entry_points[entry].name.as_str();
        self.entry_calls[entry].fetch_add(1, Ordering::Relaxed);
        session.call_args(name, &self.arguments(rows, head, kv, &self.next_out))
    }

    /// An entry point's arguments in signature order: the chunk's rows and scalars, the
    /// `head` flag, the weights, `kv`'s buffers and the storage of the `next` result.
    fn arguments<'a>(
        &'a self,
        rows: &ChunkRows<'a>,
        head: i32,
        kv: &'a IreeKv,
        next: &'a BufferView,
    ) -> Vec<Arg<'a>> {
        let mut args = vec![
            Arg::View(rows.input),
            Arg::View(rows.pos0.0),
            Arg::View(rows.valid.0),
            Arg::I32(head),
            Arg::I32(rows.pos0.1),
            Arg::I32(rows.valid.1),
        ];
        args.extend(self.weights.iter().map(Arg::View));
        args.extend(kv.bufs.iter().map(Arg::View));
        args.push(Arg::View(next));
        args
    }

    fn backend_error(&self, op: &str, status: &str) -> Error {
        Error::Backend {
            backend: self.target.backend(),
            op: op.to_string(),
            status: status.to_string(),
        }
    }
}

/// The module `load` runs for `cfg` and `opts`: the chunk sizes of `opts` plus the decode step,
/// those smaller than the context capacity, for [`IreeOptions::chosen_input`] (the other input
/// in the decode step and the largest size). `kvsnap export` compiles exactly this. A chunk as
/// large as the capacity would write the global layers' whole KV buffers, which IREE then
/// replaces with new ones instead of updating them in place (a copy per call). A Vulkan module
/// compiled for a named GPU (`vulkan_target`) keeps IREE's code for the chunks' products and
/// attention ([`graphs::GraphOptions::spirv_chunks`]).
pub fn model_graphs(
    cfg: &ModelConfig,
    opts: &IreeOptions,
    vulkan_target: Option<&str>,
) -> graphs::Graphs {
    let mut chunks = opts.chunks.clone();
    chunks.push(1);
    chunks.retain(|&c| c == 1 || c < cfg.context_capacity);
    // Panels speed up llvm-cpu's head matvec and branches skip work there; the Vulkan path keeps
    // the HF rows (uploaded as they are, embedding rows gathered on the host) and no branches
    // (each costs a queue round trip).
    let mut graph_opts = match opts.target {
        Target::LlvmCpu => graphs::GraphOptions::llvm_cpu(),
        Target::VulkanSpirv => graphs::GraphOptions::vulkan(),
    }
    .for_config(cfg);
    graph_opts.input = opts.chosen_input();
    if !opts.own_kernels {
        graph_opts.own_kernels = None;
        graph_opts.spirv_kernels = None;
    }
    // IREE's code for a named GPU runs the chunks faster than kvsnap's kernels.
    graph_opts.spirv_chunks &= vulkan_target.is_none();
    graphs::build(cfg, &chunks, graph_opts)
}

/// What a chunk call costs beyond its rows on llvm-cpu, in rows: about the time of a pass over
/// the weights over that of a row's products, so it follows the host's FLOP rate over its
/// bandwidth. The real model's chunks of 8, 16, 24, 32 and 64 rows took about 40, 60, 83, 92
/// and 157 ms on 2 Zen 3 cores (AVX2: 23 ms a call plus 2.1 ms a row, 11 rows), and 37, 49,
/// 58, 66 and 97 ms on 2 cores of an AVX-512 Xeon (29 ms plus 1.06 ms a row, 27 rows;
/// docs/BENCHMARKS.md, twentieth and twenty-first passes). 16 is between the two: it plans
/// 33-40 rows as 32 + 8 and 41-48 as one 64-row chunk, within 11 ms of either host's best.
const CALL_ROWS_CPU: usize = 16;

/// The same on Vulkan, where a call's submission and weight pass dwarf a row's work: one
/// padded call is cheaper than two that fit.
const CALL_ROWS_GPU: usize = 64;

/// Splits `n` rows starting at position `pos` into `(chunk size, valid rows)` calls of `chunks`
/// (ascending, holding 1) at the least modelled cost: each call costs its padded rows plus
/// `call_rows`. Only the last call is padded, and only where its padding fits `capacity`.
/// With the default chunks on llvm-cpu a 22-row extend runs as one 24-row chunk rather than a
/// 32-row one, 36 rows as 32 + 8 rather than one padded 64-row chunk; ties go to the larger
/// chunk first.
pub(crate) fn plan_chunks(
    chunks: &[usize],
    capacity: usize,
    call_rows: usize,
    pos: usize,
    n: usize,
) -> Vec<(usize, usize)> {
    // best[d] = (cost, first call) of the rows from `d` to `n`.
    let mut best = vec![(0usize, (0usize, 0usize)); n + 1];
    for d in (0..n).rev() {
        let rest = n - d;
        let mut choice: Option<(usize, (usize, usize))> = None;
        for &c in chunks.iter().rev() {
            let valid = c.min(rest);
            if valid < c && pos + d + c > capacity {
                continue;
            }
            let cost = call_rows + c + best[d + valid].0;
            if choice.is_none_or(|(b, _)| cost < b) {
                choice = Some((cost, (c, valid)));
            }
        }
        best[d] = choice.expect("chunk size 1 always fits");
    }
    let mut out = Vec::new();
    let mut d = 0;
    while d < n {
        let call = best[d].1;
        out.push(call);
        d += call.1;
    }
    out
}

/// Compiles `g` (with its tuning spec) for `target` through the on-disk cache, printing
/// progress when `verbose`.
pub fn compile_graphs(
    g: &graphs::Graphs,
    target: Target,
    verbose: bool,
) -> Result<crate::compile::Compiled> {
    let compiler = Compiler::discover()?;
    compiler.compile_tuned(
        &g.mlir,
        g.tuning_spec.as_deref(),
        &g.objects,
        target,
        &mut |p: &CompileProgress| {
            if verbose {
                eprintln!("{p}");
            }
        },
    )
}

impl KvModel for IreeModel {
    type Kv = IreeKv;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn backend(&self) -> &'static str {
        self.target.backend()
    }

    fn prefill(&self, ids: &[u32], logits: Logits) -> Result<(IreeKv, Next)> {
        check::tokens(&self.cfg, "prefill", 0, ids)?;
        let mut kv = self.new_kv(ids.len())?;
        let next = self.forward_ids("prefill", &mut kv, ids, logits)?;
        Ok((kv, next))
    }

    fn prefill_embeddings(
        &self,
        ids: &[u32],
        embeddings: &[f32],
        logits: Logits,
    ) -> Result<(IreeKv, Next)> {
        check::tokens(&self.cfg, "prefill_embeddings", 0, ids)?;
        check::embeddings(&self.cfg, "prefill_embeddings", ids.len(), embeddings)?;
        let mut kv = self.new_kv(ids.len())?;
        let input = ChunkInput::Embeddings(embeddings);
        let next = self.forward("prefill_embeddings", &mut kv, input, logits)?;
        Ok((kv, next))
    }

    fn extend(&self, kv: &mut IreeKv, ids: &[u32], logits: Logits) -> Result<Next> {
        check::tokens(&self.cfg, "extend", kv.len, ids)?;
        self.forward_ids("extend", kv, ids, logits)
    }

    fn step(&self, kv: &mut IreeKv, id: u32, logits: Logits) -> Result<Next> {
        check::tokens(&self.cfg, "step", kv.len, &[id])?;
        self.forward_ids("step", kv, &[id], logits)
    }

    /// On Vulkan [`IreeModel::decode_queued`]: the multi-step decode entry points, one queue
    /// submission for up to [`graphs::DECODE_STEPS`] steps. On llvm-cpu a loop of
    /// [`KvModel::step`], whose screened head costs less than the full head a queued step
    /// needs, and whose host has nothing to overlap (docs/BENCHMARKS.md, forty-third pass).
    fn decode(&self, kv: &mut IreeKv, id: u32, steps: usize) -> Result<Vec<u32>> {
        match self.target {
            Target::VulkanSpirv => self.decode_queued(kv, id, steps),
            Target::LlvmCpu => kvsnap_contract::decode_by_steps(self, kv, id, steps),
        }
    }

    fn snapshot(&self, kv: &IreeKv) -> Result<IreeKv> {
        if let Some(cause) = &kv.poisoned {
            return Err(Error::Poisoned {
                op: "snapshot",
                cause: cause.clone(),
            });
        }
        self.kv_pool.copy(&self.device, kv)
    }

    fn len(&self, kv: &IreeKv) -> usize {
        kv.len
    }

    /// Bytes of device memory the state's buffers hold (allocated in full: sliding layers
    /// `ring.rows`, global layers the capacity, plus the positions table).
    fn kv_bytes(&self, kv: &IreeKv) -> u64 {
        kv.bufs.iter().map(|b| b.byte_length() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::{plan_chunks, CALL_ROWS_CPU, CALL_ROWS_GPU};
    use crate::graphs::DEFAULT_CHUNKS;

    const CHUNKS: [usize; 6] = [1, 8, 16, 24, 32, 64];

    fn cpu(pos: usize, n: usize) -> Vec<(usize, usize)> {
        plan_chunks(&CHUNKS, 4096, CALL_ROWS_CPU, pos, n)
    }

    #[test]
    fn an_utterance_runs_in_the_chunk_that_wastes_least() {
        assert_eq!(cpu(860, 22), [(24, 22)]);
        assert_eq!(cpu(860, 16), [(16, 16)]);
        // 64 padded rows cost more than a second call's pass over the weights, 20 fewer not.
        assert_eq!(cpu(860, 36), [(32, 32), (8, 4)]);
        assert_eq!(cpu(860, 44), [(64, 44)]);
        assert_eq!(
            cpu(0, 853),
            [[(64, 64)].repeat(13), vec![(24, 21)]].concat()
        );
        assert_eq!(cpu(100, 1), [(1, 1)]);
        // With the default chunks a long prefix runs mostly in 128-row calls: 860 = 6 x 128 +
        // 64 + 28 (a 32-row call padded by 4), 8 calls.
        let mut prefix = plan_chunks(&DEFAULT_CHUNKS, 4096, CALL_ROWS_CPU, 0, 860);
        assert_eq!(prefix.iter().map(|&(_, v)| v).sum::<usize>(), 860);
        prefix.sort_unstable();
        assert_eq!(
            prefix,
            [vec![(32, 28), (64, 64)], vec![(128, 128); 6]].concat()
        );
        // On Vulkan a second call costs more than any padding.
        let gpu = plan_chunks(&CHUNKS, 4096, CALL_ROWS_GPU, 860, 36);
        assert_eq!(gpu, [(64, 36)]);
    }

    #[test]
    fn padding_never_runs_past_the_capacity() {
        // 5 rows from 4090: no padded chunk fits the 6 rows left, so single rows.
        assert_eq!(cpu(4090, 5), [(1, 1)].repeat(5));
        assert_eq!(cpu(4080, 16), [(16, 16)]);
        assert_eq!(cpu(4080, 12), [(16, 12)]);
        assert_eq!(cpu(4084, 12), [(8, 8), (1, 1), (1, 1), (1, 1), (1, 1)]);
    }

    #[test]
    fn every_plan_covers_its_rows_and_pads_only_its_last_call() {
        for pos in [0, 7, 500, 4000] {
            for n in 1..=(4096 - pos).min(300) {
                for call_rows in [0, CALL_ROWS_CPU, CALL_ROWS_GPU] {
                    let plan = plan_chunks(&CHUNKS, 4096, call_rows, pos, n);
                    let rows: usize = plan.iter().map(|&(_, v)| v).sum();
                    assert_eq!(rows, n, "pos {pos} n {n} K {call_rows}: {plan:?}");
                    let (last, body) = plan.split_last().unwrap();
                    assert!(body.iter().all(|&(c, v)| c == v), "{plan:?}");
                    assert!(CHUNKS.contains(&last.0) && last.1 <= last.0, "{plan:?}");
                    assert!(pos + n - last.1 + last.0 <= 4096, "{plan:?}");
                }
            }
        }
    }
}
