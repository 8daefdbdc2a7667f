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
 * Eight float32 lanes, one output each: a tile is two halves of 8 rows. A pair's half widened
 * to float32 is two vectors, q at k = 2i and at 2i + 1 for 8 rows (int8: 16 bytes sign-extended
 * to words, each row's two words split by shifts; 4-bit: 8 bytes, low and high nibble), every
 * q exact. Per pass row, each vector times that row's x (broadcast, float32) is added by FMA
 * into the row's group sum: the product of an integer up to 128 and a bfloat16 is exact in
 * float32, only the sums round. After a group's pairs, sum += group sum * s by FMA, then the
 * offsets' share sum += m * (the group's sum of x) by FMA; one rounding to bfloat16 at the end.
 *
 * So each output is summed in one order whatever the row count, the block or the thread: a
 * row's bits do not depend on its pass, and a verify pass gives plain decoding's tokens. A
 * machine runs this file or gemv_grouped.c (dpbf16 sums pairs in its own way): the two may
 * differ in a last bit. Per 16 weights and pass row: two FMAs of 8 products (dpbf16 does 32
 * per instruction), so passes of several rows are bound by their FMAs, as gemv_avx2.c's are.
 * Threads split the blocks. Compiled with AVX2, FMA and F16C into the kernel library
 * (engine.forward.cpu_kernels).
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
#define ROW_BLOCK 8 /* pass rows a half tile is widened for: 8 sums, 2 weights, 2 x in 16 */
#define GROUPS_AT_ONCE 4 /* groups summed side by side for a one-row pass */
#ifndef PREFETCH
#define PREFETCH 2048 /* bytes ahead of the tile being read, into L2 */
#endif

/* One pair's half (8 rows, `h` 0 or 1) of a tile as float32: q at k = 2i in *even, 2i + 1 in
 * *odd. int8 pairs: 32 bytes, row o's two at 2o, 2o + 1; 4-bit: 16 bytes, row o's in byte o. */
static inline __attribute__((always_inline)) void pair_half(const uint8_t *at, const int h,
                                                            const int bits4, __m256 *even,
                                                            __m256 *odd) {
  if (bits4) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(at + h * HALF)));
    *even = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
    *odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  } else {
    /* row o's pair as the two words of lane o: k = 2i in the low one */
    const __m128i sixteen = _mm_loadu_si128((const __m128i *)(at + h * 2 * HALF));
    const __m256i words = _mm256_cvtepi8_epi16(sixteen);
    *even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 16), 16));
    *odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(words, 16));
  }
}

/* 8 scales or offsets at p (float16 where half, else float32) as float32, exactly. */
static inline __attribute__((always_inline)) __m256 factors(const void *p, long at,
                                                            const int half) {
  if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
  return _mm256_loadu_ps((const float *)p + at);
}

/* Groups g0 .. g0 + gb (of count) of rows r0 .. r0 + rb of a half tile, added into sums[j] in
 * group order (compile-time rb, gb, bits4; offsets and half are read once a group, where a
 * branch costs nothing, and compiling them in too made this file 13 s of the library's build).
 * Each group's sum is one chain of FMAs, pair after pair, whatever rb and gb: gb groups are
 * summed side by side only so that a pass of few rows has gb * rb chains in flight (one chain
 * waits out each FMA's latency). */
static inline __attribute__((always_inline)) void sum_groups(
    const float *xf, const uint8_t *tile, const void *scales, const void *mins, const float *xg,
    __m256 *sums, long k, long g0, long count, int h, long r0, long group, const int rb,
    const int gb, const int bits4, int offsets, int half) {
  const long pairs = group / 2, pair_bytes = bits4 ? TILE : 2 * TILE;
  __m256 part[ROW_BLOCK]; /* rb * gb <= 8 */
  for (int a = 0; a < gb * rb; a++) part[a] = _mm256_setzero_ps();
  const float *xs = xf + r0 * k + g0 * group;
  for (long i = 0; i < pairs; i++)
    for (int gg = 0; gg < gb; gg++) {
      const uint8_t *at = tile + ((g0 + gg) * pairs + i) * pair_bytes;
      if (h == 0 && (i * pair_bytes) % 64 == 0) /* each 64-byte line once */
        _mm_prefetch((const char *)at + PREFETCH, _MM_HINT_T1);
      __m256 even, odd;
      pair_half(at, h, bits4, &even, &odd);
      for (int j = 0; j < rb; j++) {
        const float *xp = xs + j * k + gg * group + 2 * i;
        part[gg * rb + j] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(xp), part[gg * rb + j]);
        part[gg * rb + j] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(xp + 1), part[gg * rb + j]);
      }
    }
  for (int gg = 0; gg < gb; gg++) {
    const long at = g0 + gg;
    const __m256 s = factors(scales, at * TILE + h * HALF, half);
    for (int j = 0; j < rb; j++) sums[j] = _mm256_fmadd_ps(part[gg * rb + j], s, sums[j]);
    if (offsets) {
      const __m256 m = factors(mins, at * TILE + h * HALF, half);
      for (int j = 0; j < rb; j++)
        sums[j] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xg + (r0 + j) * count + at), sums[j]);
    }
  }
}

/* y[r0 .. r0 + rb, 16 b + 8 h .. + 8] for compile-time rb and bits4; xf the pass's x in
 * float32, xg its groups' sums (offsets only). Groups side by side: 4 for one row, 2 for up to
 * 4 rows, 1 beyond (rb * gb <= 8 chains, 2 weights and 2 x: within 16 registers). On an EPYC
 * core a one-row pass of SmolLM2's 4-bit layers took ~6 ms with one group at a time (each FMA
 * waiting for the last), ~4.8 with four side by side. */
static inline __attribute__((always_inline)) void half_block(
    const float *xf, const uint8_t *q, const void *scales, const void *mins, const float *xg,
    uint16_t *y, long k, long out, long b, int h, long r0, long group, const int rb,
    const int bits4, int offsets, int half) {
  const long count = k / group, pair_bytes = bits4 ? TILE : 2 * TILE;
  const uint8_t *tile = q + b * count * (group / 2) * pair_bytes;
  const long size = half ? 2 : 4, first_group = b * count * TILE; /* (in factors) */
  const void *s = (const char *)scales + first_group * size;
  const void *m = offsets ? (const char *)mins + first_group * size : NULL;
  const int gb = rb == 1 ? GROUPS_AT_ONCE : rb == 2 ? GROUPS_AT_ONCE / 2 : rb <= 4 ? 2 : 1;
  __m256 sums[ROW_BLOCK];
  for (int j = 0; j < rb; j++) sums[j] = _mm256_setzero_ps();
  long g0 = 0;
  for (; g0 + gb <= count; g0 += gb)
    sum_groups(xf, tile, s, m, xg, sums, k, g0, count, h, r0, group, rb, gb, bits4, offsets, half);
  for (; g0 < count; g0++)
    sum_groups(xf, tile, s, m, xg, sums, k, g0, count, h, r0, group, rb, 1, bits4, offsets, half);
  const long first = b * TILE + h * HALF;
  const long n = out - first < HALF ? out - first : HALF;
  for (int j = 0; j < rb; j++) store(y + (r0 + j) * out + first, sums[j], n);
}

#define HALF_BLOCK(rb, bits4) \
  half_block(xf, q, scales, mins, xg, y, k, out, b, h, r0, group, rb, bits4, offsets, half)
#define ROWS(bits4)                                                            \
  for (long b = first; b < last; b++)                                          \
    for (int h = 0; h < 2 && b * TILE + h * HALF < out; h++)                   \
      for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {                          \
        switch (rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK) {               \
          case 1: HALF_BLOCK(1, bits4); break;                                 \
          case 2: HALF_BLOCK(2, bits4); break;                                 \
          case 3: HALF_BLOCK(3, bits4); break;                                 \
          case 4: HALF_BLOCK(4, bits4); break;                                 \
          case 5: HALF_BLOCK(5, bits4); break;                                 \
          case 6: HALF_BLOCK(6, bits4); break;                                 \
          case 7: HALF_BLOCK(7, bits4); break;                                 \
          default: HALF_BLOCK(ROW_BLOCK, bits4);                               \
        }                                                                      \
      }

/* kenspec_gemv_grouped's product (same arguments, tiles and results: 0, -1 for arguments it
 * does not take, -2 where memory ran out), in this file's one order; scales and mins float16
 * where `half`, else float32. xg: each group's sum of a row's x in float32, added in order. */
int kenspec_gemv_grouped_avx2(const uint16_t *x, const void *weights, int bits,
                              const void *scales, const void *mins, long group, uint16_t *y,
                              long rows, long k, long out, int half) {
  if ((group != 16 && group != 32) || k % group || (bits != 4 && bits != 8)) return -1;
  const uint8_t *q = (const uint8_t *)weights;
  const long groups = k / group;
  float *xf = malloc(sizeof(float) * (size_t)(rows * k));
  float *xg = mins != NULL ? malloc(sizeof(float) * (size_t)(rows * groups)) : NULL;
  if (xf == NULL || (mins != NULL && xg == NULL)) {
    free(xf);
    free(xg);
    return -2;
  }
  for (long e = 0; e + HALF <= rows * k; e += HALF) _mm256_storeu_ps(xf + e, widen8(x + e));
  for (long e = rows * k / HALF * HALF; e < rows * k; e++) {
    const uint32_t bits32 = (uint32_t)x[e] << 16;
    memcpy(xf + e, &bits32, 4);
  }
  if (xg != NULL)
    for (long r = 0; r < rows; r++)
      for (long g = 0; g < groups; g++) {
        float sum = 0.0f;
        for (long i = 0; i < group; i++) sum += xf[r * k + g * group + i];
        xg[r * groups + g] = sum;
      }
  const long blocks = (out + TILE - 1) / TILE;
#pragma omp parallel
  {
    long first, last;
    thread_share(blocks, 1, &first, &last);
    const int offsets = mins != NULL;
    if (bits == 4) {
      ROWS(1)
    } else {
      ROWS(0)
    }
  }
  free(xf);
  free(xg);
  return 0;
}
