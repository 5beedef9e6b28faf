//! The blocks of a Gemma 3 decoder, one struct each, loaded from HF tensor names.

use kvsnap_contract::{LayerKind, ModelConfig, Result};

use crate::attention::{attention, AttnShape};
use crate::kernels::{
    add_inplace, geglu, geglu_matmul_packed, matmul, matmul_packed, rms_norm, rms_norm_inplace,
    PackedWeight,
};
use crate::kv::{KvSegment, LayerKv};
use crate::rope::{Rope, RopeTables};
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

/// A bias-free linear layer with an HF `[out, in]` weight, or several of the same input
/// stacked along the output ([`Linear::stacked`]).
///
/// Where the CPU has AVX-512F the weights are packed at load ([`PackedWeight`]) and the mapped
/// file's pages of them are released: the products read only the packed copy.
pub struct Linear {
    parts: Vec<Tensor>, // each [out_k, in]
    packed: Option<PackedWeight>,
    inp: usize,
    out: usize,
}

impl Linear {
    /// Loads `{prefix}.weight` of shape `[out, inp]`.
    pub fn load(w: &Weights, prefix: &str, inp: usize, out: usize) -> Result<Self> {
        Self::stacked(w, &[(prefix, out)], inp)
    }

    /// Loads `{prefix}.weight` of shape `[out_k, inp]` for each `(prefix, out_k)`, as one
    /// layer whose output row holds theirs side by side, in order: one product (one parallel
    /// pass over the packed weights) instead of one each.
    pub fn stacked(w: &Weights, parts: &[(&str, usize)], inp: usize) -> Result<Self> {
        let parts = parts
            .iter()
            .map(|&(prefix, out)| w.tensor(&format!("{prefix}.weight"), &[out, inp]))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::from_parts(parts, inp))
    }

    /// The layer of the weights `parts` (each `[out_k, inp]`, stacked in order), packed where
    /// the CPU allows.
    fn from_parts(parts: Vec<Tensor>, inp: usize) -> Self {
        let slices: Vec<&[f32]> = parts.iter().map(|t| &t[..]).collect();
        let packed = PackedWeight::stacked(&slices, inp);
        if packed.is_some() {
            for part in &parts {
                // Advice only: on an error the pages stay resident, nothing else changes.
                let _ = part.release_resident_pages();
            }
        }
        let out = parts.iter().map(|t| t.len() / inp).sum();
        Linear {
            parts,
            packed,
            inp,
            out,
        }
    }

    /// The packed copy the products read, or `None` where the row-major weights serve them
    /// (no AVX-512F, or the OS could not map the copy).
    pub fn packed(&self) -> Option<&PackedWeight> {
        self.packed.as_ref()
    }

    /// `x [n, in] -> y [n, out]`, `y` resized to that (its old elements are all overwritten).
    pub fn forward(&self, x: &[f32], y: &mut Vec<f32>) {
        let n = x.len() / self.inp;
        let y = sized(y, n * self.out);
        if let Some(packed) = &self.packed {
            matmul_packed(y, x, packed, n);
        } else if let [part] = &self.parts[..] {
            matmul(y, x, part, n, self.inp, self.out);
        } else {
            // Each weight's product, then its columns of every row.
            let mut col = 0;
            for part in &self.parts {
                let out = part.len() / self.inp;
                let mut yk = vec![0.0; n * out];
                matmul(&mut yk, x, part, n, self.inp, out);
                for (row, rk) in y.chunks_exact_mut(self.out).zip(yk.chunks_exact(out)) {
                    row[col..col + out].copy_from_slice(rk);
                }
                col += out;
            }
        }
    }
}

/// `buf` resized to `len` floats: zeroed only where it grows, since its users overwrite it.
fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len, 0.0);
    buf
}

/// The column blocks of a row-major `[n, sum(widths)]` matrix, each into its own `[n, width]`.
fn split_columns<const K: usize>(x: &[f32], widths: [usize; K], blocks: [&mut Vec<f32>; K]) {
    let row: usize = widths.iter().sum();
    let mut col = 0;
    for (width, block) in widths.into_iter().zip(blocks) {
        block.clear();
        for r in x.chunks_exact(row.max(1)) {
            block.extend_from_slice(&r[col..col + width]);
        }
        col += width;
    }
}

/// The buffers one forward pass reuses from layer to layer, and its RoPE tables.
///
/// Every product, norm, split and attention writes each element of its output, so a buffer is
/// zeroed only when it first grows. Allocated per layer, the 860-token prefill zeroed about 37
/// MB a layer (`memset` 4% of its samples, on the calling thread while the team waited), and
/// each layer computed its RoPE angles' cos and sin (1%): docs/BENCHMARKS.md, thirty-fourth
/// pass.
#[derive(Default)]
pub struct Scratch {
    /// `[n, hidden]`: a norm of the residual stream, the input of the attention and the MLP.
    normed: Vec<f32>,
    work: Work,
}

/// [`Scratch`]'s buffers for the attention and the MLP; `out` (`[n, hidden]`) holds the
/// output of either.
#[derive(Default)]
pub struct Work {
    qkv: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    gate_up: Vec<f32>,
    ffn: Vec<f32>,
    out: Vec<f32>,
    ropes: RopeTables,
}

/// Self-attention with grouped KV heads, q/k RMSNorm before RoPE, and a sliding or global mask.
pub struct Attention {
    qkv_proj: Linear, // q, k, v stacked: [(heads + 2 kv_heads) * hd, hidden]
    o_proj: Linear,   // [hidden, heads * hd]
    q_norm: RmsNorm,  // [hd]
    k_norm: RmsNorm,  // [hd]
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
            qkv_proj: Linear::stacked(
                w,
                &[
                    (&format!("{prefix}.q_proj"), heads * hd),
                    (&format!("{prefix}.k_proj"), kvh * hd),
                    (&format!("{prefix}.v_proj"), kvh * hd),
                ],
                h,
            )?,
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

    /// Its linear layers: the stacked q/k/v projection and the output projection.
    pub fn linears(&self) -> [&Linear; 2] {
        [&self.qkv_proj, &self.o_proj]
    }

    /// Attends the chunk at positions `pos0..pos0 + n` to the cache and itself into `w.out`,
    /// then stores its K/V rows in `kv`.
    ///
    /// # Shapes
    /// `x`: `[n, hidden]` (normed); `w.out` becomes `[n, hidden]`.
    pub fn forward(&self, x: &[f32], pos0: usize, kv: &mut LayerKv, w: &mut Work) {
        let s = self.shape;
        self.qkv_proj.forward(x, &mut w.qkv);
        let row = s.kv_heads * s.head_dim;
        // q: [n, heads, hd]; k, v: [n, kv_heads, hd].
        split_columns(
            &w.qkv,
            [s.heads * s.head_dim, row, row],
            [&mut w.q, &mut w.k, &mut w.v],
        );
        self.q_norm.forward_inplace(&mut w.q);
        self.k_norm.forward_inplace(&mut w.k);
        let n = w.q.len() / (s.heads * s.head_dim);
        w.ropes
            .get(&self.rope, pos0, n)
            .apply_qk(&mut w.q, s.heads, &mut w.k, s.kv_heads);

        let attn = sized(&mut w.attn, w.q.len()); // [n, heads, hd]
        {
            let mut segments = kv.segments(pos0, row);
            segments.push(KvSegment {
                k: &w.k,
                v: &w.v,
                pos0,
            });
            attention(attn, &w.q, pos0, &segments, s);
        }
        kv.commit(pos0, &w.k, &w.v, row);
        self.o_proj.forward(&w.attn, &mut w.out);
    }
}

/// Gemma's GeGLU MLP: `down(gelu_tanh(gate(x)) * up(x))`.
pub struct Mlp {
    gate_up_proj: Linear, // gate, up stacked: [2 ffn, hidden]
    down_proj: Linear,    // [hidden, ffn]
    ffn: usize,
}

impl Mlp {
    /// Loads `{prefix}.{gate,up,down}_proj`.
    pub fn load(cfg: &ModelConfig, w: &Weights, prefix: &str) -> Result<Self> {
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Mlp {
            gate_up_proj: Linear::stacked(
                w,
                &[
                    (&format!("{prefix}.gate_proj"), f),
                    (&format!("{prefix}.up_proj"), f),
                ],
                h,
            )?,
            down_proj: Linear::load(w, &format!("{prefix}.down_proj"), f, h)?,
            ffn: f,
        })
    }

    /// Its linear layers: the stacked gate/up projection and the down projection.
    pub fn linears(&self) -> [&Linear; 2] {
        [&self.gate_up_proj, &self.down_proj]
    }

    /// The MLP of `x` into `w.out`.
    ///
    /// # Shapes
    /// `x`: `[n, hidden]`; `w.out` becomes `[n, hidden]`.
    pub fn forward(&self, x: &[f32], w: &mut Work) {
        self.gate_up_proj.forward(x, &mut w.gate_up);
        let n = w.gate_up.len() / (2 * self.ffn);
        match self.down_proj.packed() {
            // More rows than one: the GeGLU goes into the down projection's bands.
            Some(down) if n > 1 => {
                let (o, _) = down.shape();
                geglu_matmul_packed(sized(&mut w.out, n * o), &w.gate_up, down, n);
            }
            _ => {
                geglu(sized(&mut w.ffn, n * self.ffn), &w.gate_up, self.ffn);
                self.down_proj.forward(&w.ffn, &mut w.out);
            }
        }
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

    /// Its linear layers, in the order a pass runs them: q/k/v, o, gate/up, down.
    pub fn linears(&self) -> [&Linear; 4] {
        let ([qkv, o], [gate_up, down]) = (self.self_attn.linears(), self.mlp.linears());
        [qkv, o, gate_up, down]
    }

    /// `x = x + post_attn(attn(input(x)))`, then `x = x + post_ff(mlp(pre_ff(x)))`.
    ///
    /// # Shapes
    /// `x`: `[n, hidden]`, the residual stream of positions `pos0..pos0 + n`.
    pub fn forward(&self, x: &mut [f32], pos0: usize, kv: &mut LayerKv, scratch: &mut Scratch) {
        let Scratch { normed, work } = scratch;
        self.input_layernorm.forward(sized(normed, x.len()), x);
        self.self_attn.forward(normed, pos0, kv, work);
        self.post_attention_layernorm.forward_inplace(&mut work.out);
        add_inplace(x, &work.out);

        self.pre_feedforward_layernorm.forward(normed, x);
        self.mlp.forward(normed, work);
        self.post_feedforward_layernorm
            .forward_inplace(&mut work.out);
        add_inplace(x, &work.out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::matmul_naive;
    use crate::tiny::uniform;

    /// A stacked layer's row is its weights' outputs side by side, packed (parts that end in
    /// partial panels included) and through the row-major fallback alike.
    #[test]
    fn stacked_linear_matches_its_parts() {
        let (inp, outs) = (33, [45, 7, 64]);
        let weights: Vec<Vec<f32>> = (0..3).map(|k| uniform(outs[k] * inp, k as u64)).collect();
        let parts = || {
            weights
                .iter()
                .zip(outs)
                .map(|(w, out)| Tensor::owned(w.clone(), vec![out, inp]))
                .collect::<Vec<_>>()
        };
        let packed = Linear::from_parts(parts(), inp);
        let fallback = Linear {
            packed: None,
            ..Linear::from_parts(parts(), inp)
        };
        for n in [1, 3, 22] {
            let x = uniform(n * inp, 9);
            let want: Vec<Vec<f32>> = weights
                .iter()
                .zip(outs)
                .map(|(w, out)| {
                    let mut y = vec![0.0; n * out];
                    matmul_naive(&mut y, &x, w, n, inp, out);
                    y
                })
                .collect();
            for (name, layer) in [("packed", &packed), ("fallback", &fallback)] {
                // Into a buffer left over from another product: every element is written.
                let mut got = vec![f32::NAN; 2 * n * inp + 5];
                layer.forward(&x, &mut got);
                assert_eq!(got.len(), n * outs.iter().sum::<usize>(), "{name}");
                let mut split: [Vec<f32>; 3] = Default::default();
                let [a, b, c] = &mut split;
                split_columns(&got, outs, [a, b, c]);
                for (k, (got, want)) in split.iter().zip(&want).enumerate() {
                    let diff = got
                        .iter()
                        .zip(want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0f32, f32::max);
                    assert!(diff < 1e-5, "{name}, n {n}, part {k}: {diff}");
                }
            }
        }
    }

    #[test]
    fn split_columns_takes_each_block_of_every_row() {
        let x: Vec<f32> = (0..12).map(|v| v as f32).collect(); // [2, 6]

        // Into blocks holding an earlier split's rows: those are replaced.
        let (mut a, mut b, mut c) = (vec![9.0; 7], vec![], vec![9.0]);
        split_columns(&x, [1, 3, 2], [&mut a, &mut b, &mut c]);
        assert_eq!(a, [0.0, 6.0]);
        assert_eq!(b, [1.0, 2.0, 3.0, 7.0, 8.0, 9.0]);
        assert_eq!(c, [4.0, 5.0, 10.0, 11.0]);
    }
}
