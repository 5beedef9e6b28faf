//! The blocks of a Gemma 3 decoder, one struct each, loaded from HF tensor names.

use kvsnap_contract::{LayerKind, ModelConfig, Result};

use crate::attention::{attention, AttnShape};
use crate::kernels::{
    add_inplace, geglu, matmul, matmul_packed, rms_norm, rms_norm_inplace, PackedWeight,
};
use crate::kv::{KvSegment, LayerKv};
use crate::rope::Rope;
use crate::weights::{Tensor, Weights};

/// `x * rsqrt(mean(x^2) + eps) * (1 + w)` over the last dimension.
pub struct RmsNorm {
    weight: Tensor, // [dim]
    eps: f32,
}

impl RmsNorm {
    /// Loads `{prefix}.weight` of shape `[dim]`.
    pub fn load(w: &Weights, prefix: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: w.tensor(&format!("{prefix}.weight"), &[dim])?,
            eps: eps as f32,
        })
    }

    /// `out = norm(x)` row by row.
    pub fn forward(&self, out: &mut [f32], x: &[f32]) {
        rms_norm(out, x, &self.weight, self.eps);
    }

    /// `x = norm(x)` row by row.
    pub fn forward_inplace(&self, x: &mut [f32]) {
        rms_norm_inplace(x, &self.weight, self.eps);
    }
}

/// A bias-free linear layer with an HF `[out, in]` weight.
///
/// Where the CPU has AVX-512F the weight is packed at load ([`PackedWeight`]) and the mapped
/// file's pages of it are released: the products read only the packed copy.
pub struct Linear {
    weight: Tensor, // [out, in]
    packed: Option<PackedWeight>,
    inp: usize,
    out: usize,
}

impl Linear {
    /// Loads `{prefix}.weight` of shape `[out, inp]`.
    pub fn load(w: &Weights, prefix: &str, inp: usize, out: usize) -> Result<Self> {
        let weight = w.tensor(&format!("{prefix}.weight"), &[out, inp])?;
        let packed = PackedWeight::new(&weight, inp, out);
        if packed.is_some() {
            // Advice only: on an error the pages stay resident, nothing else changes.
            let _ = weight.release_resident_pages();
        }
        Ok(Linear {
            weight,
            packed,
            inp,
            out,
        })
    }

    /// `x [n, in] -> [n, out]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let n = x.len() / self.inp;
        let mut y = vec![0.0; n * self.out];
        match &self.packed {
            Some(packed) => matmul_packed(&mut y, x, packed, n),
            None => matmul(&mut y, x, &self.weight, n, self.inp, self.out),
        }
        y
    }
}

/// Self-attention with grouped KV heads, q/k RMSNorm before RoPE, and a sliding or global mask.
pub struct Attention {
    q_proj: Linear,  // [heads * hd, hidden]
    k_proj: Linear,  // [kv_heads * hd, hidden]
    v_proj: Linear,  // [kv_heads * hd, hidden]
    o_proj: Linear,  // [hidden, heads * hd]
    q_norm: RmsNorm, // [hd]
    k_norm: RmsNorm, // [hd]
    rope: Rope,
    shape: AttnShape,
}

impl Attention {
    /// Loads `{prefix}.{q,k,v,o}_proj` and `{prefix}.{q,k}_norm` for layer `layer`.
    pub fn load(cfg: &ModelConfig, w: &Weights, prefix: &str, layer: usize) -> Result<Self> {
        let (h, hd, kvh) = (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads);
        let heads = cfg.num_attention_heads;
        let kind = cfg.layer_kinds[layer];
        let factor = match kind {
            LayerKind::Global => cfg.rope_linear_factor_global,
            LayerKind::Sliding => 1.0,
        };
        Ok(Attention {
            q_proj: Linear::load(w, &format!("{prefix}.q_proj"), h, heads * hd)?,
            k_proj: Linear::load(w, &format!("{prefix}.k_proj"), h, kvh * hd)?,
            v_proj: Linear::load(w, &format!("{prefix}.v_proj"), h, kvh * hd)?,
            o_proj: Linear::load(w, &format!("{prefix}.o_proj"), heads * hd, h)?,
            q_norm: RmsNorm::load(w, &format!("{prefix}.q_norm"), hd, cfg.rms_norm_eps)?,
            k_norm: RmsNorm::load(w, &format!("{prefix}.k_norm"), hd, cfg.rms_norm_eps)?,
            rope: Rope::new(cfg.rope_theta(layer), hd, factor),
            shape: AttnShape {
                heads,
                kv_heads: kvh,
                head_dim: hd,
                window: (kind == LayerKind::Sliding).then_some(cfg.sliding_window),
                scale: cfg.attn_scale(),
                softcap: cfg.attn_logit_softcapping.map(|c| c as f32),
            },
        })
    }

    /// Attends the chunk at positions `pos0..pos0 + n` to the cache and itself, then stores its
    /// K/V rows in `kv`.
    ///
    /// # Shapes
    /// `x`: `[n, hidden]` (normed); returns `[n, hidden]`.
    pub fn forward(&self, x: &[f32], pos0: usize, kv: &mut LayerKv) -> Vec<f32> {
        let s = self.shape;
        let mut q = self.q_proj.forward(x); // [n, heads, hd]
        let mut k = self.k_proj.forward(x); // [n, kv_heads, hd]
        let v = self.v_proj.forward(x); // [n, kv_heads, hd]
        self.q_norm.forward_inplace(&mut q);
        self.k_norm.forward_inplace(&mut k);
        self.rope
            .apply_qk(&mut q, s.heads, &mut k, s.kv_heads, pos0);

        let row = s.kv_heads * s.head_dim;
        let mut attn = vec![0.0; q.len()]; // [n, heads, hd]
        {
            let mut segments = kv.segments(pos0, row);
            segments.push(KvSegment { k: &k, v: &v, pos0 });
            attention(&mut attn, &q, pos0, &segments, s);
        }
        kv.commit(pos0, &k, &v, row);
        self.o_proj.forward(&attn)
    }
}

/// Gemma's GeGLU MLP: `down(gelu_tanh(gate(x)) * up(x))`.
pub struct Mlp {
    gate_proj: Linear, // [ffn, hidden]
    up_proj: Linear,   // [ffn, hidden]
    down_proj: Linear, // [hidden, ffn]
}

impl Mlp {
    /// Loads `{prefix}.{gate,up,down}_proj`.
    pub fn load(cfg: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Mlp {
            gate_proj: Linear::load(w, &format!("{prefix}.gate_proj"), h, f)?,
            up_proj: Linear::load(w, &format!("{prefix}.up_proj"), h, f)?,
            down_proj: Linear::load(w, &format!("{prefix}.down_proj"), f, h)?,
        })
    }

    /// # Shapes
    /// `x`: `[n, hidden]`; returns `[n, hidden]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut gate = self.gate_proj.forward(x);
        let up = self.up_proj.forward(x);
        geglu(&mut gate, &up);
        self.down_proj.forward(&gate)
    }
}

/// One decoder layer with Gemma 3's sandwich norms.
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: Mlp,
    post_feedforward_layernorm: RmsNorm,
}

impl DecoderLayer {
    /// Loads `model.layers.{layer}.*`.
    pub fn load(cfg: &ModelConfig, w: &Weights, layer: usize) -> Result<Self> {
        let p = format!("model.layers.{layer}");
        let norm = |name: &str| {
            RmsNorm::load(w, &format!("{p}.{name}"), cfg.hidden_size, cfg.rms_norm_eps)
        };
        Ok(DecoderLayer {
            input_layernorm: norm("input_layernorm")?,
            self_attn: Attention::load(cfg, w, &format!("{p}.self_attn"), layer)?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
            mlp: Mlp::load(cfg, w, &format!("{p}.mlp"))?,
            post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
        })
    }

    /// `x = x + post_attn(attn(input(x)))`, then `x = x + post_ff(mlp(pre_ff(x)))`.
    ///
    /// # Shapes
    /// `x`: `[n, hidden]`, the residual stream of positions `pos0..pos0 + n`.
    pub fn forward(&self, x: &mut [f32], pos0: usize, kv: &mut LayerKv) {
        let mut h = vec![0.0; x.len()];
        self.input_layernorm.forward(&mut h, x);
        let mut a = self.self_attn.forward(&h, pos0, kv);
        self.post_attention_layernorm.forward_inplace(&mut a);
        add_inplace(x, &a);

        self.pre_feedforward_layernorm.forward(&mut h, x);
        let mut m = self.mlp.forward(&h);
        self.post_feedforward_layernorm.forward_inplace(&mut m);
        add_inplace(x, &m);
    }
}
