/* Helpers shared by the AVX2 kernels (gemv_avx2.c, gemv_grouped_avx2.c, layer_avx2.c):
 * scalar.h's, and bfloat16 conversions in eight float32 lanes: simd.h's roles for sources
 * compiled without AVX-512. Included, not compiled on its own (the
 * library's cache key hashes it with the sources). */
#ifndef KENSPEC_AVX2_H
#define KENSPEC_AVX2_H
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "scalar.h"

/* 8 bf16 at p as float32 */
static inline __m256 widen8(const uint16_t *p) {
  const __m128i v = _mm_loadu_si128((const __m128i *)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* the first n (< 8 allowed) bf16 at p as float32, the other lanes 0 */
static inline __m256 widen(const uint16_t *p, long n) {
  if (n >= 8) return widen8(p);
  uint16_t part[8] = {0};
  memcpy(part, p, (size_t)n * 2);
  return widen8(part);
}

/* Each lane rounded to bfloat16, to nearest even (a NaN stays a quiet NaN), in the high half of
 * its 32 bits: scalar.h's to_bf16, eight at a time. */
static inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i nearest = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  const __m256i out = _mm256_blendv_epi8(nearest, quiet, _mm256_castps_si256(nan));
  return _mm256_and_si256(out, _mm256_set1_epi32((int)0xffff0000u));
}

static inline __m256 rounded(__m256 v) { return _mm256_castsi256_ps(bf16_bits(v)); }

/* the first n (8 or fewer) lanes of v to p as bf16 */
static inline void store(uint16_t *p, __m256 v, long n) {
  const __m256i high = _mm256_srli_epi32(bf16_bits(v), 16); /* each lane <= 0xffff */
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
  const __m128i eight = _mm256_castsi256_si128(packed);
  if (n >= 8) {
    _mm_storeu_si128((__m128i *)p, eight);
  } else {
    uint16_t part[8];
    _mm_storeu_si128((__m128i *)part, eight);
    memcpy(p, part, (size_t)n * 2);
  }
}

#endif
