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

/// Sets up this process so that RSS counts what is in use, once per process, before the first
/// model starts its threads ([`crate::shared`] and [`crate::exclusive`] call it):
///
/// - every thread's allocations go to one glibc heap arena (`mallopt(M_ARENA_MAX, 1)`). With the
///   default per-thread arenas, [`trim_heap`] cannot give back what the driver's threads freed:
///   on lavapipe RSS then swings by +-3 MB between samples while the heap's bytes in use stay
///   flat to a few KiB, which hides a 1 MiB leak in noise. With one arena the same open/close
///   cycles hold RSS within about 40 KiB. Later threads share the arena; the allocator's
///   behaviour is otherwise unchanged.
/// - transparent huge pages are off for the process (`prctl(PR_SET_THP_DISABLE)`). Where the
///   kernel backs anonymous memory with 2 MiB pages (`always`, or `madvise` for the regions IREE's
///   CPU slab provider advises), khugepaged collapses a partly resident range into one huge page
///   whenever it gets to it, so RSS steps by up to 2 MiB at a moment no cycle chose (what a
///   fresh-clone CI run looked like: RSS rose by 2,144 KiB within 50 open/close cycles, then
///   held, with the heap's bytes in use flat, +4 KiB). Pages stay 4 KiB, each counted when
///   touched.
pub fn prepare_process() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // An old kernel answers EINVAL, which leaves huge pages as they were.
        #[cfg(target_os = "linux")]
        prctl(PR_SET_THP_DISABLE, 1);
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

/// Whether transparent huge pages are off for this process (`prctl(PR_GET_THP_DISABLE)`);
/// `None` where the kernel does not say.
pub fn huge_pages_disabled() -> Option<bool> {
    #[cfg(target_os = "linux")]
    {
        let r = prctl(PR_GET_THP_DISABLE, 0);
        (r >= 0).then_some(r == 1)
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// `PR_SET_THP_DISABLE` (linux/prctl.h).
#[cfg(target_os = "linux")]
const PR_SET_THP_DISABLE: std::ffi::c_int = 41;
/// `PR_GET_THP_DISABLE` (linux/prctl.h).
#[cfg(target_os = "linux")]
const PR_GET_THP_DISABLE: std::ffi::c_int = 42;

/// `prctl(option, arg, 0, 0, 0)` for the two THP options above, which read or set a flag of
/// this process and take four unsigned long arguments.
#[cfg(target_os = "linux")]
fn prctl(option: std::ffi::c_int, arg: std::ffi::c_ulong) -> std::ffi::c_int {
    extern "C" {
        #[link_name = "prctl"]
        fn sys_prctl(option: std::ffi::c_int, ...) -> std::ffi::c_int;
    }
    debug_assert!(option == PR_SET_THP_DISABLE || option == PR_GET_THP_DISABLE);
    let zero: std::ffi::c_ulong = 0;
    // SAFETY: both THP options take four unsigned long arguments (the unused ones 0) and touch
    // only a flag of this process.
    unsafe { sys_prctl(option, arg, zero, zero, zero) }
}

/// Anonymous memory backed by transparent huge pages, in KiB (`AnonHugePages` of
/// `/proc/self/smaps_rollup`); `None` where the kernel does not report it.
pub fn anon_huge_kib() -> Option<u64> {
    status_kib(
        &std::fs::read_to_string("/proc/self/smaps_rollup").ok()?,
        "AnonHugePages",
    )
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

/// One sample after [`trim_heap`]: RSS, the heap's bytes in use and the huge pages.
struct Sample {
    rss_kib: u64,
    heap_kib: Option<u64>,
    huge_kib: Option<u64>,
}

fn sample() -> Option<Sample> {
    trim_heap();
    Some(Sample {
        rss_kib: leakable_rss_kib()?,
        heap_kib: heap_in_use_kib(),
        huge_kib: anon_huge_kib(),
    })
}

/// Samples of RSS taken over the measured cycles.
const SAMPLES: usize = 41;

/// The level of one end of a run: the median of its samples (the lower middle of an even
/// count). Until 2026-12-02 it was the lowest sample, which a single dip turned into growth: a
/// fresh-clone CI run read +476 KiB from the first tenth's `[13352, 13384, 13024, 13444, 13440]`
/// KiB and a last tenth at 13500-13516 KiB, where the median gives +124.
fn end_level(samples: &[u64]) -> u64 {
    let mut s = samples.to_vec();
    s.sort_unstable();
    s.get((s.len().max(1) - 1) / 2).copied().unwrap_or(0)
}
/// Samples at each end of the run that [`Growth`] compares (the first and last 10% of the cycles).
const END_SAMPLES: usize = 5;

/// RSS growth over `cycles` runs of `cycle`, after `warm_up` runs that are not measured.
///
/// RSS ([`leakable_rss_kib`]: anonymous and shared memory, not file-backed pages) is sampled
/// 41 times (`SAMPLES`), evenly over the measured cycles, each after [`trim_heap`];
/// the growth is the median sample of the last tenth minus the median of the first tenth
/// (`end_level`), or the lowest sample of the last tenth minus the lowest of the first,
/// whichever is less ([`Growth::kib`]). A leak raises every sample after it, so it shows in
/// full in both over at least 80% of the cycles, while a transient peak (a driver thread's
/// scratch memory, a deferred free) or dip (memory handed back for a moment) in up to two of
/// an end's five samples does not decide the medians, and memory that comes and goes between
/// two levels (the CPU device's tiny model, opened and closed: 16.7 and 17.8 MB, alternating)
/// does not decide the lowest samples.
#[derive(Clone, Debug)]
pub struct Growth {
    /// Median KiB of the first tenth of the measured cycles.
    pub before_kib: u64,
    /// Median KiB of the last tenth.
    pub after_kib: u64,
    /// Lowest KiB of the first tenth.
    pub floor_before_kib: u64,
    /// Lowest KiB of the last tenth.
    pub floor_after_kib: u64,
    /// Measured cycles.
    pub cycles: usize,
    /// Every RSS sample, first to last (KiB).
    pub samples_kib: Vec<u64>,
    /// The C heap's bytes in use at the first and the last sample (KiB; see [`heap_in_use_kib`]),
    /// where the C library reports them.
    pub heap_kib: Option<(u64, u64)>,
    /// Anonymous memory in transparent huge pages at the first and the last sample (KiB; see
    /// [`anon_huge_kib`]): zero after [`prepare_process`] on kernels that honour it.
    pub huge_kib: Option<(u64, u64)>,
}

impl Growth {
    /// The growth of the medians or of the lowest samples from the first tenth to the last,
    /// whichever is less; negative when the process shrank.
    ///
    /// The medians alone once failed a fresh-clone CI run's open/close row with +1148 KiB where
    /// the samples moved between two levels 1.1 MB apart all along (first tenth `[17704, 16864,
    /// 16660, 16680, 16748]`, last `[17896, 17864, 16780, 17896, 17912]` KiB): the lowest
    /// samples grew +120. A leak raises the lowest samples as much as the medians.
    pub fn kib(&self) -> i64 {
        let median = self.after_kib as i64 - self.before_kib as i64;
        let floor = self.floor_after_kib as i64 - self.floor_before_kib as i64;
        median.min(floor)
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
    let first = sample()?;
    let mut samples_kib = vec![first.rss_kib];
    let mut last_heap = first.heap_kib;
    let mut last_huge = first.huge_kib;
    let mut done = 0;
    for k in 1..SAMPLES {
        let until = (k * cycles + (SAMPLES - 1) / 2) / (SAMPLES - 1);
        while done < until {
            cycle(warm_up + done);
            done += 1;
        }
        let s = sample()?;
        samples_kib.push(s.rss_kib);
        (last_heap, last_huge) = (s.heap_kib, s.huge_kib);
    }
    let (head, tail) = (
        &samples_kib[..END_SAMPLES],
        &samples_kib[SAMPLES - END_SAMPLES..],
    );
    let lowest = |s: &[u64]| s.iter().copied().min().unwrap_or(0);
    Some(Growth {
        before_kib: end_level(head),
        after_kib: end_level(tail),
        floor_before_kib: lowest(head),
        floor_after_kib: lowest(tail),
        cycles,
        samples_kib,
        heap_kib: first.heap_kib.zip(last_heap),
        huge_kib: first.huge_kib.zip(last_huge),
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

    /// After the process is prepared, the kernel reports transparent huge pages off for it, so
    /// no 2 MiB collapse can move the leak rows' RSS.
    #[test]
    fn prepared_process_has_no_transparent_huge_pages() {
        prepare_process();
        match huge_pages_disabled() {
            Some(off) => assert!(off, "PR_GET_THP_DISABLE answers 0 after prepare_process"),
            None => eprintln!("SKIPPED: the kernel does not answer PR_GET_THP_DISABLE"),
        }
    }

    /// An end's level ignores up to two outliers of its five samples, either way; a step that
    /// holds moves it in full.
    #[test]
    fn end_levels_ignore_transients_and_follow_steps() {
        assert_eq!(end_level(&[13352, 13384, 13024, 13444, 13440]), 13384);
        assert_eq!(end_level(&[500, 900, 502, 950, 501]), 502);
        assert_eq!(end_level(&[100, 2148, 2148, 2148, 2150]), 2148);
        assert_eq!(end_level(&[7, 3]), 3);
        assert_eq!(end_level(&[]), 0);
    }

    /// Two levels in both tenths are not growth, whichever level each median lands on; a step
    /// that holds is, in full.
    #[test]
    fn growth_ignores_two_levels_and_follows_a_step() {
        let growth = |first: [u64; 5], last: [u64; 5]| {
            Growth {
                before_kib: end_level(&first),
                after_kib: end_level(&last),
                floor_before_kib: *first.iter().min().unwrap(),
                floor_after_kib: *last.iter().min().unwrap(),
                cycles: 1000,
                samples_kib: Vec::new(),
                heap_kib: None,
                huge_kib: None,
            }
            .kib()
        };
        let low_first = [17704, 16864, 16660, 16680, 16748];
        assert_eq!(growth(low_first, [17896, 17864, 16780, 17896, 17912]), 120);
        assert_eq!(
            growth([17800, 17840, 16700, 17820, 17850], low_first),
            -1072
        );
        assert_eq!(growth(low_first, [18800, 18790, 18810, 18805, 18795]), 2052);
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
