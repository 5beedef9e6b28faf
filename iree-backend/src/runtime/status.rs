//! `iree_status_t` -> [`kvsnap_contract::Error::Backend`], keeping IREE's formatted text (code,
//! message, source location and annotations) and freeing the status.

use kvsnap_contract::{Error, Result};

use super::ffi::sys;

/// `IREE_STATUS_CODE_MASK`: the low bits of a status handle hold its code.
const STATUS_CODE_MASK: usize = 0x1F;

/// The code of a status without consuming it (0 = OK).
pub(crate) fn code(status: sys::iree_status_t) -> u32 {
    ((status as usize) & STATUS_CODE_MASK) as u32
}

/// Formats `status` with `iree_status_format` and frees it. Returns "OK" for an OK status.
///
/// Takes ownership: the caller must not use `status` afterwards.
pub(crate) fn consume_to_string(status: sys::iree_status_t) -> String {
    if status.is_null() {
        return "OK".to_string();
    }
    let mut len: sys::iree_host_size_t = 0;
    // SAFETY: `status` is a live non-OK status owned by us. A zero-capacity call with a null
    // buffer only reports the required length (IREE documents this sizing pattern).
    unsafe { sys::iree_status_format(status, 0, std::ptr::null_mut(), &mut len) };
    let mut buf = vec![0u8; len + 1];
    let mut written: sys::iree_host_size_t = 0;
    // SAFETY: `buf` has `len + 1` writable bytes, room for the text and its NUL.
    let ok = unsafe {
        sys::iree_status_format(status, buf.len(), buf.as_mut_ptr().cast(), &mut written)
    };
    let text = if ok {
        buf.truncate(written.min(len));
        String::from_utf8_lossy(&buf).into_owned()
    } else {
        // SAFETY: iree_status_code_string returns a static NUL-terminated string for any code.
        let name = unsafe { std::ffi::CStr::from_ptr(sys::iree_status_code_string(code(status))) };
        format!("{} (status text unavailable)", name.to_string_lossy())
    };
    // SAFETY: `status` is non-OK and owned by us; it is freed exactly once here.
    unsafe { sys::iree_status_free(status) };
    text
}

/// Converts an IREE status into `Ok(())` or an [`Error::Backend`] carrying its text; always frees it.
pub(crate) fn check(
    backend: &'static str,
    op: impl FnOnce() -> String,
    status: sys::iree_status_t,
) -> Result<()> {
    if status.is_null() {
        return Ok(());
    }
    Err(Error::Backend {
        backend,
        op: op(),
        status: consume_to_string(status),
    })
}

/// An error that does not come from an IREE status but from a check of ours.
pub(crate) fn backend_error(
    backend: &'static str,
    op: impl Into<String>,
    status: impl Into<String>,
) -> Error {
    Error::Backend {
        backend,
        op: op.into(),
        status: status.into(),
    }
}
