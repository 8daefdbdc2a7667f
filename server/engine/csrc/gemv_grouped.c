/* y = x @ W^T for weights kept as a GGUF file keeps them: integers q [out, k] with a float32
 * scale (and offset) per group of 16 or 32 weights of a row, W[o, i] = q[o, i] * s[o, g] +
 * m[o, g] with g = i / group; bfloat16 x [rows, k] and y [rows, out]. The served weights are
 * the file's own, exactly: every q is a bfloat16 (|q| <= 128), every s and m a float32 as the
 * file's dequantization computes it (engine.gguf_quants).
 *
 * q is int8 (8 bits a weight: Q8_0, Q6_K, Q5_*...) or, for 4-bit files with groups of 32,
 * two to a byte in ggml's order: byte j of a group holds weight j in its low nibble and weight
 * j + 16 in its high one (Q4_0, Q4_1 and Q4_K re-packed).
 *
 * Per 32 weights: AVX512-BF16's dpbf16 of the widened q with x (exact products, pairs summed
 * in float32) into a fresh vector, scaled by the group's s (lanes 0-7 hold weights 0-15, lanes
 * 8-15 weights 16-31: a group of 16 scales each half by its own s) and added to the output's
 * partial sums; one horizontal sum; with offsets, the dot product of the row's m with each
 * group's sum of x (summed once a pass) added; one rounding to bfloat16. Each output is summed in this one order
 * whatever the row count, so a row's bits do not depend on its pass: a verify pass gives plain
 * decoding's tokens. Threads split the output rows.
 * Compiled with AVX512-BF16 into the kernel library (engine.forward.cpu_kernels).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "kenspec.h"
#include "simd.h"

#define OUT_BLOCK 4
#define ROW_BLOCK 4
#define ONE_ROW_BLOCK 16
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead of each weight row's next load, into L2 (see gemv.c) */
#endif

/* 32 weights of row `row` from column c as bfloat16 (exact): int8 widened, or 16 bytes of
 * nibbles (a whole group) looked up in a table of 0.0 .. 15.0. */
static inline __attribute__((always_inline)) __m512bh widen(const void *q, long row, long k,
                                                           long c, const int bits4) {
  if (bits4) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + (row * k + c) / 2));
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(15));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15));
    const __m512i index = _mm512_cvtepu8_epi16(_mm256_set_m128i(high, low));
    /* bf16 of 0, 1, ..., 15: 0x3f80 is 1.0 */
    const __m512i table = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130,
        0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0);
    return (__m512bh)_mm512_permutexvar_epi16(index, table);
  }
  const __m256i bytes = _mm256_loadu_si256((const __m256i *)((const int8_t *)q + row * k + c));
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return _mm512_cvtne2ps_pbh(high, low);
}

/* The scale (or offset) of each lane of a 32-weight chunk's dpbf16 result: one value for a
 * group of 32, the first group's in lanes 0-7 and the second's in 8-15 for groups of 16. */
static inline __attribute__((always_inline)) __m512 per_lane(const float *values, long row,
                                                            long k, long c, const int g16) {
  if (!g16) return _mm512_set1_ps(values[row * (k / 32) + c / 32]);
  const float *at = values + row * (k / 16) + c / 16;
  return _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(at[0]), _mm512_set1_ps(at[1]));
}

/* The offsets' share of output o for pass row r: m[o, :] . xg[r, :] (xg: each group's sum of
 * the row's x), 16 groups at a time in order, one horizontal sum. */
static inline float offsets_dot(const float *mins, const float *xg, long o, long r, long groups) {
  __m512 acc = _mm512_setzero_ps();
  for (long g = 0; g < groups; g += 16) {
    const __mmask16 mask = groups - g >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << (groups - g)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, mins + o * groups + g),
                          _mm512_maskz_loadu_ps(mask, xg + r * groups + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

/* The sums of 16 accumulators (lane j * nb + i: pass row j, output o + i), plus each one's
 * offsets share, rounded to bfloat16 once. */
static inline __attribute__((always_inline)) __m256i finish(__m512 acc[16], const float *mins,
                                                           const float *xg, long groups, long o,
                                                           long r0, const int nb, const int rb) {
  __m512 sums = reduce16(acc);
  if (mins != NULL) {
    float shares[16] = {0};
    for (int j = 0; j < rb; j++)
      for (int i = 0; i < nb; i++) shares[j * nb + i] = offsets_dot(mins, xg, o + i, r0 + j, groups);
    sums = _mm512_add_ps(sums, _mm512_loadu_ps(shares));
  }
  return (__m256i)_mm512_cvtneps_pbh(sums);
}

/* y[r0 .. r0 + rb, o .. o + nb] (compile-time nb * rb <= 16). */
static inline __attribute__((always_inline)) void block(
    const uint16_t *x, const void *q, const float *scales, const float *mins, const float *xg,
    uint16_t *y, long k, long out, long o, long r0, const int nb, const int rb, const int bits4,
    const int g16, long groups) {
  __m512 acc[16];
  for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();
  for (long c = 0; c < k; c += 32) {
    __m512bh xs[ROW_BLOCK];
    for (int j = 0; j < rb; j++) xs[j] = (__m512bh)_mm512_loadu_si512(x + (r0 + j) * k + c);
    for (int i = 0; i < nb; i++) {
      const long row = o + i;
      _mm_prefetch((const char *)q + (row * k + c) / (bits4 ? 2 : 1) + PREFETCH, _MM_HINT_T1);
      const __m512bh ws = widen(q, row, k, c, bits4);
      const __m512 s = per_lane(scales, row, k, c, g16);
      for (int j = 0; j < rb; j++) {
        const __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), ws, xs[j]);
        acc[j * nb + i] = _mm512_fmadd_ps(part, s, acc[j * nb + i]);
      }
    }
  }
  const __m256i rounded = finish(acc, mins, xg, groups, o, r0, nb, rb);
  for (int j = 0; j < rb; j++)
    _mm256_mask_storeu_epi16(y + (r0 + j) * out + o - j * nb,
                             (__mmask16)(((1u << nb) - 1u) << (j * nb)), rounded);
}

/* y[0, o .. o + nb] of a one-row pass, as block(..., nb, 1, ...) computes it, its weight rows
 * read one after another, each start to end (see gemv.c's ONE_ROW_BLOCK). */
static inline __attribute__((always_inline)) void one_row(
    const uint16_t *x, const void *q, const float *scales, const float *mins, const float *xg,
    uint16_t *y, long k, long o, const int nb, const int bits4, const int g16, long groups) {
  __m512 acc[16];
  for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();
  for (int i = 0; i < nb; i++) {
    const long row = o + i;
    for (long c = 0; c < k; c += 32) {
      _mm_prefetch((const char *)q + (row * k + c) / (bits4 ? 2 : 1) + PREFETCH / 4, _MM_HINT_T1);
      const __m512bh xs = (__m512bh)_mm512_loadu_si512(x + c);
      const __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), widen(q, row, k, c, bits4), xs);
      acc[i] = _mm512_fmadd_ps(part, per_lane(scales, row, k, c, g16), acc[i]);
    }
  }
  _mm256_mask_storeu_epi16(y + o, (__mmask16)((1u << nb) - 1u),
                           finish(acc, mins, xg, groups, o, 0, nb, 1));
}

#define ROWS(nb)                                                                              \
  for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {                                             \
    switch (rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK) {                                  \
      case 1: block(x, q, s, m, xg, y, k, out, o, r0, nb, 1, bits4, g16, groups); break;         \
      case 2: block(x, q, s, m, xg, y, k, out, o, r0, nb, 2, bits4, g16, groups); break;         \
      case 3: block(x, q, s, m, xg, y, k, out, o, r0, nb, 3, bits4, g16, groups); break;         \
      default: block(x, q, s, m, xg, y, k, out, o, r0, nb, ROW_BLOCK, bits4, g16, groups); break; \
    }                                                                                         \
  }

static inline __attribute__((always_inline)) void columns(
    const uint16_t *x, const void *q, const float *s, const float *m, const float *xg,
    uint16_t *y, long rows, long k, long out, long first, long last, const int bits4,
    const int g16) {
  const long groups = k / (g16 ? 16 : 32);
  long o = first;
  if (rows == 1) {
    for (; o + ONE_ROW_BLOCK <= last; o += ONE_ROW_BLOCK)
      one_row(x, q, s, m, xg, y, k, o, ONE_ROW_BLOCK, bits4, g16, groups);
    for (; o < last; o++) one_row(x, q, s, m, xg, y, k, o, 1, bits4, g16, groups);
    return;
  }
  for (; o + OUT_BLOCK <= last; o += OUT_BLOCK) ROWS(OUT_BLOCK)
  for (; o < last; o++) ROWS(1)
}

#define COLUMNS(bits4, g16) columns(x, q, scales, mins, xg, y, rows, k, out, first, last, bits4, g16)

/* xg [rows, k / group]: each group's sum of a row's x, in float32 (pairs by dpbf16 against
 * ones, then one horizontal sum per group). */
static void group_sums(const uint16_t *x, float *xg, long rows, long k, const int g16) {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
  for (long r = 0; r < rows; r++)
    for (long c = 0; c < k; c += 32) {
      const __m512 pairs = _mm512_dpbf16_ps(_mm512_setzero_ps(), ones,
                                            (__m512bh)_mm512_loadu_si512(x + r * k + c));
      if (g16) {
        xg[r * (k / 16) + c / 16] = _mm512_mask_reduce_add_ps((__mmask16)0x00ff, pairs);
        xg[r * (k / 16) + c / 16 + 1] = _mm512_mask_reduce_add_ps((__mmask16)0xff00, pairs);
      } else {
        xg[r * (k / 32) + c / 32] = _mm512_reduce_add_ps(pairs);
      }
    }
}

/* y [rows, out] = x [rows, k] @ W^T, W as the file's groups (see above), all contiguous:
 * x and y bfloat16; q int8 [out, k] (bits 8) or nibbles [out, k / 2] (bits 4, group 32);
 * scales and mins (NULL: none) float32 [out, k / group]. k a multiple of 32; group 16 or 32.
 * Returns 0, -1 for arguments it does not take, or -2 where memory ran out. */
int kenspec_gemv_grouped(const uint16_t *x, const void *q, int bits, const float *scales,
                         const float *mins, long group, uint16_t *y, long rows, long k,
                         long out) {
  if (k % 32 || (group != 16 && group != 32) || (bits != 4 && bits != 8) ||
      (bits == 4 && group != 32))
    return -1;
  const int bits4 = bits == 4, g16 = group == 16;
  float *xg = NULL;
  if (mins != NULL) {
    xg = malloc(sizeof(float) * (size_t)(rows * (k / group)));
    if (xg == NULL) return -2;
    group_sums(x, xg, rows, k, g16);
  }
#pragma omp parallel
  {
    long first, last;
    thread_share(out, ONE_ROW_BLOCK, &first, &last);
    if (first < last) {
      if (bits4)
        COLUMNS(1, 0);
      else if (g16)
        COLUMNS(0, 1);
      else
        COLUMNS(0, 0);
    }
  }
  free(xg);
  return 0;
}
