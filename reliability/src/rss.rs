//! Resident set size of this process, for the leak rows.

/// Resident set size in KiB (`VmRSS` of `/proc/self/status`), `None` where there is no procfs.
pub fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// RSS before and after `cycles` runs of `cycle`, after `warm_up` runs that are not measured.
#[derive(Clone, Copy, Debug)]
pub struct Growth {
    /// KiB after the warm-up.
    pub before_kib: u64,
    /// KiB after the measured cycles.
    pub after_kib: u64,
    /// Measured cycles.
    pub cycles: usize,
}

impl Growth {
    /// `after - before`, negative when the process shrank.
    pub fn kib(&self) -> i64 {
        self.after_kib as i64 - self.before_kib as i64
    }
}

/// Runs `cycle` `warm_up` times, then `cycles` times, and reports the RSS growth over the
/// measured part; `None` without procfs.
pub fn measure(warm_up: usize, cycles: usize, mut cycle: impl FnMut(usize)) -> Option<Growth> {
    for i in 0..warm_up {
        cycle(i);
    }
    let before_kib = rss_kib()?;
    for i in 0..cycles {
        cycle(warm_up + i);
    }
    Some(Growth {
        before_kib,
        after_kib: rss_kib()?,
        cycles,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
