//! Resident set size of this process, for the leak rows.

/// Resident set size in KiB (`VmRSS` of `/proc/self/status`), `None` where there is no procfs.
pub fn rss_kib() -> Option<u64> {
    status_kib(&std::fs::read_to_string("/proc/self/status").ok()?, "VmRSS")
}

/// Resident memory that a leak can be made of, in KiB: anonymous plus shared-memory pages
/// (`RssAnon + RssShmem`), leaving out file-backed pages (`RssFile`: code of shared libraries,
/// mapped files), which a driver faults in the first time it runs a code path, late or not.
/// Falls back to `VmRSS` where the kernel does not split it.
pub fn leakable_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    match (
        status_kib(&status, "RssAnon"),
        status_kib(&status, "RssShmem"),
    ) {
        (Some(anon), Some(shmem)) => Some(anon + shmem),
        _ => status_kib(&status, "VmRSS"),
    }
}

/// The KiB figure of `key:` in a `/proc/<pid>/status` text.
fn status_kib(status: &str, key: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Puts every thread's allocations in one glibc heap arena (`mallopt(M_ARENA_MAX, 1)`), once per
/// process, before the first model starts its threads ([`crate::shared`] and
/// [`crate::exclusive`] call it). With the default per-thread arenas, [`trim_heap`] cannot give
/// back what the driver's threads freed: on lavapipe RSS then swings by +-3 MB between
/// samples while the heap's bytes in use stay flat to a few KiB, which hides a 1 MiB leak in
/// noise. With one arena the same open/close cycles hold RSS within about 40 KiB. Later threads
/// share the arena; the allocator's behaviour is otherwise unchanged.
pub fn use_one_heap_arena() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            /// glibc's `M_ARENA_MAX` (malloc.h).
            const M_ARENA_MAX: std::ffi::c_int = -8;
            extern "C" {
                fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
            }
            // SAFETY: mallopt takes glibc's arena lock; M_ARENA_MAX only bounds future arenas.
            unsafe { mallopt(M_ARENA_MAX, 1) };
        }
    });
}

/// Returns the C heap's free memory to the system where the allocator keeps it (glibc's
/// `malloc_trim`), so that RSS counts memory in use rather than what the allocator retained after
/// frees: without it, a multi-threaded driver (lavapipe) shows megabytes of arena growth and
/// sample-to-sample swings that are not leaks. Leaked blocks are in use and stay counted.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: malloc_trim only walks glibc's own arenas under their locks; any thread may call
        // it at any time.
        unsafe { malloc_trim(0) };
    }
}

/// Bytes the C heap has handed out and not yet had back (glibc's `mallinfo2`: `uordblks` +
/// `hblkhd`, every arena and mmapped block), in KiB; `None` on other C libraries. Exact where RSS
/// is noisy: freed memory and fragmentation do not count, only allocations still live.
pub fn heap_in_use_kib() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        /// glibc's `struct mallinfo2` (all fields `size_t`).
        #[repr(C)]
        struct MallInfo2 {
            arena: usize,
            ordblks: usize,
            smblks: usize,
            hblks: usize,
            hblkhd: usize,
            usmblks: usize,
            fsmblks: usize,
            uordblks: usize,
            fordblks: usize,
            keepcost: usize,
        }
        extern "C" {
            fn mallinfo2() -> MallInfo2;
        }
        // SAFETY: mallinfo2 (glibc >= 2.33) takes the arenas' locks and returns a plain struct.
        let m = unsafe { mallinfo2() };
        Some(((m.uordblks + m.hblkhd) / 1024) as u64)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}

/// One sample: RSS after [`trim_heap`], and the heap's bytes in use.
fn sample() -> Option<(u64, Option<u64>)> {
    trim_heap();
    Some((leakable_rss_kib()?, heap_in_use_kib()))
}

/// Samples of RSS taken over the measured cycles.
const SAMPLES: usize = 41;
/// Samples at each end of the run that [`Growth`] compares (the first and last 10% of the cycles).
const END_SAMPLES: usize = 5;

/// RSS growth over `cycles` runs of `cycle`, after `warm_up` runs that are not measured.
///
/// RSS ([`leakable_rss_kib`]: anonymous and shared memory, not file-backed pages) is sampled
/// 41 times (`SAMPLES`), evenly over the measured cycles, each after [`trim_heap`];
/// the growth is the lowest sample of the last tenth minus the lowest of the first tenth. A leak
/// raises every sample after it, so it shows in full over at least 80% of the cycles, while a
/// transient peak (a driver thread's scratch memory, a deferred free) does not decide the result.
#[derive(Clone, Debug)]
pub struct Growth {
    /// Lowest KiB of the first tenth of the measured cycles.
    pub before_kib: u64,
    /// Lowest KiB of the last tenth.
    pub after_kib: u64,
    /// Measured cycles.
    pub cycles: usize,
    /// Every RSS sample, first to last (KiB).
    pub samples_kib: Vec<u64>,
    /// The C heap's bytes in use at the first and the last sample (KiB; see [`heap_in_use_kib`]),
    /// where the C library reports them.
    pub heap_kib: Option<(u64, u64)>,
}

impl Growth {
    /// `after - before`, negative when the process shrank.
    pub fn kib(&self) -> i64 {
        self.after_kib as i64 - self.before_kib as i64
    }

    /// Growth of the heap's bytes in use from the first to the last sample.
    pub fn heap_kib(&self) -> Option<i64> {
        self.heap_kib.map(|(a, b)| b as i64 - a as i64)
    }
}

/// Runs `cycle` `warm_up` times, then `cycles` times, and reports the RSS growth over the
/// measured part (see [`Growth`]); `None` without procfs.
pub fn measure(warm_up: usize, cycles: usize, mut cycle: impl FnMut(usize)) -> Option<Growth> {
    for i in 0..warm_up {
        cycle(i);
    }
    // Sample k is taken after round(k * cycles / (SAMPLES - 1)) measured cycles.
    let (first, heap_first) = sample()?;
    let mut samples_kib = vec![first];
    let mut heap_last = heap_first;
    let mut done = 0;
    for k in 1..SAMPLES {
        let until = (k * cycles + (SAMPLES - 1) / 2) / (SAMPLES - 1);
        while done < until {
            cycle(warm_up + done);
            done += 1;
        }
        let (rss, heap) = sample()?;
        samples_kib.push(rss);
        heap_last = heap;
    }
    let lowest = |s: &[u64]| s.iter().copied().min().unwrap_or(0);
    Some(Growth {
        before_kib: lowest(&samples_kib[..END_SAMPLES]),
        after_kib: lowest(&samples_kib[SAMPLES - END_SAMPLES..]),
        cycles,
        samples_kib,
        heap_kib: heap_first.zip(heap_last),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_parse_and_leakable_is_part_of_rss() {
        let status = "VmRSS:\t  150948 kB\nRssAnon:\t   20480 kB\nRssFile:\t  130000 kB\n\
                      RssShmem:\t     468 kB\n";
        assert_eq!(status_kib(status, "VmRSS"), Some(150_948));
        assert_eq!(status_kib(status, "RssAnon"), Some(20_480));
        assert_eq!(status_kib(status, "RssShmem"), Some(468));
        assert_eq!(
            status_kib(status, "Rss"),
            None,
            "a prefix of a key is not the key"
        );
        if let (Some(all), Some(leakable)) = (rss_kib(), leakable_rss_kib()) {
            assert!(leakable <= all, "{leakable} KiB of {all} KiB");
        }
    }

    /// The leak rows can fail: a planted leak of 4 KiB per cycle shows as about 40 MiB.
    #[test]
    fn a_planted_leak_is_measured() {
        let Some(g) = measure(10, 10_000, |i| {
            let page: &'static mut [u8] = Box::leak(vec![0u8; 4096].into_boxed_slice());
            page.iter_mut().step_by(512).for_each(|b| *b = i as u8);
            // Without this, release builds elide the never-read allocation.
            std::hint::black_box(page);
        }) else {
            return;
        };
        assert!(g.kib() > 30_000, "{g:?}");
        if let Some(heap) = g.heap_kib() {
            assert!(heap > 30_000, "{g:?}");
        }
    }
}
