#version 450
// A chunk's products on Vulkan: y = x . m^T, with `x` the chunk's rows ([c][k]) and `m` a
// matrix in rows ([n][k]), k a multiple of 4. A workgroup for every tile of TILE_C chunk rows
// by TILE_N matrix rows (x: the matrix's tiles, y: the chunk's): the depth in blocks of
// DEPTH, each block of both staged in shared memory depth-major (a thread's loads the
// vec4s of consecutive threads), then every thread's 2 x 4 outputs summed from it, a vec2
// of x and a vec4 of m a step. The next block's loads are issued before the current one is
// summed. Rows past c or n are read as zeros and not written.
#define THREADS 128
#define TILE_C 32
#define TILE_N 32
#define DEPTH 16
// Each thread's outputs: OUT_C chunk rows by OUT_N matrix rows.
#define OUT_C 2
#define OUT_N 4

layout(local_size_x = THREADS) in;

layout(set = 0, binding = 0) readonly buffer Rows { vec4 x[]; };    // [c][k / 4]
layout(set = 0, binding = 1) readonly buffer Matrix { vec4 m[]; };  // [n][k / 4]
layout(set = 0, binding = 2) writeonly buffer Out { float y[]; };   // [c][n]

layout(push_constant) uniform Params {
  uint c;
  uint n;
  uint k;
} pc;

shared float xs[DEPTH][TILE_C];
shared float ms[DEPTH][TILE_N];

// A block's loads: TILE_C rows of x and TILE_N of m, DEPTH / 4 vec4s each (one vec4 of x and
// one of m a thread: 32 * 4 = 128).
struct Block {
  vec4 x;
  vec4 m;
};

Block load(uint c0, uint n0, uint q0, uint quads) {
  const uint t = gl_LocalInvocationID.x, row = t / (DEPTH / 4), q = q0 + t % (DEPTH / 4);
  Block b;
  b.x = c0 + row < pc.c && q < quads ? x[(c0 + row) * quads + q] : vec4(0.0);
  b.m = n0 + row < pc.n && q < quads ? m[(n0 + row) * quads + q] : vec4(0.0);
  return b;
}

void stage(Block b) {
  const uint t = gl_LocalInvocationID.x, row = t / (DEPTH / 4), d = 4 * (t % (DEPTH / 4));
  for (uint j = 0; j < 4; ++j) {
    xs[d + j][row] = b.x[j];
    ms[d + j][row] = b.m[j];
  }
}

void main() {
  const uint t = gl_LocalInvocationID.x;
  const uint n0 = gl_WorkGroupID.x * TILE_N, c0 = gl_WorkGroupID.y * TILE_C;
  // This thread's outputs: chunk rows tc * OUT_C + i, matrix rows tn * OUT_N + j.
  const uint tn = t % (TILE_N / OUT_N), tc = t / (TILE_N / OUT_N);
  const uint quads = pc.k / 4;
  float acc[OUT_C][OUT_N];
  for (uint i = 0; i < OUT_C; ++i)
    for (uint j = 0; j < OUT_N; ++j)
      acc[i][j] = 0.0;
  Block next = load(c0, n0, 0, quads);
  for (uint q0 = 0; q0 < quads; q0 += DEPTH / 4) {
    barrier();
    stage(next);
    barrier();
    next = load(c0, n0, q0 + DEPTH / 4, quads);
    for (uint d = 0; d < DEPTH; ++d) {
      const vec2 a = vec2(xs[d][tc * OUT_C], xs[d][tc * OUT_C + 1]);
      const vec4 b = vec4(ms[d][tn * OUT_N], ms[d][tn * OUT_N + 1], ms[d][tn * OUT_N + 2],
                          ms[d][tn * OUT_N + 3]);
      for (uint i = 0; i < OUT_C; ++i)
        for (uint j = 0; j < OUT_N; ++j)
          acc[i][j] = fma(a[i], b[j], acc[i][j]);
    }
  }
  for (uint i = 0; i < OUT_C; ++i) {
    const uint row = c0 + tc * OUT_C + i;
    for (uint j = 0; j < OUT_N; ++j) {
      const uint col = n0 + tn * OUT_N + j;
      if (row < pc.c && col < pc.n)
        y[row * pc.n + col] = acc[i][j];
    }
  }
}
