/* layer.c's kernels and step.c's whole decoder pass for CPUs with AVX2 and FMA but no
 * AVX512-BF16: the residual add fused with RMS normalisation, rotary embedding fused with the
 * cache write, attention of a packed pass over the cache, SiLU(gate) * up, and every layer of
 * a pass in one call with gemv_avx2.c's products. Same arguments and the same rules as
 * layer.c's (read its header): every elementwise result rounded to bfloat16 where
 * transformers' bfloat16 layers round it; attention computes each query on its own, in
 * float32, in one order (scores by FMA over the head dimension, eight lanes summed by one
 * tree; the softmax's sum and the weighted sum of values key after key, masked keys skipped),
 * so a query's bits depend only on its own unmasked keys, not on what shares its pass.
 *
 * Eight float32 lanes where layer.c has sixteen, so its sums run in another order: the two
 * files may differ in a last bit, and a machine runs one of them.
 * Compiled with AVX2 and FMA into the kernel library (engine.forward.cpu_kernels).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "kenspec.h"
#include "avx2.h"

#define MASKED (-1e30f) /* a mask at or below this hides its key (finfo.min in practice) */

/* The sum of v's 8 lanes: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), as sums8's. */
static inline float sum8(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  const __m128 a = _mm_hadd_ps(lo, lo), b = _mm_hadd_ps(hi, hi);
  return _mm_cvtss_f32(_mm_add_ss(_mm_hadd_ps(a, a), _mm_hadd_ps(b, b)));
}

static inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* Lane j: the sum of a[j]'s lanes, each by sum8's tree, whichever j. */
static inline __m256 sums8(const __m256 a[8]) {
  const __m256 c0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 c1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  /* c0 lane i (i < 4): a[i]'s lanes 0-3 summed; lane 4 + i: its lanes 4-7 (c1: a[4 + i]'s) */
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

/* exp(x) for each lane, layer.c's exp16 with eight lanes (the same polynomial; 2^n applied as
 * two exact powers of two, as scalef would); lanes below -87.3 give 0, above 88.7 infinity. */
static inline __m256 exp8(__m256 x) {
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i whole = _mm256_cvtps_epi32(n); /* -127 .. 128: each half's power is normal */
  const __m256i first = _mm256_srai_epi32(whole, 1), second = _mm256_sub_epi32(whole, first);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 power1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(first, bias), 23));
  const __m256 power2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(second, bias), 23));
  __m256 out = _mm256_mul_ps(_mm256_mul_ps(p, power1), power2);
  out = _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ));
  return _mm256_blendv_ps(out, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(88.7f), _CMP_GT_OQ));
}

/* layer.c's kenspec_add_rmsnorm: hidden [rows, n] += delta (where given, rounded as a bfloat16
 * add), then normed = weight * bf16(hidden * rsqrt(mean(hidden^2) + eps)). */
void kenspec_add_rmsnorm_avx2(uint16_t *hidden, const uint16_t *delta, const uint16_t *weight,
                              uint16_t *normed, long rows, long n, float eps) {
  for (long r = 0; r < rows; r++) {
    uint16_t *h = hidden + r * n;
    __m256 squares = _mm256_setzero_ps();
    for (long i = 0; i < n; i += 8) {
      __m256 v = widen(h + i, n - i);
      if (delta) {
        v = rounded(_mm256_add_ps(v, widen(delta + r * n + i, n - i)));
        store(h + i, v, n - i);
      }
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    const __m256 s = _mm256_set1_ps(1.0f / sqrtf(sum8(squares) / (float)n + eps));
    for (long i = 0; i < n; i += 8) {
      const __m256 v = rounded(_mm256_mul_ps(widen(h + i, n - i), s));
      store(normed + r * n + i, _mm256_mul_ps(widen(weight + i, n - i), v), n - i);
    }
  }
}

/* layer.c's kenspec_rotary_cache: rotary on each token's query and key heads in place (each op
 * rounded to bfloat16, as transformers' q * cos + rotate_half(q) * sin), then its keys and
 * values into the cache at (cache_rows[t], positions[t]). */
void kenspec_rotary_cache_avx2(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin,
                               long tokens, long heads, long kv_heads, long dim, uint16_t *keys,
                               uint16_t *values, const int64_t *cache_rows,
                               const int64_t *positions, long capacity) {
  const long width = (heads + 2 * kv_heads) * dim, half = dim / 2; /* half: a multiple of 16 */
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (long t = 0; t < tokens; t++) {
    uint16_t *token = qkv + t * width;
    const uint16_t *c = cos + t * dim, *s = sin + t * dim;
    for (long head = 0; head < heads + kv_heads; head++) {
      uint16_t *x = token + head * dim;
      for (long d = 0; d < half; d += 8) {
        const __m256 first = widen8(x + d), second = widen8(x + half + d);
        const __m256 rotated_first = rounded(_mm256_add_ps(
            rounded(_mm256_mul_ps(first, widen8(c + d))),
            rounded(_mm256_mul_ps(_mm256_xor_ps(second, sign), widen8(s + d)))));
        const __m256 rotated_second = rounded(_mm256_add_ps(
            rounded(_mm256_mul_ps(second, widen8(c + half + d))),
            rounded(_mm256_mul_ps(first, widen8(s + half + d)))));
        store(x + d, rotated_first, 8);
        store(x + half + d, rotated_second, 8);
      }
    }
    const long at = (cache_rows[t] * kv_heads * capacity + positions[t]) * dim;
    for (long g = 0; g < kv_heads; g++) {
      memcpy(keys + at + g * capacity * dim, token + (heads + g) * dim, dim * 2);
      memcpy(values + at + g * capacity * dim, token + (heads + kv_heads + g) * dim, dim * 2);
    }
  }
}

/* Eight of the cache's values at `at` as float32: read from `widened` (the same values widened
 * once, float32) where there is one, else widened here from the bf16 cache `cached`; exact
 * either way. */
static inline __m256 cached8(const uint16_t *cached, const float *widened, long at) {
  return widened != NULL ? _mm256_loadu_ps(widened + at) : widen8(cached + at);
}

/* The scores of `group` query heads (widened: q [group, dim] float32) over one kv head's keys
 * k ([kv_length, dim]; kf: the same keys widened to float32, or NULL to widen them here):
 * scores[h * stride + j] = exp(q_h . k_j * scale + mask_j - max), 0 for a masked key. Each
 * score: eight lanes of FMAs over the head dimension in order, summed by sums8's tree,
 * whatever else is computed beside it. */
static void score_group(const float *q, const uint16_t *k, const float *kf, long group,
                        const void *mask, int mask_bf16, long kv_length, long dim, float scale,
                        float *scores, long stride) {
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (long h = 0; h < group; h++) {
    const float *query = q + h * dim;
    float *row = scores + h * stride;
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (long j0 = 0; j0 < kv_length; j0 += 8) {
      const long count = kv_length - j0 < 8 ? kv_length - j0 : 8;
      __m256 acc[8];
      for (long jj = 0; jj < 8; jj++) {
        acc[jj] = _mm256_setzero_ps();
        if (jj >= count) continue;
        const long key = (j0 + jj) * dim;
        for (long d = 0; d < dim; d += 8)
          acc[jj] = _mm256_fmadd_ps(_mm256_loadu_ps(query + d), cached8(k, kf, key + d), acc[jj]);
      }
      __m256 added;
      if (mask_bf16) {
        added = widen((const uint16_t *)mask + j0, count);
      } else {
        float part[8] = {0};
        memcpy(part, (const float *)mask + j0, (size_t)count * 4);
        added = _mm256_loadu_ps(part);
      }
      const __m256 visible = _mm256_and_ps(
          _mm256_cmp_ps(added, _mm256_set1_ps(MASKED), _CMP_GT_OQ),
          _mm256_cmp_ps(lane, _mm256_set1_ps((float)count), _CMP_LT_OQ));
      const __m256 score = _mm256_blendv_ps(
          _mm256_set1_ps(-INFINITY), _mm256_fmadd_ps(sums8(acc), _mm256_set1_ps(scale), added),
          visible);
      top = _mm256_max_ps(top, score);
      _mm256_storeu_ps(row + j0, score);
    }
    const __m256 most = _mm256_set1_ps(max8(top));
    for (long j0 = 0; j0 < kv_length; j0 += 8) /* exp8 gives 0 for -inf */
      _mm256_storeu_ps(row + j0, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j0), most)));
  }
}

/* out = sum_j p_j v_j / sum_j p_j for one query head whose scores are p ([kv_length]), over
 * `chunks` (compile-time, <= 8) eight-lane pieces of the values at v (row stride dim): its
 * sums key after key, zero weights skipped, in registers. */
static inline __attribute__((always_inline)) void value_piece(const float *p, const int chunks,
                                                              const uint16_t *v, const float *vf,
                                                              long dim, long kv_length,
                                                              float total, uint16_t *out) {
  __m256 acc[8];
  for (int c = 0; c < chunks; c++) acc[c] = _mm256_setzero_ps();
  for (long j = 0; j < kv_length; j++) {
    if (p[j] == 0.0f) continue;
    const __m256 weight = _mm256_set1_ps(p[j]);
    for (int c = 0; c < chunks; c++)
      acc[c] = _mm256_fmadd_ps(weight, cached8(v, vf, j * dim + c * 8), acc[c]);
  }
  const __m256 inverse = _mm256_set1_ps(1.0f / total);
  for (int c = 0; c < chunks; c++) store(out + c * 8, _mm256_mul_ps(acc[c], inverse), 8);
}

/* Each of `count` heads' weighted values (its scores: row h of scores), 64 dimensions at a time
 * (the last piece 32: dim is a multiple of 32); vf: the values widened to float32, or NULL. */
static void value_heads(const float *scores, long stride, long count, long dim, const uint16_t *v,
                        const float *vf, long kv_length, uint16_t *const *out) {
  for (long h = 0; h < count; h++) {
    const float *p = scores + h * stride;
    float total = 0.0f;
    for (long j = 0; j < kv_length; j++) total += p[j];
    for (long d = 0; d < dim; d += 64) {
      const float *piece = vf != NULL ? vf + d : NULL;
      if (dim - d >= 64)
        value_piece(p, 8, v + d, piece, dim, kv_length, total, out[h] + d);
      else
        value_piece(p, 4, v + d, piece, dim, kv_length, total, out[h] + d);
    }
  }
}

/* n bf16 at x as float32 at y (n a multiple of 8): exact. */
static void widen_all(const uint16_t *x, float *y, long n) {
  for (long i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, widen8(x + i));
}

/* Queries of one cache row a work item takes at most (layer.c's), and the work below which a
 * layer's attention runs on one thread: a quarter of layer.c's. One-token items split by query
 * head (below) keep both threads busy from a short cache on: SmolLM2's attention of one token
 * over 200 keys took 20.6-23.6 us a layer against 24.5-27.7 on one thread (2-core EPYC). */
#define QUERY_CHUNK 4
#define PARALLEL_WORK (1L << 15)

/* A pass's attention work (the same for each of its layers): each chunk's first token and
 * the end (firsts [chunks + 1]), and the items, by query head where every chunk is one token
 * (decoding steps: a kv head's query heads read the same keys, but one model's few kv heads,
 * SmolLM2's 3, over two threads leave one idle a third of the time; each head's scores and
 * values are the same arithmetic either way: score_group and value_heads take each head on its
 * own), else by kv head. */
typedef struct {
  long *firsts;
  long chunks, items;
  int by_head;
} attention_work;

/* A thread's room for attention's items: scores, the query widened, the outputs' places, and
 * (multi-token items) the keys and values widened. */
typedef struct {
  float *scores, *query, *widened;
  uint16_t **outs;
} attention_room;

/* The work of a pass of `tokens` (cache_rows: each token's), firsts malloc'ed (NULL: no
 * memory). */
static attention_work attention_items(const int64_t *cache_rows, long tokens, long heads,
                                      long kv_heads) {
  attention_work w = {malloc(sizeof(long) * (tokens + 1)), 0, 0, 0};
  if (!w.firsts) return w;
  for (long t = 0; t < tokens; t++)
    if (t == 0 || cache_rows[t] != cache_rows[t - 1] || t - w.firsts[w.chunks - 1] == QUERY_CHUNK)
      w.firsts[w.chunks++] = t;
  w.firsts[w.chunks] = tokens;
  w.by_head = w.chunks == tokens;
  w.items = w.chunks * (w.by_head ? heads : kv_heads);
  return w;
}

/* A thread's room (see attention_room); 0 where memory ran out (the room then freed). An item
 * of several tokens (a verify pass's) widens its keys and values to float32 once for all its
 * queries, which then read them as they are: each of a 4-token item's 12 query heads widened
 * them itself, half of a wide pass's attention. Exact: the same products and sums. A one-token
 * item (a decoding step's) reads the bf16 cache. */
static int attention_room_of(attention_room *r, const attention_work *w, long heads,
                             long kv_heads, long dim, long kv_length) {
  const long group = heads / kv_heads, stride = kv_length + 16;
  r->scores = malloc(sizeof(float) * stride * group * QUERY_CHUNK);
  r->query = malloc(sizeof(float) * group * dim);
  r->outs = malloc(sizeof(uint16_t *) * group * QUERY_CHUNK);
  r->widened = !w->by_head ? malloc(sizeof(float) * 2 * kv_length * dim) : NULL;
  if (r->scores && r->query && r->outs && (w->by_head || r->widened)) return 1;
  free(r->scores);
  free(r->query);
  free(r->outs);
  free(r->widened);
  r->scores = r->query = r->widened = NULL;
  r->outs = NULL;
  return 0;
}

static void attention_room_free(attention_room *r) {
  free(r->scores);
  free(r->query);
  free(r->outs);
  free(r->widened);
}

/* Work item `item` of w: its tokens [first, first + count) of one chunk and its query heads
 * [h0, h0 + n) of kv head g (one token's head h0 where by_head, else all of g's heads). */
static void attention_item(const attention_work *w, long item, const attention_room *r,
                           const uint16_t *qkv, uint16_t *out, long heads, long kv_heads,
                           long dim, const uint16_t *keys, const uint16_t *values,
                           const int64_t *cache_rows, long capacity, const void *mask,
                           int mask_bf16, const int64_t *mask_rows, long kv_length, float scale) {
  const long width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
  const long stride = kv_length + 16;
  const long chunk = item / (w->by_head ? heads : kv_heads);
  const long first = w->firsts[chunk], count = w->firsts[chunk + 1] - first;
  const long h0 = w->by_head ? item % heads : item % kv_heads * group;
  const long n = w->by_head ? 1 : group, g = h0 / group;
  const long cache_at = (cache_rows[first] * kv_heads + g) * capacity * dim;
  const float *kf = NULL, *vf = NULL;
  if (count > 1) {
    widen_all(keys + cache_at, r->widened, kv_length * dim);
    widen_all(values + cache_at, r->widened + kv_length * dim, kv_length * dim);
    kf = r->widened;
    vf = r->widened + kv_length * dim;
  }
  for (long i = 0; i < count; i++) {
    const long t = first + i;
    const uint16_t *q = qkv + t * width + h0 * dim;
    for (long e = 0; e < n * dim; e += 8) _mm256_storeu_ps(r->query + e, widen8(q + e));
    const char *row_mask = (const char *)mask + mask_rows[t] * kv_length * (mask_bf16 ? 2 : 4);
    score_group(r->query, keys + cache_at, kf, n, row_mask, mask_bf16, kv_length, dim, scale,
                r->scores + i * n * stride, stride);
    for (long h = 0; h < n; h++) r->outs[i * n + h] = out + t * heads * dim + (h0 + h) * dim;
  }
  value_heads(r->scores, stride, count * n, dim, values + cache_at, vf, kv_length, r->outs);
}

/* layer.c's kenspec_attention (the same arguments and work items): out [tokens, heads * dim]
 * = attention of each token's query heads over the first kv_length keys and values of its
 * cache row. Returns 0, or 1 without memory. */
int kenspec_attention_avx2(const uint16_t *qkv, uint16_t *out, long tokens, long heads,
                           long kv_heads, long dim, const uint16_t *keys, const uint16_t *values,
                           const int64_t *cache_rows, long capacity, const void *mask,
                           int mask_bf16, const int64_t *mask_rows, long kv_length, float scale) {
  const attention_work w = attention_items(cache_rows, tokens, heads, kv_heads);
  if (!w.firsts) return 1;
  int failed = 0;
#pragma omp parallel if (tokens * heads * kv_length * dim > PARALLEL_WORK) reduction(| : failed)
  {
    attention_room r;
    const int ready = attention_room_of(&r, &w, heads, kv_heads, dim, kv_length);
    if (!ready) failed = 1;
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < w.items; item++)
      if (ready)
        attention_item(&w, item, &r, qkv, out, heads, kv_heads, dim, keys, values, cache_rows,
                       capacity, mask, mask_bf16, mask_rows, kv_length, scale);
    if (ready) attention_room_free(&r);
  }
  free(w.firsts);
  return failed;
}

/* layer.c's kenspec_silu_mul: out [rows, n] = bf16(silu(gate)) * up for gate_up [rows, 2n]. */
void kenspec_silu_mul_avx2(const uint16_t *gate_up, uint16_t *out, long rows, long n) {
  for (long r = 0; r < rows; r++) {
    const uint16_t *gate = gate_up + r * 2 * n, *up = gate + n;
    for (long i = 0; i < n; i += 8) {
      const __m256 g = widen(gate + i, n - i);
      const __m256 silu = rounded(_mm256_div_ps(
          g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
      store(out + r * n + i, _mm256_mul_ps(silu, widen(up + i, n - i)), n - i);
    }
  }
}

/* GELU with tanh's approximation (transformers' gelu_pytorch_tanh, Gemma's) times up:
 * out [rows, n] = bf16(gelu(gate)) * up for gate_up [rows, 2n], in float32 each rounded to
 * bfloat16 where torch's bfloat16 ops round. gelu(x) = 0.5 x (1 + tanh(y)), y = sqrt(2 / pi)
 * (x + 0.044715 x^3), computed as x / (1 + exp(-2 y)) (the same function, without tanh's
 * cancellation near 0): within a bfloat16 step of torch's, most values equal. */
void kenspec_gelu_mul_avx2(const uint16_t *gate_up, uint16_t *out, long rows, long n) {
  const __m256 beta = _mm256_set1_ps(-2.0f * 0.7978845608028654f); /* -2 sqrt(2 / pi) */
  const __m256 kappa = _mm256_set1_ps(0.044715f), one = _mm256_set1_ps(1.0f);
  for (long r = 0; r < rows; r++) {
    const uint16_t *gate = gate_up + r * 2 * n, *up = gate + n;
    for (long i = 0; i < n; i += 8) {
      const __m256 g = widen(gate + i, n - i);
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
      const __m256 y = _mm256_mul_ps(beta, _mm256_add_ps(g, _mm256_mul_ps(kappa, cube)));
      const __m256 gelu = rounded(_mm256_div_ps(g, _mm256_add_ps(one, exp8(y))));
      store(out + r * n + i, _mm256_mul_ps(gelu, widen(up + i, n - i)), n - i);
    }
  }
}

/* 1 / sqrt(mean(x^2) + eps) over x[0 .. n) (bfloat16): Gemma's RMSNorm's factor, its sum of
 * squares in eight lanes. */
static inline float gemma_factor(const uint16_t *x, long n, float eps) {
  __m256 squares = _mm256_setzero_ps();
  for (long i = 0; i < n; i += 8) {
    const __m256 v = widen(x + i, n - i);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  return 1.0f / sqrtf(sum8(squares) / (float)n + eps);
}

/* x[i .. i + 8) * factor * (1 + weight[i ..]) in float32 (lanes from n on: 0): transformers'
 * Gemma3RMSNorm, its steps in its order (x * rsqrt(...), then times 1 + weight), unrounded. */
static inline __m256 gemma_normed8(const uint16_t *x, const uint16_t *weight, long i, long n,
                                   __m256 factor) {
  return _mm256_mul_ps(_mm256_mul_ps(widen(x + i, n - i), factor),
                       _mm256_add_ps(_mm256_set1_ps(1.0f), widen(weight + i, n - i)));
}

/* out[0 .. n) = bf16(gemma_normed8 of x): Gemma's RMSNorm, rounded once. */
static inline void gemma_norm_row(const uint16_t *x, const uint16_t *weight, uint16_t *out,
                                  long n, float factor) {
  const __m256 f = _mm256_set1_ps(factor);
  for (long i = 0; i < n; i += 8) store(out + i, gemma_normed8(x, weight, i, n, f), n - i);
}

/* norms.c's kenspec_gemma_head_norms in eight lanes: each token's query heads (q_weight) and
 * key heads (k_weight) of qkv [tokens, (heads + 2 kv_heads) * dim] normed in place. */
void kenspec_gemma_head_norms_avx2(uint16_t *qkv, long tokens, long heads, long kv_heads,
                                   long dim, const uint16_t *q_weight, const uint16_t *k_weight,
                                   float eps) {
  const long width = (heads + 2 * kv_heads) * dim;
  for (long t = 0; t < tokens; t++)
    for (long h = 0; h < heads + kv_heads; h++) {
      uint16_t *head = qkv + t * width + h * dim;
      gemma_norm_row(head, h < heads ? q_weight : k_weight, head, dim,
                     gemma_factor(head, dim, eps));
    }
}

/* norms.c's kenspec_gemma_add_norm in eight lanes, delta left as it is (the pass's threads
 * share it): where delta is given, hidden = bf16(hidden + norm(delta; delta_weight)) in
 * place; then normed = norm(hidden; weight). */
void kenspec_gemma_add_norm_avx2(uint16_t *hidden, const uint16_t *delta,
                                 const uint16_t *delta_weight, const uint16_t *weight,
                                 uint16_t *normed, long rows, long n, float eps) {
  for (long r = 0; r < rows; r++) {
    uint16_t *h = hidden + r * n;
    if (delta != NULL) {
      const uint16_t *d = delta + r * n;
      const __m256 f = _mm256_set1_ps(gemma_factor(d, n, eps));
      for (long i = 0; i < n; i += 8) /* the normed delta rounded, then the add rounded */
        store(h + i,
              _mm256_add_ps(widen(h + i, n - i), rounded(gemma_normed8(d, delta_weight, i, n, f))),
              n - i);
    }
    gemma_norm_row(h, weight, normed + r * n, n, gemma_factor(h, n, eps));
  }
}

/* A layer's product by name: its weights, scales, offsets, group, bits and scales' width. */
#define PRODUCT(L, name) \
  L->name, L->name##_scales, L->name##_mins, L->name##_group, L->name##_bits, L->name##_half

/* A team product (decoder_pass_team): this thread's share of y = x @ W^T, bf16 weights
 * (quant 0: kenspec_gemv_bf16_avx2_share) or a file's own groups (quant 2:
 * kenspec_gemv_grouped_avx2_share, x as the products read it into the thread's own `a`), and
 * the bias added to the thread's own outputs; no barrier. 0, or -1 where it failed. */
static int team_linear(const uint16_t *x, const void *w, const void *scales, const float *mins,
                       long group, long bits, long half, const void *bias, uint16_t *y,
                       long rows, long k, long n, int quant, kenspec_activations *a) {
  long first, last;
  if (quant == 2) {
    if (kenspec_gemv_grouped_avx2_share(x, w, (int)bits, scales, mins, group, y, rows, k, n,
                                        (int)half, a, &first, &last))
      return -1;
  } else {
    kenspec_gemv_bf16_avx2_share(x, (const uint16_t *)w, y, rows, k, n, &first, &last);
  }
  if (bias) { /* each sum rounded to bf16, as torch's in-place bf16 add */
    const uint16_t *b = (const uint16_t *)bias;
    for (long r = 0; r < rows; r++)
      for (long i = first; i < last; i += 8)
        store(y + r * n + i,
              _mm256_add_ps(widen(y + r * n + i, last - i), widen(b + i, last - i)), last - i);
  }
  return 0;
}

/* A pass's residual step on a thread's own hidden states: hidden += delta (Gemma: its norm by
 * delta_weight; NULL delta: nothing added), then normed = the next norm (weight) of hidden. */
static void residual_norm(const kenspec_pass *p, uint16_t *hidden, const uint16_t *delta,
                          const uint16_t *delta_weight, const uint16_t *weight, uint16_t *normed) {
  if (p->gemma)
    kenspec_gemma_add_norm_avx2(hidden, delta, delta_weight, weight, normed, p->tokens, p->size,
                                p->eps);
  else
    kenspec_add_rmsnorm_avx2(hidden, delta, weight, normed, p->tokens, p->size, p->eps);
}

/* The pass (bf16 weights or a file's own groups) in one parallel region: a thread team that waits
 * once a product (its outputs are split between the threads) and once for the cache's keys
 * and for attention's outputs, where a parallel region a product (kenspec_gemv_grouped_avx2)
 * forked, waits for the product's x and joins: 3.2 us a product on the 2-core EPYC VM, ~0.4 ms
 * a pass of SmolLM2's 120 products. Each thread reads the x of a product into its own room
 * (the same numbers in each); the norms and SiLU(gate) * up, a row's few thousand values, run
 * in every thread on its own copy of the hidden states (thread 0's: the pass's own), so no
 * thread waits for them; the rotary and the cache write run once (`single`). Every value is
 * computed by the same code as in the pass of one region a kernel: the same bits. Gemma 3's
 * layers (p->gemma) take the same steps with its kernels: its norms around each half, the
 * head norms in the `single` before the rotary, a layer's own rotary table and mask, GELU. */
static int decoder_pass_team(const kenspec_pass *p) {
  const long tokens = p->tokens, size = p->size, dim = p->dim, heads = p->heads;
  const long kv_heads = p->kv_heads, intermediate = p->intermediate;
  const long width = (heads + 2 * kv_heads) * dim;
  const long widest = width > 2 * intermediate ? width : 2 * intermediate;
  uint16_t *wide = malloc(sizeof(uint16_t) * tokens * widest);    /* qkv; gate_up */
  uint16_t *attended = malloc(sizeof(uint16_t) * tokens * heads * dim);
  uint16_t *delta = malloc(sizeof(uint16_t) * tokens * size);     /* out's and down's */
  const attention_work work = attention_items(p->cache_rows, tokens, heads, kv_heads);
  int failed = wide == NULL || attended == NULL || delta == NULL || work.firsts == NULL;
  int missing = failed; /* a thread's room not there: no thread computes */
  if (!failed) {
#pragma omp parallel reduction(| : failed)
    {
      const int me = omp_get_thread_num();
      const size_t row_bytes = sizeof(uint16_t) * tokens * size;
      uint16_t *hidden = me == 0 ? p->hidden : malloc(row_bytes);
      uint16_t *normed = me == 0 ? p->normed : malloc(row_bytes);
      uint16_t *gated = malloc(sizeof(uint16_t) * tokens * intermediate);
      kenspec_activations a = {NULL, NULL, NULL}; /* (a file's groups only) */
      if (p->quant == 2) {
        long inputs = intermediate > size ? intermediate : size; /* the products' widest x */
        if (heads * dim > inputs) inputs = heads * dim;
        long factors;
        const long room = kenspec_grouped_room(tokens, inputs, &factors);
        a.p = malloc((size_t)room);
        a.t = malloc(sizeof(float) * factors);
        a.xg = malloc(sizeof(float) * factors);
      }
      const int quantized = p->quant != 2 || (a.p && a.t && a.xg);
      attention_room r;
      const int roomy = attention_room_of(&r, &work, heads, kv_heads, dim, p->kv_length);
      if (!(hidden && normed && gated && quantized && roomy)) {
#pragma omp atomic write
        missing = 1;
      } else if (me) { /* (thread 0 changes the pass's hidden states only after a barrier) */
        memcpy(hidden, p->hidden, row_bytes);
      }
#pragma omp barrier
      if (!missing) {
        residual_norm(p, hidden, NULL, NULL, p->layers[0].input_norm, normed);
        for (long l = 0; l < p->count; l++) {
          const kenspec_layer *L = p->layers + l;
          failed |= team_linear(normed, PRODUCT(L, qkv), L->qkv_bias, wide, tokens, size, width,
                                p->quant, &a);
#pragma omp barrier
#pragma omp single
          {
            if (p->gemma)
              kenspec_gemma_head_norms_avx2(wide, tokens, heads, kv_heads, dim, L->q_norm,
                                            L->k_norm, p->eps);
            kenspec_rotary_cache_avx2(wide, L->cos ? L->cos : p->cos, L->sin ? L->sin : p->sin,
                                      tokens, heads, kv_heads, dim, L->keys, L->values,
                                      p->cache_rows, p->positions, p->capacity);
          }
#pragma omp for schedule(dynamic, 1)
          for (long item = 0; item < work.items; item++)
            attention_item(&work, item, &r, wide, attended, heads, kv_heads, dim, L->keys,
                           L->values, p->cache_rows, p->capacity, L->mask ? L->mask : p->mask,
                           p->mask_bf16, p->mask_rows, p->kv_length, p->scale);
          failed |= team_linear(attended, PRODUCT(L, out), L->out_bias, delta, tokens,
                                heads * dim, size, p->quant, &a);
#pragma omp barrier
          residual_norm(p, hidden, delta, L->attention_out_norm, L->post_norm, normed);
          failed |= team_linear(normed, PRODUCT(L, gate_up), NULL, wide, tokens, size,
                                2 * intermediate, p->quant, &a);
#pragma omp barrier
          if (p->gemma)
            kenspec_gelu_mul_avx2(wide, gated, tokens, intermediate);
          else
            kenspec_silu_mul_avx2(wide, gated, tokens, intermediate);
          failed |= team_linear(gated, PRODUCT(L, down), NULL, delta, tokens, intermediate, size,
                                p->quant, &a);
#pragma omp barrier
          const uint16_t *next = l + 1 < p->count ? p->layers[l + 1].input_norm : p->final_norm;
          residual_norm(p, hidden, delta, L->mlp_out_norm, next, normed);
        }
      }
      if (me) {
        free(hidden);
        free(normed);
      }
      free(gated);
      free(a.p);
      free(a.t);
      free(a.xg);
      if (roomy) attention_room_free(&r);
    }
  }
  free(wide);
  free(attended);
  free(delta);
  free(work.firsts);
  return failed || missing ? -1 : 0;
}

/* step.c's kenspec_decoder_pass for bf16 weights or a file's own groups (kenspec_pass.quant 0
 * or 2; others: -2), with gemv_avx2.c's and gemv_grouped_avx2.c's products and this file's
 * kernels, in step.c's order, in one parallel region (decoder_pass_team). Returns 0, -1 where
 * memory ran out. */
int kenspec_decoder_pass_avx2(const kenspec_pass *p) {
  if ((p->quant != 0 && p->quant != 2) || p->bf16_product != NULL) return -2;
  return decoder_pass_team(p);
}

/* layer.c's kenspec_top_probs in eight lanes (the recycled predictions' rows, engine.recycled):
 * per float32 row of `vocab` logits, the `width` (<= 16) largest, best first (the earlier of
 * equal logits first), and their softmax probabilities, in one read for the top (a lane enters
 * the running list only above its last entry) and one for the sum of exp(logit - max). exp8's
 * polynomial, not libm's: probabilities within float32 error of torch's. A row of fewer than
 * `width` finite logits leaves id -1 and probability 0 in the places it cannot fill. */
static inline __m256 logits8(const float *p, long n) { /* lanes past n: -inf */
  if (n >= 8) return _mm256_loadu_ps(p);
  const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(p, in), _mm256_castsi256_ps(in));
}

void kenspec_top_probs_avx2(const float *logits, long rows, long vocab, long width, int32_t *ids,
                            float *probs) {
#pragma omp parallel for schedule(static) if (rows > 1) /* rows are independent */
  for (long r = 0; r < rows; r++) {
    const float *x = logits + r * vocab;
    float best[16];
    int32_t at[16];
    long kept = 0;
    float threshold = -INFINITY;
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (long i = 0; i < vocab; i += 8) {
      const __m256 v = logits8(x + i, vocab - i);
      top = _mm256_max_ps(top, v);
      unsigned above = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(threshold), _CMP_GT_OQ));
      for (; above; above &= above - 1) {
        const long index = i + __builtin_ctz(above);
        keep_top(best, at, &kept, &threshold, width, x[index], index);
      }
    }
    const float most = max8(top);
    __m256 sum = _mm256_setzero_ps();
    for (long i = 0; i < vocab; i += 8) /* exp8 gives 0 for -inf (the lanes past vocab) */
      sum = _mm256_add_ps(sum, exp8(_mm256_sub_ps(logits8(x + i, vocab - i), _mm256_set1_ps(most))));
    const float log_total = most + logf(sum8(sum));
    for (long j = 0; j < width; j++) {
      ids[r * width + j] = j < kept ? at[j] : -1;
      probs[r * width + j] = j < kept ? expf(best[j] - log_total) : 0.0f;
    }
  }
}
