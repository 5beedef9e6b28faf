//! KV state of the reference backend, typed by layer kind: global layers keep every position,
//! sliding layers keep a ring of their window.

use crate::team;
use kvsnap_contract::{LayerKind, ModelConfig};

/// A contiguous run of cached K/V rows for consecutive positions.
///
/// # Shapes
/// `k`, `v`: `[rows][kv_heads * head_dim]`; row `r` is position `pos0 + r`.
#[derive(Clone, Copy, Debug)]
pub struct KvSegment<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub pos0: usize,
}

/// K/V of one global layer: every position `0..len`.
#[derive(Clone, Debug, Default)]
pub struct FullKv {
    k: Vec<f32>, // [len][kv_row]
    v: Vec<f32>, // [len][kv_row]
}

/// K/V of one sliding layer: position `p` lives in slot `p % window`, so the ring always holds
/// the last `min(len, window)` positions.
#[derive(Clone, Debug)]
pub struct RingKv {
    window: usize,
    k: Vec<f32>, // [min(len, window)][kv_row]
    v: Vec<f32>, // [min(len, window)][kv_row]
}

/// K/V of one layer.
#[derive(Clone, Debug)]
pub enum LayerKv {
    Full(FullKv),
    Ring(RingKv),
}

impl LayerKv {
    /// Cached rows visible to a chunk starting at `len`, in position order (at most two
    /// segments for a wrapped ring).
    pub fn segments(&self, len: usize, row: usize) -> Vec<KvSegment<'_>> {
        match self {
            LayerKv::Full(full) => vec![KvSegment {
                k: &full.k[..len * row],
                v: &full.v[..len * row],
                pos0: 0,
            }],
            LayerKv::Ring(ring) => ring.segments(len, row),
        }
    }

    /// Stores the rows of positions `pos0..pos0 + n` after the chunk has attended.
    pub fn commit(&mut self, pos0: usize, k: &[f32], v: &[f32], row: usize) {
        match self {
            LayerKv::Full(full) => {
                debug_assert_eq!(full.k.len(), pos0 * row);
                full.k.extend_from_slice(k);
                full.v.extend_from_slice(v);
            }
            LayerKv::Ring(ring) => ring.write(pos0, k, v, row),
        }
    }

    /// An empty layer of the same kind, with room for this layer's rows.
    fn empty_like(&self) -> LayerKv {
        let (k, v) = self.buffers();
        let (k, v) = (Vec::with_capacity(k.len()), Vec::with_capacity(v.len()));
        match self {
            LayerKv::Full(_) => LayerKv::Full(FullKv { k, v }),
            LayerKv::Ring(ring) => LayerKv::Ring(RingKv {
                window: ring.window,
                k,
                v,
            }),
        }
    }

    fn buffers(&self) -> (&Vec<f32>, &Vec<f32>) {
        match self {
            LayerKv::Full(f) => (&f.k, &f.v),
            LayerKv::Ring(r) => (&r.k, &r.v),
        }
    }

    fn buffers_mut(&mut self) -> (&mut Vec<f32>, &mut Vec<f32>) {
        match self {
            LayerKv::Full(f) => (&mut f.k, &mut f.v),
            LayerKv::Ring(r) => (&mut r.k, &mut r.v),
        }
    }

    /// Bytes held (live rows only).
    pub fn bytes(&self) -> usize {
        let (k, v) = self.buffers();
        (k.len() + v.len()) * 4
    }
}

impl RingKv {
    /// An empty ring of `window` positions.
    pub fn new(window: usize) -> Self {
        RingKv {
            window,
            k: Vec::new(),
            v: Vec::new(),
        }
    }

    fn segments(&self, len: usize, row: usize) -> Vec<KvSegment<'_>> {
        let w = self.window;
        if len <= w {
            return vec![KvSegment {
                k: &self.k[..len * row],
                v: &self.v[..len * row],
                pos0: 0,
            }];
        }
        // Oldest cached position `len - w` sits in slot `(len - w) % w == len % w`.
        let first = len - w;
        let split = len % w;
        let mut out = vec![KvSegment {
            k: &self.k[split * row..],
            v: &self.v[split * row..],
            pos0: first,
        }];
        if split > 0 {
            out.push(KvSegment {
                k: &self.k[..split * row],
                v: &self.v[..split * row],
                pos0: first + (w - split),
            });
        }
        out
    }

    fn write(&mut self, pos0: usize, k: &[f32], v: &[f32], row: usize) {
        let n = k.len() / row;
        let w = self.window;
        // The ring holds `min(len, w)` rows; grow it before writing (slots of a chunk longer
        // than the free space are not contiguous with the current end).
        let live = (pos0 + n).min(w) * row;
        if self.k.len() < live {
            self.k.resize(live, 0.0);
            self.v.resize(live, 0.0);
        }
        // Only the last `w` positions of the chunk survive.
        for t in n.saturating_sub(w)..n {
            let slot = (pos0 + t) % w;
            self.k[slot * row..(slot + 1) * row].copy_from_slice(&k[t * row..(t + 1) * row]);
            self.v[slot * row..(slot + 1) * row].copy_from_slice(&v[t * row..(t + 1) * row]);
        }
    }
}

/// The KV state of one sequence: its length and one [`LayerKv`] per layer.
///
/// `Clone` is the snapshot: it deep-copies the live rows, so the copies never share memory.
#[derive(Debug)]
pub struct ReferenceKv {
    pub(crate) len: usize,
    pub(crate) layers: Vec<LayerKv>, // [layer]
}

impl Clone for ReferenceKv {
    /// Copies the layers in parallel ([`crate::team`]). One core's share of the memory bandwidth
    /// can be well below the machine's: on an Ice Lake server a one-thread copy of the 860-token
    /// prefix (20 MiB) took 3.5 ms, the parallel one 2.0 ms, the same as a `memcpy` from memory
    /// (which streams with non-temporal stores; copies of the layers' smaller buffers do not).
    /// The buffers are allocated here, on the calling thread, so that a snapshot's memory comes
    /// from one malloc arena (the thread's own) and is reused from it when states are released.
    fn clone(&self) -> Self {
        let mut layers: Vec<LayerKv> = self.layers.iter().map(LayerKv::empty_like).collect();
        team::for_each_chunk_zip(&mut layers, 1, &self.layers, 1, |dst, src| {
            let ((dk, dv), (sk, sv)) = (dst[0].buffers_mut(), src[0].buffers());
            dk.extend_from_slice(sk);
            dv.extend_from_slice(sv);
        });
        ReferenceKv {
            len: self.len,
            layers,
        }
    }
}

impl ReferenceKv {
    /// An empty state for `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|kind| match kind {
                LayerKind::Global => LayerKv::Full(FullKv::default()),
                LayerKind::Sliding => LayerKv::Ring(RingKv::new(cfg.sliding_window)),
            })
            .collect();
        ReferenceKv { len: 0, layers }
    }

    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of live K/V rows.
    pub fn bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.bytes() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row of position `p` is `[p, p]` (row width 2), K and V both.
    fn rows(pos0: usize, n: usize) -> Vec<f32> {
        (pos0..pos0 + n)
            .flat_map(|p| [p as f32, p as f32])
            .collect()
    }

    fn positions(segs: &[KvSegment]) -> Vec<(usize, Vec<f32>)> {
        segs.iter()
            .flat_map(|s| {
                s.k.chunks(2)
                    .enumerate()
                    .map(move |(r, k)| (s.pos0 + r, k.to_vec()))
            })
            .collect()
    }

    #[test]
    fn ring_keeps_the_last_window_positions_in_order() {
        let mut ring = LayerKv::Ring(RingKv::new(4));
        let mut len = 0;
        for &n in &[3usize, 1, 2, 7, 1, 1] {
            let k = rows(len, n);
            ring.commit(len, &k, &k, 2);
            len += n;
            let got = positions(&ring.segments(len, 2));
            let want: Vec<(usize, Vec<f32>)> = (len.saturating_sub(4)..len)
                .map(|p| (p, vec![p as f32, p as f32]))
                .collect();
            assert_eq!(got, want, "after len {len}");
            assert!(ring.bytes() <= 4 * 2 * 2 * 4);
        }
    }

    #[test]
    fn ring_layout_is_position_mod_window() {
        let mut ring = RingKv::new(3);
        let k = rows(0, 5); // positions 0..5: slots 0,1,2,0,1
        ring.write(0, &k, &k, 2);
        assert_eq!(ring.k, vec![3.0, 3.0, 4.0, 4.0, 2.0, 2.0]);
    }

    #[test]
    fn full_keeps_everything() {
        let mut full = LayerKv::Full(FullKv::default());
        full.commit(0, &rows(0, 3), &rows(0, 3), 2);
        full.commit(3, &rows(3, 2), &rows(3, 2), 2);
        let got = positions(&full.segments(5, 2));
        assert_eq!(got.len(), 5);
        assert_eq!(got[4], (4, vec![4.0, 4.0]));
    }
}
