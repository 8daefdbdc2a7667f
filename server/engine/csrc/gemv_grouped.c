/* y = x @ W^T for weights kept as a GGUF file keeps them: integers q [out, k] with a float32
 * scale (and offset) per group of 16 or 32 weights of a row, W[o, i] = q[o, i] * s[o, g] +
 * m[o, g] with g = i / group; bfloat16 x [rows, k] and y [rows, out]. The served weights are
 * the file's own, exactly: every q is a bfloat16 (|q| <= 128), every s and m a float32 as the
 * file's dequantization computes it (engine.gguf_quants).
 *
 * The weights lie in tiles (engine.quantize.GroupedWeight): 16 output rows a block; per block
 * and group, its pairs of weights (k = 2i, 2i + 1), each pair's 16 rows side by side: int8,
 * 32 bytes a pair (row o's two at 2o, 2o + 1), or 4-bit, 16 bytes a pair (row o's in byte o,
 * k = 2i low). So one pair widened to bf16 is one vector holding 16 rows' pairs, and AVX512-
 * BF16's dpbf16 against the pass row's x pair (broadcast) adds both products into each row's
 * lane: each lane is one output, no horizontal sum. After a group's pairs, one multiply by
 * the 16 rows' scales adds the group into the outputs' sums; the offsets' share, m times the
 * group's sum of x (once a pass), another. One rounding to bfloat16.
 *
 * Each output is summed in this one order whatever the row count, so a row's bits do not
 * depend on its pass: a verify pass gives plain decoding's tokens. Per 32 weights and pass
 * row: one dpbf16 for 16 outputs' pairs; per group, row and 16 outputs: one multiply-add (two
 * with offsets). Threads split the blocks. Compiled with AVX512-BF16 into the kernel library
 * (engine.forward.cpu_kernels).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "kenspec.h"
#include "simd.h"

#define TILE 16     /* output rows a block: one vector */
#define ROW_BLOCK 8 /* pass rows a block of weights is widened for */
#ifndef PREFETCH
#define PREFETCH 2048 /* bytes ahead of the tile being read, into L2 */
#endif

/* One pair of 16 rows' weights as bfloat16 (exact): int8 widened, or nibbles spread to 16-bit
 * lanes (k = 2i low, 2i + 1 high) and looked up in a table of 0.0 .. 15.0. */
static inline __attribute__((always_inline)) __m512bh widen(const uint8_t *at, const int bits4) {
  if (bits4) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)at));
    /* per 32-bit lane: the low nibble in the low word, the high nibble in the high word */
    const __m512i words = _mm512_ternarylogic_epi32(bytes, _mm512_slli_epi32(bytes, 12),
                                                    _mm512_set1_epi32(0x000f000f), 0xa8);
    const __m512i table = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130,
        0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0);
    return (__m512bh)_mm512_permutexvar_epi16(words, table);
  }
  const __m256i bytes = _mm256_loadu_si256((const __m256i *)at);
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return _mm512_cvtne2ps_pbh(high, low);
}

/* x's pair (k = 2i, 2i + 1) in every lane */
static inline __attribute__((always_inline)) __m512bh pair(const uint16_t *x) {
  int32_t both;
  memcpy(&both, x, 4);
  return (__m512bh)_mm512_set1_epi32(both);
}

/* y[r0 .. r0 + rb, 16 b .. 16 b + 16] (compile-time rb, bits4, offsets). */
static inline __attribute__((always_inline)) void block(
    const uint16_t *x, const uint8_t *q, const float *scales, const float *mins, const float *xg,
    uint16_t *y, long k, long out, long b, long r0, long group, const int rb, const int bits4,
    const int offsets) {
  const long groups = k / group, pairs = group / 2;
  const long pair_bytes = bits4 ? TILE : 2 * TILE;
  const uint8_t *tile = q + b * groups * pairs * pair_bytes;
  __m512 sums[ROW_BLOCK];
  for (int j = 0; j < rb; j++) sums[j] = _mm512_setzero_ps();
  for (long g = 0; g < groups; g++) {
    __m512 part[ROW_BLOCK];
    for (int j = 0; j < rb; j++) part[j] = _mm512_setzero_ps();
    for (long i = 0; i < pairs; i++, tile += pair_bytes) {
      _mm_prefetch((const char *)tile + PREFETCH, _MM_HINT_T1);
      const __m512bh w = widen(tile, bits4);
      for (int j = 0; j < rb; j++)
        part[j] = _mm512_dpbf16_ps(part[j], w, pair(x + (r0 + j) * k + g * group + 2 * i));
    }
    const __m512 s = _mm512_loadu_ps(scales + (b * groups + g) * TILE);
    for (int j = 0; j < rb; j++) sums[j] = _mm512_fmadd_ps(part[j], s, sums[j]);
    if (offsets) {
      const __m512 m = _mm512_loadu_ps(mins + (b * groups + g) * TILE);
      for (int j = 0; j < rb; j++)
        sums[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(xg[(r0 + j) * groups + g]), sums[j]);
    }
  }
  const long first = b * TILE;
  const __mmask16 lanes = out - first >= TILE ? (__mmask16)0xffffu
                                              : (__mmask16)((1u << (out - first)) - 1u);
  for (int j = 0; j < rb; j++)
    _mm256_mask_storeu_epi16(y + (r0 + j) * out + first, lanes,
                             (__m256i)_mm512_cvtneps_pbh(sums[j]));
}

/* xg [rows, k / group]: each group's sum of a row's x, in float32 (pairs by dpbf16 against
 * ones, in order, then one horizontal sum). */
static void group_sums(const uint16_t *x, float *xg, long rows, long k, long group) {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
  const __mmask32 half = group == 16 ? (__mmask32)0xffffu : (__mmask32)0xffffffffu;
  for (long r = 0; r < rows; r++)
    for (long g = 0; g < k / group; g++) {
      const __m512bh xs = (__m512bh)_mm512_maskz_loadu_epi16(half, x + r * k + g * group);
      xg[r * (k / group) + g] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), ones, xs));
    }
}

#define ROWS(bits4, offsets)                                                                  \
  for (long b = first; b < last; b++)                                                         \
    for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {                                           \
      switch (rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK) {                                \
        case 1: block(x, q, scales, mins, xg, y, k, out, b, r0, group, 1, bits4, offsets); break; \
        case 2: block(x, q, scales, mins, xg, y, k, out, b, r0, group, 2, bits4, offsets); break; \
        case 3: block(x, q, scales, mins, xg, y, k, out, b, r0, group, 3, bits4, offsets); break; \
        case 4: block(x, q, scales, mins, xg, y, k, out, b, r0, group, 4, bits4, offsets); break; \
        case 5: block(x, q, scales, mins, xg, y, k, out, b, r0, group, 5, bits4, offsets); break; \
        case 6: block(x, q, scales, mins, xg, y, k, out, b, r0, group, 6, bits4, offsets); break; \
        case 7: block(x, q, scales, mins, xg, y, k, out, b, r0, group, 7, bits4, offsets); break; \
        default: block(x, q, scales, mins, xg, y, k, out, b, r0, group, ROW_BLOCK, bits4, offsets); \
      }                                                                                       \
    }

/* y [rows, out] = x [rows, k] @ W^T, W in tiles (see above), all contiguous: x and y
 * bfloat16; q int8 [blocks, k / group, group / 2, 32] (bits 8) or uint8 [..., 16] (bits 4);
 * scales and mins (NULL: none) float32 [blocks, k / group, 16]; blocks = ceil(out / 16).
 * k a multiple of group; group 16 or 32. Returns 0, -1 for arguments it does not take, or -2
 * where memory ran out. */
int kenspec_gemv_grouped(const uint16_t *x, const void *weights, int bits, const float *scales,
                         const float *mins, long group, uint16_t *y, long rows, long k,
                         long out) {
  if ((group != 16 && group != 32) || k % group || (bits != 4 && bits != 8)) return -1;
  const uint8_t *q = (const uint8_t *)weights;
  float *xg = NULL;
  if (mins != NULL) {
    xg = malloc(sizeof(float) * (size_t)(rows * (k / group)));
    if (xg == NULL) return -2;
    group_sums(x, xg, rows, k, group);
  }
  const long blocks = (out + TILE - 1) / TILE;
#pragma omp parallel
  {
    long first, last;
    thread_share(blocks, 1, &first, &last);
    if (bits == 4) {
      if (mins != NULL) {
        ROWS(1, 1)
      } else {
        ROWS(1, 0)
      }
    } else if (mins != NULL) {
      ROWS(0, 1)
    } else {
      ROWS(0, 0)
    }
  }
  free(xg);
  return 0;
}
