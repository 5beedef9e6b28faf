#version 450
// The decode step's MLP after its gate/up product on Vulkan: down . (gelu_tanh(g) * u), with
// `gu` = [g, u] the product's one row ([2 * ffn]) and `down` the [hidden][ffn] matrix. A
// workgroup for every ROWS output rows: each thread computes the GeGLU of its own dims (ffn
// in vec4s, thread t taking vec4s t, t + THREADS, ...; GELU written as the graph's `mlp`,
// op for op) and their products with the rows, UNROLL vec4 loads of each row in flight; the
// rows' sums meet by a tree in shared memory.
#define THREADS 128
#define ROWS 4
#define UNROLL 4

layout(local_size_x = THREADS) in;

layout(set = 0, binding = 0) readonly buffer GateUp { vec4 gu[]; };  // [2 * ffn / 4]
layout(set = 0, binding = 1) readonly buffer Down { vec4 down[]; };  // [hidden][ffn / 4]
layout(set = 0, binding = 2) writeonly buffer Out { float y[]; };    // [hidden]

layout(push_constant) uniform Params {
  uint hidden;
  uint ffn;
} pc;

shared float partial[ROWS][THREADS];

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

void main() {
  const uint t = gl_LocalInvocationID.x, row0 = gl_WorkGroupID.x * ROWS;
  const uint quads = pc.ffn / 4;
  float acc[ROWS];
  for (uint r = 0; r < ROWS; ++r)
    acc[r] = 0.0;
  for (uint q0 = t; q0 < quads; q0 += THREADS * UNROLL) {
    vec4 g[UNROLL], u[UNROLL], w[ROWS][UNROLL];
    for (uint k = 0; k < UNROLL; ++k) {
      const uint q = q0 + k * THREADS;
      const bool in_row = q < quads;
      g[k] = in_row ? gu[q] : vec4(0.0);
      u[k] = in_row ? gu[quads + q] : vec4(0.0);
      for (uint r = 0; r < ROWS; ++r)
        w[r][k] = in_row && row0 + r < pc.hidden ? down[(row0 + r) * quads + q] : vec4(0.0);
    }
    for (uint k = 0; k < UNROLL; ++k) {
      const vec4 a = geglu(g[k], u[k]);
      for (uint r = 0; r < ROWS; ++r)
        acc[r] += dot(a, w[r][k]);
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
  if (t < ROWS && row0 + t < pc.hidden)
    y[row0 + t] = partial[t][0];
}
