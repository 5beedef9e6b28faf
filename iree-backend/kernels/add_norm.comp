#version 450
// The decode step's residual and the next norm on Vulkan, in one workgroup: the sum
// x + a / sqrt(mean(a^2) + eps) * (1 + w_a) (`sum`), then that sum normed the same way by
// w_h (`h`), as the graph's rms_norm and add: a layer's attention or MLP output normed and
// added to the residual, then the norm before the next product. Each thread holds the dims
// t, t + THREADS, ... (at most PER_THREAD of them), all its loads issued at once; the sums
// of squares meet by a tree in shared memory.
#define THREADS 128
// The kernel takes n <= THREADS * PER_THREAD (3072) dims.
#define PER_THREAD 24

layout(local_size_x = THREADS) in;

layout(set = 0, binding = 0) readonly buffer Residual { float x[]; }; // [n]
layout(set = 0, binding = 1) readonly buffer Output { float a[]; };   // [n]
layout(set = 0, binding = 2) readonly buffer OutputNorm { float w_a[]; };
layout(set = 0, binding = 3) readonly buffer NextNorm { float w_h[]; };
layout(set = 0, binding = 4) writeonly buffer Sum { float sum[]; };   // [n]
layout(set = 0, binding = 5) writeonly buffer Normed { float h[]; };  // [n]

layout(push_constant) uniform Params {
  uint n;
  uint eps_bits;
} pc;

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

void main() {
  const uint t = gl_LocalInvocationID.x, n = pc.n;
  const float eps = uintBitsToFloat(pc.eps_bits);
  // Dims past n hold zeros, which add nothing to the sums.
  float xs[PER_THREAD], as[PER_THREAD], was[PER_THREAD], whs[PER_THREAD];
  for (uint u = 0; u < PER_THREAD; ++u) {
    const uint d = t + u * THREADS;
    const bool dim = d < n;
    xs[u] = dim ? x[d] : 0.0;
    as[u] = dim ? a[d] : 0.0;
    was[u] = dim ? w_a[d] : 0.0;
    whs[u] = dim ? w_h[d] : 0.0;
  }
  float s = 0.0;
  for (uint u = 0; u < PER_THREAD; ++u)
    s += as[u] * as[u];
  const float inv_a = 1.0 / sqrt(total(s) / float(n) + eps);
  s = 0.0;
  for (uint u = 0; u < PER_THREAD; ++u) {
    xs[u] = xs[u] + as[u] * inv_a * (1.0 + was[u]);
    s += xs[u] * xs[u];
  }
  const float inv_h = 1.0 / sqrt(total(s) / float(n) + eps);
  for (uint u = 0; u < PER_THREAD; ++u) {
    const uint d = t + u * THREADS;
    if (d < n) {
      sum[d] = xs[u];
      h[d] = xs[u] * inv_h * (1.0 + whs[u]);
    }
  }
}
