// A residual and the next norm, for one workgroup of THREADS threads: the sum
// x + a / sqrt(mean(a^2) + eps) * (1 + w_a) into `sum`, then that sum normed the same way by
// w_h into `h`, as the graph's rms_norm and add: a layer's attention or MLP output `a` normed
// and added to the residual `x`, then the norm before the next product. The including shader
// declares the buffers x, a (read), sum and h (written), each rows of n floats (the row at
// `base`), w_a and w_h (n floats, read), and THREADS. Each thread holds its dims
// (norm.glsl), all its loads issued at once.
#include "norm.glsl"

void add_norm(uint n, float eps, uint base) {
  const uint t = gl_LocalInvocationID.x;
  // Dims past n hold zeros, which add nothing to the sums.
  float xs[NORM_PER_THREAD], as[NORM_PER_THREAD], was[NORM_PER_THREAD];
  for (uint u = 0; u < NORM_PER_THREAD; ++u) {
    const uint d = t + u * THREADS;
    const bool dim = d < n;
    xs[u] = dim ? x[base + d] : 0.0;
    as[u] = dim ? a[base + d] : 0.0;
    was[u] = dim ? w_a[d] : 0.0;
  }
  const float inv_a = inv_rms(as, n, eps);
  for (uint u = 0; u < NORM_PER_THREAD; ++u)
    xs[u] = xs[u] + as[u] * inv_a * (1.0 + was[u]);
  store_normed(xs, n, eps, base);
}
