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
// The variants (build.rs): geglu_down (GEGLU), geglu_down_norm (GEGLU, ADD_NORM) and
// matvec_norm (ADD_NORM).
#extension GL_GOOGLE_include_directive : require

#define THREADS 128
#define ROWS 4
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
shared bool last;
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
#ifdef ADD_NORM
  memoryBarrierBuffer();
  barrier();
  if (t == 0)
    last = atomicAdd(count[0], 1u) == gl_NumWorkGroups.x - 1;
  barrier();
  if (last) {
    memoryBarrierBuffer();
    add_norm(pc.n, uintBitsToFloat(pc.eps_bits));
    if (t == 0)
      count[0] = 0u;
  }
#endif
}
