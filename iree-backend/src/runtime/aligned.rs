//! `AlignedBytes`: owned host memory starting on a 64-byte boundary, for what IREE reads in
//! place: a vmfb (its archive segments are 64-byte aligned) and weights imported zero-copy onto
//! the CPU device ([`super::HOST_IMPORT_ALIGNMENT`]; a large `Vec` from malloc starts 16 bytes
//! into a page).

use std::alloc::Layout;

/// The alignment of every [`AlignedBytes`].
const ALIGNMENT: usize = 64;

const _: () = assert!(ALIGNMENT == super::HOST_IMPORT_ALIGNMENT);

/// Owned bytes starting on a 64-byte boundary.
pub(crate) struct AlignedBytes {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `AlignedBytes` owns its allocation exclusively, like a `Vec<u8>`.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access only reads.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    fn layout(len: usize) -> Option<Layout> {
        Layout::from_size_align(len.max(1), ALIGNMENT).ok()
    }

    /// `len` zero bytes (a large allocation's pages are mapped lazily, as `vec!` of zeros maps
    /// them); `None` when the host is out of memory.
    pub fn zeroed(len: usize) -> Option<Self> {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout(len)?) };
        (!ptr.is_null()).then_some(AlignedBytes { ptr, len })
    }

    /// A copy of `bytes`; `None` when the host is out of memory.
    pub fn copy_of(bytes: &[u8]) -> Option<Self> {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(Self::layout(bytes.len())?) };
        if ptr.is_null() {
            return None;
        }
        // SAFETY: `ptr` has room for `bytes.len()` bytes and does not overlap `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
        Some(AlignedBytes {
            ptr,
            len: bytes.len(),
        })
    }

    /// The bytes as f32s, to fill in place.
    ///
    /// # Panics
    /// If the length is not a multiple of 4.
    pub fn as_mut_f32(&mut self) -> &mut [f32] {
        assert!(
            self.len.is_multiple_of(4),
            "AlignedBytes: {} bytes as f32",
            self.len
        );
        // SAFETY: the allocation is 64-byte aligned, `len / 4` f32s long, initialised (zeroed or
        // copied) and borrowed mutably through `self`; every bit pattern is a valid f32.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<f32>(), self.len / 4) }
    }
}

impl AlignedBytes {
    /// The bytes as i8s, to fill in place.
    pub fn as_mut_i8(&mut self) -> &mut [i8] {
        // SAFETY: `len` initialised bytes, borrowed mutably through `self`; every bit pattern is
        // a valid i8.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<i8>(), self.len) }
    }
}

impl AsRef<[u8]> for AlignedBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes at `ptr`, owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        let layout = Self::layout(self.len).expect("layout was valid at allocation");
        // SAFETY: allocated in `zeroed` or `copy_of` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_is_aligned_zeroed_or_copied_and_writable_as_f32() {
        for len in [0, 4, 100, 1 << 20] {
            let mut z = AlignedBytes::zeroed(len).unwrap();
            assert_eq!(z.as_ref().as_ptr() as usize % ALIGNMENT, 0);
            assert!(z.as_ref().iter().all(|&b| b == 0) && z.as_ref().len() == len);
            z.as_mut_f32().iter_mut().for_each(|x| *x = 1.5);
            assert!(z.as_ref().chunks(4).all(|c| c == 1.5f32.to_ne_bytes()));
        }
        let bytes: Vec<u8> = (0..=255).collect();
        let c = AlignedBytes::copy_of(&bytes[3..]).unwrap();
        assert_eq!(c.as_ref().as_ptr() as usize % ALIGNMENT, 0);
        assert_eq!(c.as_ref(), &bytes[3..]);
    }
}
