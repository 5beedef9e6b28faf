//! `ReferenceModel`: the Gemma 3 forward pass behind the `KvModel` contract.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvsnap_contract::{argmax, check, Error, KvModel, Logits, ModelConfig, Next, Result};

use crate::blocks::{DecoderLayer, RmsNorm, Scratch};
use crate::buffer::huge_page_bytes;
use crate::head::TiedHead;
use crate::kernels::{gather_rows, matvec, Kernels, PackedWeight};
use crate::kv::ReferenceKv;
use crate::weights::{Tensor, Weights};

/// What a loaded [`ReferenceModel`] runs on this machine ([`ReferenceModel::load_report`]):
/// which kernels, on how many threads, and whether what a decode step streams got the layout
/// and the pages it was meant to. A shortfall is slower, never wrong, so loading does not fail
/// on one; a benchmark records it beside its figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadReport {
    /// The kernels the forward pass dispatches to.
    pub kernels: Kernels,
    /// Threads a forward pass's kernels run on: the caller and the team's workers.
    pub threads: usize,
    /// Linear layers (q/k/v, o, gate/up and down in each decoder layer) whose weights are
    /// packed into panels at load.
    pub packed_layers: usize,
    /// Linear layers the row-major weights serve: all of them without AVX-512F; with it, those
    /// whose packed copy the OS could not map.
    pub row_major_layers: usize,
    /// Bytes of the buffers a decode step streams in whole: the packed panels and the head's
    /// int8 table.
    pub streamed_bytes: usize,
    /// Of [`LoadReport::streamed_bytes`], those on transparent huge pages at the time of the
    /// report; `None` where the OS does not say.
    pub huge_page_bytes: Option<usize>,
}

impl LoadReport {
    /// Whether every linear layer got the layout its kernels want: packed where the AVX-512F
    /// kernels run (elsewhere row-major is the layout).
    pub fn layers_as_intended(&self) -> bool {
        self.kernels != Kernels::Avx512 || self.row_major_layers == 0
    }
}

/// Gemma 3 text model on the CPU, immutable after loading; KV state is passed in explicitly.
pub struct ReferenceModel {
    cfg: ModelConfig,
    embed_tokens: Tensor, // [vocab, hidden], also the tied LM head
    head: TiedHead,       // int8 copy of embed_tokens for the greedy token
    layers: Vec<DecoderLayer>,
    norm: RmsNorm, // [hidden]
    /// Test hook: `1 + layer` after which the next forward pass fails, 0 when disarmed.
    fault_after_layer: AtomicUsize,
}

impl ReferenceModel {
    /// Loads `config.json` and `model.safetensors` from an HF checkpoint directory, with the
    /// default context capacity.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_config(dir, ModelConfig::from_dir(dir, None)?)
    }

    /// Like [`ReferenceModel::load`], with `capacity` tokens of context per KV state.
    pub fn load_with_capacity(dir: &Path, capacity: usize) -> Result<Self> {
        Self::load_config(dir, ModelConfig::from_dir(dir, Some(capacity))?)
    }

    /// Loads the weights of `dir/model.safetensors` for an already parsed `cfg`.
    pub fn load_config(dir: &Path, cfg: ModelConfig) -> Result<Self> {
        let w = Weights::open(&dir.join("model.safetensors"))?;
        let embed_tokens = w.tensor(
            "model.embed_tokens.weight",
            &[cfg.vocab_size, cfg.hidden_size],
        )?;
        let layers = (0..cfg.num_layers())
            .map(|i| DecoderLayer::load(&cfg, &w, i))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(&w, "model.norm", cfg.hidden_size, cfg.rms_norm_eps)?;
        let head = TiedHead::new(&embed_tokens, cfg.hidden_size).map_err(|e| Error::Backend {
            backend: "reference",
            op: "map the head's int8 copy".into(),
            status: e.to_string(),
        })?;
        // Decode reads the int8 copy; the f32 table serves embedding rows, the few rows the
        // head recomputes and requested logits. Its pages, all read by the copy, need not stay
        // in this process's RSS (advice: an error changes nothing).
        let _ = embed_tokens.release_resident_pages();
        Ok(ReferenceModel {
            cfg,
            embed_tokens,
            head,
            layers,
            norm,
            fault_after_layer: AtomicUsize::new(0),
        })
    }

    /// What this model runs on: its kernels, threads, packed layers and huge pages (read now:
    /// the kernel may move pages onto huge ones after the load).
    pub fn load_report(&self) -> LoadReport {
        let linears: Vec<_> = self.layers.iter().flat_map(|l| l.linears()).collect();
        let mut ranges: Vec<_> = linears
            .iter()
            .filter_map(|l| l.packed().map(PackedWeight::addresses))
            .collect();
        let packed_layers = ranges.len();
        ranges.push(self.head.addresses());
        LoadReport {
            kernels: Kernels::active(),
            threads: rayon::current_num_threads(),
            packed_layers,
            row_major_layers: linears.len() - packed_layers,
            streamed_bytes: ranges.iter().map(|r| r.len()).sum(),
            huge_page_bytes: huge_page_bytes(&ranges),
        }
    }

    /// Test-only fault injection: the next forward pass (of any operation, on any thread) fails
    /// with [`Error::Backend`] right after decoder layer `layer` has written its K/V rows, i.e.
    /// midway through an update of the KV state. One-shot: the pass that takes the fault disarms
    /// it, whether or not it has that many layers. `None` disarms.
    ///
    /// An always-present atomic (one swap per forward pass) rather than a cargo feature, so the
    /// workspace does not build this crate twice. kvsnap-reliability uses it to test that a
    /// mid-operation failure poisons the state (see `docs/RELIABILITY.md`).
    #[doc(hidden)]
    pub fn set_fault_after_layer(&self, layer: Option<usize>) {
        self.fault_after_layer
            .store(layer.map_or(0, |l| l + 1), Ordering::SeqCst);
    }

    /// Raw (unscaled) embedding rows of `ids`: what a host gathers for `prefill_embeddings`.
    ///
    /// # Shapes
    /// returns `[ids.len(), hidden]`.
    pub fn embedding_rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        check::tokens(&self.cfg, "embedding_rows", 0, ids)?;
        Ok(gather_rows(&self.embed_tokens, self.cfg.hidden_size, ids))
    }

    /// Runs the chunk whose raw embedding rows are `rows` at the end of `kv`.
    ///
    /// # Shapes
    /// `rows`: `[n, hidden]`, unscaled.
    ///
    /// # Errors
    /// Only an injected fault ([`ReferenceModel::set_fault_after_layer`]); it leaves `kv` half
    /// updated, which the handle table turns into a poisoned state.
    /// The pass runs on the calling thread; its kernels fork over [`crate::team`], whose
    /// workers spin between them.
    fn forward(&self, kv: &mut ReferenceKv, mut x: Vec<f32>, logits: Logits) -> Result<Next> {
        let fault = self
            .fault_after_layer
            .swap(0, Ordering::SeqCst)
            .checked_sub(1);
        let scale = self.cfg.embed_scale();
        x.iter_mut().for_each(|v| *v *= scale);
        let pos0 = kv.len;
        let mut scratch = Scratch::default();
        for (i, (layer, layer_kv)) in self.layers.iter().zip(&mut kv.layers).enumerate() {
            layer.forward(&mut x, pos0, layer_kv, &mut scratch);
            if fault == Some(i) {
                return Err(Error::Backend {
                    backend: "reference",
                    op: "forward".into(),
                    status: format!("injected fault after layer {i} (test hook)"),
                });
            }
        }
        kv.len += x.len() / self.cfg.hidden_size;
        Ok(self.head(&x[x.len() - self.cfg.hidden_size..], logits))
    }

    /// Final norm and tied LM head of one position: with [`Logits::Skip`] the greedy token by
    /// [`TiedHead`] (a quarter of the bytes, the same token), otherwise every logit in f32.
    fn head(&self, last: &[f32], want: Logits) -> Next {
        let mut h = vec![0.0; last.len()];
        self.norm.forward(&mut h, last);
        // A softcap's tanh can round distinct logits to one value, making a tie the pruned
        // head does not see; Gemma 3 has none.
        if want == Logits::Skip && self.cfg.final_logit_softcapping.is_none() {
            if let Some(token) = self.head.argmax(&self.embed_tokens, &h) {
                return Next {
                    token,
                    logits: None,
                };
            }
        }
        let mut logits = vec![0.0; self.cfg.vocab_size];
        matvec(
            &mut logits,
            &h,
            &self.embed_tokens,
            self.cfg.hidden_size,
            self.cfg.vocab_size,
        );
        if let Some(cap) = self.cfg.final_logit_softcapping {
            let cap = cap as f32;
            logits.iter_mut().for_each(|v| *v = (*v / cap).tanh() * cap);
        }
        Next {
            token: argmax(&logits),
            logits: (want == Logits::Return).then_some(logits),
        }
    }
}

impl KvModel for ReferenceModel {
    type Kv = ReferenceKv;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn backend(&self) -> &'static str {
        "reference"
    }

    fn prefill(&self, ids: &[u32], logits: Logits) -> Result<(ReferenceKv, Next)> {
        check::tokens(&self.cfg, "prefill", 0, ids)?;
        let rows = self.embedding_rows(ids)?;
        let mut kv = ReferenceKv::new(&self.cfg);
        let next = self.forward(&mut kv, rows, logits)?;
        Ok((kv, next))
    }

    fn prefill_embeddings(
        &self,
        ids: &[u32],
        embeddings: &[f32],
        logits: Logits,
    ) -> Result<(ReferenceKv, Next)> {
        check::tokens(&self.cfg, "prefill_embeddings", 0, ids)?;
        check::embeddings(&self.cfg, "prefill_embeddings", ids.len(), embeddings)?;
        let mut kv = ReferenceKv::new(&self.cfg);
        let next = self.forward(&mut kv, embeddings.to_vec(), logits)?;
        Ok((kv, next))
    }

    fn extend(&self, kv: &mut ReferenceKv, ids: &[u32], logits: Logits) -> Result<Next> {
        check::tokens(&self.cfg, "extend", kv.len, ids)?;
        let rows = self.embedding_rows(ids)?;
        self.forward(kv, rows, logits)
    }

    fn step(&self, kv: &mut ReferenceKv, id: u32, logits: Logits) -> Result<Next> {
        check::tokens(&self.cfg, "step", kv.len, &[id])?;
        let rows = self.embedding_rows(&[id])?;
        self.forward(kv, rows, logits)
    }

    fn snapshot(&self, kv: &ReferenceKv) -> Result<ReferenceKv> {
        // On the calling thread, like the forward passes whose freed buffers the copy can then
        // reuse (a thread's allocations come from its own malloc arena).
        Ok(kv.clone())
    }

    fn len(&self, kv: &ReferenceKv) -> usize {
        kv.len
    }

    fn kv_bytes(&self, kv: &ReferenceKv) -> u64 {
        kv.bytes()
    }
}
