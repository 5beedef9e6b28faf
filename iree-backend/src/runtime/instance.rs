//! `Instance`: IREE's VM instance (type registry shared by every session) plus the HAL driver
//! registry devices are created from. One per process is enough; it is cheap to share by `Arc`.

use std::sync::Arc;

use kvsnap_contract::Result;

use super::ffi::{self, sys};
use super::status::check;

/// Backend name of errors that concern no particular device.
pub(crate) const RUNTIME_BACKEND: &str = "iree-runtime";

/// The IREE runtime instance: a VM instance with the HAL types registered and a driver registry
/// holding every driver this build of the runtime has (`local-sync`, `local-task`, `vulkan`).
///
/// Thread safety: IREE's VM instance and driver registry are internally synchronised, so an
/// `Instance` is `Send + Sync` and may be shared by devices and sessions on any thread.
#[derive(Clone)]
pub struct Instance {
    pub(crate) inner: Arc<InstanceInner>,
}

pub(crate) struct InstanceInner {
    pub(crate) vm: *mut sys::iree_vm_instance_t,
    pub(crate) drivers: *mut sys::iree_hal_driver_registry_t,
}

// SAFETY: iree_vm_instance_t is reference counted atomically and its type registry is immutable
// after creation; iree_hal_driver_registry_t guards its factory list with a mutex. Neither has
// thread affinity.
unsafe impl Send for InstanceInner {}
// SAFETY: see above; all operations used on these handles are thread-safe in IREE.
unsafe impl Sync for InstanceInner {}

impl Drop for InstanceInner {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `Instance::new` and are released exactly once, after
        // every device and session (which hold an `Arc` to this) is gone.
        unsafe {
            sys::iree_vm_instance_release(self.vm);
            sys::iree_hal_driver_registry_free(self.drivers);
        }
    }
}

impl Instance {
    /// Creates a VM instance and a driver registry with all drivers compiled into the runtime.
    pub fn new() -> Result<Self> {
        let alloc = ffi::system_allocator();
        let mut drivers: *mut sys::iree_hal_driver_registry_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the allocator is the process-wide libc allocator.
        let status = unsafe { sys::iree_hal_driver_registry_allocate(alloc, &mut drivers) };
        check(
            RUNTIME_BACKEND,
            || "allocate driver registry".into(),
            status,
        )?;

        let mut vm: *mut sys::iree_vm_instance_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        let status = unsafe {
            sys::iree_vm_instance_create(sys::IREE_VM_TYPE_CAPACITY_DEFAULT as _, alloc, &mut vm)
        };
        if let Err(e) = check(RUNTIME_BACKEND, || "create VM instance".into(), status) {
            // SAFETY: `drivers` was allocated above and is not shared yet.
            unsafe { sys::iree_hal_driver_registry_free(drivers) };
            return Err(e);
        }
        // From here on `inner` owns both handles and frees them on every error path.
        let inner = InstanceInner { vm, drivers };
        // SAFETY: `vm` is a live instance; registering the HAL ref types is required before any
        // HAL module or buffer view list is created.
        let status = unsafe { sys::iree_hal_module_register_all_types(inner.vm) };
        check(RUNTIME_BACKEND, || "register HAL types".into(), status)?;
        // SAFETY: `drivers` is a live registry owned by `inner`.
        let status = unsafe { sys::iree_hal_register_all_available_drivers(inner.drivers) };
        check(RUNTIME_BACKEND, || "register HAL drivers".into(), status)?;
        Ok(Instance {
            inner: Arc::new(inner),
        })
    }

    /// Names of the HAL drivers available in this runtime build (e.g. `local-task`, `vulkan`).
    pub fn driver_names(&self) -> Result<Vec<String>> {
        let alloc = ffi::system_allocator();
        let mut count: sys::iree_host_size_t = 0;
        let mut infos: *mut sys::iree_hal_driver_info_t = std::ptr::null_mut();
        // SAFETY: out-pointers to locals; on success `infos` is one allocation of `count` entries
        // from `alloc` that we free below.
        let status = unsafe {
            sys::iree_hal_driver_registry_enumerate(
                self.inner.drivers,
                alloc,
                &mut count,
                &mut infos,
            )
        };
        check(RUNTIME_BACKEND, || "enumerate HAL drivers".into(), status)?;
        let mut names = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: `infos` holds `count` initialised entries whose string views point into the
            // same allocation (IREE packs them after the array).
            names.push(unsafe { ffi::string_from_view((*infos.add(i)).driver_name) });
        }
        // SAFETY: `infos` was allocated with `alloc` by the enumerate call.
        unsafe { sys::iree_allocator_free(alloc, infos.cast()) };
        Ok(names)
    }
}
