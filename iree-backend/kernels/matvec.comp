#version 450
// The decode step's products that end a layer's half on Vulkan: y = m . v, with `m` an
// [n][k] matrix in rows and `v` one row of k (a multiple of 4). A workgroup for every ROWS
// output rows: each thread takes its own vec4s of `v` (thread t the vec4s t, t + THREADS,
// ...) and their products with the rows, UNROLL vec4 loads of each row in flight; the rows'
// sums meet by a tree in shared memory.
//
// With GEGLU, `v` is the MLP's gate/up product's row ([2 * k]: gate, then up), taken as
// gelu_tanh(gate) * up (GELU written as the graph's `mlp`, op for op), `m` the down matrix.
//
// With ADD_NORM, the workgroup that finishes last also adds y to the residual and norms it
// (add_norm.glsl, y its `a`): each workgroup makes its rows visible and takes a ticket from
// `count[0]`, a counter at zero between dispatches (a module global of the graph, passed in
// place); the one that draws the last ticket reads y back (coherent: from the device's
// shared cache, not the workgroup's), runs add_norm and sets the counter back to zero. The
// attention's output projection and the MLP's down product each end in their residual and
// the next norm this way, one dispatch where the residual took its own.
//
// With ARGMAX, `m` is the tied head's table and `v` the final norm's row: y the logits, and
// the greedy token too, as the graph's argmax (NaN never wins, the lowest id on a tie). Each
// workgroup keeps its rows' best in `best_v` and `best_i`, and the last to finish (its ticket
// as ADD_NORM's) takes the best of those into `next`.
//
// The variants (build.rs): geglu_down (GEGLU), geglu_down_norm (GEGLU, ADD_NORM),
// matvec_norm (ADD_NORM) and head (ARGMAX).
#extension GL_GOOGLE_include_directive : require

#define THREADS 128
#ifdef ARGMAX
#define ROWS 8
#else
#define ROWS 4
#endif
#define UNROLL 4

layout(local_size_x = THREADS) in;

#ifdef GEGLU
layout(set = 0, binding = 0) readonly buffer GateUp { vec4 gu[]; };  // [2 * k / 4]
#else
layout(set = 0, binding = 0) readonly buffer Input { vec4 v[]; };    // [k / 4]
#endif
layout(set = 0, binding = 1) readonly buffer Matrix { vec4 m[]; };   // [n][k / 4]
#ifdef ADD_NORM
layout(set = 0, binding = 2) readonly buffer Residual { float x[]; };  // [n]
layout(set = 0, binding = 3) readonly buffer OutputNorm { float w_a[]; };
layout(set = 0, binding = 4) readonly buffer NextNorm { float w_h[]; };
layout(set = 0, binding = 5) coherent buffer Counter { uint count[]; };
layout(set = 0, binding = 6) coherent buffer Out { float a[]; };      // [n]: y
layout(set = 0, binding = 7) writeonly buffer Sum { float sum[]; };    // [n]
layout(set = 0, binding = 8) writeonly buffer Normed { float h[]; };   // [n]
#elif defined(ARGMAX)
layout(set = 0, binding = 2) coherent buffer Counter { uint count[]; };
layout(set = 0, binding = 3) writeonly buffer Out { float a[]; };     // [n]: y
layout(set = 0, binding = 4) coherent buffer BestValue { float best_v[]; };  // [groups]
layout(set = 0, binding = 5) coherent buffer BestIndex { uint best_i[]; };   // [groups]
layout(set = 0, binding = 6) writeonly buffer Next { uint next[]; };         // [1]
#else
layout(set = 0, binding = 2) writeonly buffer Out { float a[]; };     // [n]: y
#endif

layout(push_constant) uniform Params {
  uint n;
  uint k;
#ifdef ADD_NORM
  uint eps_bits;
#endif
} pc;

shared float partial[ROWS][THREADS];

#ifdef ADD_NORM
#include "add_norm.glsl"
#endif
#if defined(ADD_NORM) || defined(ARGMAX)
shared bool last;

// Whether this workgroup is the last to finish: each makes its writes visible and draws a
// ticket from `count[0]`.
bool last_to_finish() {
  memoryBarrierBuffer();
  barrier();
  if (gl_LocalInvocationID.x == 0)
    last = atomicAdd(count[0], 1u) == gl_NumWorkGroups.x - 1;
  barrier();
  return last;
}
#endif
#ifdef ARGMAX
#define NEG_INF uintBitsToFloat(0xff800000u)
shared uint share_i[THREADS];

// Whether the logit (w, j) beats (v, i): higher, or as high at a lower id.
bool beats(float w, uint j, float v, uint i) {
  return w > v || (w == v && j < i);
}

// The workgroups' best into next[0], the best of each thread's, then by a tree.
void argmax_of_groups() {
  const uint t = gl_LocalInvocationID.x;
  float v = NEG_INF;
  uint i = 0xffffffffu;
  for (uint g = t; g < gl_NumWorkGroups.x; g += THREADS)
    if (beats(best_v[g], best_i[g], v, i)) {
      v = best_v[g];
      i = best_i[g];
    }
  partial[0][t] = v;
  share_i[t] = i;
  barrier();
  for (uint width = THREADS / 2; width > 0; width /= 2) {
    if (t < width && beats(partial[0][t + width], share_i[t + width], partial[0][t], share_i[t])) {
      partial[0][t] = partial[0][t + width];
      share_i[t] = share_i[t + width];
    }
    barrier();
  }
  if (t == 0)
    next[0] = share_i[0];
}
#endif

#ifdef GEGLU
vec4 geglu(vec4 g, vec4 u) {
  vec4 t = 0.044715 * g;
  t = t * g;
  t = t * g;
  t = g + t;
  t = 0.7978846 * t;
  t = tanh(t);
  t = 1.0 + t;
  vec4 r = 0.5 * g;
  r = r * t;
  return r * u;
}
#endif

void main() {
  const uint t = gl_LocalInvocationID.x, row0 = gl_WorkGroupID.x * ROWS;
  const uint quads = pc.k / 4;
  float acc[ROWS];
  for (uint r = 0; r < ROWS; ++r)
    acc[r] = 0.0;
  for (uint q0 = t; q0 < quads; q0 += THREADS * UNROLL) {
#ifdef GEGLU
    vec4 g[UNROLL], u[UNROLL];
#else
    vec4 in_v[UNROLL];
#endif
    vec4 w[ROWS][UNROLL];
    for (uint j = 0; j < UNROLL; ++j) {
      const uint q = q0 + j * THREADS;
      const bool in_row = q < quads;
#ifdef GEGLU
      g[j] = in_row ? gu[q] : vec4(0.0);
      u[j] = in_row ? gu[quads + q] : vec4(0.0);
#else
      in_v[j] = in_row ? v[q] : vec4(0.0);
#endif
      for (uint r = 0; r < ROWS; ++r)
        w[r][j] = in_row && row0 + r < pc.n ? m[(row0 + r) * quads + q] : vec4(0.0);
    }
    for (uint j = 0; j < UNROLL; ++j) {
#ifdef GEGLU
      const vec4 b = geglu(g[j], u[j]);
#else
      const vec4 b = in_v[j];
#endif
      for (uint r = 0; r < ROWS; ++r)
        acc[r] += dot(b, w[r][j]);
    }
  }
  for (uint r = 0; r < ROWS; ++r)
    partial[r][t] = acc[r];
  barrier();
  for (uint width = THREADS / 2; width > 0; width /= 2) {
    if (t < width)
      for (uint r = 0; r < ROWS; ++r)
        partial[r][t] += partial[r][t + width];
    barrier();
  }
  if (t < ROWS && row0 + t < pc.n)
    a[row0 + t] = partial[t][0];
#ifdef ARGMAX
  if (t == 0) {
    // NaN counts as -inf; the rows in order, so the lowest id keeps a tie.
    float v = NEG_INF;
    uint i = row0;
    for (uint r = 0; r < ROWS && row0 + r < pc.n; ++r) {
      const float y = isnan(partial[r][0]) ? NEG_INF : partial[r][0];
      if (y > v) {
        v = y;
        i = row0 + r;
      }
    }
    best_v[gl_WorkGroupID.x] = v;
    best_i[gl_WorkGroupID.x] = i;
  }
  barrier();
#endif
#if defined(ADD_NORM) || defined(ARGMAX)
  if (last_to_finish()) {
    memoryBarrierBuffer();
#ifdef ADD_NORM
    add_norm(pc.n, uintBitsToFloat(pc.eps_bits), 0);
#else
    argmax_of_groups();
#endif
    if (t == 0)
      count[0] = 0u;
  }
#endif
}
