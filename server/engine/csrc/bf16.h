/* Moving 16 bfloat16 values in and out of float32 lanes, for the kernels compiled with
 * AVX512-BF16 (layer.c, step.c). Included, not compiled on its own. */
#ifndef KENSPEC_BF16_H
#define KENSPEC_BF16_H
#include <immintrin.h>
#include <stdint.h>

static inline __m512 load16(const uint16_t *p, __mmask16 m) { /* 16 bf16 -> float32 */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline void store16(uint16_t *p, __m512 v, __mmask16 m) { /* RNE, as to_bf16 */
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __m512 rounded(__m512 v) { /* through bfloat16 and back */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline __mmask16 lanes(long left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

#endif
