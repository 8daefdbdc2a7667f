/* y = x @ w^T for bfloat16 x [rows, k] and w [out, k], y [rows, out] in bfloat16: a product
 * for the few rows of a decoding step or a verify pass, streaming w once at memory speed.
 *
 * Each output is one dot product summed in float32 in a fixed order (32-wide partial sums
 * with AVX512-BF16's dpbf16, then one horizontal sum), whatever the row count: a row's
 * result does not depend on what else is in the pass. Threads split the output columns.
 * Compiled with AVX512-BF16 into the kernel library (engine.forward.cpu_kernels).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "kenspec.h"
#include "simd.h"

/* Output rows x pass rows a block takes at once: 16 accumulators, reduced together. One-row
 * passes take 16 weight rows at once, two-row passes 8 x 2, others 4 x 4 (two rows as 4 x 2
 * would leave 8 accumulators idle).
 *
 * A block of one pass row reads its weight rows one after another, each start to end: a
 * single stream the prefetchers follow at about the memory's speed, where pieces of 8 rows in
 * turn streamed a fifth slower. Each output's partial sums are the same, in the same order,
 * so the bits are too. Wider blocks keep the interleaved order: their weights are read once
 * for several pass rows, which read row after row lost a third of their speed
 * (bench/results/fused-step/NOTES.md). */
#ifndef ONE_ROW_BLOCK
#define ONE_ROW_BLOCK 16
#endif
#define TWO_ROW_BLOCK 8
#ifndef OUT_BLOCK
#define OUT_BLOCK 4
#endif
#define ROW_BLOCK (16 / OUT_BLOCK)
/* (an int8 block's scales are spread over its lanes by `lane & (nb - 1)`) */
_Static_assert(ONE_ROW_BLOCK <= 16 && (ONE_ROW_BLOCK & (ONE_ROW_BLOCK - 1)) == 0,
               "ONE_ROW_BLOCK: a power of two, at most 16");
_Static_assert(OUT_BLOCK <= 16 && (OUT_BLOCK & (OUT_BLOCK - 1)) == 0,
               "OUT_BLOCK: a power of two, at most 16");
/* Bytes ahead of each weight row's next load to prefetch, into L2 (_MM_HINT_T1): about 14
 * rows of a 576-wide layer. Into L1 the lines prefetched ahead (four rows' worth) crowd out
 * the pass's rows and the weights a block re-reads for its next rows; into L2 a multi-row
 * product streamed about twice as fast on a 2-core EPYC (bench/results/verify-cost). */
#ifndef PREFETCH
#define PREFETCH 16384
#endif
/* A one-row block's, read row after row: two rows of a 576-wide layer ahead, into L2. */
#ifndef ONE_ROW_PREFETCH
#define ONE_ROW_PREFETCH 2048
#endif

/* 32 weights from `at` as bfloat16: bf16 as they are, or int8 widened (exact: every int8
 * is a bfloat16). */
static inline __attribute__((always_inline)) __m512bh weights(const void *w, long at,
                                                             __mmask32 mask, const int int8) {
  if (!int8) return (__m512bh)_mm512_maskz_loadu_epi16(mask, (const uint16_t *)w + at);
  const __m256i bytes = _mm256_maskz_loadu_epi8(mask, (const int8_t *)w + at);
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return _mm512_cvtne2ps_pbh(high, low);
}

/* scales[o + l % nb] in lane l (nb: 1, 2, 4, 8 or 16), as float32: an int8 block's scales
 * for its lanes (lane j * nb + i: pass row j, output i). */
static inline __attribute__((always_inline)) __m512 spread_scales(const uint16_t *scales, long o,
                                                                 const int nb) {
  const __m512i lane = _mm512_and_si512(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                        _mm512_set1_epi32(nb - 1));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)((1u << nb) - 1u), scales + o)), 16));
  return _mm512_permutexvar_ps(lane, scale);
}

/* y[r0 .. r0 + rb, o .. o + nb] for compile-time nb * rb <= 16 and int8 (each call site
 * passes constants, so the accumulators stay in registers). With int8 weights each output
 * is scaled by scales[o + i] before it is rounded. */
static inline __attribute__((always_inline)) void block(const uint16_t *x, const void *w,
                                                        const uint16_t *scales, uint16_t *y,
                                                        long k, long out, long o, long r0,
                                                        const int nb, const int rb,
                                                        const int int8, const int scaled,
                                                        long wo) {
  const long whole = k & ~31L;
  const __mmask32 tail = (__mmask32)((1ULL << (k - whole)) - 1ULL);
  const long size = int8 ? 1 : 2; /* bytes a weight */
  __m512 acc[16];
  for (int a = 0; a < nb * rb; a++) acc[a] = _mm512_setzero_ps();
  for (long c = 0; c < k; c += 32) {
    const __mmask32 mask = c < whole ? (__mmask32)0xffffffffu : tail;
    __m512bh xs[16];
    for (int j = 0; j < rb; j++)
      xs[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (r0 + j) * k + c);
    for (int i = 0; i < nb; i++) {
      /* (int8 rows are half as long: the same rows ahead in half the bytes) */
      _mm_prefetch((const char *)w + ((wo + i) * k + c) * size + PREFETCH / (3 - size), _MM_HINT_T1);
      const __m512bh ws = weights(w, (wo + i) * k + c, mask, int8);
      for (int j = 0; j < rb; j++) acc[j * nb + i] = _mm512_dpbf16_ps(acc[j * nb + i], ws, xs[j]);
    }
  }
  /* One horizontal sum for the block, by reduce16's tree: the same for every output whatever
   * the block's shape (unused vectors are zeros), so a row's bits do not depend on the row
   * count. Lane j * nb + i: pass row j, output i; rounded to nearest even, as to_bf16. */
  for (int a = nb * rb; a < 16; a++) acc[a] = _mm512_setzero_ps();
  __m512 sums = reduce16(acc);
  if (scaled) sums = _mm512_mul_ps(sums, spread_scales(scales, o, nb));
  const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sums);
  for (int j = 0; j < rb; j++)
    _mm256_mask_storeu_epi16(y + (r0 + j) * out + o - j * nb,
                             (__mmask16)(((1u << nb) - 1u) << (j * nb)), rounded);
}

/* y[0, o .. o + nb] of a one-row pass, as block(..., nb, 1, ...) computes it (the same partial
 * sums in the same order, one horizontal sum, the same rounding), with its weight rows read
 * one after another, each start to end (see ONE_ROW_BLOCK). */
static inline __attribute__((always_inline)) void one_row(const uint16_t *x, const void *w,
                                                          const uint16_t *scales, uint16_t *y,
                                                          long k, long o, const int nb,
                                                          const int int8) {
  const long whole = k & ~31L;
  const __mmask32 tail = (__mmask32)((1ULL << (k - whole)) - 1ULL);
  const long size = int8 ? 1 : 2; /* bytes a weight */
  __m512 acc[16];
  for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();
  for (int i = 0; i < nb; i++)
    for (long c = 0; c < k; c += 32) {
      const __mmask32 mask = c < whole ? (__mmask32)0xffffffffu : tail;
      _mm_prefetch((const char *)w + ((o + i) * k + c) * size + ONE_ROW_PREFETCH / (3 - size),
                   _MM_HINT_T1);
      const __m512bh xs = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + c);
      acc[i] = _mm512_dpbf16_ps(acc[i], weights(w, (o + i) * k + c, mask, int8), xs);
    }
  __m512 sums = reduce16(acc);
  if (int8) sums = _mm512_mul_ps(sums, spread_scales(scales, o, nb));
  _mm256_mask_storeu_epi16(y + o, (__mmask16)((1u << nb) - 1u), (__m256i)_mm512_cvtneps_pbh(sums));
}

#define ROWS(w, nb, int8, scaled, wo)                                                         \
  for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {                                            \
    switch (rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK) {                                 \
      case 1: block(x, w, scales, y, k, out, o, r0, nb, 1, int8, scaled, wo); break;         \
      case 2: block(x, w, scales, y, k, out, o, r0, nb, 2, int8, scaled, wo); break;         \
      case 3: block(x, w, scales, y, k, out, o, r0, nb, 3, int8, scaled, wo); break;         \
      default: block(x, w, scales, y, k, out, o, r0, nb, ROW_BLOCK, int8, scaled, wo); break; \
    }                                                                                        \
  }

static inline __attribute__((always_inline)) int columns(const uint16_t *x, const void *w,
                                                         const uint16_t *scales, uint16_t *y,
                                                         long rows, long k, long out,
                                                         long first, long last, const int int8) {
  long o = first;
  if (rows == 1) {
    for (; o + ONE_ROW_BLOCK <= last; o += ONE_ROW_BLOCK) one_row(x, w, scales, y, k, o, ONE_ROW_BLOCK, int8);
    for (; o + OUT_BLOCK <= last; o += OUT_BLOCK) one_row(x, w, scales, y, k, o, OUT_BLOCK, int8);
    for (; o < last; o++) one_row(x, w, scales, y, k, o, 1, int8);
    return 0;
  }
  if (rows == 2) /* the rest (fewer than 8 outputs) below, 4 x 2 and 1 x 2 */
    for (; o + TWO_ROW_BLOCK <= last; o += TWO_ROW_BLOCK)
      block(x, w, scales, y, k, out, o, 0, TWO_ROW_BLOCK, 2, int8, int8, o);
  /* int8 weights are widened in registers for each block of pass rows: widened once into an
   * L1 buffer for every row block instead cost more (bench/results/int8-weights; the same
   * bits either way). */
  for (; o + OUT_BLOCK <= last; o += OUT_BLOCK) ROWS(w, OUT_BLOCK, int8, int8, o)
  for (; o < last; o++) ROWS(w, 1, int8, int8, o)
  return 0;
}

static int product(const uint16_t *x, const void *w, const uint16_t *scales, uint16_t *y,
                   long rows, long k, long out, const int int8) {
  int failed = 0;
#pragma omp parallel reduction(| : failed)
  {
    long first, last;
    thread_share(out, OUT_BLOCK, &first, &last);
    if (first < last) {
      if (int8)
        failed |= columns(x, w, scales, y, rows, k, out, first, last, 1) != 0;
      else
        failed |= columns(x, w, scales, y, rows, k, out, first, last, 0) != 0;
    }
  }
  return failed;
}

/* y [rows, out] = x [rows, k] @ w [out, k]^T, all contiguous bfloat16. */
void kenspec_gemv_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long k,
                       long out) {
  product(x, w, NULL, y, rows, k, out, 0);
}

/* y [rows, out] = (x [rows, k] @ q [out, k]^T) * scales [out] for int8 q and bfloat16 x,
 * scales and y, contiguous: the weights widened to bfloat16 in registers (exact), summed as
 * kenspec_gemv_bf16 sums, scaled, rounded once. Returns 0 (-1 is kept for a failure to
 * allocate, which nothing here does now). */
int kenspec_gemv_int8_bf16(const uint16_t *x, const int8_t *q, const uint16_t *scales,
                           uint16_t *y, long rows, long k, long out) {
  return product(x, q, scales, y, rows, k, out, 1);
}

/* The exact logits of a screened row's candidates (engine.forward.screened_head): for bf16 x
 * [k] and the rows `candidates` (ascending) of w [vocab, k], each logit as kenspec_gemv_bf16
 * computes it (the same 32-wide dpbf16 partial sums in order, the same reduce16, the same
 * rounding to bfloat16), written into approximate[candidate] (float32). Returns the candidate
 * with the largest logit, the earliest among equals (as torch's argmax), or -1 for none. */
long kenspec_exact_candidates(const uint16_t *x, const uint16_t *w, long k,
                              const int32_t *candidates, long count, float *approximate) {
  const long whole = k & ~31L;
  const __mmask32 tail = (__mmask32)((1ULL << (k - whole)) - 1ULL);
  long best = -1;
  float top = 0.0f;
  for (long first = 0; first < count; first += 16) {
    const long n = count - first < 16 ? count - first : 16;
    __m512 acc[16];
    for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();
    for (long i = 0; i < n; i++) {
      const uint16_t *row = w + (long)candidates[first + i] * k;
      for (long c = 0; c < k; c += 32) {
        const __mmask32 mask = c < whole ? (__mmask32)0xffffffffu : tail;
        const __m512bh xs = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + c);
        acc[i] = _mm512_dpbf16_ps(acc[i], weights(row, c, mask, 0), xs);
      }
    }
    float values[16];
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(reduce16(acc));
    _mm512_storeu_ps(values, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
    for (long i = 0; i < n; i++) {
      const long token = candidates[first + i];
      approximate[token] = values[i];
      if (best < 0 || values[i] > top) {
        best = token;
        top = values[i];
      }
    }
  }
  return best;
}
