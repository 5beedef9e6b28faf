//! `BufferView`: a device buffer with a shape and an element type, the value IREE functions take
//! and return. Created by allocation, host upload, zero-copy host import, device copy, or as a
//! function result; read back to the host only on request.

use std::sync::atomic::Ordering;

use kvsnap_contract::{Error, Result};

use super::device::{Device, DeviceKind, ImportMode};
use super::ffi::{self, sys};
use super::status::{backend_error, check};

/// Alignment IREE's CPU (heap) allocator requires of imported host memory
/// (`IREE_HAL_HEAP_BUFFER_ALIGNMENT`).
pub const HOST_IMPORT_ALIGNMENT: usize = 64;

/// Element types kvsnap passes to and from IREE functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElementType {
    /// 32-bit IEEE float (`f32` in MLIR).
    F32,
    /// 16-bit IEEE float (`f16`).
    F16,
    /// 32-bit integer (`i32`, signless as in StableHLO).
    I32,
    /// 64-bit integer (`i64`, signless).
    I64,
    /// 8-bit boolean (`i1` tensors are stored one byte per element).
    Bool,
    /// 8-bit integer (`i8`, signless).
    I8,
}

impl ElementType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElementType::F32 | ElementType::I32 => 4,
            ElementType::F16 => 2,
            ElementType::I64 => 8,
            ElementType::Bool | ElementType::I8 => 1,
        }
    }

    fn raw(self) -> sys::iree_hal_element_type_t {
        (match self {
            ElementType::F32 => sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_FLOAT_32,
            ElementType::F16 => sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_FLOAT_16,
            ElementType::I32 => sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_INT_32,
            ElementType::I64 => sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_INT_64,
            ElementType::Bool => sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_BOOL_8,
            ElementType::I8 => sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_INT_8,
        }) as sys::iree_hal_element_type_t
    }

    fn from_raw(raw: sys::iree_hal_element_type_t) -> Option<Self> {
        use ElementType::*;
        #[allow(non_upper_case_globals)]
        let t = match raw as sys::iree_hal_element_types_t {
            sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_FLOAT_32 => F32,
            sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_FLOAT_16 => F16,
            sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_INT_32
            | sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_SINT_32
            | sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_UINT_32 => I32,
            sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_INT_64
            | sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_SINT_64
            | sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_UINT_64 => I64,
            sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_BOOL_8 => Bool,
            sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_INT_8
            | sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_SINT_8
            | sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_UINT_8 => I8,
            _ => return None,
        };
        Some(t)
    }
}

/// One operation of a [`BufferView::transfer`] batch, in bytes.
#[derive(Debug)]
pub enum Transfer<'a> {
    /// `len` bytes of `src` at `offset` to the same offset of `dst`.
    Copy {
        src: &'a BufferView,
        dst: &'a BufferView,
        offset: usize,
        len: usize,
    },
    /// `len` zero bytes into `dst` at `offset` (both multiples of 4).
    Zero {
        dst: &'a BufferView,
        offset: usize,
        len: usize,
    },
    /// `len` bytes of `buf` at `from` to `to` in the same buffer (the two ranges apart).
    Within {
        buf: &'a BufferView,
        from: usize,
        to: usize,
        len: usize,
    },
}

impl Transfer<'_> {
    /// Bytes the operation writes.
    pub fn len(&self) -> usize {
        match self {
            Transfer::Copy { len, .. }
            | Transfer::Zero { len, .. }
            | Transfer::Within { len, .. } => *len,
        }
    }

    /// Whether it writes nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A device buffer with a shape and an element type (`iree_hal_buffer_view_t`).
///
/// Dropping it releases the reference; the memory goes when IREE holds no other reference (a
/// function result may share storage with an input, see `docs/IREE.md`).
///
/// Thread safety: buffer views are immutable metadata over an atomically reference-counted buffer,
/// so a `BufferView` is `Send + Sync`. The *contents* are device memory written by queue operations
/// and function calls: callers must not read a buffer back while a call on another thread writes
/// it (the values would be torn, though memory stays valid).
pub struct BufferView {
    raw: *mut sys::iree_hal_buffer_view_t,
    device: Device,
}

// SAFETY: iree_hal_buffer_view_t is immutable after creation and reference counted atomically; the
// underlying iree_hal_buffer_t is likewise thread-safe to retain/release/map. The owning device is
// Send + Sync.
unsafe impl Send for BufferView {}
// SAFETY: all `&self` methods only read metadata or go through thread-safe device queue operations.
unsafe impl Sync for BufferView {}

impl Drop for BufferView {
    fn drop(&mut self) {
        // SAFETY: `raw` holds exactly one reference, owned by this value.
        unsafe { sys::iree_hal_buffer_view_release(self.raw) };
        self.device.inner.live_views.fetch_sub(1, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for BufferView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferView")
            .field("shape", &self.shape())
            .field("element_type", &self.element_type())
            .field("byte_length", &self.byte_length())
            .field("device", &self.device.kind())
            .finish()
    }
}

fn element_count(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// `Ok` where `bytes` host bytes are exactly `shape` x `elem`, else the typed error of `op`.
fn host_data_fits(
    op: &'static str,
    shape: &[usize],
    elem: ElementType,
    bytes: usize,
) -> Result<()> {
    let expected = element_count(shape).and_then(|n| n.checked_mul(elem.size()));
    if expected == Some(bytes) {
        return Ok(());
    }
    Err(Error::ShapeMismatch {
        op,
        what: "host data (bytes)",
        expected: vec![expected.unwrap_or(usize::MAX)],
        got: vec![bytes],
    })
}

/// Buffer parameters for device-local storage usable by dispatches and transfers.
fn device_local_params() -> sys::iree_hal_buffer_params_t {
    sys::iree_hal_buffer_params_t {
        usage: sys::iree_hal_buffer_usage_bits_t_IREE_HAL_BUFFER_USAGE_DEFAULT as _,
        access: sys::iree_hal_memory_access_bits_t_IREE_HAL_MEMORY_ACCESS_ALL as _,
        type_: sys::iree_hal_memory_type_bits_t_IREE_HAL_MEMORY_TYPE_DEVICE_LOCAL as _,
        queue_affinity: ffi::QUEUE_AFFINITY_ANY,
        min_alignment: 0,
    }
}

/// Buffer parameters for a small input the host writes through a mapping and a dispatch
/// reads: host memory the device can see.
fn host_input_params() -> sys::iree_hal_buffer_params_t {
    sys::iree_hal_buffer_params_t {
        usage: (sys::iree_hal_buffer_usage_bits_t_IREE_HAL_BUFFER_USAGE_DEFAULT
            | sys::iree_hal_buffer_usage_bits_t_IREE_HAL_BUFFER_USAGE_MAPPING_SCOPED
            | sys::iree_hal_buffer_usage_bits_t_IREE_HAL_BUFFER_USAGE_MAPPING_ACCESS_SEQUENTIAL_WRITE)
            as _,
        access: sys::iree_hal_memory_access_bits_t_IREE_HAL_MEMORY_ACCESS_ALL as _,
        type_: (sys::iree_hal_memory_type_bits_t_IREE_HAL_MEMORY_TYPE_HOST_LOCAL
            | sys::iree_hal_memory_type_bits_t_IREE_HAL_MEMORY_TYPE_DEVICE_VISIBLE)
            as _,
        queue_affinity: ffi::QUEUE_AFFINITY_ANY,
        min_alignment: 0,
    }
}

/// Buffer parameters for a small result a dispatch writes and the host reads through a
/// mapping: host memory the device can see.
fn host_result_params() -> sys::iree_hal_buffer_params_t {
    sys::iree_hal_buffer_params_t {
        usage: (sys::iree_hal_buffer_usage_bits_t_IREE_HAL_BUFFER_USAGE_DEFAULT
            | sys::iree_hal_buffer_usage_bits_t_IREE_HAL_BUFFER_USAGE_MAPPING_SCOPED
            | sys::iree_hal_buffer_usage_bits_t_IREE_HAL_BUFFER_USAGE_MAPPING_ACCESS_RANDOM)
            as _,
        ..host_input_params()
    }
}

impl BufferView {
    /// Takes ownership of one reference to `raw`.
    ///
    /// # Safety
    /// `raw` must be a live buffer view whose buffer belongs to `device`, and the caller must give
    /// up the reference it passes.
    pub(crate) unsafe fn from_raw(raw: *mut sys::iree_hal_buffer_view_t, device: &Device) -> Self {
        device.inner.live_views.fetch_add(1, Ordering::Relaxed);
        BufferView {
            raw,
            device: device.clone(),
        }
    }

    pub(crate) fn raw(&self) -> *mut sys::iree_hal_buffer_view_t {
        self.raw
    }

    fn buffer(&self) -> *mut sys::iree_hal_buffer_t {
        // SAFETY: `raw` is live; the buffer is borrowed from the view for as long as `self` lives.
        unsafe { sys::iree_hal_buffer_view_buffer(self.raw) }
    }

    /// Wraps a buffer (taking over our one reference to it) in a view with `shape`/`elem`.
    fn wrap_buffer(
        device: &Device,
        buffer: *mut sys::iree_hal_buffer_t,
        shape: &[usize],
        elem: ElementType,
        op: &dyn Fn() -> String,
    ) -> Result<BufferView> {
        let mut raw: *mut sys::iree_hal_buffer_view_t = std::ptr::null_mut();
        // SAFETY: `buffer` is live; `shape` outlives the call (IREE copies it); out-pointer to a
        // local. The view retains the buffer, so our reference is released right after.
        let status = unsafe {
            let status = sys::iree_hal_buffer_view_create(
                buffer,
                shape.len(),
                shape.as_ptr(),
                elem.raw(),
                sys::iree_hal_encoding_types_t_IREE_HAL_ENCODING_TYPE_DENSE_ROW_MAJOR as _,
                ffi::system_allocator(),
                &mut raw,
            );
            sys::iree_hal_buffer_release(buffer);
            status
        };
        check(device.backend(), op, status)?;
        // SAFETY: `raw` is a fresh view owning one reference, over a buffer of `device`.
        Ok(unsafe { BufferView::from_raw(raw, device) })
    }

    /// A second view of this view's buffer with `shape` (the same element type and byte
    /// length): the device sees one buffer under both.
    pub fn reshaped(&self, shape: &[usize]) -> Result<BufferView> {
        let elem = self.element_type().ok_or_else(|| {
            backend_error(
                self.device.backend(),
                "reshape a view",
                "unknown element type",
            )
        })?;
        let op = || format!("view {:?} as {shape:?}", self.shape());
        if element_count(shape).and_then(|n| n.checked_mul(elem.size())) != Some(self.byte_length())
        {
            return Err(backend_error(
                self.device.backend(),
                op(),
                "byte lengths differ",
            ));
        }
        let buffer = self.buffer();
        // SAFETY: the buffer is live; wrap_buffer takes over this reference.
        unsafe { sys::iree_hal_buffer_retain(buffer) };
        Self::wrap_buffer(&self.device, buffer, shape, elem, &op)
    }

    /// Allocates a device-local buffer of `shape` x `elem`. Its contents are undefined until
    /// written (use [`BufferView::zeros`] for a defined start).
    pub fn allocate(device: &Device, shape: &[usize], elem: ElementType) -> Result<BufferView> {
        let op = || format!("allocate {shape:?} x {elem:?}");
        let buffer = Self::allocate_raw(device, device_local_params(), shape, elem, &op)?;
        Self::wrap_buffer(device, buffer, shape, elem, &op)
    }

    /// Allocates storage of `shape` x `elem` for a small result (a call's token): host memory
    /// the device writes, so that [`BufferView::read_bytes`] reads it through a mapping, with
    /// no queue operation and wait (on Vulkan; the CPU device's buffers are host memory
    /// anyway). Where the driver offers no such memory, a device-local buffer, read back by a
    /// transfer. Its contents are undefined until written.
    pub fn host_result(device: &Device, shape: &[usize], elem: ElementType) -> Result<BufferView> {
        let op = || format!("allocate a result's storage {shape:?} x {elem:?}");
        match Self::allocate_raw(device, host_result_params(), shape, elem, &op) {
            Ok(buffer) => Self::wrap_buffer(device, buffer, shape, elem, &op),
            // The allocator's refusal: device memory instead (an overflow fails there too).
            Err(_) => Self::allocate(device, shape, elem),
        }
    }

    /// A buffer of `shape` x `elem` from the device's allocator with `params` (one reference,
    /// the caller's), or the error: the size overflows, or the allocator refused.
    fn allocate_raw(
        device: &Device,
        params: sys::iree_hal_buffer_params_t,
        shape: &[usize],
        elem: ElementType,
        op: &dyn Fn() -> String,
    ) -> Result<*mut sys::iree_hal_buffer_t> {
        let bytes = element_count(shape)
            .and_then(|n| n.checked_mul(elem.size()))
            .ok_or_else(|| backend_error(device.backend(), op(), "size overflows usize"))?;
        let mut buffer: *mut sys::iree_hal_buffer_t = std::ptr::null_mut();
        // SAFETY: the allocator belongs to the live device; out-pointer to a local.
        let status = unsafe {
            sys::iree_hal_allocator_allocate_buffer(device.allocator(), params, bytes, &mut buffer)
        };
        check(device.backend(), op, status)?;
        Ok(buffer)
    }

    /// Whether the host reads the buffer through a mapping (host-visible memory that allows
    /// it), with no queue operation.
    pub fn host_readable(&self) -> bool {
        // SAFETY: the buffer is live for as long as `self`.
        let (memory, usage) = unsafe {
            (
                sys::iree_hal_buffer_memory_type(self.buffer()),
                sys::iree_hal_buffer_allowed_usage(self.buffer()),
            )
        };
        let visible = sys::iree_hal_memory_type_bits_t_IREE_HAL_MEMORY_TYPE_HOST_VISIBLE;
        let scoped = sys::iree_hal_buffer_usage_bits_t_IREE_HAL_BUFFER_USAGE_MAPPING_SCOPED;
        memory & visible == visible && usage & scoped == scoped
    }

    /// Allocates a buffer and fills it with zero bytes on the device queue.
    pub fn zeros(device: &Device, shape: &[usize], elem: ElementType) -> Result<BufferView> {
        let view = Self::allocate(device, shape, elem)?;
        let zero = Transfer::Zero {
            dst: &view,
            offset: 0,
            len: view.byte_length(),
        };
        Self::transfer(device, &[zero])?;
        Ok(view)
    }

    /// Allocates a buffer of `shape` x `elem` and uploads `bytes` into it.
    pub fn from_bytes(
        device: &Device,
        shape: &[usize],
        elem: ElementType,
        bytes: &[u8],
    ) -> Result<BufferView> {
        host_data_fits("upload to device", shape, elem, bytes.len())?;
        let view = Self::allocate(device, shape, elem)?;
        view.write_bytes(bytes)?;
        Ok(view)
    }

    /// A call's small input (a chunk's ids or embedding rows, `pos0`, `valid`): on Vulkan in
    /// host memory the device reads, written through a mapping, so that no queue operation
    /// runs before the call (each upload of [`BufferView::from_bytes`] is a submission and a
    /// wait: three per decode step, 0.14-1.06 ms a step on lavapipe); where the driver offers
    /// no such memory (asked once a device), and on the CPU device, [`BufferView::from_bytes`]
    /// ([`Device::input_stats`] counts both). Not for large or long-lived data: a GPU reads
    /// host memory over its bus.
    pub fn input(
        device: &Device,
        shape: &[usize],
        elem: ElementType,
        bytes: &[u8],
    ) -> Result<BufferView> {
        host_data_fits("write a call's input", shape, elem, bytes.len())?;
        let refused = &device.inner.host_inputs_refused;
        if device.kind() == DeviceKind::Vulkan
            && !bytes.is_empty()
            && !refused.load(Ordering::Relaxed)
        {
            if let Some(view) = Self::mapped_input(device, shape, elem, bytes)? {
                device.inner.inputs_mapped.fetch_add(1, Ordering::Relaxed);
                return Ok(view);
            }
            refused.store(true, Ordering::Relaxed);
        }
        let view = Self::from_bytes(device, shape, elem, bytes)?;
        device.inner.inputs_uploaded.fetch_add(1, Ordering::Relaxed);
        Ok(view)
    }

    /// [`BufferView::input`]'s host-memory buffer (`bytes` as long as `shape` x `elem`), or
    /// `None` where the allocator cannot make one (the caller uploads instead).
    fn mapped_input(
        device: &Device,
        shape: &[usize],
        elem: ElementType,
        bytes: &[u8],
    ) -> Result<Option<BufferView>> {
        let op = || format!("write {} input bytes as {shape:?} x {elem:?}", bytes.len());
        // `input` checked that `bytes` is `shape` x `elem` long.
        let Ok(buffer) = Self::allocate_raw(device, host_input_params(), shape, elem, &op) else {
            return Ok(None);
        };
        // SAFETY: `buffer` is live, mappable and `bytes.len()` long; `bytes` is readable.
        let status = unsafe {
            sys::iree_hal_buffer_map_write(buffer, 0, bytes.as_ptr().cast(), bytes.len())
        };
        if !status.is_null() {
            // SAFETY: our one reference to the buffer, which no view holds yet.
            unsafe { sys::iree_hal_buffer_release(buffer) };
            return Err(backend_error(
                device.backend(),
                op(),
                super::status::consume_to_string(status),
            ));
        }
        Self::wrap_buffer(device, buffer, shape, elem, &op).map(Some)
    }

    /// [`BufferView::input`] of f32 `data`.
    pub fn input_f32(device: &Device, shape: &[usize], data: &[f32]) -> Result<BufferView> {
        Self::input(device, shape, ElementType::F32, as_bytes(data))
    }

    /// [`BufferView::input`] of i32 `data`.
    pub fn input_i32(device: &Device, shape: &[usize], data: &[i32]) -> Result<BufferView> {
        Self::input(device, shape, ElementType::I32, as_bytes(data))
    }

    /// Uploads `data` as an f32 buffer of `shape`.
    pub fn from_f32(device: &Device, shape: &[usize], data: &[f32]) -> Result<BufferView> {
        Self::from_bytes(device, shape, ElementType::F32, as_bytes(data))
    }

    /// Uploads `data` as an i32 buffer of `shape`.
    pub fn from_i32(device: &Device, shape: &[usize], data: &[i32]) -> Result<BufferView> {
        Self::from_bytes(device, shape, ElementType::I32, as_bytes(data))
    }

    /// Overwrites the whole buffer with `bytes` from the host (synchronous).
    pub fn write_bytes(&self, bytes: &[u8]) -> Result<()> {
        if bytes.len() != self.byte_length() {
            return Err(Error::ShapeMismatch {
                op: "write to device buffer",
                what: "host data (bytes)",
                expected: vec![self.byte_length()],
                got: vec![bytes.len()],
            });
        }
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: `bytes` is readable for its length during the (blocking) transfer; the target
        // buffer is live and at least that long.
        let status = unsafe {
            sys::iree_hal_device_transfer_h2d(
                self.device.inner.raw,
                bytes.as_ptr().cast(),
                self.buffer(),
                0,
                bytes.len(),
                sys::iree_hal_transfer_buffer_flag_bits_t_IREE_HAL_TRANSFER_BUFFER_FLAG_DEFAULT
                    as _,
                ffi::infinite_timeout(),
            )
        };
        check(
            self.device.backend(),
            || format!("upload {} bytes", bytes.len()),
            status,
        )
    }

    /// Wraps host memory as a read-only buffer without copying where the device allows it (the
    /// CPU device, memory aligned to [`HOST_IMPORT_ALIGNMENT`]); otherwise copies it into a new
    /// device buffer. `owner` (a `Vec`, an `Arc<Mmap>`, a `&'static [u8]`...) is kept alive until
    /// IREE releases the buffer, which may be after this `BufferView` is dropped if a function
    /// result still references it.
    ///
    /// Pass imported buffers only to arguments a function reads: IREE may update arguments in place
    /// (see `docs/IREE.md`), and the memory is registered read-only.
    pub fn import_host<O>(
        device: &Device,
        owner: O,
        shape: &[usize],
        elem: ElementType,
    ) -> Result<(BufferView, ImportMode)>
    where
        O: AsRef<[u8]> + Send + Sync + 'static,
    {
        host_data_fits("import host memory", shape, elem, owner.as_ref().len())?;
        match Self::try_import(device, owner, shape, elem)? {
            Ok(view) => {
                let inner = &device.inner;
                inner.imports_zero_copy.fetch_add(1, Ordering::Relaxed);
                inner
                    .zero_copy_bytes
                    .fetch_add(view.byte_length() as u64, Ordering::Relaxed);
                Ok((view, ImportMode::ZeroCopy))
            }
            Err((owner, reason)) => {
                let view = Self::from_bytes(device, shape, elem, owner.as_ref())?;
                let inner = &device.inner;
                inner.imports_copied.fetch_add(1, Ordering::Relaxed);
                inner
                    .copied_bytes
                    .fetch_add(view.byte_length() as u64, Ordering::Relaxed);
                Ok((view, ImportMode::Copied { reason }))
            }
        }
    }

    /// The zero-copy attempt. `Ok(Err((owner, reason)))` hands the owner back for the copy path.
    #[allow(clippy::type_complexity)]
    fn try_import<O>(
        device: &Device,
        owner: O,
        shape: &[usize],
        elem: ElementType,
    ) -> Result<std::result::Result<BufferView, (O, String)>>
    where
        O: AsRef<[u8]> + Send + Sync + 'static,
    {
        let bytes = owner.as_ref();
        let (ptr, len) = (bytes.as_ptr(), bytes.len());
        if len == 0 {
            return Ok(Err((owner, "empty host region".into())));
        }
        if !(ptr as usize).is_multiple_of(HOST_IMPORT_ALIGNMENT) {
            return Ok(Err((
                owner,
                format!(
                    "host memory at offset {} mod {HOST_IMPORT_ALIGNMENT} is not aligned to \
                     {HOST_IMPORT_ALIGNMENT} bytes",
                    ptr as usize % HOST_IMPORT_ALIGNMENT
                ),
            )));
        }
        let params = sys::iree_hal_buffer_params_t {
            usage: sys::iree_hal_buffer_usage_bits_t_IREE_HAL_BUFFER_USAGE_DEFAULT as _,
            access: sys::iree_hal_memory_access_bits_t_IREE_HAL_MEMORY_ACCESS_READ as _,
            type_: (sys::iree_hal_memory_type_bits_t_IREE_HAL_MEMORY_TYPE_DEVICE_LOCAL
                | sys::iree_hal_memory_type_bits_t_IREE_HAL_MEMORY_TYPE_HOST_VISIBLE)
                as _,
            queue_affinity: ffi::QUEUE_AFFINITY_ANY,
            min_alignment: 0,
        };
        let mut external = sys::iree_hal_external_buffer_t {
            type_:
                sys::iree_hal_external_buffer_type_e_IREE_HAL_EXTERNAL_BUFFER_TYPE_HOST_ALLOCATION,
            flags: 0,
            size: len,
            ..Default::default()
        };
        external.handle.host_allocation.ptr = ptr as *mut std::ffi::c_void;

        // The owner moves to the heap; IREE calls `release_owner::<O>` exactly once when the buffer
        // is destroyed, which drops it. Until then the pointer above stays valid.
        let boxed: *mut O = Box::into_raw(Box::new(owner));
        let callback = sys::iree_hal_buffer_release_callback_t {
            fn_: Some(release_owner::<O>),
            user_data: boxed.cast(),
        };
        let mut buffer: *mut sys::iree_hal_buffer_t = std::ptr::null_mut();
        // SAFETY: the allocator belongs to the live device; `external` describes `len` readable
        // bytes kept alive by `boxed` until the release callback runs; out-pointer to a local.
        let status = unsafe {
            sys::iree_hal_allocator_import_buffer(
                device.allocator(),
                params,
                &mut external,
                callback,
                &mut buffer,
            )
        };
        if !status.is_null() {
            // A failed import never calls the release callback: take the owner back.
            let reason = super::status::consume_to_string(status);
            // SAFETY: `boxed` came from Box::into_raw above and IREE did not take it.
            let owner = unsafe { *Box::from_raw(boxed) };
            return Ok(Err((owner, reason)));
        }
        let op = || format!("import {len} host bytes as {shape:?} x {elem:?}");
        Self::wrap_buffer(device, buffer, shape, elem, &op).map(Ok)
    }

    /// A new buffer with the same shape, type and contents, copied by [`BufferView::transfer`]:
    /// later in-place updates of either buffer do not affect the other.
    pub fn device_copy(&self) -> Result<BufferView> {
        let elem = self.element_type().ok_or_else(|| {
            backend_error(
                self.device.backend(),
                "device copy",
                "unsupported element type",
            )
        })?;
        let copy = Self::allocate(&self.device, &self.shape(), elem)?;
        let whole = Transfer::Copy {
            src: self,
            dst: &copy,
            offset: 0,
            len: self.byte_length(),
        };
        Self::transfer(&self.device, &[whole])?;
        Ok(copy)
    }

    /// Runs `ops` as one batch and waits for it: on Vulkan recorded in one command buffer and
    /// submitted once; on the CPU device as copies and fills through the buffers' host
    /// mappings (`host_transfer`). The operations of a batch may run in any order or at once
    /// (the command buffer has no barriers; the CPU splits a large batch over two threads), so
    /// no operation may write what another one reads or writes. Empty ranges are skipped;
    /// every buffer must belong to `device`, every range lie inside its buffers, a zero fill
    /// cover whole 4-byte words and a copy within one buffer keep its two ranges apart (checked
    /// first: an error names the operation and nothing is written).
    pub fn transfer(device: &Device, ops: &[Transfer]) -> Result<()> {
        let backend = device.backend();
        for op in ops {
            let (views, offset, len): (&[&BufferView], _, _) = match op {
                Transfer::Copy {
                    src,
                    dst,
                    offset,
                    len,
                } => (&[src, dst], *offset, *len),
                Transfer::Zero { dst, offset, len } => (&[dst], *offset, *len),
                Transfer::Within { buf, from, to, len } => {
                    if from.abs_diff(*to) < *len {
                        return Err(backend_error(
                            backend,
                            "device transfer",
                            format!("{op:?}: the source and target ranges overlap"),
                        ));
                    }
                    (&[buf], *from.max(to), *len)
                }
            };
            let zero = matches!(op, Transfer::Zero { .. });
            if zero && (offset % 4 != 0 || len % 4 != 0) {
                return Err(backend_error(
                    backend,
                    "device transfer",
                    format!("{op:?}: a zero fill needs an offset and length in whole words"),
                ));
            }
            for v in views {
                if !std::sync::Arc::ptr_eq(&v.device.inner, &device.inner) {
                    return Err(backend_error(
                        backend,
                        "device transfer",
                        "the buffers belong to different devices",
                    ));
                }
                if offset
                    .checked_add(len)
                    .is_none_or(|end| end > v.byte_length())
                {
                    return Err(backend_error(
                        backend,
                        "device transfer",
                        format!(
                            "{op:?} reaches past the end of a {}-byte buffer",
                            v.byte_length()
                        ),
                    ));
                }
            }
        }
        let ops: Vec<&Transfer> = ops.iter().filter(|op| !op.is_empty()).collect();
        if ops.is_empty() {
            return Ok(());
        }
        let bytes: usize = ops.iter().map(|op| op.len()).sum();
        let what = || {
            format!(
                "device transfer of {bytes} bytes in {} operations",
                ops.len()
            )
        };
        if device.kind() == DeviceKind::Cpu {
            return host_transfer(device, &ops, &what);
        }
        let cb = CommandBuffer::record(device, &what, &ops)?;
        device.submit_and_wait(&what, |wait, signal| {
            // SAFETY: the command buffer is live until `cb` drops, after the wait; the buffers
            // it references are borrowed by `ops` for as long.
            unsafe {
                sys::iree_hal_device_queue_execute(
                    device.inner.raw,
                    ffi::QUEUE_AFFINITY_ANY,
                    wait,
                    signal,
                    cb.raw,
                    sys::iree_hal_buffer_binding_table_t {
                        count: 0,
                        bindings: std::ptr::null(),
                    },
                    sys::iree_hal_execute_flag_bits_t_IREE_HAL_EXECUTE_FLAG_NONE as _,
                )
            }
        })
    }

    /// Copies the whole buffer to the host (synchronous): through a mapping where the buffer
    /// is host memory that allows it ([`BufferView::host_readable`]), else by a transfer, a
    /// queue operation and a wait ([`Device::read_stats`] counts both). Results a call has
    /// written are complete when the call returns.
    pub fn read_bytes(&self) -> Result<Vec<u8>> {
        let len = self.byte_length();
        let mut out = vec![0u8; len];
        if len == 0 {
            return Ok(out);
        }
        let op = || format!("read back {len} bytes");
        if self.host_readable() {
            // SAFETY: the buffer is live, host-visible and `len` long; `out` has `len` bytes.
            let status = unsafe {
                sys::iree_hal_buffer_map_read(self.buffer(), 0, out.as_mut_ptr().cast(), len)
            };
            check(self.device.backend(), op, status)?;
            self.device
                .inner
                .reads_mapped
                .fetch_add(1, Ordering::Relaxed);
            return Ok(out);
        }
        // SAFETY: `out` has `len` writable bytes; the source buffer is live and `len` long; the
        // transfer blocks until done.
        let status = unsafe {
            sys::iree_hal_device_transfer_d2h(
                self.device.inner.raw,
                self.buffer(),
                0,
                out.as_mut_ptr().cast(),
                len,
                sys::iree_hal_transfer_buffer_flag_bits_t_IREE_HAL_TRANSFER_BUFFER_FLAG_DEFAULT
                    as _,
                ffi::infinite_timeout(),
            )
        };
        check(self.device.backend(), op, status)?;
        self.device
            .inner
            .reads_transferred
            .fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }

    /// Reads an f32 buffer back to the host.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        self.expect_type(ElementType::F32, "read back f32")?;
        Ok(self
            .read_bytes()?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Reads an i32 buffer back to the host.
    pub fn to_i32_vec(&self) -> Result<Vec<i32>> {
        self.expect_type(ElementType::I32, "read back i32")?;
        Ok(self
            .read_bytes()?
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn expect_type(&self, want: ElementType, op: &'static str) -> Result<()> {
        match self.element_type() {
            Some(t) if t == want => Ok(()),
            got => Err(backend_error(
                self.device.backend(),
                op,
                format!("buffer element type is {got:?}, not {want:?}"),
            )),
        }
    }

    /// The shape (dimensions, outermost first).
    pub fn shape(&self) -> Vec<usize> {
        // SAFETY: `raw` is live; `shape_dims` points to `rank` dims owned by the view.
        unsafe {
            let rank = sys::iree_hal_buffer_view_shape_rank(self.raw);
            let dims = sys::iree_hal_buffer_view_shape_dims(self.raw);
            if rank == 0 || dims.is_null() {
                return Vec::new();
            }
            std::slice::from_raw_parts(dims, rank).to_vec()
        }
    }

    /// The element type, or `None` for a type kvsnap does not use.
    pub fn element_type(&self) -> Option<ElementType> {
        // SAFETY: `raw` is live.
        ElementType::from_raw(unsafe { sys::iree_hal_buffer_view_element_type(self.raw) })
    }

    /// Size of the contents in bytes.
    pub fn byte_length(&self) -> usize {
        // SAFETY: `raw` is live.
        unsafe { sys::iree_hal_buffer_view_byte_length(self.raw) }
    }

    /// The device holding the buffer.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// True if both views are backed by the same device allocation (e.g. a function result that
    /// IREE wrote in place into an argument).
    pub fn shares_storage_with(&self, other: &BufferView) -> bool {
        // SAFETY: both buffers are live; allocated_buffer returns the root allocation of a
        // (possibly sub-span) buffer without changing reference counts.
        unsafe {
            sys::iree_hal_buffer_allocated_buffer(self.buffer())
                == sys::iree_hal_buffer_allocated_buffer(other.buffer())
        }
    }
}

/// Release callback of imported host memory: drops the owner.
unsafe extern "C" fn release_owner<O>(
    user_data: *mut std::ffi::c_void,
    _buffer: *mut sys::iree_hal_buffer_t,
) {
    // A panic must not unwind into C; dropping a Vec or an Mmap does not panic in practice, and if
    // it did, aborting is the only sound option.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `user_data` is the `Box<O>` leaked by `try_import`; IREE calls this exactly once.
        drop(unsafe { Box::from_raw(user_data.cast::<O>()) });
    }));
    if result.is_err() {
        std::process::abort();
    }
}

/// Plain numbers whose every byte is initialised (no padding), so a slice of them is a byte slice.
pub(crate) trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for i32 {}

/// Views a slice of plain numbers as bytes.
pub(crate) fn as_bytes<T: Plain>(data: &[T]) -> &[u8] {
    // SAFETY: `Plain` types have no padding and no invalid bytes; the byte slice covers exactly the
    // same memory for the same lifetime.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// A one-shot transfer command buffer (`iree_hal_command_buffer_t`), released on drop.
///
/// [`BufferView::transfer`] records all its operations in one, so a batch is one queue
/// submission: submitted one by one, a KV state's 43 copies and fills cost 26 ms on the H200's
/// Vulkan driver (about 0.6 ms per submission) for 25 MB that the GPU copies in microseconds.
struct CommandBuffer {
    raw: *mut sys::iree_hal_command_buffer_t,
}

impl CommandBuffer {
    fn record(device: &Device, what: &dyn Fn() -> String, ops: &[&Transfer]) -> Result<Self> {
        let backend = device.backend();
        let mut raw: *mut sys::iree_hal_command_buffer_t = std::ptr::null_mut();
        // SAFETY: the device is live; out-pointer to a local.
        let status = unsafe {
            sys::iree_hal_command_buffer_create(
                device.inner.raw,
                sys::iree_hal_command_buffer_mode_bits_t_IREE_HAL_COMMAND_BUFFER_MODE_ONE_SHOT as _,
                sys::iree_hal_command_category_bits_t_IREE_HAL_COMMAND_CATEGORY_TRANSFER as _,
                ffi::QUEUE_AFFINITY_ANY,
                0,
                &mut raw,
            )
        };
        check(
            backend,
            || format!("{}: create command buffer", what()),
            status,
        )?;
        let cb = CommandBuffer { raw };
        // SAFETY: `cb.raw` is a fresh command buffer, recorded once between begin and end.
        check(backend, || format!("{}: begin", what()), unsafe {
            sys::iree_hal_command_buffer_begin(cb.raw)
        })?;
        let pattern: u32 = 0;
        for op in ops {
            let status = match **op {
                // SAFETY (both arms): the buffers are live (borrowed by `ops`) and the ranges
                // were checked by the caller; the fill pattern is copied when recorded.
                Transfer::Copy {
                    src,
                    dst,
                    offset,
                    len,
                } => unsafe {
                    sys::iree_hal_command_buffer_copy_buffer(
                        cb.raw,
                        buffer_ref(src, offset, len),
                        buffer_ref(dst, offset, len),
                        sys::iree_hal_copy_flag_bits_t_IREE_HAL_COPY_FLAG_NONE as _,
                    )
                },
                Transfer::Zero { dst, offset, len } => unsafe {
                    sys::iree_hal_command_buffer_fill_buffer(
                        cb.raw,
                        buffer_ref(dst, offset, len),
                        (&pattern as *const u32).cast(),
                        std::mem::size_of::<u32>(),
                        0,
                    )
                },
                Transfer::Within { buf, from, to, len } => unsafe {
                    sys::iree_hal_command_buffer_copy_buffer(
                        cb.raw,
                        buffer_ref(buf, from, len),
                        buffer_ref(buf, to, len),
                        sys::iree_hal_copy_flag_bits_t_IREE_HAL_COPY_FLAG_NONE as _,
                    )
                },
            };
            check(backend, || format!("{}: record {op:?}", what()), status)?;
        }
        // SAFETY: as above.
        check(backend, || format!("{}: end", what()), unsafe {
            sys::iree_hal_command_buffer_end(cb.raw)
        })?;
        Ok(cb)
    }
}

impl Drop for CommandBuffer {
    fn drop(&mut self) {
        // SAFETY: `raw` holds one reference, given up once.
        unsafe { sys::iree_hal_command_buffer_release(self.raw) }
    }
}

/// `len` bytes of `view`'s buffer at `offset`, as a command buffer operand.
fn buffer_ref(view: &BufferView, offset: usize, len: usize) -> sys::iree_hal_buffer_ref_t {
    // SAFETY: all-zero is a valid iree_hal_buffer_ref_t (no buffer, binding slot 0); the
    // fields below make it a direct reference to the buffer.
    let mut r: sys::iree_hal_buffer_ref_t = unsafe { std::mem::zeroed() };
    r.buffer = view.buffer();
    r.offset = offset as _;
    r.length = len as _;
    r
}

/// Runs `ops` on the CPU device as plain copies and fills through host mappings: on the calling
/// thread, or from [`PARALLEL_TRANSFER_BYTES`] in two halves by bytes, one on a scoped thread.
///
/// The CPU device's buffers are host memory that IREE's heap allocator always maps, and no
/// queue work is pending when kvsnap transfers (every call and transfer waits for its end). On
/// the queue, a restore's 39 buffers went through a command buffer, a submission, the task
/// workers' wake-up and a semaphore wait: 1.6-8 ms for 20 MiB where a `memcpy` of it takes
/// 1.7 ms (docs/BENCHMARKS.md, thirteenth pass).
fn host_transfer(
    device: &Device,
    ops: &[&Transfer],
    what: &(dyn Fn() -> String + Sync),
) -> Result<()> {
    let total: usize = ops.iter().map(|op| op.len()).sum();
    if total < PARALLEL_TRANSFER_BYTES || ops.len() < 2 {
        return host_ops(device, ops, what);
    }
    // Two halves by bytes, the second on a scoped thread.
    let mut acc = 0;
    let split = ops
        .iter()
        .position(|op| {
            acc += op.len();
            acc >= total / 2
        })
        .map_or(ops.len(), |i| i + 1)
        .min(ops.len() - 1);
    let (first, second) = ops.split_at(split);
    std::thread::scope(|s| {
        let other = s.spawn(|| host_ops(device, second, what));
        let mine = host_ops(device, first, what);
        let theirs = other.join().unwrap_or_else(|_| {
            Err(backend_error(
                device.backend(),
                what(),
                "a transfer thread panicked",
            ))
        });
        mine.and(theirs)
    })
}

/// Transfers of at least this many bytes run on two threads.
const PARALLEL_TRANSFER_BYTES: usize = 1 << 20;

fn host_ops(device: &Device, ops: &[&Transfer], what: &(dyn Fn() -> String + Sync)) -> Result<()> {
    for op in ops {
        // SAFETY: every buffer is live (borrowed by `ops`) and belongs to `device`; the ranges
        // were checked against their lengths by `transfer`.
        let status = unsafe {
            match **op {
                Transfer::Copy {
                    src,
                    dst,
                    offset,
                    len,
                } => sys::iree_hal_buffer_map_copy(
                    src.buffer(),
                    offset as _,
                    dst.buffer(),
                    offset as _,
                    len as _,
                ),
                Transfer::Zero { dst, offset, len } => {
                    sys::iree_hal_buffer_map_zero(dst.buffer(), offset as _, len as _)
                }
                Transfer::Within { buf, from, to, len } => sys::iree_hal_buffer_map_copy(
                    buf.buffer(),
                    from as _,
                    buf.buffer(),
                    to as _,
                    len as _,
                ),
            }
        };
        check(device.backend(), || format!("{}: {op:?}", what()), status)?;
    }
    Ok(())
}
