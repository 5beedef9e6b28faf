#version 450
// The decode step's residual and the next norm on Vulkan, in one workgroup: the sum
// x + a / sqrt(mean(a^2) + eps) * (1 + w_a) (`out[0]`), then that sum normed the same way by
// w_h (`out[1]`), as the graph's rms_norm and add: a layer's attention or MLP output normed
// and added to the residual, then the norm before the next product. Each thread takes the
// dims t, t + THREADS, ...; the sums of squares meet by a tree in shared memory.
#define THREADS 128

layout(local_size_x = THREADS) in;

layout(set = 0, binding = 0) readonly buffer Residual { float x[]; }; // [n]
layout(set = 0, binding = 1) readonly buffer Output { float a[]; };   // [n]
layout(set = 0, binding = 2) readonly buffer OutputNorm { float w_a[]; };
layout(set = 0, binding = 3) readonly buffer NextNorm { float w_h[]; };
layout(set = 0, binding = 4) buffer Sum { float sum[]; };             // [n]
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
  float s = 0.0;
  for (uint d = t; d < n; d += THREADS)
    s += a[d] * a[d];
  const float inv_a = 1.0 / sqrt(total(s) / float(n) + eps);
  s = 0.0;
  for (uint d = t; d < n; d += THREADS) {
    const float y = x[d] + a[d] * inv_a * (1.0 + w_a[d]);
    sum[d] = y;
    s += y * y;
  }
  const float inv_h = 1.0 / sqrt(total(s) / float(n) + eps);
  // Each thread reads back only the dims it wrote.
  for (uint d = t; d < n; d += THREADS)
    h[d] = sum[d] * inv_h * (1.0 + w_h[d]);
}
