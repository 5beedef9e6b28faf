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
        let n = q.len() / (q_heads * 2 * self.inv_freq.len()).max(1);
        self.table(pos0, n).apply_qk(q, q_heads, k, k_heads);
    }

    /// The cos and sin of the angles at positions `pos0..pos0 + n`: the angle is rounded to
    /// f32 first (transformers multiplies the f32 `inv_freq` by the position in f32), then
    /// cos/sin are taken.
    pub fn table(&self, pos0: usize, n: usize) -> RopeTable {
        let half = self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
        for pos in pos0..pos0 + n {
            for &f in &self.inv_freq {
                let angle = (f * pos as f32) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        RopeTable {
            inv_freq: self.inv_freq.clone(),
            pos0,
            cos,
            sin,
        }
    }
}

/// One RoPE base's cos and sin at a run of positions ([`Rope::table`]): a forward pass
/// computes it once and rotates every layer of that base with it ([`RopeTables`]).
#[derive(Clone, Debug)]
pub struct RopeTable {
    inv_freq: Vec<f32>,
    pos0: usize,
    cos: Vec<f32>, // [n, head_dim / 2]
    sin: Vec<f32>,
}

impl RopeTable {
    /// Whether this is `rope`'s table of the positions `pos0..pos0 + n`.
    fn is(&self, rope: &Rope, pos0: usize, n: usize) -> bool {
        self.pos0 == pos0
            && self.cos.len() == n * self.inv_freq.len()
            && self.inv_freq == rope.inv_freq
    }

    /// Rotates each `head_dim` row of the queries and keys of its positions in place.
    ///
    /// # Shapes
    /// `q`: `[n, q_heads, head_dim]`; `k`: `[n, k_heads, head_dim]` or empty.
    pub fn apply_qk(&self, q: &mut [f32], q_heads: usize, k: &mut [f32], k_heads: usize) {
        let half = self.inv_freq.len();
        let head_dim = 2 * half;
        assert!(
            k.is_empty() || k.len() * q_heads == q.len() * k_heads,
            "RopeTable::apply_qk: q and k of different lengths"
        );
        assert_eq!(
            q.len(),
            self.cos.len() / half * q_heads * head_dim,
            "RopeTable::apply_qk: q is not the table's positions"
        );
        let mut keys = k.chunks_exact_mut((k_heads * head_dim).max(1));
        let angles = self.cos.chunks_exact(half).zip(self.sin.chunks_exact(half));
        for (token, (cos, sin)) in q.chunks_exact_mut(q_heads * head_dim).zip(angles) {
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
}

/// The RoPE tables of one forward pass, one per base its layers use: a Gemma 3 pass has two
/// (sliding and global), where computing them for each of 18 layers took about 2% of a
/// prefill's time (`sincos` on the calling thread).
#[derive(Clone, Debug, Default)]
pub struct RopeTables(Vec<RopeTable>);

impl RopeTables {
    /// `rope`'s table of the positions `pos0..pos0 + n`, computed on first use.
    pub fn get(&mut self, rope: &Rope, pos0: usize, n: usize) -> &RopeTable {
        let at = match self.0.iter().position(|t| t.is(rope, pos0, n)) {
            Some(at) => at,
            None => {
                self.0.push(rope.table(pos0, n));
                self.0.len() - 1
            }
        };
        &self.0[at]
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

    /// A pass's table of many positions rotates each one as that position's own table does,
    /// bit for bit, and the cache hands it out again only for the same base and positions.
    #[test]
    fn tables_of_a_pass_are_each_positions_own() {
        let (sliding, global) = (Rope::new(10_000.0, 8, 1.0), Rope::new(1e6, 8, 8.0));
        let q: Vec<f32> = (0..5 * 2 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
        let k: Vec<f32> = (0..5 * 8).map(|i| (i as f32 * 0.71).cos()).collect();
        let mut tables = RopeTables::default();
        let (mut q_all, mut k_all) = (q.clone(), k.clone());
        tables
            .get(&sliding, 40, 5)
            .apply_qk(&mut q_all, 2, &mut k_all, 1);
        for t in 0..5 {
            let (mut q1, mut k1) = (q[t * 16..][..16].to_vec(), k[t * 8..][..8].to_vec());
            sliding.table(40 + t, 1).apply_qk(&mut q1, 2, &mut k1, 1);
            assert_eq!(q1, q_all[t * 16..][..16], "q at position {}", 40 + t);
            assert_eq!(k1, k_all[t * 8..][..8], "k at position {}", 40 + t);
        }
        tables.get(&sliding, 40, 5);
        assert_eq!(
            tables.0.len(),
            1,
            "the same base and positions: the same table"
        );
        for (rope, pos0, n) in [(&global, 40, 5), (&sliding, 41, 5), (&sliding, 40, 4)] {
            let before = tables.0.len();
            assert!(tables.get(rope, pos0, n).is(rope, pos0, n));
            assert_eq!(tables.0.len(), before + 1, "{pos0} {n}: a table of its own");
        }
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
