#version 450
// The decode step's attention on Vulkan, first half: one workgroup a split of a layer's key
// rows and a key/value head (x: split, y: head), as `kvsnap_attend_1` in avx512.c. Each split
// reads only the rows the query can see and writes, per query head, its unnormalised weighted
// sum of values, its maximum score and its sum of weights (`part`: [splits][kv_heads][group]
// [head_dim + 2]); attend_merge.comp merges the splits.
//
// A key row is visible when its position kp satisfies 0 <= kp <= query, kp < end and, with a
// window, kp > query - window (`pos[r] - 1`, a sliding layer's ring; `r`, a global layer's
// buffer, `window` 0). A global layer's splits divide its first min(rows, query + 1, end)
// rows, a sliding layer's all `rows`; `splits` is at least rows / SPLIT_ROWS (rounded up), so
// no split holds more than SPLIT_ROWS rows.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_GOOGLE_include_directive : require

#include "exp.glsl"

#define THREADS 256
#define MAX_GROUP 8
#define SPLIT_ROWS 32
#define EMPTY (-3.0e38)

layout(local_size_x = THREADS) in;

layout(set = 0, binding = 0) readonly buffer Query { float q[]; };     // [kv_heads][group][head_dim]
layout(set = 0, binding = 1) readonly buffer Keys { float k[]; };      // [buf_rows][kv_heads][head_dim]
layout(set = 0, binding = 2) readonly buffer Values { float v[]; };    // [buf_rows][kv_heads][head_dim]
layout(set = 0, binding = 3) readonly buffer Positions { int pos[]; }; // [pos_rows]: p + 1, 0 empty
layout(set = 0, binding = 4) readonly buffer Bounds { int lim[]; };    // {query, end}
layout(set = 0, binding = 5) writeonly buffer Parts { float part[]; };

layout(push_constant) uniform Params {
  uint kv_heads;
  uint group;
  uint head_dim;
  uint rows;
  uint window;
  uint scale_bits;
  uint splits;
} pc;

shared float weight[MAX_GROUP][SPLIT_ROWS]; // scores, then e^(s - m)
shared uint visible[SPLIT_ROWS];
shared float maximum[MAX_GROUP];

void main() {
  const uint split = gl_WorkGroupID.x, h = gl_WorkGroupID.y, t = gl_LocalInvocationID.x;
  const uint hd = pc.head_dim, g = pc.group, stride = pc.kv_heads * hd;
  const float scale = uintBitsToFloat(pc.scale_bits);
  const int query = lim[0], end = lim[1];
  uint live = pc.rows;
  if (pc.window == 0) {
    const int seen = min(query + 1, end);
    live = seen <= 0 ? 0 : min(uint(seen), pc.rows);
  }
  const uint r0 = split * live / pc.splits, r1 = (split + 1) * live / pc.splits, n = r1 - r0;

  // Scores: a subgroup a row, its lanes across the head's dims.
  for (uint i = gl_SubgroupID; i < n; i += gl_NumSubgroups) {
    const uint r = r0 + i;
    const int kp = pc.window != 0 ? pos[r] - 1 : int(r);
    const bool seen = kp >= 0 && kp <= query && kp < end &&
                      (pc.window == 0 || kp > query - int(pc.window));
    if (gl_SubgroupInvocationID == 0)
      visible[i] = seen ? 1 : 0;
    if (!seen)
      continue;
    float dot[MAX_GROUP];
    for (uint j = 0; j < MAX_GROUP; ++j)
      dot[j] = 0.0;
    const uint key = r * stride + h * hd;
    for (uint d = gl_SubgroupInvocationID; d < hd; d += gl_SubgroupSize) {
      const float kd = k[key + d];
      for (uint j = 0; j < MAX_GROUP; ++j)
        if (j < g)
          dot[j] = fma(q[(h * g + j) * hd + d], kd, dot[j]);
    }
    for (uint j = 0; j < MAX_GROUP; ++j) {
      if (j < g) {
        const float sum = subgroupAdd(dot[j]);
        if (gl_SubgroupInvocationID == 0)
          weight[j][i] = sum * scale;
      }
    }
  }
  barrier();

  // Each query head's maximum over the visible rows, then the rows' weights.
  if (t < g) {
    float top = EMPTY;
    for (uint i = 0; i < n; ++i)
      if (visible[i] != 0)
        top = max(top, weight[t][i]);
    maximum[t] = top;
  }
  barrier();
  for (uint x = t; x < g * SPLIT_ROWS; x += THREADS) {
    const uint j = x / SPLIT_ROWS, i = x % SPLIT_ROWS;
    if (i < n)
      weight[j][i] = visible[i] != 0 ? exp_poly(weight[j][i] - maximum[j]) : 0.0;
  }
  barrier();

  const uint slot = hd + 2, base = (split * pc.kv_heads + h) * g * slot;
  for (uint d = t; d < hd; d += THREADS) {
    float acc[MAX_GROUP];
    for (uint j = 0; j < MAX_GROUP; ++j)
      acc[j] = 0.0;
    for (uint i = 0; i < n; ++i) {
      if (visible[i] == 0)
        continue;
      const float vd = v[(r0 + i) * stride + h * hd + d];
      for (uint j = 0; j < MAX_GROUP; ++j)
        if (j < g)
          acc[j] = fma(weight[j][i], vd, acc[j]);
    }
    for (uint j = 0; j < MAX_GROUP; ++j)
      if (j < g)
        part[base + j * slot + d] = acc[j];
  }
  if (t < g) {
    float l = 0.0;
    for (uint i = 0; i < n; ++i)
      l += weight[t][i];
    part[base + t * slot + hd] = maximum[t];
    part[base + t * slot + hd + 1] = l;
  }
}
