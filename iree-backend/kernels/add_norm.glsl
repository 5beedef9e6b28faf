// A residual and the next norm, for one workgroup of THREADS threads: the sum
// x + a / sqrt(mean(a^2) + eps) * (1 + w_a) into `sum`, then that sum normed the same way by
// w_h into `h`, as the graph's rms_norm and add: a layer's attention or MLP output `a` normed
// and added to the residual `x`, then the norm before the next product. The including shader
// declares the buffers x, a, w_a, w_h (read), sum and h (written), each of n floats, and
// THREADS. Each thread holds the dims t, t + THREADS, ... (at most NORM_PER_THREAD of them),
// all its loads issued at once; the sums of squares meet by a tree in shared memory.

// add_norm takes n <= THREADS * NORM_PER_THREAD (3072) dims.
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

void add_norm(uint n, float eps) {
  const uint t = gl_LocalInvocationID.x;
  // Dims past n hold zeros, which add nothing to the sums.
  float xs[NORM_PER_THREAD], as[NORM_PER_THREAD], was[NORM_PER_THREAD], whs[NORM_PER_THREAD];
  for (uint u = 0; u < NORM_PER_THREAD; ++u) {
    const uint d = t + u * THREADS;
    const bool dim = d < n;
    xs[u] = dim ? x[d] : 0.0;
    as[u] = dim ? a[d] : 0.0;
    was[u] = dim ? w_a[d] : 0.0;
    whs[u] = dim ? w_h[d] : 0.0;
  }
  float s = 0.0;
  for (uint u = 0; u < NORM_PER_THREAD; ++u)
    s += as[u] * as[u];
  const float inv_a = 1.0 / sqrt(total(s) / float(n) + eps);
  s = 0.0;
  for (uint u = 0; u < NORM_PER_THREAD; ++u) {
    xs[u] = xs[u] + as[u] * inv_a * (1.0 + was[u]);
    s += xs[u] * xs[u];
  }
  const float inv_h = 1.0 / sqrt(total(s) / float(n) + eps);
  for (uint u = 0; u < NORM_PER_THREAD; ++u) {
    const uint d = t + u * THREADS;
    if (d < n) {
      sum[d] = xs[u];
      h[d] = xs[u] * inv_h * (1.0 + whs[u]);
    }
  }
}
