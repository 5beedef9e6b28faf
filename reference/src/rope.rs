//! Rotary position embeddings (rotate-half, NeoX layout) with tables in f32, as transformers'
//! `Gemma3RotaryEmbedding` builds them.

/// Inverse frequencies of one RoPE base: `[head_dim / 2]`.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// `inv_freq[k] = 1 / (theta ^ (2k / head_dim)) / linear_factor`, in f32.
    pub fn new(theta: f64, head_dim: usize, linear_factor: f64) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|k| {
                let exponent = (2 * k) as f32 / head_dim as f32;
                let f = 1.0 / (theta as f32).powf(exponent);
                f / linear_factor as f32
            })
            .collect();
        Rope { inv_freq }
    }

    /// Rotates each `head_dim` row of `x` in place; row `r` of head block `t` is at position
    /// `pos0 + t`.
    ///
    /// # Shapes
    /// `x`: `[n, heads, head_dim]`.
    pub fn apply(&self, x: &mut [f32], pos0: usize, heads: usize) {
        self.apply_qk(x, heads, &mut [], 0, pos0);
    }

    /// [`Rope::apply`] to a layer's queries and keys of the same positions, each position's
    /// cos and sin computed once for both (they were 1.7% of a prefill's samples when computed
    /// for each).
    ///
    /// # Shapes
    /// `q`: `[n, q_heads, head_dim]`; `k`: `[n, k_heads, head_dim]` or empty.
    pub fn apply_qk(
        &self,
        q: &mut [f32],
        q_heads: usize,
        k: &mut [f32],
        k_heads: usize,
        pos0: usize,
    ) {
        let half = self.inv_freq.len();
        let head_dim = 2 * half;
        assert!(
            k.is_empty() || k.len() * q_heads == q.len() * k_heads,
            "Rope::apply_qk: q and k of different lengths"
        );
        let mut cos = vec![0.0f32; half];
        let mut sin = vec![0.0f32; half];
        let mut keys = k.chunks_exact_mut((k_heads * head_dim).max(1));
        for (t, token) in q.chunks_exact_mut(q_heads * head_dim).enumerate() {
            self.tables(pos0 + t, &mut cos, &mut sin);
            let key = keys.next().unwrap_or_default();
            for row in token
                .chunks_exact_mut(head_dim)
                .chain(key.chunks_exact_mut(head_dim))
            {
                let (a, b) = row.split_at_mut(half);
                for k in 0..half {
                    let (x1, x2) = (a[k], b[k]);
                    a[k] = x1 * cos[k] - x2 * sin[k];
                    b[k] = x2 * cos[k] + x1 * sin[k];
                }
            }
        }
    }

    /// cos and sin of the angles at `pos`: the angle is rounded to f32 first (transformers
    /// multiplies the f32 `inv_freq` by the position in f32), then cos/sin are taken.
    fn tables(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for (k, &f) in self.inv_freq.iter().enumerate() {
            let angle = f * pos as f32;
            cos[k] = (angle as f64).cos() as f32;
            sin[k] = (angle as f64).sin() as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_rotation_preserves_norm() {
        let rope = Rope::new(10_000.0, 8, 1.0);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let mut x = orig.clone();
        rope.apply(&mut x, 0, 2);
        assert_eq!(x, orig);
        let mut y = orig.clone();
        rope.apply(&mut y, 37, 2);
        for (a, b) in y.chunks(8).zip(orig.chunks(8)) {
            let na: f32 = a.iter().map(|v| v * v).sum();
            let nb: f32 = b.iter().map(|v| v * v).sum();
            assert!((na - nb).abs() < 1e-3);
        }
    }

    /// Queries and keys rotated together are bit for bit the two rotated apart.
    #[test]
    fn apply_qk_equals_apply_on_each() {
        let rope = Rope::new(10_000.0, 8, 1.0);
        let q: Vec<f32> = (0..3 * 4 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
        let k: Vec<f32> = (0..3 * 2 * 8).map(|i| (i as f32 * 0.71).cos()).collect();
        let (mut q1, mut k1) = (q.clone(), k.clone());
        rope.apply(&mut q1, 5, 4);
        rope.apply(&mut k1, 5, 2);
        let (mut q2, mut k2) = (q, k);
        rope.apply_qk(&mut q2, 4, &mut k2, 2, 5);
        assert_eq!(q1, q2);
        assert_eq!(k1, k2);
        assert_ne!(
            k1,
            (0..3 * 2 * 8)
                .map(|i| (i as f32 * 0.71).cos())
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn rotate_half_pairs_k_with_k_plus_half() {
        // head_dim 2: one frequency (1.0); position 1 rotates (1, 0) by 1 radian.
        let rope = Rope::new(10_000.0, 2, 1.0);
        let mut x = vec![1.0, 0.0];
        rope.apply(&mut x, 1, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-7 && (x[1] - 1f32.sin()).abs() < 1e-7);
        // Relative property: <R(p)q, R(p+d)k> depends only on d.
        let rope = Rope::new(10_000.0, 8, 1.0);
        let q: Vec<f32> = (0..8).map(|i| (i as f32).sin()).collect();
        let k: Vec<f32> = (0..8).map(|i| (i as f32).cos()).collect();
        let score = |p: usize| {
            let (mut a, mut b) = (q.clone(), k.clone());
            rope.apply(&mut a, p, 1);
            rope.apply(&mut b, p + 3, 1);
            a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>()
        };
        assert!((score(0) - score(11)).abs() < 1e-4);
    }

    #[test]
    fn linear_scaling_divides_frequencies() {
        let a = Rope::new(1e6, 16, 1.0);
        let b = Rope::new(1e6, 16, 8.0);
        for (x, y) in a.inv_freq.iter().zip(&b.inv_freq) {
            assert_eq!(x / 8.0, *y);
        }
    }
}
