//! The few pieces of IREE's C API that are `static inline` or macros in its headers, so bindgen does
//! not emit them, re-stated in Rust. Everything else comes from `eerie_sys::runtime` as is.

pub(crate) use eerie_sys::runtime as sys;

extern "C" {
    // The control function behind `iree_allocator_system()` in this build: eerie-sys configures
    // IREE with `IREE_ALLOCATOR_SYSTEM=libc`, so CMake defines
    // `IREE_ALLOCATOR_SYSTEM_CTL=iree_allocator_libc_ctl` and the archive exports this symbol.
    // bindgen parses the headers without that define and so never declares it.
    fn iree_allocator_libc_ctl(
        self_: *mut std::ffi::c_void,
        command: sys::iree_allocator_command_t,
        params: *const std::ffi::c_void,
        inout_ptr: *mut *mut std::ffi::c_void,
    ) -> sys::iree_status_t;
}

/// `iree_allocator_system()`.
pub(crate) fn system_allocator() -> sys::iree_allocator_t {
    sys::iree_allocator_t {
        self_: std::ptr::null_mut(),
        ctl: Some(iree_allocator_libc_ctl),
    }
}

/// `iree_allocator_null()`: an allocator that never frees (for memory Rust owns).
pub(crate) fn null_allocator() -> sys::iree_allocator_t {
    sys::iree_allocator_t {
        self_: std::ptr::null_mut(),
        ctl: None,
    }
}

/// `iree_make_string_view(s.as_ptr(), s.len())`: borrows `s`, which must outlive the use.
pub(crate) fn string_view(s: &str) -> sys::iree_string_view_t {
    sys::iree_string_view_t {
        data: s.as_ptr().cast(),
        size: s.len(),
    }
}

/// Copies an `iree_string_view_t` into an owned `String` (lossy on invalid UTF-8).
///
/// # Safety
/// `v.data` must point to `v.size` readable bytes (or be null with any size treated as empty).
pub(crate) unsafe fn string_from_view(v: sys::iree_string_view_t) -> String {
    if v.data.is_null() || v.size == 0 {
        return String::new();
    }
    // SAFETY: the caller guarantees `v.data` points to `v.size` readable bytes.
    let bytes = unsafe { std::slice::from_raw_parts(v.data.cast::<u8>(), v.size) };
    String::from_utf8_lossy(bytes).into_owned()
}

/// `iree_infinite_timeout()`.
pub(crate) fn infinite_timeout() -> sys::iree_timeout_t {
    sys::iree_timeout_t {
        type_: sys::iree_timeout_type_e_IREE_TIMEOUT_ABSOLUTE,
        nanos: i64::MAX, // IREE_TIME_INFINITE_FUTURE
    }
}

/// `IREE_HAL_QUEUE_AFFINITY_ANY`.
pub(crate) const QUEUE_AFFINITY_ANY: sys::iree_hal_queue_affinity_t = u64::MAX;

/// `iree_vm_make_undefined_type_def()`: a list element type accepting any variant.
pub(crate) fn undefined_type_def() -> sys::iree_vm_type_def_t {
    // All-zero bits are IREE_VM_VALUE_TYPE_NONE with IREE_VM_REF_TYPE_NULL, which is what the C
    // helper builds.
    sys::iree_vm_type_def_t::default()
}
