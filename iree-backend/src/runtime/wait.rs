//! A HAL semaphore the host owns ([`Semaphore`]), and waiting for it on the calling thread,
//! parked, without a spin.
//!
//! IREE 3.13's own host wait (`iree_hal_fence_wait`, and the `hal.fence.await` a synchronous
//! entry point ends with) registers a timepoint whose state lives on the waiter's stack. The
//! worker that reaches the value runs the timepoint's callback, which wakes the waiter and only
//! then marks itself complete; before the waiter may return it spins until it sees that mark.
//! When the woken waiter lands on the signalling worker's CPU it preempts the worker between
//! the two, and spins for the rest of its time slice while the worker cannot run: on a
//! two-core host one decode step in five or ten took 4-6 ms longer (docs/BENCHMARKS.md,
//! twenty-ninth pass).
//!
//! [`Semaphore::wait`] registers its own timepoint in a reference-counted block instead: the callback
//! records the status, marks it done, unparks the waiter and drops its reference, in that
//! order, and the waiter returns as soon as it sees the mark. Nothing waits for the callback to
//! finish, because whichever side drops the block last frees it.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::Arc;
use std::thread::{self, Thread};

use kvsnap_contract::Result;

use super::device::Device;
use super::ffi::{self, sys};
use super::status::check;

/// A timeline semaphore on one device, one reference owned, released on drop.
pub(crate) struct Semaphore(*mut sys::iree_hal_semaphore_t);

// SAFETY: IREE's semaphores are thread-safe; the one reference is released once, on drop.
unsafe impl Send for Semaphore {}
// SAFETY: as above.
unsafe impl Sync for Semaphore {}

impl Semaphore {
    /// A semaphore on `device` at `initial`; `op` names what it is for in an error.
    pub(crate) fn new(device: &Device, initial: u64, op: impl FnOnce() -> String) -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: the device is live; out-pointer to a local.
        let status = unsafe {
            sys::iree_hal_semaphore_create(
                device.inner.raw,
                ffi::QUEUE_AFFINITY_ANY,
                initial,
                sys::iree_hal_semaphore_flag_bits_t_IREE_HAL_SEMAPHORE_FLAG_DEFAULT as _,
                &mut raw,
            )
        };
        check(device.backend(), op, status)?;
        Ok(Semaphore(raw))
    }

    /// The handle, for IREE calls that retain what they keep.
    pub(crate) fn raw(&self) -> *mut sys::iree_hal_semaphore_t {
        self.0
    }

    /// Blocks the calling thread until the semaphore reaches `value`, parked.
    ///
    /// Errors: the semaphore's failure (an execution error of the work that signals it), with
    /// IREE's status text, under `op`.
    pub(crate) fn wait(
        &self,
        value: u64,
        backend: &'static str,
        op: impl Fn() -> String,
    ) -> Result<()> {
        // SAFETY: `self` holds a reference until this returns.
        unsafe { wait_for(self.0, value, backend, op) }
    }
}

impl Drop for Semaphore {
    fn drop(&mut self) {
        // SAFETY: the one reference `new` created; IREE's queues hold their own.
        unsafe { sys::iree_hal_semaphore_release(self.0) };
    }
}

/// One registered wait: the timepoint IREE links into the semaphore, and what its callback
/// reports to the parked thread.
struct Waiter {
    /// Handed to IREE by address; IREE owns it from registration until the callback runs.
    timepoint: UnsafeCell<sys::iree_async_semaphore_timepoint_t>,
    /// The callback's status (null: the value was reached), taken by the waiter.
    status: AtomicPtr<sys::iree_status_handle_t>,
    /// Set by the callback after `status`.
    done: AtomicBool,
    /// The thread to unpark.
    thread: Thread,
}

// SAFETY: `timepoint` is written by the waiter before registration and then only by IREE under
// the semaphore's lock until the callback runs, which is the happens-before edge IREE provides;
// the other fields are atomics or `Thread` (Sync).
unsafe impl Sync for Waiter {}
// SAFETY: as above; the raw pointers inside `timepoint` are IREE's list links.
unsafe impl Send for Waiter {}

/// The timepoint's callback, on whichever thread reaches the value (or fails the semaphore).
///
/// # Safety
/// `user_data` is the `Arc<Waiter>` reference [`wait_for`] leaked for it; this consumes it.
unsafe extern "C" fn reached(
    user_data: *mut std::ffi::c_void,
    _timepoint: *mut sys::iree_async_semaphore_timepoint_t,
    status: sys::iree_status_t,
) {
    // SAFETY: the caller's contract: one leaked reference, consumed once (IREE fires a
    // timepoint's callback exactly once).
    let waiter = unsafe { Arc::from_raw(user_data.cast::<Waiter>().cast_const()) };
    waiter.status.store(status, Ordering::Release);
    waiter.done.store(true, Ordering::Release);
    waiter.thread.unpark();
    // Dropping `waiter` is the callback's last touch of the block.
}

/// [`Semaphore::wait`].
///
/// # Safety
/// `semaphore` must be a live HAL semaphore (every HAL semaphore embeds its async semaphore
/// at offset 0) that stays alive until this returns.
unsafe fn wait_for(
    semaphore: *mut sys::iree_hal_semaphore_t,
    value: u64,
    backend: &'static str,
    op: impl Fn() -> String,
) -> Result<()> {
    let waiter = Arc::new(Waiter {
        timepoint: UnsafeCell::new(sys::iree_async_semaphore_timepoint_t {
            next: std::ptr::null_mut(),
            prev: std::ptr::null_mut(),
            semaphore: std::ptr::null_mut(),
            minimum_value: 0,
            callback: Some(reached),
            user_data: std::ptr::null_mut(),
        }),
        status: AtomicPtr::new(std::ptr::null_mut()),
        done: AtomicBool::new(false),
        thread: thread::current(),
    });
    let leaked = Arc::into_raw(Arc::clone(&waiter));
    // SAFETY: nothing else sees the timepoint before registration.
    unsafe { (*waiter.timepoint.get()).user_data = leaked.cast_mut().cast() };
    // SAFETY: the caller guarantees the semaphore (HAL semaphores begin with their async
    // semaphore); the timepoint stays at its address inside the Arc block until both the
    // callback and this function have dropped their references.
    let status = unsafe {
        sys::iree_async_semaphore_acquire_timepoint(semaphore.cast(), value, waiter.timepoint.get())
    };
    if !status.is_null() {
        // Not registered: the callback will never run, so its reference is ours to drop.
        // SAFETY: `leaked` came from `Arc::into_raw` above and was not consumed.
        drop(unsafe { Arc::from_raw(leaked) });
        return check(backend, || format!("{}: wait", op()), status);
    }
    while !waiter.done.load(Ordering::Acquire) {
        thread::park();
    }
    let status = waiter.status.swap(std::ptr::null_mut(), Ordering::Acquire);
    check(backend, op, status)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use kvsnap_contract::Error;

    use super::*;
    use crate::runtime::Instance;

    impl Semaphore {
        fn at(initial: u64) -> Semaphore {
            Semaphore::new(&device(), initial, || "create semaphore".into()).unwrap()
        }

        fn test_wait(&self, value: u64) -> Result<()> {
            self.wait(value, "iree-cpu", || "test wait".into())
        }
    }

    fn device() -> Device {
        static INSTANCE: std::sync::OnceLock<Instance> = std::sync::OnceLock::new();
        Device::cpu(INSTANCE.get_or_init(|| Instance::new().unwrap())).unwrap()
    }

    #[test]
    fn a_value_already_reached_returns_at_once() {
        let semaphore = Semaphore::at(3);
        semaphore.test_wait(2).unwrap();
        semaphore.test_wait(3).unwrap();
    }

    #[test]
    fn parks_until_another_thread_signals() {
        let semaphore = Arc::new(Semaphore::at(0));
        let start = Instant::now();
        let signaller = {
            let semaphore = Arc::clone(&semaphore);
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(40));
                // SAFETY: the Arc keeps the semaphore alive; no frontier.
                let status =
                    unsafe { sys::iree_hal_semaphore_signal(semaphore.raw(), 1, std::ptr::null()) };
                check("iree-cpu", || "signal".into(), status).unwrap();
            })
        };
        semaphore.test_wait(1).unwrap();
        assert!(
            start.elapsed() >= Duration::from_millis(40),
            "returned before the signal, after {:?}",
            start.elapsed()
        );
        signaller.join().unwrap();
        // Many waits in a row, each signalled from another thread: none is lost or left over.
        for value in 2..200u64 {
            let shared = Arc::clone(&semaphore);
            let t = thread::spawn(move || {
                // SAFETY: as above.
                let status = unsafe {
                    sys::iree_hal_semaphore_signal(shared.raw(), value, std::ptr::null())
                };
                check("iree-cpu", || "signal".into(), status).unwrap();
            });
            semaphore.test_wait(value).unwrap();
            t.join().unwrap();
        }
    }

    #[test]
    fn a_failed_semaphore_is_an_error_carrying_its_status() {
        let semaphore = Arc::new(Semaphore::at(0));
        let failer = {
            let semaphore = Arc::clone(&semaphore);
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(20));
                let text = "the device fell over";
                // SAFETY: a status made from a static message; `fail` takes it over.
                unsafe {
                    let status = sys::iree_status_allocate(
                        sys::iree_status_code_e_IREE_STATUS_ABORTED as _,
                        c"test".as_ptr(),
                        1,
                        ffi::string_view(text),
                    );
                    sys::iree_hal_semaphore_fail(semaphore.raw(), status);
                }
            })
        };
        let err = semaphore.test_wait(1).unwrap_err();
        failer.join().unwrap();
        match err {
            Error::Backend {
                backend,
                op,
                status,
            } => {
                assert_eq!((backend, op.as_str()), ("iree-cpu", "test wait"));
                assert!(status.contains("ABORTED"), "{status}");
            }
            other => panic!("expected a backend error, got {other:?}"),
        }
        // A later wait on the failed semaphore fails at once rather than hanging.
        assert!(semaphore.test_wait(1).is_err());
    }
}
