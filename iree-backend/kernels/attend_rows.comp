#version 450
// A chunk's attention on Vulkan: one workgroup a query row and key/value head (x: row, y:
// head), as `kvsnap_attend_c` in avx512.c. `q` [chunk][kv_heads][group][head_dim] (normed and
// rotated), the layer's K and V buffers (the chunk's rows written), `pos` and `lim` as
// attend_split.comp's (`lim[0]` the chunk's first query position: row i is at lim[0] + i);
// `out` [kv_heads][chunk][group][head_dim], normalised.
//
// The workgroup runs over the key rows its query can see in blocks of BLOCK rows, online:
// the block's scores (LANES threads a row, each over every LANES-th dim, every query head
// of the key/value head at once), a new running maximum, the old sums rescaled and the
// block's weights e^(s - m) (kernels/exp.glsl) added, each thread summing a dim of the
// values. A key row is visible when its position kp satisfies low <= kp <= query and
// kp < end (low the query's window start, or 0): a sliding layer's rows by the ring's
// positions (`pos[r] - 1`), a global layer's row r at position r, read up to the last the
// query sees.
#extension GL_GOOGLE_include_directive : require

#include "exp.glsl"

#define THREADS 128
#define MAX_GROUP 8
#define MAX_HEAD_DIM 256
#define BLOCK 16
// Threads that score one row together (THREADS / BLOCK), each over every LANES-th dim.
#define LANES 8
#define UNROLL 8
// Dims a thread sums (MAX_HEAD_DIM / THREADS).
#define DIMS 2
#define EMPTY (-3.0e38)

layout(local_size_x = THREADS) in;

layout(set = 0, binding = 0) readonly buffer Queries { float q[]; };   // [chunk][kv_heads][group][head_dim]
layout(set = 0, binding = 1) readonly buffer Keys { float k[]; };      // [buf_rows][kv_heads][head_dim]
layout(set = 0, binding = 2) readonly buffer Values { float v[]; };    // [buf_rows][kv_heads][head_dim]
layout(set = 0, binding = 3) readonly buffer Positions { int pos[]; }; // [pos_rows]: p + 1, 0 empty
layout(set = 0, binding = 4) readonly buffer Bounds { int lim[]; };    // {first query, end}
layout(set = 0, binding = 5) writeonly buffer Out { float o[]; };      // [kv_heads][chunk][group][head_dim]

layout(push_constant) uniform Params {
  uint kv_heads;
  uint group;
  uint head_dim;
  uint rows;
  uint window;
  uint scale_bits;
  uint chunk;
} pc;

shared float qs[MAX_GROUP * MAX_HEAD_DIM];
shared float partial[MAX_GROUP][THREADS];
shared float weight[MAX_GROUP][BLOCK]; // scores, then e^(s - m)
shared bool visible[BLOCK];
shared float top[MAX_GROUP];
shared float corr[MAX_GROUP];
shared float mass[MAX_GROUP];

void main() {
  const uint i = gl_WorkGroupID.x, h = gl_WorkGroupID.y, t = gl_LocalInvocationID.x;
  const uint hd = pc.head_dim, g = pc.group, stride = pc.kv_heads * hd, head = h * hd;
  const float scale = uintBitsToFloat(pc.scale_bits);
  const int query = lim[0] + int(i), end = lim[1];
  const int low = pc.window != 0 ? query - int(pc.window) + 1 : 0;
  const int last = min(query, end - 1);
  uint live = pc.rows;
  if (pc.window == 0)
    live = last < 0 ? 0 : min(uint(last) + 1, pc.rows);

  for (uint x = t; x < g * hd; x += THREADS)
    qs[x] = q[((i * pc.kv_heads + h) * g) * hd + x];
  if (t < g) {
    top[t] = EMPTY;
    mass[t] = 0.0;
  }
  float acc[DIMS][MAX_GROUP];
  for (uint c = 0; c < DIMS; ++c)
    for (uint j = 0; j < MAX_GROUP; ++j)
      acc[c][j] = 0.0;
  barrier();

  const uint row = t / LANES, lane = t % LANES;
  for (uint r0 = 0; r0 < live; r0 += BLOCK) {
    const uint n = min(BLOCK, live - r0);
    if (t < BLOCK) {
      const uint r = r0 + t;
      const int kp = t >= n ? -1 : pc.window != 0 ? pos[r] - 1 : int(r);
      visible[t] = t < n && kp >= 0 && kp >= low && kp <= last;
    }
    barrier();

    // Scores: LANES threads a row.
    float dot[MAX_GROUP];
    for (uint j = 0; j < MAX_GROUP; ++j)
      dot[j] = 0.0;
    if (visible[row]) {
      const uint key = (r0 + row) * stride + head;
      for (uint d0 = lane; d0 < hd; d0 += LANES * UNROLL) {
        float kd[UNROLL];
        for (uint u = 0; u < UNROLL; ++u) {
          const uint d = d0 + u * LANES;
          kd[u] = d < hd ? k[key + d] : 0.0;
        }
        for (uint u = 0; u < UNROLL; ++u) {
          const uint d = min(d0 + u * LANES, hd - 1);
          for (uint j = 0; j < MAX_GROUP; ++j)
            if (j < g)
              dot[j] = fma(qs[j * hd + d], kd[u], dot[j]);
        }
      }
    }
    for (uint j = 0; j < MAX_GROUP; ++j)
      if (j < g)
        partial[j][t] = dot[j];
    barrier();
    if (t < g * BLOCK) {
      const uint j = t / BLOCK, b = t % BLOCK;
      float s = 0.0;
      for (uint l = 0; l < LANES; ++l)
        s += partial[j][b * LANES + l];
      weight[j][b] = s * scale;
    }
    barrier();

    // The running maximum and the rescale of what came before.
    if (t < g) {
      float m = top[t];
      for (uint b = 0; b < BLOCK; ++b)
        if (visible[b])
          m = max(m, weight[t][b]);
      corr[t] = exp_poly(top[t] - m);
      top[t] = m;
    }
    barrier();
    if (t < g * BLOCK) {
      const uint j = t / BLOCK, b = t % BLOCK;
      weight[j][b] = visible[b] ? exp_poly(weight[j][b] - top[j]) : 0.0;
    }
    barrier();
    if (t < g) {
      float l = 0.0;
      for (uint b = 0; b < BLOCK; ++b)
        l += weight[t][b];
      mass[t] = fma(mass[t], corr[t], l);
    }

    // The weighted values: a thread a dim, UNROLL rows' values loaded at a time.
    for (uint c = 0; c < DIMS; ++c) {
      const uint d = t + c * THREADS;
      if (d >= hd)
        break;
      for (uint j = 0; j < MAX_GROUP; ++j)
        if (j < g)
          acc[c][j] *= corr[j];
      for (uint b0 = 0; b0 < BLOCK; b0 += UNROLL) {
        float vd[UNROLL];
        for (uint u = 0; u < UNROLL; ++u) {
          const uint b = b0 + u;
          vd[u] = visible[b] ? v[(r0 + b) * stride + head + d] : 0.0;
        }
        for (uint u = 0; u < UNROLL; ++u)
          for (uint j = 0; j < MAX_GROUP; ++j)
            if (j < g)
              acc[c][j] = fma(weight[j][b0 + u], vd[u], acc[c][j]);
      }
    }
    barrier();
  }

  for (uint c = 0; c < DIMS; ++c) {
    const uint d = t + c * THREADS;
    if (d >= hd)
      break;
    for (uint j = 0; j < MAX_GROUP; ++j)
      if (j < g) {
        // A padding row may see no key (its window past the chunk's last written position).
        const float inv = mass[j] > 0.0 ? 1.0 / mass[j] : 0.0;
        o[((h * pc.chunk + i) * g + j) * hd + d] = acc[c][j] * inv;
      }
  }
}
