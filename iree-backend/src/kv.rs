//! KV states on the device: [`IreeKv`], the per-model pool that recycles their buffer sets, and
//! the queue transfers that start a state (zeros, or a snapshot's copy).
//!
//! # Why a pool, and why the copies are exact
//! A snapshot used to allocate every buffer anew and copy it whole: 42.8 MiB for Gemma 3 270M
//! at a 4096-token capacity, most of it the global layers' empty rows, into fresh pages that the
//! copy then faulted in (a restore took 3.3 ms, the first snapshot 17-23 ms). Now a state's
//! buffers go back to its model's [`KvPool`] when it is released, and a snapshot copies only what
//! the source holds: the full-layer buffers' first `len` rows, the sliding rings and the
//! positions table whole.
//!
//! The rows a snapshot does not copy must not be left with old contents: the graphs mask
//! those keys, but a masked key still multiplies its value row by a zero weight, and a stale
//! non-finite value would turn that into NaN. So every buffer set keeps one invariant:
//! **full-layer rows at or above its `written` mark are zero** (a fresh set is zero: allocated
//! so on the CPU, zero-filled on Vulkan; a chunk call raises the mark to the end of the rows it
//! wrote, padding included). Starting a state in a recycled set zeroes the rows between the new
//! length and the set's old mark, so the result is byte for byte what a fresh zero set plus a
//! whole copy would hold.
//!
//! # A restore moves what the turn changed
//! The catalog's loop restores one snapshot per request: copy the prefix's state into a working
//! set, extend it by the request, decode, release it, and again. The released set still holds
//! the snapshot's rows, except what the turn wrote: full-layer rows at or above the
//! snapshot's length (the turn only appends) and the ring rows its chunk calls wrote. So each
//! state carries a **stamp** (new whenever its contents change: created, or about to be
//! written by a chunk call) and, when it began as a copy, the stamp of its source then and
//! the ring rows written since. A copy of a source whose stamp is the one a free
//! set was copied from takes that set and moves only those ring rows back (plus the
//! positions table), zeroing the full-layer rows the turn appended as any recycled set's are:
//! the result is byte for byte a whole copy's. For an 860-token prefix of Gemma 3 270M and a
//! turn that writes 37 ring rows that is about 1.1 MB moved instead of 25 MB. A source
//! written since (its stamp changed) gets a whole copy.
//!
//! # A spare set, faulted in beside the prefill
//! On the CPU device a new set is `calloc`'d memory that the kernel maps page by page as it is
//! first written, so the first snapshot of a prefix paid a page fault per 4 KiB of the rows it
//! copied (6085 for an 860-token prefix of Gemma 3 270M, 9-12 ms on a Zen 4 VM, 3-5x a
//! memcpy of the same bytes). When a model's first state starts, the pool now allocates one more
//! set and, on a thread of its own, writes zeros over the rows the state is about to hold (and
//! the rings and the positions table whole); the next set the pool hands out, in practice the
//! snapshot of that prefix, is that one, already resident. The faults still happen, but during
//! the prefill, on the other thread, instead of in the snapshot. Once per model: a model that
//! never snapshots pays those pages (about 20 MiB for an 860-token prefix) until its first
//! states are gone, and its later states allocate as before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use kvsnap_contract::{Error, Result};

use crate::graphs::{KvLayout, RingGeometry};
use crate::runtime::{BufferView, Device, DeviceKind, ElementType, Transfer};

/// Free buffer sets a model keeps at most: a restored working state and one more (the state a
/// prefill left behind once its snapshot is taken).
pub const MAX_FREE_SETS: usize = 2;

/// The KV state of one sequence: its device buffers (manifest KV order) and length.
///
/// The graphs update some buffers in place, so a buffer is never shared between two states:
/// [`kvsnap_contract::KvModel::snapshot`] copies on the device. Dropping a state returns its
/// buffers to its model's pool (unless it is poisoned).
#[derive(Debug)]
pub struct IreeKv {
    pub(crate) len: usize,
    /// Full-layer rows `written..` are zero in every full-layer buffer (module docs).
    pub(crate) written: usize,
    pub(crate) bufs: Vec<BufferView>, // [layer][k, v], then sliding.positions
    /// Set when a device call failed midway: the buffers may hold part of an update.
    pub(crate) poisoned: Option<String>,
    /// Identifies the contents: new when the state starts and before each chunk call.
    stamp: u64,
    /// For a state started as a copy: its source's stamp then, and the ring rows written
    /// since (module docs).
    since: Option<Since>,
    pool: Arc<KvPool>,
}

impl IreeKv {
    /// The state's device buffers in manifest KV order (for inspection; the model owns what
    /// they hold).
    pub fn buffers(&self) -> &[BufferView] {
        &self.bufs
    }

    /// A state over `set` (counted live in `pool` until dropped), with a new stamp.
    fn new(pool: &Arc<KvPool>, len: usize, set: FreeSet, since: Option<Since>) -> IreeKv {
        pool.lock().live += 1;
        IreeKv {
            len,
            written: set.written,
            bufs: set.bufs,
            poisoned: None,
            stamp: pool.next_stamp(),
            since,
            pool: Arc::clone(pool),
        }
    }

    /// Records a chunk call of `rows` rows (padding included) about to run at the state's end:
    /// it writes full-layer rows up to `len + rows` and ring rows `len % modulus ..` (see
    /// [`crate::graphs::RingGeometry`]), so the contents get a new stamp.
    pub(crate) fn will_write(&mut self, rows: usize) {
        let pool = &self.pool;
        self.written = self.written.max((self.len + rows).min(pool.capacity));
        self.stamp = pool.next_stamp();
        if let Some(since) = &mut self.since {
            let start = self.len % pool.ring.modulus;
            let end = (start + rows).min(since.ring_rows.len());
            since.ring_rows[start..end].fill(true);
        }
    }

    /// Records a multi-step decode call of `steps` one-row steps (padding included) about to
    /// run at the state's end: step `i` writes full-layer row `len + i` and ring row
    /// `(len + i) % modulus`, so the contents get a new stamp.
    pub(crate) fn will_write_steps(&mut self, steps: usize) {
        let pool = &self.pool;
        self.written = self.written.max((self.len + steps).min(pool.capacity));
        self.stamp = pool.next_stamp();
        if let Some(since) = &mut self.since {
            for i in 0..steps {
                since.ring_rows[(self.len + i) % pool.ring.modulus] = true;
            }
        }
    }

    /// After a chunk call of `rows` rows (padding included) at the state's end (before its
    /// length counts them), if it wrote the rings past their modulus: moves each ring's rows
    /// past the modulus to the rows their positions map to, `p % modulus`, and empties them in
    /// the positions table, so that every held position is in row `p % modulus` again (what
    /// the decode step, which attends over the modulus only, relies on:
    /// [`crate::graphs::RingGeometry`]). The rows overwritten held positions no later query
    /// sees (the same argument as for the chunk's own write). Nothing
    /// to do for a call that stayed within the modulus.
    pub(crate) fn fold_ring(&mut self, device: &Device, rows: usize) -> Result<()> {
        let ring = self.pool.ring;
        let end = (self.len % ring.modulus + rows).min(ring.rows);
        if end <= ring.modulus {
            return Ok(());
        }
        let (modulus, past) = (ring.modulus, end - ring.modulus);
        let pool = Arc::clone(&self.pool);
        let mut moves = Vec::new();
        let mut empties = Vec::new();
        for (buf, kind) in self.bufs.iter().zip(&pool.kinds) {
            let row_bytes = match *kind {
                BufKind::Ring { row_bytes } => row_bytes,
                BufKind::Whole => buf.byte_length() / ring.rows,
                BufKind::Rows { .. } => continue,
            };
            moves.push(Transfer::Within {
                buf,
                from: modulus * row_bytes,
                to: 0,
                len: past * row_bytes,
            });
            if *kind == BufKind::Whole {
                empties.push(Transfer::Zero {
                    dst: buf,
                    offset: modulus * row_bytes,
                    len: past * row_bytes,
                });
            }
        }
        // Two batches: a batch's operations may run at once, and the table's move reads what
        // its emptying writes.
        BufferView::transfer(device, &moves)?;
        BufferView::transfer(device, &empties)?;
        self.stamp = pool.next_stamp();
        if let Some(since) = &mut self.since {
            since.ring_rows[..past].fill(true);
        }
        Ok(())
    }
}

/// What a state started as a copy has changed since (module docs).
#[derive(Debug)]
struct Since {
    /// The source's stamp when it was copied.
    source: u64,
    /// Per ring row: written since.
    ring_rows: Vec<bool>,
}

impl Since {
    /// The runs of written ring rows, as row ranges.
    fn ring_runs(&self) -> Vec<std::ops::Range<usize>> {
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        for (row, _) in self.ring_rows.iter().enumerate().filter(|(_, &w)| w) {
            match runs.last_mut() {
                Some(run) if run.end == row => run.end += 1,
                _ => runs.push(row..row + 1),
            }
        }
        runs
    }
}

impl Drop for IreeKv {
    fn drop(&mut self) {
        let set = FreeSet {
            bufs: std::mem::take(&mut self.bufs),
            written: self.written,
            zero: false,
            since: self.since.take(),
        };
        // A poisoned state's buffers may hold half an update, so they are not recycled.
        self.pool.put_back(set, self.poisoned.is_none());
    }
}

/// A buffer set with its `written` mark.
struct FreeSet {
    bufs: Vec<BufferView>,
    written: usize,
    /// Every byte of every buffer is zero (a new set on the CPU device).
    zero: bool,
    /// What the set's last state changed since it was copied (module docs).
    since: Option<Since>,
}

/// What the transfers of a state's start must know about each KV buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BufKind {
    /// A full layer's `[capacity, kv_heads, head_dim]` buffer: position `p` in row `p`.
    Rows { row_bytes: usize },
    /// A sliding layer's `[ring.rows, kv_heads, head_dim]` ring: copied whole, or only the rows
    /// written since (module docs); zeroed whole.
    Ring { row_bytes: usize },
    /// The positions table: copied or zeroed whole.
    Whole,
}

/// The buffer sets of one model's released states, kept for its next states.
///
/// The pool lives as long as the model or any of its states; it empties itself when the
/// model's last live state goes, so a model with no states holds no KV memory (and a closed
/// model's allocator comes back to what loading left).
pub struct KvPool {
    /// Shape and type of each buffer, manifest KV order.
    specs: Vec<(Vec<usize>, ElementType)>,
    kinds: Vec<BufKind>,
    capacity: usize,
    ring: RingGeometry,
    /// The last stamp handed out ([`IreeKv`]'s contents).
    stamps: AtomicU64,
    /// Bytes the copies ([`KvPool::copy`]) have moved, zero fills not counted.
    copied_bytes: AtomicU64,
    inner: Mutex<PoolInner>,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
        f.debug_struct("KvPool")
            .field("buffers", &self.specs.len())
            .field("capacity", &self.capacity)
            .field("live_states", &inner.live)
            .field("free_sets", &inner.free.len())
            .finish()
    }
}

#[derive(Default)]
struct PoolInner {
    /// States of this model alive now.
    live: usize,
    free: Vec<FreeSet>,
    /// The spare set being faulted in (module docs); `None` once taken or released.
    spare: Option<JoinHandle<Option<FreeSet>>>,
    /// Whether the spare was started: once per model.
    spare_started: bool,
}

impl KvPool {
    /// The pool for KV buffers of `specs` (manifest KV order, ending with the sliding positions
    /// table), where layer `l` has buffers `2l` (K) and `2l + 1` (V) laid out as `layouts[l]`,
    /// the sliding layers' as `ring`.
    pub(crate) fn new(
        specs: Vec<(Vec<usize>, ElementType)>,
        layouts: &[KvLayout],
        capacity: usize,
        ring: RingGeometry,
    ) -> Arc<KvPool> {
        let kinds = specs
            .iter()
            .enumerate()
            .map(|(i, (dims, elem))| {
                let row_bytes = dims[1..].iter().product::<usize>() * elem.size();
                match layouts.get(i / 2) {
                    Some(KvLayout::Full) => BufKind::Rows { row_bytes },
                    Some(KvLayout::Ring) => BufKind::Ring { row_bytes },
                    None => BufKind::Whole,
                }
            })
            .collect();
        Arc::new(KvPool {
            specs,
            kinds,
            capacity,
            ring,
            stamps: AtomicU64::new(0),
            copied_bytes: AtomicU64::new(0),
            inner: Mutex::new(PoolInner::default()),
        })
    }

    fn next_stamp(&self) -> u64 {
        self.stamps.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Bytes the pool's copies (snapshots and restores) have moved so far; zero fills are not
    /// counted.
    pub fn copied_bytes(&self) -> u64 {
        self.copied_bytes.load(Ordering::Relaxed)
    }

    /// The pool's state; a panic elsewhere while it was held leaves nothing half done (every
    /// change is a push, a pop or a counter step), so a poisoned lock is taken as is.
    fn lock(&self) -> MutexGuard<'_, PoolInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Buffer sets kept for reuse now.
    pub fn free_sets(&self) -> usize {
        self.lock().free.len()
    }

    fn put_back(&self, set: FreeSet, reusable: bool) {
        let mut inner = self.lock();
        inner.live = inner.live.saturating_sub(1);
        let (dropped, spare) = if inner.live == 0 {
            (std::mem::take(&mut inner.free), inner.spare.take())
        } else {
            if reusable && !set.bufs.is_empty() && inner.free.len() < MAX_FREE_SETS {
                inner.free.push(set);
                return;
            }
            (Vec::new(), None)
        };
        // Buffers are released outside the lock; an unfinished spare is waited for, so that
        // its memory goes back with the rest.
        drop(inner);
        drop(dropped);
        drop(set);
        drop(spare.and_then(|thread| thread.join().ok().flatten()));
    }

    /// Starts the spare set (module docs) once per model, with its first state, on the CPU:
    /// its full-layer rows `..rows` and its other buffers are written with zeros on a thread
    /// of its own. (Later states find recycled sets, or none because the model had no state
    /// left: a model used statelessly, prefill after prefill, pays for one spare, not one each.)
    fn start_spare(&self, device: &Device, rows: usize) {
        let mut inner = self.lock();
        if device.kind() != DeviceKind::Cpu || inner.spare_started {
            return;
        }
        inner.spare_started = true;
        // Allocated here, as every other set is: from another thread the allocator's `calloc`
        // can come from that thread's arena, which zero-fills (touches) all of it.
        let Ok(bufs) = self.allocate(device) else {
            return;
        };
        let kinds = self.kinds.clone();
        let rows = rows.min(self.capacity);
        let device = device.clone();
        let fault_in = move || {
            // One buffer at a time: a single thread beside the prefill's.
            for zero in zero_fills(&kinds, &bufs, rows) {
                BufferView::transfer(&device, &[zero]).ok()?;
            }
            Some(FreeSet {
                bufs,
                written: 0,
                zero: true,
                since: None,
            })
        };
        // Without a thread there is no spare: the snapshot allocates its set as before.
        inner.spare = std::thread::Builder::new()
            .name("kvsnap-kv-spare".into())
            .spawn(fault_in)
            .ok();
    }

    /// A set to start a state in: a recycled one, or a new allocation. A new set on the CPU
    /// device is zero already (below); elsewhere its full-layer rows are marked unwritten up to
    /// the capacity, and the start's transfers zero them.
    ///
    /// IREE's CPU device allocates every buffer with `calloc` (its heap allocator takes the
    /// storage from `iree_allocator_malloc`, which zero-fills): fresh pages that the kernel
    /// maps as they are first touched. Zeroing them again touched all of a new set's 42.8 MiB
    /// (Gemma 3 270M, 4096-token capacity): a snapshot of an 860-token prefix faulted in 10958
    /// pages (17-30 ms on a Zen 4 VM) where its copy needs the live rows' half of them; a short
    /// chat held the whole capacity resident.
    ///
    /// A copy of the source stamped `source` takes the free set copied from it, if one is
    /// (module docs). With no free set, the spare (module docs) is next, waited for if it is
    /// still being faulted in.
    fn take(&self, device: &Device, source: Option<u64>) -> Result<FreeSet> {
        let spare = {
            let mut inner = self.lock();
            let copied_from_source = inner.free.iter().rposition(|set| {
                source.is_some() && set.since.as_ref().map(|s| s.source) == source
            });
            if let Some(i) = copied_from_source {
                return Ok(inner.free.remove(i));
            }
            if let Some(set) = inner.free.pop() {
                return Ok(set);
            }
            inner.spare.take()
        };
        if let Some(set) = spare.and_then(|thread| thread.join().ok().flatten()) {
            return Ok(set);
        }
        let bufs = self.allocate(device)?;
        let zero = device.kind() == DeviceKind::Cpu;
        Ok(FreeSet {
            bufs,
            written: if zero { 0 } else { self.capacity },
            zero,
            since: None,
        })
    }

    /// A new buffer set: one buffer per spec, manifest KV order.
    fn allocate(&self, device: &Device) -> Result<Vec<BufferView>> {
        self.specs
            .iter()
            .map(|(dims, elem)| BufferView::allocate(device, dims, *elem))
            .collect()
    }

    /// An empty state: every buffer zero. `rows` is how many rows the caller is about to write
    /// (the prefill's tokens): a model's first state starts the spare set with as many
    /// ([`KvPool::start_spare`]).
    pub(crate) fn zeros(self: &Arc<Self>, device: &Device, rows: usize) -> Result<IreeKv> {
        let set = self.take(device, None)?;
        self.start_spare(device, rows);
        if set.zero {
            return Ok(IreeKv::new(self, 0, set, None));
        }
        let ops = zero_fills(&self.kinds, &set.bufs, set.written.min(self.capacity));
        BufferView::transfer(device, &ops)?;
        let set = FreeSet { written: 0, ..set };
        Ok(IreeKv::new(self, 0, set, None))
    }

    /// An independent copy of `src` (a state of this pool's model): what it holds is copied,
    /// the rest of a recycled set zeroed; into a set copied from `src` before, only what that
    /// set's state wrote since (module docs).
    pub(crate) fn copy(self: &Arc<Self>, device: &Device, src: &IreeKv) -> Result<IreeKv> {
        if !Arc::ptr_eq(&src.pool, self) {
            return Err(Error::Backend {
                backend: device.backend(),
                op: "snapshot".into(),
                status: "the state belongs to another model".into(),
            });
        }
        let set = self.take(device, Some(src.stamp))?;
        let live = src.len.min(self.capacity);
        // Copied from `src` as it is now: its full-layer rows `..live` are still `src`'s (the
        // set's state only appended), and so are its ring rows but the ones written since.
        let since = set.since.as_ref().filter(|s| s.source == src.stamp);
        let ring_runs = since.map(Since::ring_runs);
        let mut ops = Vec::with_capacity(2 * set.bufs.len());
        for ((from, dst), kind) in src.bufs.iter().zip(&set.bufs).zip(&self.kinds) {
            let copy = |offset, len| Transfer::Copy {
                src: from,
                dst,
                offset,
                len,
            };
            match (*kind, &ring_runs) {
                (BufKind::Rows { row_bytes }, _) => {
                    if since.is_none() {
                        ops.push(copy(0, live * row_bytes));
                    }
                    let stale = set.written.min(self.capacity).saturating_sub(live);
                    ops.push(Transfer::Zero {
                        dst,
                        offset: live * row_bytes,
                        len: stale * row_bytes,
                    });
                }
                (BufKind::Ring { row_bytes }, Some(runs)) => ops.extend(
                    runs.iter()
                        .map(|run| copy(run.start * row_bytes, run.len() * row_bytes)),
                ),
                (BufKind::Ring { .. } | BufKind::Whole, _) => ops.push(copy(0, from.byte_length())),
            }
        }
        BufferView::transfer(device, &ops)?;
        let moved: usize = ops
            .iter()
            .map(|op| match op {
                Transfer::Copy { len, .. } => *len,
                _ => 0,
            })
            .sum();
        self.copied_bytes.fetch_add(moved as u64, Ordering::Relaxed);
        drop(ops);
        let set = FreeSet {
            written: live,
            ..set
        };
        let since = Since {
            source: src.stamp,
            ring_rows: vec![false; self.ring.rows],
        };
        Ok(IreeKv::new(self, src.len, set, Some(since)))
    }
}

/// Zero fills of a set's buffers (`kinds` in the same order): full-layer rows `..rows`, every
/// other buffer whole.
fn zero_fills<'b>(kinds: &[BufKind], bufs: &'b [BufferView], rows: usize) -> Vec<Transfer<'b>> {
    bufs.iter()
        .zip(kinds)
        .map(|(dst, kind)| Transfer::Zero {
            dst,
            offset: 0,
            len: match *kind {
                BufKind::Rows { row_bytes } => rows * row_bytes,
                BufKind::Ring { .. } | BufKind::Whole => dst.byte_length(),
            },
        })
        .collect()
}
