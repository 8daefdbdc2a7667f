/* The fast step's per-layer work between its products, for bfloat16 activations: a residual
 * add fused with RMS normalisation, rotary embedding fused with the cache write, attention of
 * a packed pass over the cache, and SiLU(gate) * up. Each replaces several torch operations
 * (and their dispatch, some microseconds each) with one call.
 *
 * Every elementwise result is rounded to bfloat16 where transformers' bfloat16 layers round
 * it (a bfloat16 op computes in float32 and rounds once), so they give torch's bits except
 * where a sum or an exponential is computed in another order or by another polynomial.
 *
 * Attention computes each query on its own, in float32, in a fixed order: scores by dpbf16
 * over the head dimension, the softmax's sum and the weighted sum of values key after key,
 * masked keys skipped (they would add exact zeros). A query's result therefore depends only
 * on its own unmasked keys in order, not on the rows or queries beside it in the pass: the
 * same in a one-token step as in a verify pass, a token tree's node the same as the
 * sequence of its ancestors (their slots come in depth order).
 *
 * Compiled with AVX512-BF16 into the kernel library (engine.forward.cpu_kernels).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "kenspec.h"
#include "simd.h"
#include "bf16.h"

#define MASKED (-1e30f) /* a mask at or below this hides its key (finfo.min in practice) */

/* exp(x) for each lane, a degree-6 polynomial on x - n ln 2 (relative error ~2e-7); lanes
 * below -87.3 (where exp(x) < FLT_MIN) give 0, above 88.7 infinity. Lane-independent. */
static inline __m512 exp16(__m512 x) {
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512 out = _mm512_scalef_ps(p, n);
  out = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ), out, _mm512_setzero_ps());
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.7f), _CMP_GT_OQ), out,
                              _mm512_set1_ps(INFINITY));
}

/* hidden [rows, n] += delta (where given, rounded as a bfloat16 add), then normed [rows, n] =
 * weight * bf16(hidden * rsqrt(mean(hidden^2) + eps)): transformers' LlamaRMSNorm. */
void kenspec_add_rmsnorm(uint16_t *hidden, const uint16_t *delta, const uint16_t *weight,
                         uint16_t *normed, long rows, long n, float eps) {
  for (long r = 0; r < rows; r++) {
    uint16_t *h = hidden + r * n;
    __m512 squares = _mm512_setzero_ps();
    for (long i = 0; i < n; i += 16) {
      const __mmask16 m = lanes(n - i);
      __m512 v = load16(h + i, m);
      if (delta) {
        v = rounded(_mm512_add_ps(v, load16(delta + r * n + i, m)));
        store16(h + i, v, m);
      }
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)n + eps);
    const __m512 s = _mm512_set1_ps(scale);
    for (long i = 0; i < n; i += 16) {
      const __mmask16 m = lanes(n - i);
      const __m512 v = rounded(_mm512_mul_ps(load16(h + i, m), s));
      store16(normed + r * n + i, _mm512_mul_ps(load16(weight + i, m), v), m);
    }
  }
}

/* Rotary embedding on each token's query and key heads of qkv [tokens, (heads + 2 kv_heads)
 * * dim], in place, as transformers computes q * cos + rotate_half(q) * sin in bfloat16 (each
 * op rounded); then each token's keys and values written into the cache at (cache_rows[t],
 * positions[t]). cos, sin: [tokens, dim]. The caches are [slots, kv_heads, capacity, dim]. */
void kenspec_rotary_cache(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, long tokens,
                          long heads, long kv_heads, long dim, uint16_t *keys, uint16_t *values,
                          const int64_t *cache_rows, const int64_t *positions, long capacity) {
  const long width = (heads + 2 * kv_heads) * dim, half = dim / 2; /* half: a multiple of 16 */
  for (long t = 0; t < tokens; t++) {
    uint16_t *token = qkv + t * width;
    const uint16_t *c = cos + t * dim, *s = sin + t * dim;
    for (long head = 0; head < heads + kv_heads; head++) {
      uint16_t *x = token + head * dim;
      for (long d = 0; d < half; d += 16) {
        const __m512 first = load16(x + d, 0xffff), second = load16(x + half + d, 0xffff);
        const __m512 rotated_first = rounded(_mm512_add_ps(
            rounded(_mm512_mul_ps(first, load16(c + d, 0xffff))),
            rounded(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(second), _mm512_set1_epi32((int)0x80000000u))), load16(s + d, 0xffff)))));
        const __m512 rotated_second = rounded(_mm512_add_ps(
            rounded(_mm512_mul_ps(second, load16(c + half + d, 0xffff))),
            rounded(_mm512_mul_ps(first, load16(s + half + d, 0xffff)))));
        store16(x + d, rotated_first, 0xffff);
        store16(x + half + d, rotated_second, 0xffff);
      }
    }
    const long at = (cache_rows[t] * kv_heads * capacity + positions[t]) * dim;
    for (long g = 0; g < kv_heads; g++) {
      memcpy(keys + at + g * capacity * dim, token + (heads + g) * dim, dim * 2);
      memcpy(values + at + g * capacity * dim, token + (heads + kv_heads + g) * dim, dim * 2);
    }
  }
}

/* Scores of one token's `group` query heads q (consecutive, dim each) over one kv head's keys
 * k ([kv_length, dim]): scores[h * stride + j] = exp(q_h . k_j * scale + mask_j - max), 0 for
 * a masked key. Each score is one dot product of 32-wide dpbf16 partial sums and reduce16's
 * sum, whatever else is computed beside it. */
static void score_group(const uint16_t *q, const uint16_t *k, long group, const void *mask,
                        int mask_bf16, long kv_length, long dim, float scale, float *scores,
                        long stride) {
  for (long h = 0; h < group; h++) {
    const uint16_t *query = q + h * dim;
    float *row = scores + h * stride;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (long j0 = 0; j0 < kv_length; j0 += 16) {
      const long count = kv_length - j0 < 16 ? kv_length - j0 : 16;
      const __mmask16 m = lanes(count);
      __m512 acc[16];
      for (long jj = 0; jj < 16; jj++) {
        acc[jj] = _mm512_setzero_ps();
        if (jj >= count) continue;
        const uint16_t *key = k + (j0 + jj) * dim;
        for (long d = 0; d < dim; d += 32)
          acc[jj] = _mm512_dpbf16_ps(acc[jj], (__m512bh)_mm512_loadu_si512(query + d),
                                     (__m512bh)_mm512_loadu_si512(key + d));
      }
      const __m512 added = mask_bf16 ? load16((const uint16_t *)mask + j0, m)
                                     : _mm512_maskz_loadu_ps(m, (const float *)mask + j0);
      const __mmask16 visible = _mm512_mask_cmp_ps_mask(m, added, _mm512_set1_ps(MASKED), _CMP_GT_OQ);
      const __m512 score = _mm512_mask_blend_ps(
          visible, _mm512_set1_ps(-INFINITY), _mm512_fmadd_ps(reduce16(acc), _mm512_set1_ps(scale), added));
      top = _mm512_max_ps(top, score);
      _mm512_storeu_ps(row + j0, score);
    }
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (long j0 = 0; j0 < kv_length; j0 += 16) { /* exp16 gives 0 for -inf */
      const __m512 s = _mm512_loadu_ps(row + j0);
      _mm512_storeu_ps(row + j0, exp16(_mm512_sub_ps(s, most)));
    }
  }
}

/* out[h] = sum_j p_hj v_j / sum_j p_hj for `nh` (compile-time, with chunks = dim / 16) query
 * heads whose scores are rows first .. first + nh of `scores`: each head's sums run key after
 * key, skipping its zero weights, so a head's bits do not depend on the heads beside it (its
 * own token's or another token's of the same cache row). Each value is converted once for
 * them all; the accumulators stay in registers. */
static inline __attribute__((always_inline)) void value_heads(
    const float *scores, long stride, long first, const int nh, const int chunks,
    const uint16_t *v, long kv_length, uint16_t *const *out) {
  if (nh * chunks > 16) return; /* (shapes value_all never asks for; folded away) */
  __m512 acc[16];
  float total[16];
  for (int i = 0; i < nh * chunks; i++) acc[i] = _mm512_setzero_ps();
  for (int h = 0; h < nh; h++) total[h] = 0.0f;
  for (long j = 0; j < kv_length; j++) {
    float p[16];
    int any = 0;
    for (int h = 0; h < nh; h++) {
      p[h] = scores[(first + h) * stride + j];
      any |= p[h] != 0.0f;
    }
    if (!any) continue;
    __m512 converted[16];
    for (int c = 0; c < chunks; c++) converted[c] = load16(v + j * chunks * 16 + c * 16, 0xffff);
    for (int h = 0; h < nh; h++) {
      if (p[h] == 0.0f) continue;
      const __m512 weight = _mm512_set1_ps(p[h]);
      for (int c = 0; c < chunks; c++)
        acc[h * chunks + c] = _mm512_fmadd_ps(weight, converted[c], acc[h * chunks + c]);
      total[h] += p[h];
    }
  }
  for (int h = 0; h < nh; h++) {
    const __m512 inverse = _mm512_set1_ps(1.0f / total[h]);
    for (int c = 0; c < chunks; c++)
      store16(out[h] + c * 16, _mm512_mul_ps(acc[h * chunks + c], inverse), 0xffff);
  }
}

/* value_heads for any number of heads: batches of as many as have registers (16
 * accumulators), specialised for the head widths models use (64, 128, 256; others: one head a
 * batch through the same code). */
static void value_all(const float *scores, long stride, long count, long dim, const uint16_t *v,
                      long kv_length, uint16_t *const *out) {
#define BATCHES(CHUNKS, MOST)                                                                    \
  for (long first = 0; first < count; first += MOST) {                                           \
    switch (count - first < MOST ? count - first : MOST) {                                       \
      case 1: value_heads(scores, stride, first, 1, CHUNKS, v, kv_length, out + first); break;   \
      case 2: value_heads(scores, stride, first, 2, CHUNKS, v, kv_length, out + first); break;   \
      case 3: value_heads(scores, stride, first, 3, CHUNKS, v, kv_length, out + first); break;   \
      default: value_heads(scores, stride, first, MOST, CHUNKS, v, kv_length, out + first); break; \
    }                                                                                            \
  }
  switch (dim) {
    case 64: BATCHES(4, 4) break;
    case 128: BATCHES(8, 2) break;
    case 256: BATCHES(16, 1) break;
    default: /* (dim <= 256: one head's chunks fit) */
      for (long first = 0; first < count; first++)
        value_heads(scores, stride, first, 1, (int)(dim / 16), v, kv_length, out + first);
  }
#undef BATCHES
}

/* Queries of one cache row a work item takes at most: a verify pass's 8-17 tokens over 3
 * kv heads split into 6-15 items, so two threads share them evenly. */
#define QUERY_CHUNK 4
/* Below this much work (tokens x kv heads x keys x group x dim) a layer's attention runs on
 * one thread: a one-token step over a short context costs less than waking the others. */
#define PARALLEL_WORK (1L << 17)

/* out [tokens, heads * dim] = attention of each token's query heads (qkv [tokens, (heads + 2
 * kv_heads) * dim], after rotary) over the first kv_length keys and values of its cache row
 * (caches [slots, kv_heads, capacity, dim]), query head h reading kv head h / (heads /
 * kv_heads); mask rows [queries, kv_length] (bfloat16 or float32, additive), token t's being
 * mask_rows[t]. dim: a multiple of 32, at most 256. A work item is up to QUERY_CHUNK
 * consecutive tokens of one cache row (a verify pass's pending token and drafts) and one kv
 * head: their scores one query at a time, then the values read once for all their heads.
 * Threads take the items as they come; each head's sums are the same whichever item holds
 * it. Returns 0, or 1 without memory. */
int kenspec_attention(const uint16_t *qkv, uint16_t *out, long tokens, long heads, long kv_heads,
                      long dim, const uint16_t *keys, const uint16_t *values,
                      const int64_t *cache_rows, long capacity, const void *mask, int mask_bf16,
                      const int64_t *mask_rows, long kv_length, float scale) {
  const long width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
  const long stride = kv_length + 16;
  long *firsts = malloc(sizeof(long) * (tokens + 1)); /* each chunk's first token, and the end */
  if (!firsts) return 1;
  long chunks = 0;
  for (long t = 0; t < tokens; t++)
    if (t == 0 || cache_rows[t] != cache_rows[t - 1] || t - firsts[chunks - 1] == QUERY_CHUNK)
      firsts[chunks++] = t;
  firsts[chunks] = tokens;
  const long items = chunks * kv_heads;
  int failed = 0;
#pragma omp parallel if (tokens * kv_heads * kv_length * group * dim > PARALLEL_WORK) \
    reduction(| : failed)
  {
    float *scores = malloc(sizeof(float) * stride * group * QUERY_CHUNK);
    uint16_t **outs = malloc(sizeof(uint16_t *) * group * QUERY_CHUNK);
    if (!scores || !outs) failed = 1;
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < items; item++) {
      if (!scores || !outs) continue;
      const long chunk = item / kv_heads, g = item % kv_heads;
      const long first = firsts[chunk], count = firsts[chunk + 1] - first;
      const long cache_at = (cache_rows[first] * kv_heads + g) * capacity * dim;
      for (long i = 0; i < count; i++) {
        const long t = first + i;
        const char *row_mask = (const char *)mask + mask_rows[t] * kv_length * (mask_bf16 ? 2 : 4);
        score_group(qkv + t * width + g * group * dim, keys + cache_at, group, row_mask, mask_bf16,
                    kv_length, dim, scale, scores + i * group * stride, stride);
        for (long h = 0; h < group; h++) outs[i * group + h] = out + t * heads * dim + (g * group + h) * dim;
      }
      value_all(scores, stride, count * group, dim, values + cache_at, kv_length, outs);
    }
    free(scores);
    free(outs);
  }
  free(firsts);
  return failed;
}

/* out [rows, n] = bf16(silu(gate)) * up for gate_up [rows, 2n] (gate first), each op rounded
 * to bfloat16 as transformers' MLP computes act_fn(gate_proj(x)) * up_proj(x). */
void kenspec_silu_mul(const uint16_t *gate_up, uint16_t *out, long rows, long n) {
  for (long r = 0; r < rows; r++) {
    const uint16_t *gate = gate_up + r * 2 * n, *up = gate + n;
    for (long i = 0; i < n; i += 16) {
      const __mmask16 m = lanes(n - i);
      const __m512 g = load16(gate + i, m);
      const __m512 silu = rounded(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
      store16(out + r * n + i, _mm512_mul_ps(silu, load16(up + i, m)), m);
    }
  }
}

/* For each of `rows` float32 logit rows [vocab]: the ids of its `width` (<= 16) largest
 * logits, best first (the earlier id first among equals), and their probabilities
 * exp(logit - logsumexp(row)) (engine.recycled: the target's predictions kept as drafts).
 * One pass keeps the best so far (a vector compare against the smallest kept skips nearly
 * every lane), a second sums exp(logit - max). A row of fewer than `width` finite logits
 * leaves id -1 and probability 0 in the places it cannot fill. */
void kenspec_top_probs(const float *logits, long rows, long vocab, long width, int32_t *ids,
                       float *probs) {
#pragma omp parallel for schedule(static) if (rows > 1) /* rows are independent */
  for (long r = 0; r < rows; r++) {
    const float *x = logits + r * vocab;
    float best[16];
    int32_t at[16];
    long kept = 0;
    float threshold = -INFINITY;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (long i = 0; i < vocab; i += 16) {
      const __mmask16 m = lanes(vocab - i);
      const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, x + i);
      top = _mm512_max_ps(top, v);
      for (__mmask16 above = _mm512_cmp_ps_mask(v, _mm512_set1_ps(threshold), _CMP_GT_OQ); above;
           above &= (__mmask16)(above - 1)) {
        const long index = i + __builtin_ctz(above);
        keep_top(best, at, &kept, &threshold, width, x[index], index);
      }
    }
    const float most = _mm512_reduce_max_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (long i = 0; i < vocab; i += 16) { /* exp16 gives 0 for -inf (the lanes past vocab) */
      const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(vocab - i), x + i);
      sum = _mm512_add_ps(sum, exp16(_mm512_sub_ps(v, _mm512_set1_ps(most))));
    }
    const float log_total = most + logf(_mm512_reduce_add_ps(sum));
    for (long j = 0; j < width; j++) {
      ids[r * width + j] = j < kept ? at[j] : -1;
      probs[r * width + j] = j < kept ? expf(best[j] - log_total) : 0.0f;
    }
  }
}

/* The candidates of a screened argmax (engine.screened_head): the indices j, ascending, of
 * the approximate logits a [vocab] (float32) with a_j + b_j >= max_k (a_k - b_k), where b_j =
 * 1.01 (norm error_j + residue weight_j + 2^-8 |a_j|) + 1e-30 bounds how far a_j may be from
 * the exact logit (weight NULL: no residue term, for approximations of unquantized
 * activations). Writes at most `room` of them to out; returns how many there are (more than
 * room: the caller computes the whole row), or -1 where a lower bound is NaN or the largest
 * is not finite (a NaN or infinite logit). */
long kenspec_screen(const float *a, const float *error, float norm, const float *weight,
                    float residue, long vocab, int32_t *out, long room) {
  const __m512 scale = _mm512_set1_ps(norm), step = _mm512_set1_ps(0x1p-8f);
  const __m512 rest = _mm512_set1_ps(residue);
  const __m512 slack = _mm512_set1_ps(1.01f), tiny = _mm512_set1_ps(1e-30f);
  const __m512i absolute = _mm512_set1_epi32(0x7fffffff);
#define BOUND(v, e, r)                                                                           \
  _mm512_add_ps(_mm512_mul_ps(slack, _mm512_add_ps(_mm512_fmadd_ps(rest, r, _mm512_mul_ps(scale, e)), \
                _mm512_mul_ps(step, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), absolute))))), tiny)
  __m512 low = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (long i = 0; i < vocab; i += 16) {
    const __mmask16 m = lanes(vocab - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, a + i), e = _mm512_maskz_loadu_ps(m, error + i);
    const __m512 r = weight == NULL ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, weight + i);
    const __m512 lower = _mm512_sub_ps(v, BOUND(v, e, r));
    unordered |= _mm512_mask_cmp_ps_mask(m, lower, lower, _CMP_UNORD_Q);
    low = _mm512_mask_max_ps(low, m, low, lower);
  }
  const float least = _mm512_reduce_max_ps(low);
  if (unordered || !isfinite(least)) return -1; /* (a NaN would compare as no candidate) */
  const __m512 floor = _mm512_set1_ps(least);
  __m512i index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  long count = 0;
  for (long i = 0; i < vocab; i += 16) {
    const __mmask16 m = lanes(vocab - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, a + i), e = _mm512_maskz_loadu_ps(m, error + i);
    const __m512 r = weight == NULL ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, weight + i);
    const __mmask16 in = _mm512_mask_cmp_ps_mask(m, _mm512_add_ps(v, BOUND(v, e, r)), floor, _CMP_GE_OQ);
    if (in) {
      const long found = __builtin_popcount(in);
      if (count + found <= room) _mm512_mask_compressstoreu_epi32(out + count, in, index);
      count += found;
    }
    index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
  }
#undef BOUND
  return count;
}
