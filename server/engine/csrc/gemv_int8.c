/* y = (x @ q^T) * scale for int8 weights q [out, k] with one scale per output row, x [rows, k]
 * and y [rows, out] in float32 or bfloat16 (both the same): a weight-only int8 product for the
 * few rows of a decoding step or a verify pass, streaming q (a byte a weight) once.
 *
 * Weights are widened in registers (int8 -> int32 -> float32, exact) and multiplied into
 * float32 partial sums, 16 lanes wide, in order of k; one horizontal sum, then the row's scale
 * (bfloat16 outputs are rounded once, to nearest even). Each output is summed in this one
 * order whatever the row count, so a row's result does not depend on what else is in the pass
 * (batch-invariant by construction). Threads split the output rows.
 * Compiled with AVX-512 F/BW/VL/DQ into the kernel library (engine.forward.cpu_kernels).
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
#ifndef PREFETCH
#define PREFETCH 8192 /* bytes ahead of each weight row's next load (int8: ~14 rows of 576) */
#endif

static void columns(const float *x, const int8_t *q, const float *scale, void *y, int bf16,
                    long rows, long k, long out, long first, long last) {
  const long whole = k & ~15L;
  const __mmask16 tail = (__mmask16)((1u << (k - whole)) - 1u);
  for (long o = first; o < last; o += OUT_BLOCK) {
    const long nb = last - o < OUT_BLOCK ? last - o : OUT_BLOCK;
    for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
      const long rb = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
      __m512 acc[OUT_BLOCK][ROW_BLOCK];
      for (int i = 0; i < OUT_BLOCK; i++)
        for (int j = 0; j < ROW_BLOCK; j++) acc[i][j] = _mm512_setzero_ps();
      for (long c = 0; c < k; c += 16) {
        const __mmask16 mask = c < whole ? (__mmask16)0xffffu : tail;
        __m512 xs[ROW_BLOCK];
        for (int j = 0; j < rb; j++) xs[j] = _mm512_maskz_loadu_ps(mask, x + (r0 + j) * k + c);
        for (int i = 0; i < nb; i++) {
          const int8_t *row = q + (o + i) * k + c;
          _mm_prefetch((const char *)row + PREFETCH, _MM_HINT_T1); /* into L2: see gemv.c */
          const __m512 ws = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, row)));
          for (int j = 0; j < rb; j++) acc[i][j] = _mm512_fmadd_ps(ws, xs[j], acc[i][j]);
        }
      }
      for (int i = 0; i < nb; i++)
        for (int j = 0; j < rb; j++) {
          const float value = _mm512_reduce_add_ps(acc[i][j]) * scale[o + i];
          const long at = (r0 + j) * out + o + i;
          if (bf16)
            ((uint16_t *)y)[at] = to_bf16(value);
          else
            ((float *)y)[at] = value;
        }
    }
  }
}

/* y [rows, out] = (x [rows, k] @ q [out, k]^T) * scale [out], contiguous; x, scale and y in
 * float32 (bf16 = 0) or bfloat16 (bf16 = 1), q int8. Returns 0, or -1 where memory ran out. */
int kenspec_gemv_int8(const void *x, const int8_t *q, const void *scale, void *y, long rows,
                      long k, long out, int bf16) {
  const float *xf = (const float *)x, *sf = (const float *)scale;
  float *converted = NULL;
  if (bf16) { /* widened once, so the inner loop is the same for both */
    converted = malloc(sizeof(float) * (size_t)(rows * k + out));
    if (converted == NULL) return -1;
    for (long i = 0; i < rows * k; i++) converted[i] = from_bf16(((const uint16_t *)x)[i]);
    for (long i = 0; i < out; i++) converted[rows * k + i] = from_bf16(((const uint16_t *)scale)[i]);
    xf = converted;
    sf = converted + rows * k;
  }
#pragma omp parallel
  {
    long first, last;
    thread_share(out, OUT_BLOCK, &first, &last);
    if (first < last) columns(xf, q, sf, y, bf16, rows, k, out, first, last);
  }
  free(converted);
  return 0;
}
