//! The runtime's calls and buffers over thousands of cycles leave the process's resident size
//! flat. Resident size is the whole process's, so these run in a binary of their own, one at a
//! time (`EXCLUSIVE`): in `runtime.rs` the other tests' compiles and sessions, running beside
//! them, once grew it by 3.3 MB within one of their windows.

mod common;

use std::sync::Mutex;

use common::{devices, load, ADD};
use kvsnap_iree::runtime::{BufferView, DeviceKind};

/// The allocator's statistics read every 10 ms until `done` accepts one, or the last read
/// once `limit` has passed.
fn stats_until(
    device: &kvsnap_iree::runtime::Device,
    limit: std::time::Duration,
    mut done: impl FnMut(&kvsnap_iree::runtime::AllocatorStats) -> bool,
) -> kvsnap_iree::runtime::AllocatorStats {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let now = device.allocator_stats();
        if done(&now) || std::time::Instant::now() >= deadline {
            return now;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The allocator's statistics once its live bytes read the same five times 10 ms apart (at
/// most two seconds): a buffer whose release waits on a queue operation still retiring is not
/// yet freed when the warm-up ends (a fresh-clone run read 16 live bytes there, 0 after).
fn settled_stats(device: &kvsnap_iree::runtime::Device) -> kvsnap_iree::runtime::AllocatorStats {
    let (mut last, mut same) = (None, 0);
    stats_until(device, std::time::Duration::from_secs(2), |now| {
        let live = Some(now.live_bytes());
        same = if live == last { same + 1 } else { 0 };
        last = live;
        same == 4
    })
}

/// The allocator's statistics once its live bytes are `live`, or after five seconds: the
/// releases of the last cycle's buffers may still be retiring when it ends (a fresh-clone run
/// read the 16 bytes of the last call's output there); a leak never comes back down.
fn stats_once_live(
    device: &kvsnap_iree::runtime::Device,
    live: u64,
) -> kvsnap_iree::runtime::AllocatorStats {
    stats_until(device, std::time::Duration::from_secs(5), |now| {
        now.live_bytes() == live
    })
}

/// Held by each test for its whole run.
static EXCLUSIVE: Mutex<()> = Mutex::new(());

/// Resident set size of this process (Linux), for leak checks where allocator statistics are blind.
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

#[test]
fn twenty_thousand_calls_keep_memory_flat() {
    let _alone = EXCLUSIVE.lock().unwrap_or_else(|e| e.into_inner());
    // Each call creates a semaphore, its signal fence and a timepoint block (`runtime::wait`):
    // a leak of any of them, a few hundred bytes, would be several MiB over these calls.
    const CALLS: usize = 20_000;
    for (device, target) in devices() {
        let session = load(&device, target, ADD);
        let a = BufferView::from_f32(&device, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let call = || {
            let out = session.call("add", &[&a, &a]).unwrap();
            assert_eq!(out.len(), 1);
        };
        let views_before = device.live_buffer_views();
        for _ in 0..200 {
            call(); // warm-up: pools and caches reach their steady size
        }
        let rss_warm = resident_bytes();
        let start = std::time::Instant::now();
        for _ in 0..CALLS {
            call();
        }
        let rss_growth = resident_bytes().saturating_sub(rss_warm);
        eprintln!(
            "{}: {CALLS} calls in {:?}, resident growth {} KiB",
            target.name(),
            start.elapsed(),
            rss_growth / 1024
        );
        assert_eq!(device.live_buffer_views(), views_before, "{target:?}");
        assert!(
            rss_growth < 2 << 20,
            "{target:?}: resident size grew by {rss_growth} bytes over {CALLS} calls"
        );
    }
}

#[test]
fn thousand_allocate_copy_release_cycles_keep_memory_flat() {
    let _alone = EXCLUSIVE.lock().unwrap_or_else(|e| e.into_inner());
    // 64 KiB per buffer: a leak of one buffer per cycle would be 64 MiB (or 128 MiB), far above the
    // resident-size slack below.
    const SHAPE: [usize; 2] = [64, 256];
    let data: Vec<f32> = (0..SHAPE[0] * SHAPE[1]).map(|i| i as f32).collect();
    for (device, target) in devices() {
        let session = load(&device, target, ADD);
        let cycle = |i: usize| {
            let v = BufferView::from_f32(&device, &SHAPE, &data).unwrap();
            let c = v.device_copy().unwrap();
            if i.is_multiple_of(100) {
                let a = BufferView::from_f32(&device, &[4], &[1.0; 4]).unwrap();
                let out = session.call("add", &[&a, &a]).unwrap();
                assert_eq!(out[0].to_f32_vec().unwrap(), vec![2.0; 4]);
                assert_eq!(c.to_f32_vec().unwrap(), data);
            }
        };
        let views_before = device.live_buffer_views();
        for i in 0..10 {
            cycle(i); // warm-up: pools and caches reach their steady size
        }
        let warm = settled_stats(&device);
        let rss_warm = resident_bytes();
        for i in 0..1000 {
            cycle(i);
        }
        let stats = if device.kind() == DeviceKind::Cpu {
            stats_once_live(&device, warm.live_bytes())
        } else {
            // Vulkan's statistics record no frees (below): nothing to wait for.
            device.allocator_stats()
        };
        let rss_growth = resident_bytes().saturating_sub(rss_warm);
        eprintln!(
            "{}: after 1000 cycles: allocator {stats:?}, resident growth {} KiB",
            target.name(),
            rss_growth / 1024
        );
        assert_eq!(device.live_buffer_views(), views_before, "{target:?}");
        assert!(
            rss_growth < 16 << 20,
            "{target:?}: resident size grew by {rss_growth} bytes"
        );
        let allocated = |s: &kvsnap_iree::runtime::AllocatorStats| {
            s.host_bytes_allocated + s.device_bytes_allocated
        };
        assert!(
            allocated(&stats) >= allocated(&warm) + 1000 * 2 * 65536,
            "the allocator statistics must see the allocations: {stats:?}"
        );
        if device.kind() == DeviceKind::Cpu {
            // The CPU heap allocator records every free, so live bytes must be flat, and the peak
            // too but for a few buffers: a copy's source is released when its queue operation
            // retires, which on a loaded machine can lag a cycle or two (full test runs on a
            // shared host read one and two buffers more). A leak would add 64 MiB.
            // (IREE 3.13's Vulkan allocator records pool allocations but not their frees, so its
            // statistics cannot show a leak: the resident size above covers it.)
            let buffer = (SHAPE[0] * SHAPE[1] * std::mem::size_of::<f32>()) as u64;
            assert_eq!(stats.live_bytes(), warm.live_bytes(), "{stats:?}");
            assert!(
                stats.device_bytes_peak <= warm.device_bytes_peak + 8 * buffer,
                "peak grew by more than 8 buffers: warm {warm:?}, after {stats:?}"
            );
        }
    }
}
