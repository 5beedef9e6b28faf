//! [`LargeBuffer`]: a zeroed buffer of plain numbers in an anonymous mapping of its own,
//! advised onto transparent huge pages, for what a decode step streams from memory: the
//! layers' packed weights and the screened head's int8 table (about 590 MB a step).
//!
//! On 4 KiB pages a step crosses some 150,000 pages, each one a TLB miss and a page walk
//! (two-dimensional under a hypervisor). Linux hands out 2 MiB pages to a mapping advised with
//! `MADV_HUGEPAGE` when `/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` (the
//! common default) or `always`. A `vec!` from malloc is not advised, and in `madvise` mode
//! stays on 4 KiB pages. Measured on a 2-vCPU AVX-512 Xeon VM (docs/BENCHMARKS.md,
//! twenty-sixth pass): the reference's decode step 25.2-28.1 ms on 4 KiB pages, 22.4-23.9 ms
//! on 2 MiB ones. The advice is only advice: where the kernel has no huge pages to give, or on
//! other systems, the buffer is an ordinary zeroed mapping.
//!
//! Only whole 2 MiB pages of a mapping become huge, and Linux (6.18 here) starts a mapping on
//! a 2 MiB boundary only where its length is a multiple of 2 MiB, so a buffer's partial huge
//! pages at either end stay small: on the real model 474 of the 569 MB a step streams sit on
//! huge pages ([`huge_page_bytes`] counts them; `ReferenceModel::load_report` reports them).
//! Buffers mapped from a boundary and rounded up to whole huge pages put all 569 MB on them,
//! with the same decode step (three alternating catalog pairs, 19.74-20.17 against
//! 19.82-20.13 ms) and 53 MB more peak RSS (the rounded tails): not done
//! (docs/BENCHMARKS.md, twenty-eighth pass).

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut, Range};

use memmap2::MmapMut;

/// Element types a [`LargeBuffer`] holds: plain numbers, valid as all-zero bits, without
/// drop glue.
pub trait Plain: Copy + Send + Sync + 'static + sealed::Sealed {}

mod sealed {
    pub trait Sealed {}
}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Plain for $t {}
    )*};
}
plain!(f32, i8, u8, i32);

/// `len` zeroed `T`s in an anonymous mapping of their own, page-aligned, advised onto
/// transparent huge pages where the OS offers them (see the module docs).
pub struct LargeBuffer<T: Plain> {
    map: MmapMut,
    len: usize,
    _elem: PhantomData<T>,
}

impl<T: Plain> LargeBuffer<T> {
    /// `len` zeroed elements. Nothing is touched yet: the pages are mapped as they are first
    /// written, huge where the advice holds.
    ///
    /// # Errors
    /// The OS's error when it cannot map the bytes (out of memory or address space), or
    /// `OutOfMemory` when `len` elements overflow the address space.
    pub fn zeroed(len: usize) -> std::io::Result<Self> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                format!(
                    "{len} elements of {} bytes overflow the address space",
                    std::mem::size_of::<T>()
                ),
            )
        })?;
        // A mapping cannot be empty: an empty buffer maps one byte it never shows.
        let map = MmapMut::map_anon(bytes.max(1))?;
        #[cfg(target_os = "linux")]
        {
            // Advice only: refused (EINVAL) where the kernel has no transparent huge pages, and
            // the buffer works the same on 4 KiB pages.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        Ok(LargeBuffer {
            map,
            len,
            _elem: PhantomData,
        })
    }

    /// A copy of `src`.
    ///
    /// # Errors
    /// As for [`LargeBuffer::zeroed`].
    pub fn copy_of(src: &[T]) -> std::io::Result<Self> {
        let mut copy = Self::zeroed(src.len())?;
        copy.copy_from_slice(src);
        Ok(copy)
    }

    /// The elements' bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.map[..std::mem::size_of_val(self.deref())]
    }

    /// The addresses of the elements, for [`huge_page_bytes`].
    pub fn addresses(&self) -> Range<usize> {
        let start = self.map.as_ptr() as usize;
        start..start + std::mem::size_of_val(self.deref())
    }
}

/// Bytes of the address ranges `ranges` that sit on transparent huge pages now, from the
/// `AnonHugePages` of the mappings that hold them in `/proc/self/smaps` (read once); `None`
/// where the OS does not say (not Linux, or no such file).
///
/// Linux may merge adjacent anonymous mappings with the same flags into one; a mapping's huge
/// pages count up to the bytes of `ranges` inside it, so a merged neighbour's never make the
/// sum exceed those bytes.
pub fn huge_page_bytes(ranges: &[Range<usize>]) -> Option<usize> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    Some(huge_bytes_in_smaps(&smaps, ranges))
}

/// [`huge_page_bytes`] over the text of an `smaps` file.
fn huge_bytes_in_smaps(smaps: &str, ranges: &[Range<usize>]) -> usize {
    let mut total = 0;
    // The bytes of `ranges` inside the mapping whose lines are being read.
    let mut inside = 0;
    for line in smaps.lines() {
        if let Some(mapping) = mapping_header(line) {
            inside = ranges
                .iter()
                .map(|r| {
                    r.end
                        .min(mapping.end)
                        .saturating_sub(r.start.max(mapping.start))
                })
                .sum();
        } else if let Some(kb) = line.strip_prefix("AnonHugePages:") {
            let kb: usize = kb.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
            total += (kb << 10).min(inside);
        }
    }
    total
}

/// The address range of an `smaps` mapping's first line (`start-end perms offset ...`, in hex).
fn mapping_header(line: &str) -> Option<Range<usize>> {
    let (start, end) = line.split_whitespace().next()?.split_once('-')?;
    Some(usize::from_str_radix(start, 16).ok()?..usize::from_str_radix(end, 16).ok()?)
}

impl<T: Plain> Deref for LargeBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: the mapping is page-aligned (so aligned for `T`), at least `len *
        // size_of::<T>()` bytes long and owned by `self`; every bit pattern the mapping can hold
        // is a valid `T` (`Plain`: plain numbers).
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> DerefMut for LargeBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> AsRef<[u8]> for LargeBuffer<T> {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl<T: Plain> std::fmt::Debug for LargeBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LargeBuffer")
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_aligned_and_writable() {
        for len in [0, 1, 1000, 3 << 20] {
            let mut b = LargeBuffer::<f32>::zeroed(len).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % 4096, 0);
            assert!(b.iter().all(|&x| x == 0.0));
            b.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
            assert!(b.iter().enumerate().all(|(i, &x)| x == i as f32));
            assert_eq!(b.as_bytes().len(), len * 4);
            if len > 1 {
                assert_eq!(b.as_bytes()[4..8], 1.0f32.to_ne_bytes());
            }
        }
        let mut q = LargeBuffer::<i8>::zeroed(5).unwrap();
        q[4] = -3;
        assert_eq!(&q[..], &[0, 0, 0, 0, -3]);
        assert_eq!(q.as_ref(), &[0, 0, 0, 0, 253]);
        let c = LargeBuffer::copy_of(&[7i32, -8]).unwrap();
        assert_eq!(&c[..], &[7, -8]);
        assert_eq!(c.as_ptr() as usize % 4096, 0);
    }

    #[test]
    fn an_impossible_length_is_an_error() {
        let e = LargeBuffer::<f32>::zeroed(usize::MAX / 2).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::OutOfMemory);
        // Within the address-space arithmetic but beyond any host: the OS refuses the mapping.
        assert!(LargeBuffer::<u8>::zeroed(usize::MAX / 4).is_err());
    }

    /// On Linux with transparent huge pages in `madvise` or `always` mode, a written buffer of
    /// several huge pages sits at least partly on them (`AnonHugePages` of its mapping in
    /// `/proc/self/smaps`). Skipped, and says so, where the kernel offers none.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_written_buffer_sits_on_huge_pages_where_the_kernel_offers_them() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if !(mode.contains("[madvise]") || mode.contains("[always]")) {
            eprintln!(
                "skipped: transparent huge pages are off here ({})",
                mode.trim()
            );
            return;
        }
        let mut b = LargeBuffer::<u8>::zeroed(16 << 20).unwrap();
        b.fill(1);
        let huge = huge_page_bytes(&[b.addresses()]).expect("Linux has /proc/self/smaps");
        assert!(
            (2 << 20..=16 << 20).contains(&huge),
            "16 MiB written, {huge} bytes on huge pages ({})",
            mode.trim()
        );
    }

    /// The `smaps` reading counts each mapping's huge pages up to the bytes of the ranges
    /// inside it: a mapping holding none adds nothing, one merged with a neighbour adds at
    /// most the ranges' share.
    #[test]
    fn huge_pages_count_within_the_ranges_mappings() {
        let smaps = "\
00400000-00600000 r-xp 00000000 08:01 42 /usr/bin/kvsnap
Size:               2048 kB
AnonHugePages:      2048 kB
7f0000000000-7f0000800000 rw-p 00000000 00:00 0
Size:               8192 kB
AnonHugePages:      6144 kB
7f0000800000-7f0001000000 rw-p 00000000 00:00 0
Size:               8192 kB
AnonHugePages:      8192 kB
";
        let mib = 1usize << 20;
        let (a, b) = (0x7f00_0000_0000usize, 0x7f00_0080_0000usize);
        // The first anonymous mapping whole: its 6 MiB of huge pages.
        assert_eq!(
            huge_bytes_in_smaps(smaps, std::slice::from_ref(&(a..a + 8 * mib))),
            6 * mib
        );
        // 4 MiB of it: at most those 4.
        assert_eq!(
            huge_bytes_in_smaps(smaps, std::slice::from_ref(&(a..a + 4 * mib))),
            4 * mib
        );
        // Both mappings, as two ranges: 6 + 8 MiB; the binary's mapping is never counted.
        assert_eq!(
            huge_bytes_in_smaps(smaps, &[a..a + 8 * mib, b..b + 8 * mib]),
            14 * mib
        );
        // Ranges outside every mapping.
        assert_eq!(
            huge_bytes_in_smaps(smaps, std::slice::from_ref(&(0x1000..0x2000))),
            0
        );
        assert_eq!(huge_bytes_in_smaps(smaps, &[]), 0);
    }
}
