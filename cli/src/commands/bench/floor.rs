//! The cost model of the real forward pass: bytes read and FLOPs of a chunk, from the config
//! alone, so that every measured time can be set against the machine's limits.
//!
//! A chunk of `n` tokens at positions `pos0..pos0 + n` touches every layer weight once, the tied
//! head once (one position only: the head is sliced), and the K/V rows each query can see. Its
//! floor is the roofline `max(bytes / read bandwidth, flops / SGEMM rate)`: a decode step is
//! bound by the bytes, a long prefill by the FLOPs.
//!
//! The head's bytes depend on the backend ([`HeadRead`]): the reference and iree-cpu find the
//! greedy token from an int8 copy of the table and recompute a few rows in f32
//! (`kvsnap_reference::head`, `GraphOptions::screen`), a quarter of the f32 table's bytes;
//! iree-vulkan reads the f32 table. Each figure is set against the floor of what its backend
//! reads, and the catalog report also gives the floor of the f32 head.

use kvsnap_contract::{KvModel, LayerKind, ModelConfig};

use super::limits::Limits;

/// Bytes of an f32.
const F32: u64 = 4;

/// How a backend's tied head reads its table when only the greedy token is wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadRead {
    /// Every f32 weight of the table (iree-vulkan).
    F32,
    /// An int8 copy with a scale and an error bound per row, plus the rows it recomputes in
    /// f32, counted as one (the reference and iree-cpu; a few on the real model).
    Int8Screen,
}

impl HeadRead {
    /// What `backend` (a [`KvModel::backend`] name) reads.
    pub fn of_backend(backend: &str) -> Self {
        match backend {
            "reference" | "iree-cpu" => HeadRead::Int8Screen,
            _ => HeadRead::F32,
        }
    }

    /// The name the JSON reports.
    pub fn name(self) -> &'static str {
        match self {
            HeadRead::F32 => "f32",
            HeadRead::Int8Screen => "int8-screen",
        }
    }
}

/// Parameter counts and shapes the cost model needs.
#[derive(Clone, Debug)]
pub struct CostModel {
    cfg: ModelConfig,
    head: HeadRead,
}

/// Work of one forward call.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    /// Bytes that must come from memory at least once: weights, head, visible K/V.
    pub bytes: f64,
    /// Floating-point operations (a multiply-add counts two).
    pub flops: f64,
}

impl Work {
    /// The roofline floor of this work on a machine with `limits`.
    pub fn floor_s(&self, limits: &Limits) -> f64 {
        (self.bytes / limits.read_bandwidth_bps).max(self.flops / limits.sgemm_flops)
    }
}

impl CostModel {
    /// The cost model of `cfg` with an f32 head.
    pub fn new(cfg: &ModelConfig) -> Self {
        CostModel {
            cfg: cfg.clone(),
            head: HeadRead::F32,
        }
    }

    /// The cost model of `model`, its head read as its backend reads it.
    pub fn of<M: KvModel>(model: &M) -> Self {
        Self::new(model.config()).with_head(HeadRead::of_backend(model.backend()))
    }

    /// The same model with the head read as `head`.
    pub fn with_head(&self, head: HeadRead) -> Self {
        CostModel {
            cfg: self.cfg.clone(),
            head,
        }
    }

    /// How this model's head reads its table.
    pub fn head(&self) -> HeadRead {
        self.head
    }

    /// Parameters of one decoder layer's projections (the matmul weights).
    fn layer_matmul_params(&self) -> u64 {
        let c = &self.cfg;
        let (h, hd) = (c.hidden_size as u64, c.head_dim as u64);
        let q = h * c.num_attention_heads as u64 * hd;
        let kv = 2 * h * c.num_key_value_heads as u64 * hd;
        let o = c.num_attention_heads as u64 * hd * h;
        let mlp = 3 * h * c.intermediate_size as u64;
        q + kv + o + mlp
    }

    /// Parameters of one decoder layer's norms (four of `hidden`, q/k norms of `head_dim`).
    fn layer_norm_params(&self) -> u64 {
        4 * self.cfg.hidden_size as u64 + 2 * self.cfg.head_dim as u64
    }

    /// Parameters of the token embedding (also the tied head).
    fn embed_params(&self) -> u64 {
        self.cfg.vocab_size as u64 * self.cfg.hidden_size as u64
    }

    /// f32 bytes of every parameter (embedding counted once: the head is tied).
    pub fn weights_bytes(&self) -> u64 {
        let layers = self.cfg.num_layers() as u64;
        let params = layers * (self.layer_matmul_params() + self.layer_norm_params())
            + self.embed_params()
            + self.cfg.hidden_size as u64;
        params * F32
    }

    /// Keys a query at `pos` sees on a layer of `kind`.
    fn visible(&self, kind: LayerKind, pos: usize) -> u64 {
        match kind {
            LayerKind::Global => pos as u64 + 1,
            LayerKind::Sliding => (pos + 1).min(self.cfg.sliding_window) as u64,
        }
    }

    /// Work of a chunk of `n` tokens appended at `pos0` (a prefill when `pos0 == 0`, an extend
    /// otherwise, a decode step when `n == 1`), head sliced to the last position.
    pub fn chunk(&self, pos0: usize, n: usize) -> Work {
        let c = &self.cfg;
        let layers = c.num_layers() as f64;
        let kv_row = (c.num_key_value_heads * c.head_dim) as f64;
        let q_row = (c.num_attention_heads * c.head_dim) as f64;
        let last = pos0 + n - 1;

        // Projections: 2 FLOPs per weight per token; weights read once per call.
        let mut flops = 2.0 * n as f64 * layers * self.layer_matmul_params() as f64;
        let mut bytes =
            layers * (self.layer_matmul_params() + self.layer_norm_params()) as f64 * F32 as f64;
        // Attention: Q.K^T and P.V, 2 FLOPs each per (query head, key, dim); the K/V rows the
        // last query sees are read at least once.
        for &kind in &c.layer_kinds {
            let keys: u64 = (pos0..pos0 + n).map(|p| self.visible(kind, p)).sum();
            flops += 4.0 * q_row * keys as f64;
            bytes += 2.0 * kv_row * self.visible(kind, last) as f64 * F32 as f64;
        }
        // Head of one position over the whole vocabulary.
        flops += 2.0 * self.embed_params() as f64;
        bytes += match self.head {
            HeadRead::F32 => self.embed_params() as f64 * F32 as f64,
            // One byte a weight, a scale and a bound a row, one row in f32.
            HeadRead::Int8Screen => {
                (self.embed_params() + 2 * F32 * c.vocab_size as u64) as f64
                    + (c.hidden_size as u64 * F32) as f64
            }
        };
        Work { bytes, flops }
    }

    /// Work of one stateless step on `seq` tokens: the whole sequence recomputed, head sliced.
    pub fn stateless_step(&self, seq: usize) -> Work {
        self.chunk(0, seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsnap_reference::tiny::{config, Preset};

    /// Gemma 3 270M: 268,098,176 parameters (100.3M in the layers, 167.8M in the embedding).
    #[test]
    fn real_shapes_parameter_count() {
        let m = CostModel::new(&config(Preset::RealShapes));
        assert_eq!(m.weights_bytes(), 268_098_176 * 4);
    }

    /// A decode step reads every layer weight and the whole head once; its FLOPs are twice the
    /// weights it multiplies plus attention.
    #[test]
    fn decode_step_is_bytes_bound() {
        let cfg = config(Preset::RealShapes);
        let m = CostModel::new(&cfg);
        let step = m.chunk(100, 1);
        let weights = m.weights_bytes() as f64;
        assert!(step.bytes > weights * 0.99 && step.bytes < weights * 1.02);
        let attn: f64 = cfg
            .layer_kinds
            .iter()
            .map(|_| 4.0 * 4.0 * 256.0 * 101.0)
            .sum();
        let want = 2.0 * (m.layer_matmul_params() as f64 * 18.0 + m.embed_params() as f64) + attn;
        assert_eq!(step.flops, want);
        // The int8-screened head reads a quarter of the f32 head's bytes and does the same
        // multiplies.
        let screened = m.with_head(HeadRead::Int8Screen).chunk(100, 1);
        let head = m.embed_params() as f64 * 4.0;
        let saved = step.bytes - screened.bytes;
        assert!(
            saved > head * 0.74 && saved < head * 0.75,
            "saved {saved} of {head}"
        );
        assert_eq!(screened.flops, step.flops);
        // Prefilling twice the tokens costs about twice the FLOPs.
        let (a, b) = (m.chunk(0, 400).flops, m.chunk(0, 800).flops);
        assert!(b / a > 1.9 && b / a < 2.2);
    }
}
