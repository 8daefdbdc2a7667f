/* gemv_grouped.c's product for CPUs with AVX2 and FMA but no AVX512-BF16: y = x @ W^T for
 * weights kept as a GGUF file keeps them (q [out, k] with a float32 scale, and offset, per group
 * of 16 or 32 weights of a row: W[o, i] = q[o, i] * s[o, g] + m[o, g], g = i / group), bfloat16
 * x [rows, k] and y [rows, out]. Same arguments and the same tiles (engine.quantize.
 * GroupedWeight: 16 output rows a block; per block and group, pairs of weights k = 2i, 2i + 1,
 * each pair's 16 rows side by side), so one layout serves both files; and one more argument:
 * the scales and offsets may be float16 where every one is a float16 exactly (the simple types'
 * d and m are the file's own float16 numbers): Q4_1's groups of 32 then take 5 bits a weight
 * to read (4, and a scale and an offset in 16 bits each), not 6.
 *
 * In integers, as llama.cpp's AVX2 dot products are, but with 16-bit activations, not 8: each
 * row's x is written per group as p * t, p int16 and t = a power of two chosen so that the
 * group's largest |x| takes 15 bits. A bfloat16 has 8 significant bits, so every x within 2^-8
 * of its group's largest is exactly p * t; smaller ones are rounded to a multiple of t (an error
 * under 2^-16 of the largest, beside bfloat16's own 2^-9 of each). Then a group's products are
 * int16 pairs (vpmaddwd: 16 products an instruction, twice a float32 FMA's 8, and no widening
 * of q to float) summed exactly in int32, whatever the order; per group and output, in order of
 * groups: sum += float(group sum) * (s * t) by FMA (s * t exact: t is a power of two), then the
 * offsets' share sum += m * (the group's sum of x, float32, in order) by FMA; one rounding to
 * bfloat16 at the end. A row whose x holds an infinity or a NaN gives NaN outputs.
 *
 * So each output is summed in one order whatever the row count, the block or the thread: a
 * row's bits do not depend on its pass, and a verify pass gives plain decoding's tokens. A
 * machine runs this file or gemv_grouped.c (dpbf16 sums pairs in float32): the two may differ
 * in the last bits. Per 16 output rows and pair of weights: the pair unpacked to int16 once per
 * block of pass rows (4-bit: 6 instructions; int8: 2), then per pass row one broadcast, two
 * vpmaddwd and two adds with a one-cycle latency (the float32 kernel before this one took four
 * FMAs, each chain waiting out FMA latency, and four conversions); a one-row pass over 4-bit
 * groups, bound by the unpacking, takes two pairs at a time (one_row_4bit: the same integer
 * sums). Threads split the blocks.
 * Compiled with AVX2, FMA and F16C into the kernel library (engine.forward.cpu_kernels).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "kenspec.h"
#include "avx2.h"

#define TILE 16     /* output rows a block, as gemv_grouped.c's */
#define HALF 8      /* rows a vector holds */
#define ROW_BLOCK 4 /* pass rows a pair is unpacked for: 8 sums, 2 weights and x in 16 */
#ifndef PREFETCH
#define PREFETCH 2048 /* bytes ahead of the tile being read, into L2 */
#endif

/* One pair of a tile as int16 pairs: rows 0-7 in *low, 8-15 in *high, row o's q at k = 2i in
 * the low word of its 32-bit lane, 2i + 1 in the high one. int8 pairs: 32 bytes, row o's two
 * at 2o, 2o + 1; 4-bit: 16 bytes, row o's in byte o (low nibble k = 2i). */
static inline __attribute__((always_inline)) void pair(const uint8_t *at, const int bits4,
                                                       __m256i *low, __m256i *high) {
  if (bits4) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)at);
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i even = _mm_and_si128(bytes, nibble);
    const __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    *low = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(even, odd));
    *high = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(even, odd));
  } else {
    *low = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)at));
    *high = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(at + 16)));
  }
}

/* 8 scales or offsets at p (float16 where half, else float32) as float32, exactly. */
static inline __attribute__((always_inline)) __m256 factors(const void *p, long at,
                                                            const int half) {
  if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
  return _mm256_loadu_ps((const float *)p + at);
}

/* A pass's x as the products read it: per row and group, p (int16, k a row), t (a power of two;
 * NaN where the group holds an infinity or a NaN, so that each of the row's outputs is NaN) and
 * the group's sum of x (float32, in order). */
typedef struct {
  int16_t *p;
  float *t, *xg;
} activations;

/* Group rg of the pass's x (n = 16 or 32 x's at x; groups in order, a row's one after
 * another) into a's entry rg. */
static void quantize_group(const uint16_t *x, long n, activations *a, long rg) {
  __m256 v[4];
  __m256i largest = _mm256_setzero_si256(); /* |x|'s bits: integers order as the floats do */
  for (long c = 0; c < n / HALF; c++) {
    v[c] = widen8(x + c * HALF);
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(v[c]), _mm256_set1_epi32(0x7fffffff));
    largest = _mm256_max_epi32(largest, bits); /* an infinity or a NaN above every finite */
  }
  float sum = 0.0f, lanes[8];
  for (long c = 0; c < n / HALF; c++) {
    _mm256_storeu_ps(lanes, v[c]);
    for (int i = 0; i < HALF; i++) sum += lanes[i];
  }
  a->xg[rg] = sum;
  int32_t each[8], top = 0;
  _mm256_storeu_si256((__m256i *)each, largest);
  for (int i = 0; i < HALF; i++) top = each[i] > top ? each[i] : top;
  long exponent = (long)(top >> 23); /* biased: |x| < 2^(exponent - 126) */
  const int finite = exponent < 255;
  if (exponent < 14) exponent = 14; /* t >= 2^-127 (a float32, subnormal at 14) */
  if (exponent > 254) exponent = 254;
  /* p = x * 2^(141 - exponent): |p| <= 2^15 (1 - 2^-8), an integer where |x| >= 2^-8 of the
   * largest; t = 2^(exponent - 141) */
  const uint32_t up = (uint32_t)(268 - exponent) << 23;
  const uint32_t down = exponent > 14 ? (uint32_t)(exponent - 14) << 23 : 1u << 22;
  float scale, t;
  memcpy(&scale, &up, 4);
  memcpy(&t, &down, 4);
  a->t[rg] = finite ? t : __builtin_nanf("");
  int16_t *p = a->p + rg * n;
  for (long c = 0; c < n / HALF; c++) {
    const __m256i whole = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], _mm256_set1_ps(scale)));
    const __m128i packed =
        _mm_packs_epi32(_mm256_castsi256_si128(whole), _mm256_extracti128_si256(whole, 1));
    _mm_storeu_si128((__m128i *)(p + c * HALF), packed);
  }
}

/* One pass row's sums of a group of 4-bit pairs (pairs even), rows 0-7 in *low and 8-15 in
 * *high: as block()'s loop gives them (integers: the same sums), with two pairs at a time
 * unpacked together, each 128-bit lane one pair and its own x (8.5 instructions a pair where
 * block()'s loop takes 12: a one-row pass is bound by them). */
static inline __attribute__((always_inline)) void one_row_4bit(const uint8_t *at,
                                                               const int16_t *x, long pairs,
                                                               __m256i *low, __m256i *high) {
  const __m256i nibble = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256i rows0 = zero, rows4 = zero, rows8 = zero, rows12 = zero; /* 4 rows a lane */
  for (long i = 0; i < pairs; i += 2, at += 2 * TILE) {
    if ((i * TILE) % 64 == 0) _mm_prefetch((const char *)at + PREFETCH, _MM_HINT_T1);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)at);
    const __m256i even = _mm256_and_si256(bytes, nibble);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    const __m256i first = _mm256_unpacklo_epi8(even, odd), second = _mm256_unpackhi_epi8(even, odd);
    int64_t four;
    memcpy(&four, x + 2 * i, 8); /* x pairs i and i + 1: lane 0 takes i, lane 1 takes i + 1 */
    const __m256i xs = _mm256_permutevar8x32_epi32(_mm256_set1_epi64x(four), spread);
    rows0 = _mm256_add_epi32(rows0, _mm256_madd_epi16(_mm256_unpacklo_epi8(first, zero), xs));
    rows4 = _mm256_add_epi32(rows4, _mm256_madd_epi16(_mm256_unpackhi_epi8(first, zero), xs));
    rows8 = _mm256_add_epi32(rows8, _mm256_madd_epi16(_mm256_unpacklo_epi8(second, zero), xs));
    rows12 = _mm256_add_epi32(rows12, _mm256_madd_epi16(_mm256_unpackhi_epi8(second, zero), xs));
  }
#define FOLD(v) _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1))
  *low = _mm256_set_m128i(FOLD(rows4), FOLD(rows0));
  *high = _mm256_set_m128i(FOLD(rows12), FOLD(rows8));
#undef FOLD
}

/* Rows r0 .. r0 + rb of block b (both halves): y[r0 + j, 16 b .. + 16], for compile-time rb
 * and bits4. */
static inline __attribute__((always_inline)) void block(
    const activations *a, const uint8_t *q, const void *scales, const void *mins, uint16_t *y,
    long k, long out, long b, long r0, long group, const int rb, const int bits4, int offsets,
    int half) {
  const long count = k / group, pairs = group / 2, pair_bytes = bits4 ? TILE : 2 * TILE;
  const uint8_t *tile = q + b * count * pairs * pair_bytes;
  const long first_factor = b * count * TILE;
  __m256 sums[2 * ROW_BLOCK];
  for (int j = 0; j < 2 * rb; j++) sums[j] = _mm256_setzero_ps();
  for (long g = 0; g < count; g++) {
    __m256i acc[2 * ROW_BLOCK];
    for (int j = 0; j < 2 * rb; j++) acc[j] = _mm256_setzero_si256();
    const uint8_t *at = tile + g * pairs * pair_bytes;
    if (rb == 1 && bits4)
      one_row_4bit(at, a->p + r0 * k + g * group, pairs, &acc[0], &acc[1]);
    else
      for (long i = 0; i < pairs; i++, at += pair_bytes) {
        if ((i * pair_bytes) % 64 == 0) /* each 64-byte line once */
          _mm_prefetch((const char *)at + PREFETCH, _MM_HINT_T1);
        __m256i low, high;
        pair(at, bits4, &low, &high);
        for (int j = 0; j < rb; j++) {
          int32_t two;
          memcpy(&two, a->p + (r0 + j) * k + g * group + 2 * i, 4);
          const __m256i xs = _mm256_set1_epi32(two);
          acc[2 * j] = _mm256_add_epi32(acc[2 * j], _mm256_madd_epi16(low, xs));
          acc[2 * j + 1] = _mm256_add_epi32(acc[2 * j + 1], _mm256_madd_epi16(high, xs));
        }
      }
    for (int h = 0; h < 2; h++) {
      const long at_factor = first_factor + g * TILE + h * HALF;
      const __m256 s = factors(scales, at_factor, half);
      const __m256 m = offsets ? factors(mins, at_factor, half) : _mm256_setzero_ps();
      for (int j = 0; j < rb; j++) {
        const long rg = (r0 + j) * count + g;
        const __m256 st = _mm256_mul_ps(s, _mm256_set1_ps(a->t[rg]));
        sums[2 * j + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[2 * j + h]), st, sums[2 * j + h]);
        if (offsets)
          sums[2 * j + h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->xg[rg]), sums[2 * j + h]);
      }
    }
  }
  for (int j = 0; j < rb; j++)
    for (int h = 0; h < 2; h++) {
      const long first = b * TILE + h * HALF;
      if (first >= out) break;
      const long n = out - first < HALF ? out - first : HALF;
      store(y + (r0 + j) * out + first, sums[2 * j + h], n);
    }
}

#define BLOCK(rb, bits4) block(&a, q, scales, mins, y, k, out, b, r0, group, rb, bits4, offsets, half)
#define ROWS(bits4)                                                 \
  for (long b = first; b < last; b++)                               \
    for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {                 \
      switch (rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK) {      \
        case 1: BLOCK(1, bits4); break;                             \
        case 2: BLOCK(2, bits4); break;                             \
        case 3: BLOCK(3, bits4); break;                             \
        default: BLOCK(ROW_BLOCK, bits4);                           \
      }                                                             \
    }

/* kenspec_gemv_grouped's product (same arguments, tiles and results: 0, -1 for arguments it
 * does not take, -2 where memory ran out), in this file's one order; scales and mins float16
 * where `half`, else float32. */
int kenspec_gemv_grouped_avx2(const uint16_t *x, const void *weights, int bits,
                              const void *scales, const void *mins, long group, uint16_t *y,
                              long rows, long k, long out, int half) {
  if ((group != 16 && group != 32) || k % group || (bits != 4 && bits != 8)) return -1;
  const uint8_t *q = (const uint8_t *)weights;
  const long count = k / group;
  activations a;
  a.p = malloc(sizeof(int16_t) * (size_t)(rows * k));
  a.t = malloc(sizeof(float) * (size_t)(rows * count));
  a.xg = malloc(sizeof(float) * (size_t)(rows * count));
  if (a.p == NULL || a.t == NULL || a.xg == NULL) {
    free(a.p);
    free(a.t);
    free(a.xg);
    return -2;
  }
  const long blocks = (out + TILE - 1) / TILE;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (long rg = 0; rg < rows * count; rg++) quantize_group(x + rg * group, group, &a, rg);
    long first, last; /* (after the loop's barrier: every row's x is written) */
    thread_share(blocks, 1, &first, &last);
    const int offsets = mins != NULL;
    if (bits == 4) {
      ROWS(1)
    } else {
      ROWS(0)
    }
  }
  free(a.p);
  free(a.t);
  free(a.xg);
  return 0;
}
