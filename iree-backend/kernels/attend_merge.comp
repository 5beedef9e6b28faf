#version 450
// The decode step's attention on Vulkan, second half: the splits of attend_split.comp merged,
// one workgroup a query head (x: kv head * group + query head): with M the largest of the
// splits' maxima m, o = sum(e^(m - M) acc) / sum(e^(m - M) l). `out`: [kv_heads][group]
// [head_dim]. The splits' m and l are loaded at once, a thread each, and their weights taken
// once into shared memory; each thread then sums a dim over the splits, UNROLL loads at a
// time.
#extension GL_GOOGLE_include_directive : require

#include "exp.glsl"

#define THREADS 128
#define UNROLL 8
#define EMPTY (-3.0e38)

layout(local_size_x = THREADS) in;

layout(set = 0, binding = 0) readonly buffer Parts { float part[]; };
layout(set = 0, binding = 1) writeonly buffer Out { float o[]; };

layout(push_constant) uniform Params {
  uint kv_heads;
  uint group;
  uint head_dim;
  uint splits;
} pc;

shared float top[THREADS];
shared float mass[THREADS];
// Each split's weight e^(m - M); splits past THREADS fold into their thread's entry first.
shared float split_weight[THREADS];

void main() {
  const uint head = gl_WorkGroupID.x, t = gl_LocalInvocationID.x;
  const uint hd = pc.head_dim, slot = hd + 2, step = pc.kv_heads * pc.group * slot;
  const uint first = head * slot;

  // The largest maximum, by a tree over the threads' own.
  float m = EMPTY;
  for (uint s = t; s < pc.splits; s += THREADS)
    m = max(m, part[first + s * step + hd]);
  top[t] = m;
  barrier();
  for (uint half_ = THREADS / 2; half_ > 0; half_ /= 2) {
    if (t < half_)
      top[t] = max(top[t], top[t + half_]);
    barrier();
  }
  const float best = top[0];

  // The weights' mass sum(e^(m - M) l), by a tree.
  float l = 0.0;
  for (uint s = t; s < pc.splits; s += THREADS) {
    const uint at = first + s * step;
    const float w = exp_poly(part[at + hd] - best);
    if (s < THREADS)
      split_weight[s] = w;
    l = fma(w, part[at + hd + 1], l);
  }
  mass[t] = l;
  barrier();
  for (uint half_ = THREADS / 2; half_ > 0; half_ /= 2) {
    if (t < half_)
      mass[t] += mass[t + half_];
    barrier();
  }
  const float total = mass[0];

  for (uint d = t; d < hd; d += THREADS) {
    float acc = 0.0;
    for (uint s0 = 0; s0 < pc.splits; s0 += UNROLL) {
      float x[UNROLL];
      for (uint u = 0; u < UNROLL; ++u) {
        const uint s = s0 + u;
        x[u] = s < pc.splits ? part[first + s * step + d] : 0.0;
      }
      for (uint u = 0; u < UNROLL; ++u) {
        const uint s = s0 + u;
        const float w = s >= pc.splits ? 0.0
                        : s < THREADS  ? split_weight[s]
                                       : exp_poly(part[first + s * step + hd] - best);
        acc = fma(w, x[u], acc);
      }
    }
    o[head * hd + d] = acc / total;
  }
}
