// kvsnap's kernels for IREE's llvm-cpu target on AVX-512 hosts, linked into the module as
// one object (`hal.executable.objects`): no libc, no globals, no thread-local state. The
// bindings arrive as MLIR memref descriptors (base pointer, aligned pointer, offset, size,
// stride: `MEMREF`); only the aligned pointer and the offset are used (`AT`). Workgroup `wg`
// of the panel product's `groups` computes panels [wg * panels / groups, (wg + 1) * panels /
// groups); of the screen's, panels [wg * run, (wg + 1) * run); of the gather's, one block.
//
// - `kvsnap_mmt4d_8x32`, the chunks' panel products. They are `linalg.mmt4d`-shaped: the
//   chunk's rows packed in tiles of 8 (`lhs`: [m1][depth][8]) against a weight in 32-lane
//   panels (`rhs`: [panels][depth][32]), giving `out`: [m1][panels][8][32]. IREE's own code
//   runs each 8-row tile over the whole depth, so a panel comes from memory in the first tile
//   and from cache in the others, and memory idles while they run. This kernel runs the same
//   8 x 32 register tiles (16 accumulators, two panel loads and eight broadcasts per 16 FMAs,
//   the sums in the same order, so its results are IREE's bit for bit) and, while it runs a
//   panel's tiles, prefetches the next panel into L2, spread evenly over those tiles: memory
//   and arithmetic overlap.
// - `kvsnap_screen_16`, the screened head's scores: the int8 copy of the tied head in 16-lane
//   panels (`q`: [panels][depth][16]) against the final norm's row (`h`: [depth]), giving
//   `out`: [panels][16] f32 sums. Each int8 weight is widened to f32 before its FMA, three
//   instructions per 16 weights, so at 168 MB a step the arithmetic is half the time the
//   reads take; IREE's code overlapped the two poorly. This one runs eight panels at a time
//   (eight accumulators, eight streams) and prefetches each stream 512 bytes ahead. Its sums
//   run in another order than IREE's, which the screen's bound allows (any order:
//   `kvsnap_reference::head`).
// - `kvsnap_gather_16`, the screen's candidate rows: the f32 table's rows of the blocks of 16
//   the screen could not rule out, copied for their exact logits. IREE's code for the gather
//   (`stablehlo.gather` of 512 rows) took about 290 us a step, element by element.
// - `kvsnap_attend_1`, the decode step's attention over a layer's K/V buffers: it reads only
//   the rows the query can see (the graph's attention reads and masks every row of the ring
//   or the span), in splits whose running sums the graph merges.
// - `kvsnap_attend_c`, a chunk's attention: 16 (row, query head) pairs of a key/value head in
//   the lanes of each workgroup's register tiles (a key's element broadcast against all 16
//   queries), over the rows any of them sees, masked per lane, with flash-style running sums.
//   IREE's matmuls over every row of the ring or the span ran at about a third of the SGEMM
//   rate (24-row chunks: M = 96).

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define ROWS 8
#define LANES 32
#define LINE 64 /* bytes */

// One binding's parameters as MLIR passes a memref: base pointer, aligned pointer, offset
// (elements), size, stride.
#define MEMREF(type, name)                                                                    \
  const void *name##_base, type *restrict name, size_t name##_offset, size_t name##_size,     \
      size_t name##_stride
// A binding's first element: its aligned pointer plus its offset (the other fields unused).
#define AT(name) ((void)name##_base, (void)name##_size, (void)name##_stride, name + name##_offset)

// Where the next panel's prefetch stands: its 2 x depth lines are spread over the `tiles` x
// depth steps of this panel's tiles, two credits a step and one line per `tiles` credits (two
// lines a step for a single tile, one a step for two, two every three steps for three...).
struct prefetch {
  const char *next; // the next panel, or null
  size_t line;      // the next line to fetch
  size_t credit;
  size_t tiles;
};

// Sixteen accumulators of one 8 x 32 tile over the whole depth, stored to `out` (8 rows of
// 32), prefetching as `pf` says.
static inline __attribute__((always_inline)) void
tile_8x32(const float *restrict a, const float *restrict panel, size_t depth,
          float *restrict out, struct prefetch *pf) {
  __m512 c[ROWS][2];
  for (int r = 0; r < ROWS; ++r) {
    c[r][0] = _mm512_setzero_ps();
    c[r][1] = _mm512_setzero_ps();
  }
  const char *next = pf->next;
  size_t line = pf->line, credit = pf->credit, tiles = pf->tiles;
  for (size_t k = 0; k < depth; ++k) {
    if (next) {
      credit += 2;
      while (credit >= tiles) {
        _mm_prefetch(next + line * LINE, _MM_HINT_T1);
        ++line;
        credit -= tiles;
      }
    }
    __m512 b0 = _mm512_loadu_ps(panel + k * LANES);
    __m512 b1 = _mm512_loadu_ps(panel + k * LANES + 16);
    const float *ak = a + k * ROWS;
    for (int r = 0; r < ROWS; ++r) {
      __m512 x = _mm512_set1_ps(ak[r]);
      c[r][0] = _mm512_fmadd_ps(x, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(x, b1, c[r][1]);
    }
  }
  pf->line = line;
  pf->credit = credit;
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(out + r * LANES, c[r][0]);
    _mm512_storeu_ps(out + r * LANES + 16, c[r][1]);
  }
}

// The panel product: see the top of this file.
void kvsnap_mmt4d_8x32(MEMREF(const float, lhs), MEMREF(const float, rhs), MEMREF(float, out),
                       size_t m1, size_t panels, size_t depth, size_t wg, size_t groups) {
  lhs = AT(lhs);
  rhs = AT(rhs);
  out = AT(out);
  size_t p0 = wg * panels / groups;
  size_t p1 = (wg + 1) * panels / groups;
  size_t panel_floats = depth * LANES;
  for (size_t p = p0; p < p1; ++p) {
    const float *panel = rhs + p * panel_floats;
    // The next panel, this workgroup's or the next one's (often run next on the same worker).
    struct prefetch pf = {
        .next = p + 1 < panels ? (const char *)(panel + panel_floats) : NULL,
        .line = 0,
        .credit = 0,
        .tiles = m1,
    };
    for (size_t t = 0; t < m1; ++t) {
      tile_8x32(lhs + t * depth * ROWS, panel, depth, out + (t * panels + p) * ROWS * LANES,
                &pf);
    }
  }
}

// Panels the screen runs at a time, and how far ahead of each it reads (in steps of 16
// bytes: 512 bytes, eight lines).
#define SCREEN_LANES 16
#define SCREEN_PANELS 8
#define SCREEN_AHEAD 32

// 16 int8 weights as f32.
static inline __attribute__((always_inline)) __m512 widen16(const int8_t *w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}

// `n` panels from `q` (1 to SCREEN_PANELS, each `depth` x 16 int8) against `h`, into
// `out` (16 sums a panel). Each panel's line `SCREEN_AHEAD` steps ahead is prefetched once
// every four steps (a line holds four).
static inline __attribute__((always_inline)) void
screen_panels(const int8_t *restrict q, const float *restrict h, size_t depth, size_t n,
              float *restrict out) {
  const size_t panel = depth * SCREEN_LANES;
  __m512 acc[SCREEN_PANELS];
  for (size_t j = 0; j < n; ++j)
    acc[j] = _mm512_setzero_ps();
  for (size_t k = 0; k < depth; ++k) {
    const __m512 hk = _mm512_set1_ps(h[k]);
    const int8_t *row = q + k * SCREEN_LANES;
    if ((k & 3) == 0) {
      for (size_t j = 0; j < n; ++j)
        _mm_prefetch((const char *)(row + j * panel + SCREEN_AHEAD * SCREEN_LANES),
                     _MM_HINT_T0);
    }
    for (size_t j = 0; j < n; ++j)
      acc[j] = _mm512_fmadd_ps(widen16(row + j * panel), hk, acc[j]);
  }
  for (size_t j = 0; j < n; ++j)
    _mm512_storeu_ps(out + j * SCREEN_LANES, acc[j]);
}

// The screen's scores: see the top of this file.
void kvsnap_screen_16(MEMREF(const int8_t, q), MEMREF(const float, h), MEMREF(float, out),
                      size_t panels, size_t depth, size_t wg, size_t run) {
  q = AT(q);
  h = AT(h);
  out = AT(out);
  size_t p = wg * run;
  size_t end = p + run < panels ? p + run : panels;
  const size_t panel = depth * SCREEN_LANES;
  for (; p + SCREEN_PANELS <= end; p += SCREEN_PANELS)
    screen_panels(q + p * panel, h, depth, SCREEN_PANELS, out + p * SCREEN_LANES);
  if (p < end)
    screen_panels(q + p * panel, h, depth, end - p, out + p * SCREEN_LANES);
}

// The screen's candidate rows: see the top of this file. `table`: [rows][width] f32; `ids`:
// [blocks] i32 block indices (16 rows each); `out`: [blocks][16][width]. Workgroup `wg`
// copies block `ids[wg]`, each row index clamped to the table (a block past the last holds
// no candidates: its rows only fill the shape, as the table's last row).
void kvsnap_gather_16(MEMREF(const float, table), MEMREF(const int32_t, ids),
                      MEMREF(float, out), size_t rows, size_t width, size_t wg) {
  table = AT(table);
  ids = AT(ids);
  out = AT(out) + wg * SCREEN_LANES * width;
  const int64_t block = ids[wg];
  const __mmask16 tail = (__mmask16)((1u << (width % 16)) - 1);
  for (int64_t l = 0; l < SCREEN_LANES; ++l) {
    int64_t r = block * SCREEN_LANES + l;
    r = r < 0 ? 0 : r >= (int64_t)rows ? (int64_t)rows - 1 : r;
    const float *src = table + (size_t)r * width;
    float *dst = out + (size_t)l * width;
    size_t i = 0;
    for (; i + 16 <= width; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_loadu_ps(src + i));
    if (tail)
      _mm512_mask_storeu_ps(dst + i, tail, _mm512_maskz_loadu_ps(tail, src + i));
  }
}

// ---- The decode step's attention ------------------------------------------------------------

// Visible rows a block of the attention takes at a time, the most query heads a key/value head
// serves, the running maximum of a split that has seen no visible row, and how many visible
// rows ahead of the one it scores the kernel prefetches.
#define ATTEND_BLOCK 32
#define ATTEND_MAX_GROUP 8
#define ATTEND_MAX_HEAD_DIM 256
#define ATTEND_EMPTY (-3.0e38f)
#define ATTEND_AHEAD 4

// e^x of 16 floats: 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 in [-ln 2 / 2,
// ln 2 / 2] (ln 2 in two parts, the first exact in n * C1), e^r by its Taylor series to degree
// 7 (truncation below 6e-9 relative). Below -104 the result is 0 or the smallest subnormal.
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The f32 whose bits are the low 32 of `bits` (a float passed as an index operand).
static inline __attribute__((always_inline)) float f32_of_bits(size_t bits) {
  union {
    uint32_t bits;
    float f;
  } x = {.bits = (uint32_t)bits};
  return x.f;
}

// Every line of `bytes` at `p` into L2.
static inline __attribute__((always_inline)) void prefetch_span(const float *p, size_t bytes) {
  for (size_t b = 0; b < bytes; b += LINE)
    _mm_prefetch((const char *)p + b, _MM_HINT_T1);
}

// One key/value head's running state over a split: `acc` holds, per query head, the
// unnormalised sum of e^(s - m) v (head_dim floats), then m, then the sum of e^(s - m).
struct attend_head {
  const float *q; // [group][head_dim]
  const float *k; // row 0 of this head's keys, rows `stride` floats apart
  const float *v;
  float *acc; // [group][head_dim + 2]
  size_t group, head_dim, stride;
  float scale;
};

// Folds the visible rows `idx[0..n)` into `a`: their scores, a new running maximum, the old
// sums rescaled, the rows' weights added. Each key row is read once for every query head; the
// key and value rows `ATTEND_AHEAD` ahead are prefetched into L2 while a row is scored, so
// memory streams while the arithmetic runs (the values are read again, from L2, for the sums).
static void attend_block(const struct attend_head *a, const size_t *idx, size_t n) {
  const size_t hd = a->head_dim, slot = hd + 2;
  float s[ATTEND_MAX_GROUP][ATTEND_BLOCK];
  for (size_t j = 0; j < ATTEND_AHEAD && j < n; ++j) {
    prefetch_span(a->k + idx[j] * a->stride, hd * sizeof(float));
    prefetch_span(a->v + idx[j] * a->stride, hd * sizeof(float));
  }
  for (size_t j = 0; j < n; ++j) {
    const float *kr = a->k + idx[j] * a->stride;
    if (j + ATTEND_AHEAD < n) {
      prefetch_span(a->k + idx[j + ATTEND_AHEAD] * a->stride, hd * sizeof(float));
      prefetch_span(a->v + idx[j + ATTEND_AHEAD] * a->stride, hd * sizeof(float));
    }
    __m512 dot[ATTEND_MAX_GROUP];
    for (size_t g = 0; g < a->group; ++g)
      dot[g] = _mm512_setzero_ps();
    for (size_t c = 0; c < hd; c += 16) {
      const __m512 kc = _mm512_loadu_ps(kr + c);
      for (size_t g = 0; g < a->group; ++g)
        dot[g] = _mm512_fmadd_ps(_mm512_loadu_ps(a->q + g * hd + c), kc, dot[g]);
    }
    for (size_t g = 0; g < a->group; ++g)
      s[g][j] = _mm512_reduce_add_ps(dot[g]) * a->scale;
  }
  float corr[ATTEND_MAX_GROUP];
  for (size_t g = 0; g < a->group; ++g) {
    float *m = a->acc + g * slot + hd, *l = m + 1;
    float top = *m;
    for (size_t j = 0; j < n; ++j)
      top = s[g][j] > top ? s[g][j] : top;
    corr[g] = _mm512_cvtss_f32(exp16(_mm512_set1_ps(*m - top)));
    float sum = 0.0f;
    for (size_t j = 0; j < n; j += 16) {
      const __mmask16 live = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(live, &s[g][j]);
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, _mm512_set1_ps(top))));
      _mm512_mask_storeu_ps(&s[g][j], live, e);
      sum += _mm512_reduce_add_ps(e);
    }
    *l = *l * corr[g] + sum;
    *m = top;
  }
  for (size_t c = 0; c < hd; c += 16) {
    __m512 o[ATTEND_MAX_GROUP];
    for (size_t g = 0; g < a->group; ++g)
      o[g] = _mm512_mul_ps(_mm512_loadu_ps(a->acc + g * slot + c), _mm512_set1_ps(corr[g]));
    for (size_t j = 0; j < n; ++j) {
      const __m512 vc = _mm512_loadu_ps(a->v + idx[j] * a->stride + c);
      for (size_t g = 0; g < a->group; ++g)
        o[g] = _mm512_fmadd_ps(_mm512_set1_ps(s[g][j]), vc, o[g]);
    }
    for (size_t g = 0; g < a->group; ++g)
      _mm512_storeu_ps(a->acc + g * slot + c, o[g]);
  }
}

// The decode step's attention, one split of the key rows per workgroup: `q` [kv_heads][group]
// [head_dim] (the step's one row), `k` and `v` [>= rows][kv_heads][head_dim], `pos` the ring's
// stored positions (p + 1, 0 for an empty row; read when `window` is not 0), `lim` = {the
// query's position, the first position past the written ones}. A key row is visible when
// its position kp satisfies 0 <= kp <= query, kp < end and, with a window, kp > query -
// window. A global layer's row r holds position r (`window` 0): its first min(rows, query + 1,
// end) rows are the visible ones, `live`; a sliding layer's `live` is all `rows`. Workgroup
// `wg` of `splits` takes rows [wg * live / splits, (wg + 1) * live / splits), skips the
// invisible ones without reading them, and writes per key/value head and query head its
// unnormalised sums, its maximum score and its sum of weights (`out`: [splits][kv_heads]
// [group][head_dim + 2]), merged across splits by the graph. `scale_bits`: the f32 score
// scale's bits.
void kvsnap_attend_1(MEMREF(const float, q), MEMREF(const float, k), MEMREF(const float, v),
                     MEMREF(const int32_t, pos), MEMREF(const int32_t, lim), MEMREF(float, out),
                     size_t kv_heads, size_t group, size_t head_dim, size_t rows, size_t window,
                     size_t scale_bits, size_t wg, size_t splits) {
  q = AT(q);
  k = AT(k);
  v = AT(v);
  pos = AT(pos);
  lim = AT(lim);
  out = AT(out);
  const float scale = f32_of_bits(scale_bits);
  const int64_t query = lim[0], end = lim[1];
  size_t live = rows; // the rows the splits divide
  if (!window) {
    const int64_t seen = query + 1 < end ? query + 1 : end;
    live = seen <= 0 ? 0 : (size_t)seen < rows ? (size_t)seen : rows;
  }
  const size_t r0 = wg * live / splits, r1 = (wg + 1) * live / splits;
  const size_t slot = head_dim + 2;
  for (size_t h = 0; h < kv_heads; ++h) {
    struct attend_head a = {
        .q = q + h * group * head_dim,
        .k = k + h * head_dim,
        .v = v + h * head_dim,
        .acc = out + (wg * kv_heads + h) * group * slot,
        .group = group,
        .head_dim = head_dim,
        .stride = kv_heads * head_dim,
        .scale = scale,
    };
    for (size_t g = 0; g < group; ++g) {
      float *acc = a.acc + g * slot;
      for (size_t c = 0; c < head_dim; ++c)
        acc[c] = 0.0f;
      acc[head_dim] = ATTEND_EMPTY;
      acc[head_dim + 1] = 0.0f;
    }
    size_t idx[ATTEND_BLOCK], n = 0;
    for (size_t r = r0; r < r1; ++r) {
      const int64_t kp = window ? (int64_t)pos[r] - 1 : (int64_t)r;
      const int visible = kp >= 0 && kp <= query && kp < end &&
                          (window == 0 || kp > query - (int64_t)window);
      if (!visible)
        continue;
      idx[n++] = r;
      if (n == ATTEND_BLOCK) {
        attend_block(&a, idx, n);
        n = 0;
      }
    }
    if (n)
      attend_block(&a, idx, n);
  }
}

// ---- A chunk's attention ----------------------------------------------------------------------

// Query rows a workgroup of a chunk's attention takes (one vector's lanes), the key rows it
// folds in at a time, and where it prefetches the next block's rows to (L2: prefetched into
// L1, beside the block's own 48 KiB, a workgroup ran 10% slower).
#define CHUNK_LANES 16
#define CHUNK_KEYS 16
#define CHUNK_HINT _MM_HINT_T1

// One workgroup's state over a chunk's attention: its 16 query rows in the lanes, `qt`
// [head_dim][16] (the queries transposed, so that a key's element times every query is one
// FMA of a broadcast), `ot` [head_dim][16] the unnormalised weighted sums, `m` and `l` each
// lane's running maximum and sum of weights, `qp` and `low` each lane's query position and
// the first key position it sees (within the window, or 0). `rows`
// [head_dim / 16][CHUNK_KEYS][16] holds a block's key rows, then its value rows, in pieces of
// 16 floats, so that every broadcast of a row's element is at a fixed offset from one pointer
// and the rows are read in order.
struct chunk_tile {
  const float *k, *v; // row 0 of this key/value head's keys and values, rows `stride` apart
  size_t stride, head_dim;
  float scale;
  const float *qt;
  float *ot, *rows;
  __m512i qp, low;
  __m512 m, l;
  const size_t *next; // the next block's rows, prefetched while this one runs
  size_t next_n;
};

// Copies the rows `idx[0..n)` of `src` into `t->rows` (a missing row, n < CHUNK_KEYS,
// repeats the last).
static inline __attribute__((always_inline)) void
chunk_rows(const struct chunk_tile *t, const float *src, const size_t *idx, size_t n) {
  for (size_t j = 0; j < CHUNK_KEYS; ++j) {
    const float *row = src + idx[j < n ? j : n - 1] * t->stride;
    for (size_t c = 0; c < t->head_dim; c += 16)
      _mm512_storeu_ps(t->rows + c * CHUNK_KEYS + j * 16, _mm512_loadu_ps(row + c));
  }
}

// Folds the key rows `idx[0..n)` (n <= CHUNK_KEYS, positions `kp`) into the tile: their
// scores, each lane's mask (the key in [low, qp]), the new running maximum, the old sums
// rescaled and the rows' weights added.
static void chunk_block(struct chunk_tile *t, const size_t *idx, const int64_t *kp, size_t n) {
  const size_t hd = t->head_dim;
  chunk_rows(t, t->k, idx, n);
  __m512 s[CHUNK_KEYS];
  for (size_t j = 0; j < CHUNK_KEYS; ++j)
    s[j] = _mm512_setzero_ps();
  for (size_t c = 0; c < hd; c += 16) {
    const float *piece = t->rows + c * CHUNK_KEYS;
    for (size_t j = 0; j < t->next_n; ++j)
      _mm_prefetch((const char *)(t->k + t->next[j] * t->stride + c), CHUNK_HINT);
    for (size_t d = 0; d < 16; ++d) {
      const __m512 qd = _mm512_loadu_ps(t->qt + (c + d) * CHUNK_LANES);
      for (size_t j = 0; j < CHUNK_KEYS; ++j)
        s[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(piece[j * 16 + d]), s[j]);
    }
  }
  chunk_rows(t, t->v, idx, n);
  const __m512 scale = _mm512_set1_ps(t->scale);
  __mmask16 seen[CHUNK_KEYS];
  __m512 top = t->m;
  for (size_t j = 0; j < n; ++j) {
    const __m512i key = _mm512_set1_epi32((int32_t)kp[j]);
    const __mmask16 vis =
        _mm512_cmple_epi32_mask(key, t->qp) & _mm512_cmpge_epi32_mask(key, t->low);
    seen[j] = vis;
    s[j] = _mm512_mul_ps(s[j], scale);
    top = _mm512_mask_max_ps(top, vis, top, s[j]);
  }
  const __m512 corr = exp16(_mm512_sub_ps(t->m, top));
  // Once every lane's maximum has settled, the sums need no rescaling.
  const int rescale = _mm512_cmpneq_ps_mask(t->m, top) != 0;
  __m512 sum = _mm512_setzero_ps();
  for (size_t j = 0; j < n; ++j) {
    s[j] = _mm512_maskz_mov_ps(seen[j], exp16(_mm512_sub_ps(s[j], top)));
    sum = _mm512_add_ps(sum, s[j]);
  }
  t->l = _mm512_fmadd_ps(t->l, corr, sum);
  t->m = top;
  for (size_t c = 0; c < hd; c += 16) {
    float *ot = t->ot + c * CHUNK_LANES;
    const float *piece = t->rows + c * CHUNK_KEYS;
    for (size_t j = 0; j < t->next_n; ++j)
      _mm_prefetch((const char *)(t->v + t->next[j] * t->stride + c), CHUNK_HINT);
    __m512 o[16];
    for (size_t cc = 0; cc < 16; ++cc) {
      o[cc] = _mm512_loadu_ps(ot + cc * CHUNK_LANES);
      if (rescale)
        o[cc] = _mm512_mul_ps(o[cc], corr);
    }
    for (size_t j = 0; j < n; ++j)
      for (size_t cc = 0; cc < 16; ++cc)
        o[cc] = _mm512_fmadd_ps(s[j], _mm512_set1_ps(piece[j * 16 + cc]), o[cc]);
    for (size_t cc = 0; cc < 16; ++cc)
      _mm512_storeu_ps(ot + cc * CHUNK_LANES, o[cc]);
  }
}

// Where a workgroup's scan of the key rows stands: the next row, the rows it scans, and the
// positions any of its queries sees, [lo, hi]; `pos` the ring's positions (null for a global
// layer, whose row r holds position r).
struct chunk_scan {
  const int32_t *pos;
  size_t row, live;
  int64_t lo, hi;
};

// The next up to CHUNK_KEYS visible rows and their positions; 0 at the end.
static size_t chunk_next(struct chunk_scan *sc, size_t *idx, int64_t *kp) {
  size_t n = 0;
  for (; sc->row < sc->live && n < CHUNK_KEYS; ++sc->row) {
    const int64_t p = sc->pos ? (int64_t)sc->pos[sc->row] - 1 : (int64_t)sc->row;
    if (p < 0 || p < sc->lo || p > sc->hi)
      continue;
    idx[n] = sc->row;
    kp[n++] = p;
  }
  return n;
}

// A chunk's attention, one key/value head and 16 query rows per workgroup: `q` [chunk]
// [kv_heads][group][head_dim], `k`, `v`, `pos` and `lim` as for `kvsnap_attend_1` (`lim[0]`
// the chunk's first query position; query row i is at lim[0] + i), `out` [kv_heads][chunk]
// [group][head_dim], normalised. The query rows of a key/value head are its chunk x group
// (row, query head) pairs in order; workgroup `wg` takes head wg / tiles and pairs
// [16 (wg % tiles), 16 (wg % tiles) + 16), tiles = ceil(chunk x group / 16). It reads the key
// rows visible to any of its queries, in blocks of CHUNK_KEYS, and masks per query.
void kvsnap_attend_c(MEMREF(const float, q), MEMREF(const float, k), MEMREF(const float, v),
                     MEMREF(const int32_t, pos), MEMREF(const int32_t, lim), MEMREF(float, out),
                     size_t kv_heads, size_t group, size_t head_dim, size_t rows, size_t window,
                     size_t scale_bits, size_t chunk, size_t wg) {
  q = AT(q);
  k = AT(k);
  v = AT(v);
  pos = AT(pos);
  lim = AT(lim);
  out = AT(out);
  const float scale = f32_of_bits(scale_bits);
  const size_t pairs = chunk * group, tiles = (pairs + CHUNK_LANES - 1) / CHUNK_LANES;
  const size_t h = wg / tiles, r0 = (wg % tiles) * CHUNK_LANES;
  const size_t lanes = pairs - r0 < CHUNK_LANES ? pairs - r0 : CHUNK_LANES;
  const int64_t first = lim[0], end = lim[1];
  float qt[ATTEND_MAX_HEAD_DIM * CHUNK_LANES], ot[ATTEND_MAX_HEAD_DIM * CHUNK_LANES];
  float rows_buf[ATTEND_MAX_HEAD_DIM * CHUNK_KEYS];
  int32_t qp[CHUNK_LANES], low[CHUNK_LANES];
  for (size_t l = 0; l < CHUNK_LANES; ++l) {
    const size_t r = r0 + l, i = r / group, g = r % group;
    for (size_t d = 0; d < head_dim; ++d) {
      qt[d * CHUNK_LANES + l] = 0.0f;
      ot[d * CHUNK_LANES + l] = 0.0f;
    }
    // A lane past the last pair sees no key (every position is at least 0).
    qp[l] = -1;
    if (l < lanes) {
      const float *row = q + ((i * kv_heads + h) * group + g) * head_dim;
      for (size_t d = 0; d < head_dim; ++d)
        qt[d * CHUNK_LANES + l] = row[d];
      qp[l] = (int32_t)(first + (int64_t)i);
    }
    low[l] = window ? qp[l] - (int32_t)window + 1 : 0;
  }
  struct chunk_tile t = {
      .k = k + h * head_dim,
      .v = v + h * head_dim,
      .stride = kv_heads * head_dim,
      .head_dim = head_dim,
      .scale = scale,
      .qt = qt,
      .ot = ot,
      .rows = rows_buf,
      .qp = _mm512_loadu_si512(qp),
      .low = _mm512_loadu_si512(low),
      .m = _mm512_set1_ps(ATTEND_EMPTY),
      .l = _mm512_setzero_ps(),
  };
  // The positions any lane sees: [lo, hi], and below `end`.
  const int64_t qlo = first + (int64_t)(r0 / group);
  const int64_t qhi = first + (int64_t)((r0 + lanes - 1) / group);
  const int64_t lo = window ? qlo - (int64_t)window + 1 : 0;
  const int64_t hi = qhi < end - 1 ? qhi : end - 1;
  size_t live = rows;
  if (!window)
    live = hi < 0 ? 0 : (size_t)hi + 1 < rows ? (size_t)hi + 1 : rows;
  struct chunk_scan scan = {
      .pos = window ? pos : NULL, .row = 0, .live = live, .lo = lo, .hi = hi};
  size_t idx[2][CHUNK_KEYS];
  int64_t kp[2][CHUNK_KEYS];
  size_t n = chunk_next(&scan, idx[0], kp[0]);
  for (int cur = 0; n; cur ^= 1) {
    t.next = idx[cur ^ 1];
    t.next_n = chunk_next(&scan, idx[cur ^ 1], kp[cur ^ 1]);
    chunk_block(&t, idx[cur], kp[cur], n);
    n = t.next_n;
  }
  float l_sum[CHUNK_LANES];
  _mm512_storeu_ps(l_sum, t.l);
  for (size_t l = 0; l < lanes; ++l) {
    float *o = out + (h * pairs + r0 + l) * head_dim;
    // A padding row may see no key (its window past the chunk's last written position).
    const float inv = l_sum[l] > 0.0f ? 1.0f / l_sum[l] : 0.0f;
    for (size_t d = 0; d < head_dim; ++d)
      o[d] = ot[d * CHUNK_LANES + l] * inv;
  }
}
