#version 450
// A chunk's residual and next norm on Vulkan, a workgroup a row (add_norm.glsl): the sum
// x + rms_norm(a, w_a) and that sum normed by w_h, as the graph's rms_norm and add, where
// IREE's generic SPIR-V reduced each of a chunk's norms in one workgroup.
#extension GL_GOOGLE_include_directive : require

#define THREADS 128

layout(local_size_x = THREADS) in;

layout(set = 0, binding = 0) readonly buffer Residual { float x[]; };   // [c][n]
layout(set = 0, binding = 1) readonly buffer Output { float a[]; };     // [c][n]
layout(set = 0, binding = 2) readonly buffer OutputNorm { float w_a[]; };  // [n]
layout(set = 0, binding = 3) readonly buffer NextNorm { float w_h[]; };    // [n]
layout(set = 0, binding = 4) writeonly buffer Sum { float sum[]; };     // [c][n]
layout(set = 0, binding = 5) writeonly buffer Normed { float h[]; };    // [c][n]

layout(push_constant) uniform Params {
  uint n;
  uint eps_bits;
} pc;

#include "add_norm.glsl"

void main() {
  add_norm(pc.n, uintBitsToFloat(pc.eps_bits), gl_WorkGroupID.x * pc.n);
}
