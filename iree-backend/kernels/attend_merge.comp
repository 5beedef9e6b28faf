#version 450
// The decode step's attention on Vulkan, second half: the splits of attend_split.comp merged,
// one workgroup a query head (x: kv head * group + query head): with M the largest of the
// splits' maxima m, o = sum(e^(m - M) acc) / sum(e^(m - M) l), in split order. `out`:
// [kv_heads][group][head_dim].
#extension GL_GOOGLE_include_directive : require

#include "exp.glsl"

#define THREADS 256

layout(local_size_x = THREADS) in;

layout(set = 0, binding = 0) readonly buffer Parts { float part[]; };
layout(set = 0, binding = 1) writeonly buffer Out { float o[]; };

layout(push_constant) uniform Params {
  uint kv_heads;
  uint group;
  uint head_dim;
  uint splits;
} pc;

void main() {
  const uint head = gl_WorkGroupID.x, t = gl_LocalInvocationID.x;
  const uint hd = pc.head_dim, slot = hd + 2, step = pc.kv_heads * pc.group * slot;
  const uint first = head * slot;
  float top = part[first + hd];
  for (uint s = 1; s < pc.splits; ++s)
    top = max(top, part[first + s * step + hd]);
  float l = 0.0;
  for (uint s = 0; s < pc.splits; ++s) {
    const uint at = first + s * step;
    l = fma(exp_poly(part[at + hd] - top), part[at + hd + 1], l);
  }
  for (uint d = t; d < hd; d += THREADS) {
    float acc = 0.0;
    for (uint s = 0; s < pc.splits; ++s) {
      const uint at = first + s * step;
      acc = fma(exp_poly(part[at + hd] - top), part[at + d], acc);
    }
    o[head * hd + d] = acc / l;
  }
}
