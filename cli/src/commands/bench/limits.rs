//! The machine's own limits, measured in the benchmark's process: read bandwidth (a parallel sum
//! over a buffer far larger than the last-level cache) and the rate of a large SGEMM on all cores,
//! the faster of two implementations: the `gemm` crate (AVX2 code on stable Rust: its AVX-512
//! kernels need a nightly compiler) and the reference backend's own blocked GEMM
//! (`kernels::matmul`, AVX-512 where the CPU has it). Every other figure is stated against these.

use std::hint::black_box;
use std::time::Instant;

use anyhow::Context;
use kvsnap_reference::{kernels, LargeBuffer};
use rayon::prelude::*;
use serde_json::{json, Value};

/// Measured limits of this machine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// Bytes per second a parallel sum streams from memory (best pass).
    pub read_bandwidth_bps: f64,
    /// FLOP/s of an `n x n x n` f32 GEMM on all cores: the better of the two below.
    pub sgemm_flops: f64,
    /// FLOP/s of the `gemm` crate on the same SGEMM (best run).
    pub sgemm_gemm_crate_flops: f64,
    /// FLOP/s of the reference's `kernels::matmul` on the same SGEMM (best run).
    pub sgemm_reference_flops: f64,
    /// Size of the bandwidth buffer.
    pub buffer_bytes: u64,
    /// Side of the SGEMM.
    pub sgemm_n: usize,
    /// Threads of rayon's pool (the ones the backends use).
    pub threads: usize,
}

impl Limits {
    /// The better of two measurements of each limit.
    pub fn best(&self, other: &Limits) -> Limits {
        Limits {
            read_bandwidth_bps: self.read_bandwidth_bps.max(other.read_bandwidth_bps),
            sgemm_flops: self.sgemm_flops.max(other.sgemm_flops),
            sgemm_gemm_crate_flops: self
                .sgemm_gemm_crate_flops
                .max(other.sgemm_gemm_crate_flops),
            sgemm_reference_flops: self.sgemm_reference_flops.max(other.sgemm_reference_flops),
            ..*self
        }
    }

    /// The limits as JSON fields.
    pub fn json(&self) -> Value {
        json!({
            "read_bandwidth_bps": self.read_bandwidth_bps,
            "sgemm_flops": self.sgemm_flops,
            "sgemm_gemm_crate_flops": self.sgemm_gemm_crate_flops,
            "sgemm_reference_flops": self.sgemm_reference_flops,
            "bandwidth_buffer_bytes": self.buffer_bytes,
            "sgemm_n": self.sgemm_n,
            "threads": self.threads,
        })
    }
}

/// Measures both limits: `buffer_bytes` for the bandwidth sum, an `sgemm_n`-sided SGEMM.
pub fn measure(buffer_bytes: u64, sgemm_n: usize) -> anyhow::Result<Limits> {
    eprintln!(
        "limits: read bandwidth over {:.2} GiB ...",
        buffer_bytes as f64 / (1u64 << 30) as f64
    );
    let read_bandwidth_bps = read_bandwidth(buffer_bytes as usize / 4, 5)?;
    eprintln!("limits: SGEMM {sgemm_n}^3 ...");
    let (sgemm_gemm_crate_flops, sgemm_reference_flops) = sgemm_rates(sgemm_n, 3);
    Ok(Limits {
        read_bandwidth_bps,
        sgemm_flops: sgemm_gemm_crate_flops.max(sgemm_reference_flops),
        sgemm_gemm_crate_flops,
        sgemm_reference_flops,
        buffer_bytes,
        sgemm_n,
        threads: rayon::current_num_threads(),
    })
}

/// Best-of-`passes` bytes/s of a parallel sum over `len` f32 (pages touched beforehand).
fn read_bandwidth(len: usize, passes: usize) -> anyhow::Result<f64> {
    Ok(best_sum_rate(&touched(len)?, passes))
}

/// `len` f32 whose pages are all mapped, holding values the compiler cannot fold away. A
/// [`LargeBuffer`], as the weights the decode kernels stream are: on huge pages where the OS
/// offers them (a sum over 4 KiB pages read 1-5% less on a Xeon VM), so that the limit is what
/// the best-placed kernel could reach.
fn touched(len: usize) -> anyhow::Result<LargeBuffer<f32>> {
    let mut buf = LargeBuffer::zeroed(len)
        .with_context(|| format!("cannot map a {}-byte buffer to read", len * 4))?;
    buf.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(i, c)| c.fill(i as f32 * 1e-9));
    Ok(buf)
}

/// Best-of-`passes` bytes/s of a parallel sum over `buf`.
fn best_sum_rate(buf: &[f32], passes: usize) -> f64 {
    let bytes = std::mem::size_of_val(buf) as f64;
    let mut best = f64::INFINITY;
    for _ in 0..passes {
        let t = Instant::now();
        let s: f32 = buf.par_chunks(1 << 16).map(sum).sum();
        black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes / best
}

/// A read-bandwidth measurement short enough to run between the turns of a scenario, so that
/// each turn is set against the bandwidth of its own moment.
///
/// On a shared host the memory bandwidth moves in phases: `kvsnap bench limits` read 26, 42 and
/// 48 GB/s within two minutes on a Zen 4 host, and a limit taken minutes before or after a
/// turn says little about the turn. The probe is the limit's own sum over a buffer eight times a
/// 32 MiB last-level cache (by default), allocated once and kept: its pages count in the
/// process's RSS, so a scenario that runs probes subtracts [`Probe::resident_bytes`] from its
/// peak.
pub struct Probe {
    buf: LargeBuffer<f32>,
    resident_bytes: u64,
}

impl Probe {
    /// Passes per [`Probe::read_bps`]; the best one counts, as for the limit.
    pub const PASSES: usize = 3;

    /// A probe over `bytes` (rounded down to whole f32), its pages touched now.
    pub fn new(bytes: u64) -> anyhow::Result<Probe> {
        let before = super::rss_bytes().ok();
        let buf = touched((bytes / 4) as usize)?;
        let resident_bytes = match (before, super::rss_bytes().ok()) {
            (Some(b), Some(a)) => a.saturating_sub(b),
            _ => std::mem::size_of_val(&buf[..]) as u64,
        };
        Ok(Probe {
            buf,
            resident_bytes,
        })
    }

    /// What the probe added to the process's resident set when it was made.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_bytes
    }

    /// Read bandwidth now, in bytes/s: the best of [`Probe::PASSES`] passes.
    pub fn read_bps(&self) -> f64 {
        best_sum_rate(&self.buf, Self::PASSES)
    }
}

/// Sum, bound by loads: four 16-lane accumulators where the CPU has AVX-512F, otherwise
/// eight independent accumulators (so that the baseline build vectorises).
///
/// The wide loop matters: on an Ice Lake server the baseline's loop read 14-17 GB/s on 2 cores
/// where the AVX-512 one reads 18-19 GB/s, and the decode kernels (AVX-512 too) stream at
/// that rate; a limit below what the kernels reach would flatter every "x floor".
fn sum(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { sum_avx512(x) };
    }
    sum_plain(x)
}

/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 4];
    let chunks = x.chunks_exact(64);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (j, acc) in acc.iter_mut().enumerate() {
            // SAFETY: `c` holds 64 floats, so lanes 16 j .. 16 j + 16 exist.
            *acc = _mm512_add_ps(*acc, _mm512_loadu_ps(c.as_ptr().add(16 * j)));
        }
    }
    let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(sum) + tail
}

fn sum_plain(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for k in 0..8 {
            acc[k] += c[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Best-of-`runs` FLOP/s of `C = A B^T` with `n x n` f32 matrices on rayon's pool, by the
/// `gemm` crate and by the reference's `kernels::matmul`, runs interleaved.
fn sgemm_rates(n: usize, runs: usize) -> (f64, f64) {
    let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 * 0.25).collect();
    let b: Vec<f32> = (0..n * n).map(|i| (i % 5) as f32 * 0.5).collect();
    let mut c = vec![0.0f32; n * n];
    let flops = 2.0 * (n as f64).powi(3);
    let mut best = [f64::INFINITY; 2];
    // One warm-up run of each (pack buffers, thread wake-up), then the timed ones.
    for run in 0..=runs {
        for (which, best) in best.iter_mut().enumerate() {
            let t = Instant::now();
            if which == 0 {
                kernels::matmul_gemm_crate(&mut c, &a, &b, n, n, n);
            } else {
                kernels::matmul(&mut c, &a, &b, n, n, n);
            }
            black_box(&c);
            if run > 0 {
                *best = best.min(t.elapsed().as_secs_f64());
            }
        }
    }
    (flops / best[0], flops / best[1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_handle_tails() {
        // Integers, so every order of summation is exact: 64-wide body and tails of both paths.
        for n in [0usize, 1, 7, 8, 19, 63, 64, 65, 200] {
            let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let want = (n * n.saturating_sub(1) / 2) as f32;
            assert_eq!(sum(&x), want, "n={n}");
            assert_eq!(sum_plain(&x), want, "plain n={n}");
        }
    }

    /// Both SGEMMs compute the same product: the limit times real work.
    #[test]
    fn both_sgemms_agree() {
        let n = 70;
        let a: Vec<f32> = (0..n * n).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
        let b: Vec<f32> = (0..n * n).map(|i| ((i * 13) % 7) as f32 - 3.0).collect();
        let (mut x, mut y) = (vec![0.0; n * n], vec![0.0; n * n]);
        kernels::matmul_gemm_crate(&mut x, &a, &b, n, n, n);
        kernels::matmul(&mut y, &a, &b, n, n, n);
        // Small integers: every order of summation is exact.
        assert_eq!(x, y);
        assert_eq!(
            x[n + 2],
            (0..n).map(|k| a[n + k] * b[2 * n + k]).sum::<f32>()
        );
    }

    #[test]
    fn small_limits_are_positive_and_finite() {
        let l = measure(1 << 20, 64).unwrap();
        assert!(l.read_bandwidth_bps.is_finite() && l.read_bandwidth_bps > 0.0);
        assert!(l.sgemm_flops.is_finite() && l.sgemm_flops > 0.0);
        assert_eq!(
            l.sgemm_flops,
            l.sgemm_gemm_crate_flops.max(l.sgemm_reference_flops)
        );
    }
}
