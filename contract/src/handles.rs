//! `HandleTable`: opaque `u64` handles for values that FFI callers cannot own.
//!
//! In Rust a released KV state is a compile error (`release` takes it by value). Across an FFI
//! boundary (JNI `long`s, a fuzzer's integers) the caller holds a number instead, so the table
//! turns every misuse of that number into [`Error::StaleHandle`]: zero, never issued, released
//! (double release included), or issued by another table (another model). Nothing a caller
//! passes can reach freed memory or another model's state.
//!
//! # Handle layout
//! `tag:16 | generation:24 | index:24`, most significant first. `tag` is per table and never 0,
//! so no handle is 0. `generation` counts the reuses of slot `index` from 1; a slot whose
//! generation would wrap is retired instead of reused, so a stale handle never aliases a later
//! state.
//!
//! # Locking
//! Two levels, never held in the other order:
//! - the table lock (one `Mutex` around the slot vector) is held only to look a handle up,
//!   insert or remove an entry: no model code runs under it;
//! - each live value sits in its own `Mutex`. [`HandleTable::with_mut`] and
//!   [`HandleTable::with_ref`] take the table lock, clone the value's `Arc`, drop the table lock,
//!   then lock the value for the duration of the call.
//!
//! So calls on distinct handles run in parallel; calls on one handle are serialised. A release
//! that races a call on the same handle waits for the call; a call that was waiting for that
//! value then finds it gone and fails with `StaleHandle` ("released while this call waited").
//!
//! # Poisoning
//! A value is poisoned when a `with_mut` closure panics, or returns an error that is not an
//! input error. Input errors (bad tokens or shapes, context overflow, stale handles, ...) are
//! checked before a backend changes anything; other errors (device, I/O) may strike midway
//! through an update. A
//! poisoned value fails every later call with [`Error::Poisoned`] naming the first cause; it can
//! still be released.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};

/// Bits of the slot index in a handle.
const INDEX_BITS: u32 = 24;
/// Bits of the generation in a handle.
const GENERATION_BITS: u32 = 24;
/// Most slots a table holds at once.
pub const MAX_LIVE: usize = (1 << INDEX_BITS) - 1;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
const GENERATION_MASK: u64 = (1 << GENERATION_BITS) - 1;
const TAG_SHIFT: u32 = INDEX_BITS + GENERATION_BITS;

/// The `reason` texts of [`Error::StaleHandle`], so callers can tell them apart without parsing.
pub mod reason {
    /// The handle is 0.
    pub const ZERO: &str = "zero handle";
    /// The handle was issued by another table (in kvsnap: another model, or another kind of
    /// handle).
    pub const FOREIGN: &str = "issued by another model";
    /// No state was ever issued under this handle.
    pub const NEVER_ISSUED: &str = "never issued";
    /// The state was released (this includes a second release of the same handle).
    pub const RELEASED: &str = "released";
    /// The state was released by another thread while this call waited for it.
    pub const RELEASED_WHILE_WAITING: &str = "released while this call waited";
}

/// Tags handed to tables, so a handle from one table is recognised as foreign by another.
static NEXT_TAG: AtomicU64 = AtomicU64::new(0);

/// A live value with its poisoning record.
struct Entry<K> {
    /// `None` once released; a call that waited for the lock then reports a stale handle.
    value: Option<K>,
    /// The first failure that may have left `value` half-updated.
    poisoned: Option<String>,
}

type Shared<K> = Arc<Mutex<Entry<K>>>;

/// One slot of the table: its current generation, and the value issued under it if live.
struct Slot<K> {
    generation: u64,
    entry: Option<Shared<K>>,
}

struct Slots<K> {
    slots: Vec<Slot<K>>,
    /// Indices of empty slots that may be reused.
    free: Vec<usize>,
    closed: bool,
}

/// Maps opaque, never-zero `u64` handles to values of type `K` (KV states); see the
/// [module documentation](self) for the handle layout, the locking and poisoning.
pub struct HandleTable<K> {
    tag: u64,
    inner: Mutex<Slots<K>>,
}

impl<K> Default for HandleTable<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K> HandleTable<K> {
    /// An empty table with a fresh tag.
    pub fn new() -> Self {
        // Tags cycle through 1..=0xffff; tables 65535 apart share a tag, and then only the
        // generation check tells their handles apart.
        let tag = NEXT_TAG.fetch_add(1, Ordering::Relaxed) % 0xffff + 1;
        HandleTable {
            tag,
            inner: Mutex::new(Slots {
                slots: Vec::new(),
                free: Vec::new(),
                closed: false,
            }),
        }
    }

    /// Stores `value` and returns its handle.
    ///
    /// # Errors
    /// [`Error::Closed`] after [`HandleTable::close`]; [`Error::Unsupported`] when
    /// [`MAX_LIVE`] values are already live.
    pub fn insert(&self, op: &'static str, value: K) -> Result<u64> {
        let mut t = self.lock();
        if t.closed {
            return Err(Error::Closed { op });
        }
        let index = match t.free.pop() {
            Some(index) => index,
            None if t.slots.len() < MAX_LIVE => {
                t.slots.push(Slot {
                    generation: 1,
                    entry: None,
                });
                t.slots.len() - 1
            }
            None => {
                return Err(Error::Unsupported {
                    backend: "handle table",
                    op: "more than 16777215 live handles",
                })
            }
        };
        let slot = &mut t.slots[index];
        slot.entry = Some(Arc::new(Mutex::new(Entry {
            value: Some(value),
            poisoned: None,
        })));
        Ok(self.tag << TAG_SHIFT | slot.generation << INDEX_BITS | index as u64)
    }

    /// Runs `f` on the value of `handle` with exclusive access, for operations that change it.
    ///
    /// The value is poisoned when `f` panics or returns an error that is not an input error.
    pub fn with_mut<R>(
        &self,
        op: &'static str,
        handle: u64,
        f: impl FnOnce(&mut K) -> Result<R>,
    ) -> Result<R> {
        let shared = self.lookup(op, handle)?;
        let mut entry = lock_entry(op, handle, &shared)?;
        let value = entry.value.as_mut().ok_or(Error::StaleHandle {
            op,
            handle,
            reason: reason::RELEASED_WHILE_WAITING,
        })?;
        let result = f(value);
        if let Err(e) = &result {
            if !is_input_error(e) {
                entry.poisoned = Some(e.to_string());
            }
        }
        result
    }

    /// Runs `f` on the value of `handle` for operations that only read it (snapshot, length).
    ///
    /// Calls on one handle are still serialised; a failure of `f` does not poison the value.
    pub fn with_ref<R>(
        &self,
        op: &'static str,
        handle: u64,
        f: impl FnOnce(&K) -> Result<R>,
    ) -> Result<R> {
        let shared = self.lookup(op, handle)?;
        let entry = lock_entry(op, handle, &shared)?;
        let value = entry.value.as_ref().ok_or(Error::StaleHandle {
            op,
            handle,
            reason: reason::RELEASED_WHILE_WAITING,
        })?;
        f(value)
    }

    /// Removes the value of `handle` and returns it; the handle is stale from now on.
    ///
    /// Waits for a call in progress on the same handle. Poisoned values are returned too, so
    /// the caller can free them.
    pub fn remove(&self, op: &'static str, handle: u64) -> Result<K> {
        let shared = {
            let mut t = self.lock();
            let index = self.resolve(op, handle, &t)?;
            let slot = &mut t.slots[index];
            let shared = slot.entry.take().expect("resolve checked the slot is live");
            retire_or_free(&mut t, index);
            shared
        };
        take(&shared).ok_or(Error::StaleHandle {
            op,
            handle,
            reason: reason::RELEASED_WHILE_WAITING,
        })
    }

    /// Closes the table: every handle becomes invalid, later calls fail with
    /// [`Error::Closed`], and the live values are returned for the caller to free.
    ///
    /// Waits for the calls in progress. Closing a closed table returns nothing.
    pub fn close(&self) -> Vec<K> {
        let live: Vec<Shared<K>> = {
            let mut t = self.lock();
            t.closed = true;
            t.free.clear();
            t.slots.iter_mut().filter_map(|s| s.entry.take()).collect()
        };
        live.iter().filter_map(take).collect()
    }

    /// Number of live values.
    pub fn live(&self) -> usize {
        self.lock()
            .slots
            .iter()
            .filter(|s| s.entry.is_some())
            .count()
    }

    /// Whether [`HandleTable::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// The table lock. A panic never happens while it is held (no foreign code runs under it),
    /// so a poisoned lock still holds consistent slots.
    fn lock(&self) -> MutexGuard<'_, Slots<K>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lookup(&self, op: &'static str, handle: u64) -> Result<Shared<K>> {
        let t = self.lock();
        let index = self.resolve(op, handle, &t)?;
        Ok(Arc::clone(
            t.slots[index]
                .entry
                .as_ref()
                .expect("resolve checked the slot is live"),
        ))
    }

    /// The slot index of a live `handle`.
    fn resolve(&self, op: &'static str, handle: u64, t: &Slots<K>) -> Result<usize> {
        if t.closed {
            return Err(Error::Closed { op });
        }
        let stale = |reason| Error::StaleHandle { op, handle, reason };
        if handle == 0 {
            return Err(stale(reason::ZERO));
        }
        if handle >> TAG_SHIFT != self.tag {
            return Err(stale(reason::FOREIGN));
        }
        let index = (handle & INDEX_MASK) as usize;
        let generation = handle >> INDEX_BITS & GENERATION_MASK;
        let Some(slot) = t.slots.get(index) else {
            return Err(stale(reason::NEVER_ISSUED));
        };
        if generation == 0 || generation > slot.generation {
            return Err(stale(reason::NEVER_ISSUED));
        }
        if generation < slot.generation || slot.entry.is_none() {
            return Err(stale(reason::RELEASED));
        }
        Ok(index)
    }
}

/// Advances the generation of the now empty slot `index`, and offers it for reuse unless the
/// generation is exhausted.
fn retire_or_free<K>(t: &mut Slots<K>, index: usize) {
    let slot = &mut t.slots[index];
    slot.generation += 1;
    if slot.generation <= GENERATION_MASK {
        t.free.push(index);
    }
}

/// Locks one value; a value whose lock was poisoned by a panic reports [`Error::Poisoned`], as
/// does a value poisoned by an earlier backend failure.
fn lock_entry<'a, K>(
    op: &'static str,
    handle: u64,
    shared: &'a Mutex<Entry<K>>,
) -> Result<MutexGuard<'a, Entry<K>>> {
    let entry = match shared.lock() {
        Ok(entry) => entry,
        Err(p) => {
            let mut entry = p.into_inner();
            entry
                .poisoned
                .get_or_insert_with(|| "a panic during an earlier operation".to_string());
            shared.clear_poison();
            entry
        }
    };
    if entry.value.is_none() {
        return Err(Error::StaleHandle {
            op,
            handle,
            reason: reason::RELEASED_WHILE_WAITING,
        });
    }
    match &entry.poisoned {
        Some(cause) => Err(Error::Poisoned {
            op,
            cause: cause.clone(),
        }),
        None => Ok(entry),
    }
}

/// Takes the value out of a removed entry, waiting for a call in progress on it.
fn take<K>(shared: &Shared<K>) -> Option<K> {
    shared
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .value
        .take()
}

/// Whether `e` is an input error: one the contract checks before anything changes, so the
/// state it concerns is intact.
fn is_input_error(e: &Error) -> bool {
    matches!(
        e,
        Error::TokenOutOfRange { .. }
            | Error::EmptyInput { .. }
            | Error::ContextOverflow { .. }
            | Error::ShapeMismatch { .. }
            | Error::NonFinite { .. }
            | Error::KvBudget { .. }
            | Error::Unsupported { .. }
            | Error::StaleHandle { .. }
            | Error::Closed { .. }
            | Error::Poisoned { .. }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    fn stale_reason(r: Result<impl std::fmt::Debug>) -> &'static str {
        match r {
            Err(Error::StaleHandle { reason, .. }) => reason,
            other => panic!("expected a stale handle, got {other:?}"),
        }
    }

    #[test]
    fn handles_are_never_zero_and_resolve_to_their_values() {
        let t = HandleTable::new();
        let a = t.insert("insert", 10).unwrap();
        let b = t.insert("insert", 20).unwrap();
        assert_ne!(a, 0);
        assert_ne!(a, b);
        assert_eq!(t.with_ref("get", a, |v| Ok(*v)).unwrap(), 10);
        t.with_mut("add", b, |v| {
            *v += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(t.with_ref("get", b, |v| Ok(*v)).unwrap(), 21);
        assert_eq!(t.live(), 2);
    }

    #[test]
    fn zero_foreign_released_and_never_issued_handles_are_typed_errors() {
        let t = HandleTable::new();
        let other = HandleTable::new();
        let h = t.insert("insert", 1u32).unwrap();
        let foreign = other.insert("insert", 2u32).unwrap();

        assert_eq!(stale_reason(t.with_ref("get", 0, |_| Ok(()))), reason::ZERO);
        assert_eq!(
            stale_reason(t.with_ref("get", foreign, |_| Ok(()))),
            reason::FOREIGN
        );
        let unissued_index = h + 5;
        assert_eq!(
            stale_reason(t.with_ref("get", unissued_index, |_| Ok(()))),
            reason::NEVER_ISSUED
        );
        let future_generation = h + (1 << INDEX_BITS);
        assert_eq!(
            stale_reason(t.with_ref("get", future_generation, |_| Ok(()))),
            reason::NEVER_ISSUED
        );

        assert_eq!(t.remove("release", h).unwrap(), 1);
        assert_eq!(
            stale_reason(t.with_mut("step", h, |_| Ok(()))),
            reason::RELEASED
        );
        assert_eq!(stale_reason(t.remove("release", h)), reason::RELEASED);
        let msg = t.remove("release", h).unwrap_err().to_string();
        assert!(
            msg.contains("release: stale handle") && msg.contains("released"),
            "{msg}"
        );
    }

    #[test]
    fn a_reused_slot_gets_a_new_handle_and_the_old_one_stays_stale() {
        let t = HandleTable::new();
        let old = t.insert("insert", "old").unwrap();
        t.remove("release", old).unwrap();
        let new = t.insert("insert", "new").unwrap();
        assert_eq!(old & INDEX_MASK, new & INDEX_MASK, "the slot is reused");
        assert_ne!(old, new);
        assert_eq!(
            stale_reason(t.with_ref("get", old, |_| Ok(()))),
            reason::RELEASED
        );
        assert_eq!(t.with_ref("get", new, |v| Ok(*v)).unwrap(), "new");
    }

    #[test]
    fn an_exhausted_slot_is_retired_not_reused() {
        let t = HandleTable::new();
        let first = t.insert("insert", 0).unwrap();
        t.remove("release", first).unwrap();
        t.lock().slots[0].generation = GENERATION_MASK;
        let last = t.insert("insert", 1).unwrap();
        assert_eq!(last >> INDEX_BITS & GENERATION_MASK, GENERATION_MASK);
        t.remove("release", last).unwrap();
        let next = t.insert("insert", 2).unwrap();
        assert_eq!(next & INDEX_MASK, 1, "slot 0 is retired");
        assert_eq!(
            stale_reason(t.with_ref("get", last, |_| Ok(()))),
            reason::RELEASED
        );
    }

    #[test]
    fn close_returns_the_live_values_and_later_calls_report_closed() {
        let t = HandleTable::new();
        let a = t.insert("insert", 1).unwrap();
        let b = t.insert("insert", 2).unwrap();
        t.remove("release", a).unwrap();
        assert_eq!(t.close(), vec![2]);
        assert!(t.is_closed());
        assert!(matches!(
            t.with_ref("step", b, |_| Ok(())),
            Err(Error::Closed { op: "step" })
        ));
        assert!(matches!(t.insert("prefill", 3), Err(Error::Closed { .. })));
        assert!(t.close().is_empty());
    }

    #[test]
    fn backend_failures_poison_input_errors_do_not() {
        let t = HandleTable::new();
        let h = t.insert("insert", 0).unwrap();
        let input = t.with_mut("extend", h, |_| -> Result<()> {
            Err(Error::EmptyInput { op: "extend" })
        });
        assert!(matches!(input, Err(Error::EmptyInput { .. })));
        t.with_mut("step", h, |_| Ok(())).unwrap();

        let device = t.with_mut("step", h, |_| -> Result<()> {
            Err(Error::Backend {
                backend: "test",
                op: "step".into(),
                status: "DEVICE_LOST".into(),
            })
        });
        assert!(matches!(device, Err(Error::Backend { .. })));
        match t.with_ref("len", h, |_| Ok(())) {
            Err(Error::Poisoned { cause, .. }) => assert!(cause.contains("DEVICE_LOST")),
            other => panic!("expected poisoned, got {other:?}"),
        }
        assert_eq!(
            t.remove("release", h).unwrap(),
            0,
            "poisoned states can be freed"
        );
    }

    #[test]
    fn a_panic_poisons_only_its_own_value() {
        let t = HandleTable::new();
        let a = t.insert("insert", 0).unwrap();
        let b = t.insert("insert", 0).unwrap();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            t.with_mut("step", a, |_| -> Result<()> { panic!("boom") })
        }));
        assert!(caught.is_err());
        match t.with_mut("step", a, |_| Ok(())) {
            Err(Error::Poisoned { cause, .. }) => assert!(cause.contains("panic")),
            other => panic!("expected poisoned, got {other:?}"),
        }
        t.with_mut("step", b, |_| Ok(())).unwrap();
        t.remove("release", a).unwrap();
    }

    #[test]
    fn distinct_handles_run_in_parallel() {
        // Both closures wait on one barrier: this only finishes if they hold their value locks
        // at the same time.
        let t = HandleTable::new();
        let handles: Vec<u64> = (0..4).map(|i| t.insert("insert", i).unwrap()).collect();
        let barrier = Barrier::new(handles.len());
        std::thread::scope(|s| {
            for &h in &handles {
                let (t, barrier) = (&t, &barrier);
                s.spawn(move || {
                    t.with_mut("step", h, |v| {
                        barrier.wait();
                        *v += 10;
                        Ok(())
                    })
                    .unwrap()
                });
            }
        });
        let values: Vec<i32> = handles
            .iter()
            .map(|&h| t.with_ref("get", h, |v| Ok(*v)).unwrap())
            .collect();
        assert_eq!(values, vec![10, 11, 12, 13]);
    }

    #[test]
    fn calls_on_one_handle_are_serialised() {
        let t = HandleTable::new();
        let h = t.insert("insert", 0u64).unwrap();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        t.with_mut("step", h, |v| {
                            // A read-modify-write that would lose updates without the lock.
                            let old = *v;
                            std::hint::black_box(());
                            *v = old + 1;
                            Ok(())
                        })
                        .unwrap();
                    }
                });
            }
        });
        assert_eq!(t.remove("release", h).unwrap(), 4000);
    }

    #[test]
    fn a_release_racing_a_call_waits_for_it() {
        let t = HandleTable::new();
        let h = t.insert("insert", 0).unwrap();
        let started = Barrier::new(2);
        std::thread::scope(|s| {
            s.spawn(|| {
                t.with_mut("step", h, |v| {
                    started.wait();
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    *v = 7;
                    Ok(())
                })
                .unwrap()
            });
            started.wait();
            assert_eq!(
                t.remove("release", h).unwrap(),
                7,
                "the step finished first"
            );
        });
    }
}
