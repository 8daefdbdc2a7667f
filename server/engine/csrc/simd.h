/* Helpers shared by the fast step's kernels (gemv.c, layer.c): bfloat16 conversions and the
 * horizontal sum of 16 vectors at once. Included, not compiled on its own; cpu_gemv.py builds
 * each kernel with this folder on the include path and hashes this file into its cache key. */
#ifndef KENSPEC_SIMD_H
#define KENSPEC_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t value) {
  uint32_t bits = (uint32_t)value << 16;
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

static inline uint16_t to_bf16(float value) { /* round to nearest even, as torch does */
  uint32_t bits;
  memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

/* out[j] = the sum of a[j]'s 16 lanes, for j < 16: every sum by the same tree (lanes l and
 * l + 8, then + 4, + 2, + 1), so a key's score does not depend on where in a block it lies. */
static inline __m512 reduce16(const __m512 a[16]) {
  __m512 b[8], c[4], f[2];
  for (int i = 0; i < 8; i++)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++)
    f[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  const __m512 g = _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], 0x88), _mm512_shuffle_ps(f[0], f[1], 0xDD));
  /* lane 4k + m of g holds a[4m + k]'s sum */
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, g);
}

#endif
