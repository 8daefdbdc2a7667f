/* Helpers shared by the AVX-512 kernels in this folder: scalar.h's, and the horizontal sum of
 * 16 vectors at once. Included, not compiled on
 * its own; engine/forward/cpu_kernels.py builds each source with this folder on the include
 * path and hashes this file into the library's cache key. */
#ifndef KENSPEC_SIMD_H
#define KENSPEC_SIMD_H
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "scalar.h"

/* name(a)[j] = the sum of a[j]'s 16 lanes, for j < 16: every sum by the same tree (lanes l and
 * l + 8, then + 4, + 2, + 1), so a key's score does not depend on where in a block it lies.
 * One body for float32 lanes (reduce16) and int32 lanes (reduce16i: exact in any order, and
 * 15 additions for 16 sums); ps/from_ps move an int32 vector through the float shuffles. */
#define KENSPEC_REDUCE16(name, vector, add, shuffle128, ps, from_ps, permute)                     \
  static inline vector name(const vector a[16]) {                                              \
    vector b[8], c[4], f[2];                                                                   \
    for (int i = 0; i < 8; i++)                                                                \
      b[i] = add(shuffle128(a[2 * i], a[2 * i + 1], 0x44), shuffle128(a[2 * i], a[2 * i + 1], 0xEE)); \
    for (int i = 0; i < 4; i++)                                                                \
      c[i] = add(shuffle128(b[2 * i], b[2 * i + 1], 0x88), shuffle128(b[2 * i], b[2 * i + 1], 0xDD)); \
    for (int i = 0; i < 2; i++)                                                                \
      f[i] = add(from_ps(_mm512_shuffle_ps(ps(c[2 * i]), ps(c[2 * i + 1]), 0x44)),             \
                 from_ps(_mm512_shuffle_ps(ps(c[2 * i]), ps(c[2 * i + 1]), 0xEE)));            \
    const vector g = add(from_ps(_mm512_shuffle_ps(ps(f[0]), ps(f[1]), 0x88)),                 \
                         from_ps(_mm512_shuffle_ps(ps(f[0]), ps(f[1]), 0xDD)));                \
    /* lane 4k + m of g holds a[4m + k]'s sum */                                               \
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0); \
    return permute(order, g);                                                                  \
  }
#define KENSPEC_SAME(v) (v)
KENSPEC_REDUCE16(reduce16, __m512, _mm512_add_ps, _mm512_shuffle_f32x4, KENSPEC_SAME, KENSPEC_SAME,
                 _mm512_permutexvar_ps)
KENSPEC_REDUCE16(reduce16i, __m512i, _mm512_add_epi32, _mm512_shuffle_i32x4, _mm512_castsi512_ps,
                 _mm512_castps_si512, _mm512_permutexvar_epi32)

#endif
