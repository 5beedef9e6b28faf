// RMS norms for one workgroup of THREADS threads, each holding the dims t, t + THREADS, ...
// of an n-dim row (at most NORM_PER_THREAD of them) in registers: the sums of squares meet
// by a tree in shared memory. The including shader declares THREADS, and the buffers w_h
// (the norm's weights, n floats, read), sum and h (written; the row at `base`).

// The norms take n <= THREADS * NORM_PER_THREAD (3072) dims.
#define NORM_PER_THREAD 24

shared float share[THREADS];

// The sum of every thread's `s`.
float total(float s) {
  const uint t = gl_LocalInvocationID.x;
  share[t] = s;
  barrier();
  for (uint width = THREADS / 2; width > 0; width /= 2) {
    if (t < width)
      share[t] += share[t + width];
    barrier();
  }
  const float all = share[0];
  barrier();
  return all;
}

// 1 / sqrt(mean(xs^2) + eps) over the workgroup's row, the dims past n zeros.
float inv_rms(float xs[NORM_PER_THREAD], uint n, float eps) {
  float s = 0.0;
  for (uint u = 0; u < NORM_PER_THREAD; ++u)
    s += xs[u] * xs[u];
  return 1.0 / sqrt(total(s) / float(n) + eps);
}

// The row `xs` into `sum`, and normed by w_h, xs / sqrt(mean(xs^2) + eps) * (1 + w_h), into
// `h`, as the graph's rms_norm: each at `base`.
void store_normed(float xs[NORM_PER_THREAD], uint n, float eps, uint base) {
  const uint t = gl_LocalInvocationID.x;
  float whs[NORM_PER_THREAD];
  for (uint u = 0; u < NORM_PER_THREAD; ++u) {
    const uint d = t + u * THREADS;
    whs[u] = d < n ? w_h[d] : 0.0;
  }
  const float inv_h = inv_rms(xs, n, eps);
  for (uint u = 0; u < NORM_PER_THREAD; ++u) {
    const uint d = t + u * THREADS;
    if (d < n) {
      sum[base + d] = xs[u];
      h[base + d] = xs[u] * inv_h * (1.0 + whs[u]);
    }
  }
}
