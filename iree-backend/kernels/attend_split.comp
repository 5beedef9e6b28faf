#version 450
// The decode step's attention on Vulkan, first half: one workgroup a split of a layer's key
// rows and a key/value head (x: split, y: head), as `kvsnap_attend_1` in avx512.c. Each split
// reads only the rows the query can see and writes, per query head, its unnormalised weighted
// sum of values, its maximum score and its sum of weights (`part`: [splits][kv_heads][group]
// [head_dim + 2]); attend_merge.comp merges the splits.
//
// The step's query and key heads arrive as the projection gives them (`qk`: [heads +
// kv_heads][head_dim], the queries first) and every workgroup norms and rotates its own, as
// the graph's norm_rotate_heads: x / sqrt(mean(x^2) + eps) * (1 + w), then rotate-half RoPE,
// x * [cos, cos] + [x2, x1] * [-sin, sin]. The first split's workgroups (each its head's)
// store the step's key and value rows (`v_row`) at row `start[0]` of the buffers, the
// dispatch's in-place results, where dispatches of their own would write them first. No
// workgroup reads that row of the buffers: the one whose split holds it takes the rows from
// shared memory and `v_row`.
//
// A key row is visible when its position kp satisfies 0 <= kp <= query, kp < end and, with a
// window, kp > query - window (`pos[r] - 1`, a sliding layer's ring; `r`, a global layer's
// buffer, `window` 0). A global layer's splits divide its first min(rows, query + 1, end)
// rows, a sliding layer's all `rows`; `splits` is at least rows / SPLIT_ROWS (rounded up), so
// no split holds more than SPLIT_ROWS rows.
//
// The K and V rows come from device memory, far from the workgroup (about half a microsecond
// a load): every thread issues UNROLL independent loads before it uses them, where a loop of
// one load at a time would wait that long for each.
//
// 128 threads and at most 16 KB of shared memory (about 14.1 KB here): the least Vulkan
// promises (maxComputeWorkGroupInvocations, maxComputeSharedMemorySize), as IREE's generic
// SPIR-V target assumes.
#extension GL_GOOGLE_include_directive : require

#include "exp.glsl"

#define THREADS 128
#define MAX_GROUP 8
// Two dims a thread in RoPE's pairs: a head's halves are at most THREADS long.
#define MAX_HEAD_DIM (2 * THREADS)
#define SPLIT_ROWS 16
// Threads that score one row together (THREADS / SPLIT_ROWS), each over every LANES-th dim.
#define LANES 8
#define UNROLL 8
#define EMPTY (-3.0e38)

layout(local_size_x = THREADS) in;

layout(set = 0, binding = 0) readonly buffer Heads { float qk[]; };     // [heads + kv_heads][head_dim]
layout(set = 0, binding = 1) readonly buffer ValueRow { float v_row[]; }; // [kv_heads][head_dim]
layout(set = 0, binding = 2) readonly buffer QueryNorm { float q_norm[]; }; // [head_dim]: w
layout(set = 0, binding = 3) readonly buffer KeyNorm { float k_norm[]; };
layout(set = 0, binding = 4) readonly buffer Cos { float cos_t[]; };     // [head_dim / 2]
layout(set = 0, binding = 5) readonly buffer Sin { float sin_t[]; };     // [2][head_dim / 2]: -sin, sin
layout(set = 0, binding = 6) readonly buffer Positions { int pos[]; };   // [pos_rows]: p + 1, 0 empty
layout(set = 0, binding = 7) readonly buffer Bounds { int lim[]; };      // {query, end}
layout(set = 0, binding = 8) readonly buffer Start { int start[]; };     // {the step's row}
layout(set = 0, binding = 9) buffer Keys { float k[]; };                 // [buf_rows][kv_heads][head_dim]
layout(set = 0, binding = 10) buffer Values { float v[]; };              // [buf_rows][kv_heads][head_dim]
layout(set = 0, binding = 11) writeonly buffer Parts { float part[]; };

layout(push_constant) uniform Params {
  uint kv_heads;
  uint group;
  uint head_dim;
  uint rows;
  uint window;
  uint scale_bits;
  uint splits;
  uint eps_bits;
} pc;

// The query heads, then the key head (row `group`).
shared float head_rows[(MAX_GROUP + 1) * MAX_HEAD_DIM];
// Each thread's share of a head's sum of squares (the key's last), then of its row's dot
// products.
shared float partial[MAX_GROUP + 1][THREADS];
shared float weight[MAX_GROUP][SPLIT_ROWS]; // scores, then e^(s - m)
shared bool visible[SPLIT_ROWS];
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
  const uint fresh = uint(start[0]), head = h * hd;

  // The heads, normed and rotated. Thread t takes RoPE's pair (t, t + hd / 2); its norm
  // weights and table entries load with the heads, UNROLL loads in flight at a time. The
  // sums of squares meet by a tree over the threads' shares.
  const uint half_dim = hd / 2, own_heads = g * hd, key_head = (pc.kv_heads * g + h) * hd;
  const bool pairs = t < half_dim;
  const float c = pairs ? cos_t[t] : 0.0, s1 = pairs ? sin_t[t] : 0.0;
  const float s2 = pairs ? sin_t[half_dim + t] : 0.0;
  const float q1 = pairs ? 1.0 + q_norm[t] : 0.0, q2 = pairs ? 1.0 + q_norm[half_dim + t] : 0.0;
  const float k1 = pairs ? 1.0 + k_norm[t] : 0.0, k2 = pairs ? 1.0 + k_norm[half_dim + t] : 0.0;
  for (uint x0 = t; x0 < own_heads + hd; x0 += THREADS * UNROLL) {
    float got[UNROLL];
    for (uint u = 0; u < UNROLL; ++u) {
      const uint x = x0 + u * THREADS;
      got[u] = x < own_heads        ? qk[h * own_heads + x]
               : x < own_heads + hd ? qk[key_head + x - own_heads]
                                    : 0.0;
    }
    for (uint u = 0; u < UNROLL; ++u)
      if (x0 + u * THREADS < own_heads + hd)
        head_rows[x0 + u * THREADS] = got[u];
  }
  barrier();
  for (uint j = 0; j <= g; ++j) {
    float s = 0.0;
    for (uint d = t; d < hd; d += THREADS)
      s += head_rows[j * hd + d] * head_rows[j * hd + d];
    partial[j][t] = s;
  }
  barrier();
  for (uint width = THREADS / 2; width > 0; width /= 2) {
    if (t < width)
      for (uint j = 0; j <= g; ++j)
        partial[j][t] += partial[j][t + width];
    barrier();
  }
  const float eps = uintBitsToFloat(pc.eps_bits);
  if (pairs)
    for (uint j = 0; j <= g; ++j) {
      const float inv = 1.0 / sqrt(partial[j][0] / float(hd) + eps);
      const uint at = j * hd + t;
      const float y1 = head_rows[at] * inv * (j < g ? q1 : k1);
      const float y2 = head_rows[at + half_dim] * inv * (j < g ? q2 : k2);
      head_rows[at] = y1 * c + y2 * s1;
      head_rows[at + half_dim] = y2 * c + y1 * s2;
    }
  if (t < n) {
    const uint r = r0 + t;
    const int kp = pc.window != 0 ? pos[r] - 1 : int(r);
    visible[t] = kp >= 0 && kp <= query && kp < end &&
                 (pc.window == 0 || kp > query - int(pc.window));
  }
  barrier();

  if (split == 0)
    for (uint d = t; d < hd; d += THREADS) {
      k[fresh * stride + head + d] = head_rows[g * hd + d];
      v[fresh * stride + head + d] = v_row[head + d];
    }

  // Scores: LANES threads a row, each over the dims lane, lane + LANES, ...
  const uint i = t / LANES, lane = t % LANES;
  float dot[MAX_GROUP];
  for (uint j = 0; j < MAX_GROUP; ++j)
    dot[j] = 0.0;
  if (i < n && visible[i]) {
    const bool own = r0 + i == fresh;
    const uint key = (r0 + i) * stride + head;
    for (uint d0 = lane; d0 < hd; d0 += LANES * UNROLL) {
      float kd[UNROLL];
      for (uint u = 0; u < UNROLL; ++u) {
        const uint d = d0 + u * LANES;
        kd[u] = d >= hd ? 0.0 : own ? head_rows[g * hd + d] : k[key + d];
      }
      for (uint u = 0; u < UNROLL; ++u) {
        const uint d = min(d0 + u * LANES, hd - 1);
        for (uint j = 0; j < MAX_GROUP; ++j)
          if (j < g)
            dot[j] = fma(head_rows[j * hd + d], kd[u], dot[j]);
      }
    }
  }
  for (uint j = 0; j < MAX_GROUP; ++j)
    if (j < g)
      partial[j][t] = dot[j];
  barrier();
  if (t < g * SPLIT_ROWS) {
    const uint j = t / SPLIT_ROWS, row = t % SPLIT_ROWS;
    if (row < n && visible[row]) {
      float s = 0.0;
      for (uint l = 0; l < LANES; ++l)
        s += partial[j][row * LANES + l];
      weight[j][row] = s * scale;
    }
  }
  barrier();

  // Each query head's maximum over the visible rows, then the rows' weights.
  if (t < g) {
    float top = EMPTY;
    for (uint row = 0; row < n; ++row)
      if (visible[row])
        top = max(top, weight[t][row]);
    maximum[t] = top;
  }
  barrier();
  if (t < g * SPLIT_ROWS) {
    const uint j = t / SPLIT_ROWS, row = t % SPLIT_ROWS;
    if (row < n)
      weight[j][row] = visible[row] ? exp_poly(weight[j][row] - maximum[j]) : 0.0;
  }
  barrier();

  // The weighted values: a thread a dim, UNROLL rows' values loaded at a time.
  const uint slot = hd + 2, base = (split * pc.kv_heads + h) * g * slot;
  for (uint d = t; d < hd; d += THREADS) {
    float acc[MAX_GROUP];
    for (uint j = 0; j < MAX_GROUP; ++j)
      acc[j] = 0.0;
    for (uint i0 = 0; i0 < n; i0 += UNROLL) {
      float vd[UNROLL];
      for (uint u = 0; u < UNROLL; ++u) {
        const uint row = i0 + u, r = r0 + row;
        vd[u] = row >= n || !visible[row] ? 0.0
                : r == fresh                ? v_row[head + d]
                                            : v[r * stride + head + d];
      }
      for (uint u = 0; u < UNROLL; ++u) {
        const uint row = min(i0 + u, SPLIT_ROWS - 1);
        for (uint j = 0; j < MAX_GROUP; ++j)
          if (j < g)
            acc[j] = fma(i0 + u < n ? weight[j][row] : 0.0, vd[u], acc[j]);
      }
    }
    for (uint j = 0; j < MAX_GROUP; ++j)
      if (j < g)
        part[base + j * slot + d] = acc[j];
  }
  if (t < g) {
    float l = 0.0;
    for (uint row = 0; row < n; ++row)
      l += weight[t][row];
    part[base + t * slot + hd] = maximum[t];
    part[base + t * slot + hd + 1] = l;
  }
}
