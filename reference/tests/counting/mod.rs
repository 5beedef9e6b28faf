//! A global allocator that counts the allocations of at least [`LARGE`] bytes made while
//! [`COUNTING`] is set, for the tests that check what a forward pass allocates. Each such test
//! is a binary of its own, installing it with
//! `#[global_allocator] static ALLOCATOR: counting::Counting = counting::Counting;`: it counts
//! every thread's allocations, so nothing else may run beside the test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The counting allocator (the system allocator underneath).
pub struct Counting;

/// Whether allocations are counted now.
pub static COUNTING: AtomicBool = AtomicBool::new(false);
/// The size from which an allocation counts, in bytes.
pub static LARGE: AtomicUsize = AtomicUsize::new(usize::MAX);
/// Allocations of at least [`LARGE`] bytes seen while counting.
pub static LARGE_SEEN: AtomicUsize = AtomicUsize::new(0);
/// The largest allocation seen while counting, in bytes.
pub static LARGEST: AtomicUsize = AtomicUsize::new(0);

impl Counting {
    fn count(size: usize) {
        if COUNTING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(size, Ordering::Relaxed);
            if size >= LARGE.load(Ordering::Relaxed) {
                LARGE_SEEN.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::count(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::count(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::count(new_size);
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}
