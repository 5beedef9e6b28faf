#version 450
// The first layer's input on Vulkan: the embedding rows scaled, x = rows * scale, and x
// normed by the first layer's input norm, a workgroup a row (norm.glsl), as the graph's
// `embed` and rms_norm.
#extension GL_GOOGLE_include_directive : require

#define THREADS 128

layout(local_size_x = THREADS) in;

layout(set = 0, binding = 0) readonly buffer Rows { float rows[]; };   // [c][n]
layout(set = 0, binding = 1) readonly buffer Norm { float w_h[]; };    // [n]
layout(set = 0, binding = 2) writeonly buffer Sum { float sum[]; };    // [c][n]: x
layout(set = 0, binding = 3) writeonly buffer Normed { float h[]; };   // [c][n]

layout(push_constant) uniform Params {
  uint n;
  uint eps_bits;
  uint scale_bits;
} pc;

#include "norm.glsl"

void main() {
  const uint t = gl_LocalInvocationID.x, base = gl_WorkGroupID.x * pc.n;
  const float scale = uintBitsToFloat(pc.scale_bits);
  float xs[NORM_PER_THREAD];
  for (uint u = 0; u < NORM_PER_THREAD; ++u) {
    const uint d = t + u * THREADS;
    xs[u] = d < pc.n ? rows[base + d] * scale : 0.0;
  }
  store_normed(xs, pc.n, uintBitsToFloat(pc.eps_bits), base);
}
