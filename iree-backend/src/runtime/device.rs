//! `Device`: one HAL device (`local-task` on the CPU, or a Vulkan physical device) with its
//! allocator, plus the queue operations kvsnap needs (device copy and fill with semaphore waits).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvsnap_contract::{Error, Result};

use super::ffi::{self, sys};
use super::instance::Instance;
use super::status::{backend_error, check};
use super::wait::Semaphore;

/// Which HAL driver a [`Device`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// The `local-task` driver: llvm-cpu code on a pool of host threads.
    Cpu,
    /// The `vulkan` driver: SPIR-V on a Vulkan device (a GPU, or Mesa's lavapipe).
    Vulkan,
}

impl DeviceKind {
    /// The backend name carried by errors from this device: `iree-cpu` or `iree-vulkan`.
    pub fn backend(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "iree-cpu",
            DeviceKind::Vulkan => "iree-vulkan",
        }
    }

    /// The IREE driver name: `local-task` or `vulkan`.
    pub fn driver_name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "local-task",
            DeviceKind::Vulkan => "vulkan",
        }
    }
}

/// Aggregate statistics of a device allocator (`iree_hal_allocator_query_statistics`).
///
/// On the CPU device every allocation and free through the device allocator is counted, so
/// [`AllocatorStats::live_bytes`] shows leaks. IREE 3.13's Vulkan allocator records pooled
/// allocations but not their frees, so there only the `*_allocated` totals mean anything (see
/// docs/IREE.md). Imported host memory is never counted. [`Device::live_buffer_views`] counts every
/// buffer view on any device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Highest host-local bytes ever live at once.
    pub host_bytes_peak: u64,
    /// Host-local bytes allocated in total.
    pub host_bytes_allocated: u64,
    /// Host-local bytes freed in total.
    pub host_bytes_freed: u64,
    /// Highest device-local bytes ever live at once.
    pub device_bytes_peak: u64,
    /// Device-local bytes allocated in total.
    pub device_bytes_allocated: u64,
    /// Device-local bytes freed in total.
    pub device_bytes_freed: u64,
}

impl AllocatorStats {
    /// Bytes currently live (host and device), as allocated minus freed.
    pub fn live_bytes(&self) -> u64 {
        (self.host_bytes_allocated + self.device_bytes_allocated)
            .saturating_sub(self.host_bytes_freed + self.device_bytes_freed)
    }
}

/// How host memory ended up in a buffer view created by [`super::BufferView::import_host`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImportMode {
    /// The device reads the host memory in place; the owner lives as long as the buffer.
    ZeroCopy,
    /// The device could not use the host memory directly; its contents were copied into a new
    /// device buffer (the owner was dropped after the copy). `reason` says why.
    Copied {
        /// Why zero-copy import was not possible (IREE's status text or our alignment check).
        reason: String,
    },
}

/// Counters of host imports, to see which path weights took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImportStats {
    /// Imports that wrapped host memory without a copy.
    pub zero_copy: u64,
    /// Imports that fell back to a copy.
    pub copied: u64,
    /// Bytes wrapped without a copy.
    pub zero_copy_bytes: u64,
    /// Bytes copied by fallbacks.
    pub copied_bytes: u64,
}

/// Counters of a call's small inputs ([`BufferView::input`](super::BufferView::input)), to
/// see which path they took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InputStats {
    /// Inputs written through a host mapping (Vulkan's host memory the device reads).
    pub mapped: u64,
    /// Inputs uploaded into device memory (the CPU device, or a driver without such memory).
    pub uploaded: u64,
}

/// Counters of [`BufferView::read_bytes`](super::BufferView::read_bytes), to see which path
/// results took back to the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Reads through a host mapping (host memory the device wrote, or the CPU device's).
    pub mapped: u64,
    /// Reads by a transfer from device memory: a queue operation and a wait each.
    pub transferred: u64,
}

impl ImportStats {
    /// Counts one import of `bytes` that took the path `mode`.
    pub fn add(&mut self, mode: &ImportMode, bytes: u64) {
        match mode {
            ImportMode::ZeroCopy => {
                self.zero_copy += 1;
                self.zero_copy_bytes += bytes;
            }
            ImportMode::Copied { .. } => {
                self.copied += 1;
                self.copied_bytes += bytes;
            }
        }
    }
}

/// A HAL device and its allocator. Cheap to clone (shared handle).
///
/// Thread safety: IREE HAL devices, allocators and queues are internally synchronised, so a
/// `Device` is `Send + Sync`; buffers from it may be used from any thread.
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    pub(crate) raw: *mut sys::iree_hal_device_t,
    /// The one-device group the device belongs to. IREE assigns a device its queue topology and
    /// frontier tracker when it joins a group, and queue operations need both (a queue fill on a
    /// device outside any group crashes in local-task), so the group is made with the device.
    pub(crate) group: *mut sys::iree_hal_device_group_t,
    driver: *mut sys::iree_hal_driver_t,
    pub(crate) kind: DeviceKind,
    name: String,
    pub(crate) instance: Instance,
    pub(crate) live_views: AtomicU64,
    pub(crate) imports_zero_copy: AtomicU64,
    pub(crate) imports_copied: AtomicU64,
    pub(crate) zero_copy_bytes: AtomicU64,
    pub(crate) copied_bytes: AtomicU64,
    pub(crate) inputs_mapped: AtomicU64,
    pub(crate) inputs_uploaded: AtomicU64,
    pub(crate) reads_mapped: AtomicU64,
    pub(crate) reads_transferred: AtomicU64,
    /// Set once the allocator refused host memory for a call's input: later inputs upload
    /// without asking again.
    pub(crate) host_inputs_refused: AtomicBool,
}

// SAFETY: iree_hal_device_t and iree_hal_driver_t are reference counted atomically and their APIs
// are thread-safe (queues and allocators lock internally); nothing has thread affinity.
unsafe impl Send for DeviceInner {}
// SAFETY: see above.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: created in `Device::open` and released once; every buffer view and session holds
        // an `Arc<DeviceInner>`, so none outlives the device. The group retains the device and must
        // outlive it, so our device reference goes first and the group's release destroys the
        // device before the group itself; the driver goes last.
        unsafe {
            sys::iree_hal_device_release(self.raw);
            sys::iree_hal_device_group_release(self.group);
            sys::iree_hal_driver_release(self.driver);
        }
    }
}

/// Releases a driver on early returns while a device is being opened.
struct DriverGuard(*mut sys::iree_hal_driver_t);
impl Drop for DriverGuard {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the guard owns one reference to a live driver.
            unsafe { sys::iree_hal_driver_release(self.0) };
        }
    }
}

impl Device {
    /// Opens the CPU device (`local-task` driver, one worker per core).
    pub fn cpu(instance: &Instance) -> Result<Device> {
        Self::open(instance, DeviceKind::Cpu, None)
    }

    /// Opens the Vulkan device with the given ordinal (in the driver's enumeration order).
    ///
    /// Returns [`Error::Unsupported`] (`op`: "a Vulkan device") when the Vulkan driver finds no
    /// device at all, so callers can skip cleanly; other failures (no Vulkan loader, ordinal out of
    /// range, device creation) are [`Error::Backend`] with IREE's text.
    pub fn vulkan(instance: &Instance, ordinal: usize) -> Result<Device> {
        Self::open(instance, DeviceKind::Vulkan, Some(ordinal))
    }

    fn open(instance: &Instance, kind: DeviceKind, ordinal: Option<usize>) -> Result<Device> {
        let backend = kind.backend();
        let alloc = ffi::system_allocator();
        let mut driver = DriverGuard(std::ptr::null_mut());
        // SAFETY: the registry is live (held by `instance`); the name view borrows a static str.
        let status = unsafe {
            sys::iree_hal_driver_registry_try_create(
                instance.inner.drivers,
                ffi::string_view(kind.driver_name()),
                alloc,
                &mut driver.0,
            )
        };
        check(
            backend,
            || format!("create HAL driver `{}`", kind.driver_name()),
            status,
        )?;

        let mut device_names = Vec::new();
        if let Some(ordinal) = ordinal {
            device_names = query_devices(driver.0, backend)?;
            if device_names.is_empty() {
                return Err(Error::Unsupported {
                    backend,
                    op: "a Vulkan device (the vulkan driver found none)",
                });
            }
            if ordinal >= device_names.len() {
                return Err(backend_error(
                    backend,
                    format!("open Vulkan device {ordinal}"),
                    format!(
                        "ordinal out of range: the driver found {} device(s): {}",
                        device_names.len(),
                        device_names.join(", ")
                    ),
                ));
            }
        }

        // The proactor pool runs the device's async I/O; the device retains it.
        let mut pool: *mut sys::iree_async_proactor_pool_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; NULL node ids means "nodes 0..count".
        let status = unsafe {
            sys::iree_async_proactor_pool_create(
                sys::iree_numa_node_count(),
                std::ptr::null(),
                sys::iree_async_proactor_pool_options_default(),
                alloc,
                &mut pool,
            )
        };
        check(backend, || "create proactor pool".into(), status)?;
        let params = sys::iree_hal_device_create_params_t {
            next: std::ptr::null(),
            proactor_pool: pool,
        };
        let mut raw: *mut sys::iree_hal_device_t = std::ptr::null_mut();
        // SAFETY: the driver and pool are live; `params` outlives the call; out-pointer to a local.
        let status = unsafe {
            match ordinal {
                None => {
                    sys::iree_hal_driver_create_default_device(driver.0, &params, alloc, &mut raw)
                }
                Some(ordinal) => sys::iree_hal_driver_create_device_by_ordinal(
                    driver.0,
                    ordinal,
                    0,
                    std::ptr::null(),
                    &params,
                    alloc,
                    &mut raw,
                ),
            }
        };
        // SAFETY: the device retained the pool if it was created; our reference goes either way.
        unsafe { sys::iree_async_proactor_pool_release(pool) };
        check(
            backend,
            || format!("create {} device", kind.driver_name()),
            status,
        )?;
        // Join a one-device group (as iree_runtime_session_create_with_device does), which gives the
        // device's queues their frontier tracker.
        let group = match create_group(raw, backend) {
            Ok(group) => group,
            Err(e) => {
                // SAFETY: our only reference to the fresh device.
                unsafe { sys::iree_hal_device_release(raw) };
                return Err(e);
            }
        };
        // SAFETY: `raw` is a live device; the id view points into the device and is copied at once.
        let id = unsafe { ffi::string_from_view(sys::iree_hal_device_id(raw)) };
        let name = match ordinal {
            Some(o) => format!("{id} ({})", device_names[o]),
            None => id,
        };
        let driver_raw = std::mem::replace(&mut driver.0, std::ptr::null_mut());
        Ok(Device {
            inner: Arc::new(DeviceInner {
                raw,
                group,
                driver: driver_raw,
                kind,
                name,
                instance: instance.clone(),
                live_views: AtomicU64::new(0),
                imports_zero_copy: AtomicU64::new(0),
                imports_copied: AtomicU64::new(0),
                zero_copy_bytes: AtomicU64::new(0),
                copied_bytes: AtomicU64::new(0),
                inputs_mapped: AtomicU64::new(0),
                inputs_uploaded: AtomicU64::new(0),
                reads_mapped: AtomicU64::new(0),
                reads_transferred: AtomicU64::new(0),
                host_inputs_refused: AtomicBool::new(false),
            }),
        })
    }

    /// The driver this device runs on.
    pub fn kind(&self) -> DeviceKind {
        self.inner.kind
    }

    /// The backend name errors from this device carry (`iree-cpu` or `iree-vulkan`).
    pub fn backend(&self) -> &'static str {
        self.inner.kind.backend()
    }

    /// A human-readable device name (IREE's device id, plus the physical device for Vulkan).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The instance the device was created from.
    pub fn instance(&self) -> &Instance {
        &self.inner.instance
    }

    /// True if both handles refer to the same opened device.
    pub fn same_device(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The allocator's aggregate statistics.
    pub fn allocator_stats(&self) -> AllocatorStats {
        let mut s = sys::iree_hal_allocator_statistics_t::default();
        // SAFETY: the device is live; its allocator pointer is borrowed for the call only.
        unsafe {
            let allocator = sys::iree_hal_device_allocator(self.inner.raw);
            sys::iree_hal_allocator_query_statistics(allocator, &mut s);
        }
        AllocatorStats {
            host_bytes_peak: s.host_bytes_peak as u64,
            host_bytes_allocated: s.host_bytes_allocated as u64,
            host_bytes_freed: s.host_bytes_freed as u64,
            device_bytes_peak: s.device_bytes_peak as u64,
            device_bytes_allocated: s.device_bytes_allocated as u64,
            device_bytes_freed: s.device_bytes_freed as u64,
        }
    }

    /// Number of [`super::BufferView`]s of this device alive right now (ours, counted in Rust).
    pub fn live_buffer_views(&self) -> u64 {
        self.inner.live_views.load(Ordering::Relaxed)
    }

    /// Counters of [`super::BufferView::import_host`] calls by the path they took.
    pub fn import_stats(&self) -> ImportStats {
        ImportStats {
            zero_copy: self.inner.imports_zero_copy.load(Ordering::Relaxed),
            copied: self.inner.imports_copied.load(Ordering::Relaxed),
            zero_copy_bytes: self.inner.zero_copy_bytes.load(Ordering::Relaxed),
            copied_bytes: self.inner.copied_bytes.load(Ordering::Relaxed),
        }
    }

    /// How a call's small inputs reached this device so far.
    pub fn input_stats(&self) -> InputStats {
        InputStats {
            mapped: self.inner.inputs_mapped.load(Ordering::Relaxed),
            uploaded: self.inner.inputs_uploaded.load(Ordering::Relaxed),
        }
    }

    /// How results came back to the host so far.
    pub fn read_stats(&self) -> ReadStats {
        ReadStats {
            mapped: self.inner.reads_mapped.load(Ordering::Relaxed),
            transferred: self.inner.reads_transferred.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn allocator(&self) -> *mut sys::iree_hal_allocator_t {
        // SAFETY: the device is live; the allocator lives as long as the device.
        unsafe { sys::iree_hal_device_allocator(self.inner.raw) }
    }

    /// Submits one queue operation that signals a semaphore to 1 and blocks until it is
    /// signalled. `submit` receives the (empty) wait list and the signal list.
    pub(crate) fn submit_and_wait(
        &self,
        op: &dyn Fn() -> String,
        submit: impl FnOnce(
            sys::iree_hal_semaphore_list_t,
            sys::iree_hal_semaphore_list_t,
        ) -> sys::iree_status_t,
    ) -> Result<()> {
        let backend = self.backend();
        let semaphore = Semaphore::new(self, 0, || format!("{}: create semaphore", op()))?;
        let mut raw = semaphore.raw();
        let mut value: u64 = 1;
        let wait = sys::iree_hal_semaphore_list_t {
            count: 0,
            semaphores: std::ptr::null_mut(),
            payload_values: std::ptr::null_mut(),
        };
        let signal = sys::iree_hal_semaphore_list_t {
            count: 1,
            semaphores: &mut raw,
            payload_values: &mut value,
        };
        check(
            backend,
            || format!("{}: submit", op()),
            submit(wait, signal),
        )?;
        semaphore.wait(1, backend, || format!("{}: wait", op()))
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("kind", &self.inner.kind)
            .field("name", &self.inner.name)
            .finish()
    }
}

/// Creates a frontier tracker and a group holding only `device`; the group retains both.
fn create_group(
    device: *mut sys::iree_hal_device_t,
    backend: &'static str,
) -> Result<*mut sys::iree_hal_device_group_t> {
    let alloc = ffi::system_allocator();
    let mut tracker: *mut sys::iree_async_frontier_tracker_t = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    let status = unsafe {
        sys::iree_async_frontier_tracker_create(frontier_tracker_options(), alloc, &mut tracker)
    };
    check(backend, || "create frontier tracker".into(), status)?;
    let mut group: *mut sys::iree_hal_device_group_t = std::ptr::null_mut();
    // SAFETY: device and tracker are live; the group retains both on success. Our tracker
    // reference is released either way.
    let status = unsafe {
        let status =
            sys::iree_hal_device_group_create_from_device(device, tracker, alloc, &mut group);
        sys::iree_async_frontier_tracker_release(tracker);
        status
    };
    check(backend, || "create device group".into(), status)?;
    Ok(group)
}

/// `iree_async_frontier_tracker_options_default()` (a static inline in the headers).
fn frontier_tracker_options() -> sys::iree_async_frontier_tracker_options_t {
    sys::iree_async_frontier_tracker_options_t {
        axis_table_capacity: 256,
        session_epoch: 1,
        machine_index: 0,
    }
}

/// What to try when the Vulkan loader found no driver that could make an instance
/// (`VK_ERROR_INCOMPATIBLE_DRIVER`): in a headless container NVIDIA's manifest names
/// `libGLX_nvidia.so.0`, which has no instance there while `libEGL_nvidia.so.0` does (seen on
/// an H100 host, driver 580).
const INCOMPATIBLE_DRIVER_HINT: &str = "the Vulkan loader found no driver that could start \
     (is a Vulkan driver installed? with NVIDIA's driver in a headless container, point \
     VK_ICD_FILENAMES at a driver manifest whose library_path is libEGL_nvidia.so.0; README, \
     \"Vulkan devices\")";

/// `e` with [`INCOMPATIBLE_DRIVER_HINT`] added where the loader gave no driver.
fn driver_hint(e: Error) -> Error {
    match e {
        Error::Backend {
            backend,
            op,
            status,
        } if status.contains("VK_ERROR_INCOMPATIBLE_DRIVER") => Error::Backend {
            backend,
            op,
            status: format!("{status}: {INCOMPATIBLE_DRIVER_HINT}"),
        },
        e => e,
    }
}

/// The names of the devices a driver can open, in ordinal order.
fn query_devices(
    driver: *mut sys::iree_hal_driver_t,
    backend: &'static str,
) -> Result<Vec<String>> {
    let alloc = ffi::system_allocator();
    let mut count: sys::iree_host_size_t = 0;
    let mut infos: *mut sys::iree_hal_device_info_t = std::ptr::null_mut();
    // SAFETY: the driver is live; out-pointers to locals; `infos` is one allocation from `alloc`.
    let status = unsafe {
        sys::iree_hal_driver_query_available_devices(driver, alloc, &mut count, &mut infos)
    };
    check(backend, || "query available devices".into(), status).map_err(driver_hint)?;
    let mut names = Vec::with_capacity(count);
    for i in 0..count {
        // SAFETY: `infos` holds `count` entries whose strings live in the same allocation.
        let name = unsafe { ffi::string_from_view((*infos.add(i)).name) };
        names.push(name);
    }
    if !infos.is_null() {
        // SAFETY: allocated with `alloc` by the query above.
        unsafe { sys::iree_allocator_free(alloc, infos.cast()) };
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loader_without_a_driver_says_what_to_try() {
        let status = "physical_device.c:441: UNAVAILABLE; [vkCreateInstance] \
                      VK_ERROR_INCOMPATIBLE_DRIVER";
        let e = driver_hint(backend_error(
            "iree-vulkan",
            "query available devices",
            status,
        ));
        let Error::Backend {
            op, status: got, ..
        } = &e
        else {
            panic!("not a backend error: {e:?}");
        };
        assert_eq!(op, "query available devices");
        assert!(got.starts_with(status), "{got}");
        assert!(got.contains("VK_ICD_FILENAMES") && got.contains("libEGL_nvidia.so.0"));
        // Any other failure passes through as it was.
        let other = backend_error("iree-vulkan", "query available devices", "OUT_OF_MEMORY");
        let before = other.to_string();
        assert_eq!(driver_hint(other).to_string(), before);
    }
}
