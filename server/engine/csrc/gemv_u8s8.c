/* Approximate logits of a verify pass's rows through an int8 copy of the output layer, with
 * the activations in 8 bits too: y [rows, out] ~= x [rows, k] @ w [out, k]^T, where each row
 * of x (bfloat16) is quantized here to p = round(x / t) in [-127, 127] with t = max|x| / 127,
 * and w_j ~= s_j q_j (int8 q, one bfloat16 scale s_j a row, engine.quantize).
 *
 * Why: a pass of 7-12 rows through the bf16 layer is bound by its dpbf16 multiply-adds (32
 * weights each); AVX512-VNNI's dpbusd multiplies 64 bytes at once, so the same rows take half
 * the instructions over half the bytes. The sums are integers (exact, in any order: the same
 * result whatever the block shape or row count); one conversion and two float32 products a
 * logit: y = float(sum_k (p_k + 128) q_jk - 128 sum_k q_jk) * s_j * t.
 *
 * The caller's exact screen (engine.screened_head) bounds |x . w_j - y_j| with the residues
 * this returns: d_r = |x_r - t_r p_r|_2 (float64, rounded up by one part in 10^6).
 * Compiled with AVX512-VNNI and -BW into the kernel library (engine.forward.cpu_kernels).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "kenspec.h"
#include "simd.h"

#define OUT_BLOCK 4 /* (block() spreads its lanes for 4 or 1 outputs) */
#define ROW_BLOCK 4
#ifndef PREFETCH
#define PREFETCH 8192 /* bytes ahead of each weight row's next load */
#endif

/* acc + the products of u8 lanes of u with s8 lanes of s, 4 a 32-bit lane (vpdpbusd). In
 * assembly: GCC 12 compiles the intrinsic with a register copy or a spill per call (the
 * accumulator not tied), which cost a third of the product's time. */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

static inline __attribute__((always_inline)) void block(const uint8_t *u, const int8_t *q,
                                                        const float *scale, const int32_t *offset,
                                                        const float *t, float *y, long k,
                                                        long kp, long out, long o, long r0,
                                                        const int nb, const int rb) {
  __m512i acc[16];
  for (int a = 0; a < nb * rb; a++) acc[a] = _mm512_setzero_si512();
  const long whole = k & ~63L;
  const __mmask64 tail = k == whole ? ~0ULL : (__mmask64)((1ULL << (k - whole)) - 1ULL);
  for (long c = 0; c < k; c += 64) {
    const __mmask64 mask = c < whole ? ~0ULL : tail;
    __m512i xs[ROW_BLOCK];
    for (int j = 0; j < rb; j++) xs[j] = _mm512_loadu_si512((const void *)(u + (r0 + j) * kp + c));
    for (int i = 0; i < nb; i++) {
      const int8_t *row = q + (o + i) * k + c;
      _mm_prefetch((const char *)row + PREFETCH, _MM_HINT_T1); /* into L2: see gemv.c */
      const __m512i ws = _mm512_maskz_loadu_epi8(mask, row); /* masked weights: 0 past k */
      for (int j = 0; j < rb; j++) acc[j * nb + i] = dpbusd(acc[j * nb + i], xs[j], ws);
    }
  }
  for (int a = nb * rb; a < 16; a++) acc[a] = _mm512_setzero_si512();
  /* lane j * nb + i: pass row j, output i (each spread from one short load: gathers cost
   * ~20 cycles each on Zen 4) */
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i output = _mm512_and_si512(lane, _mm512_set1_epi32(nb - 1));
  const __m512i row = _mm512_srli_epi32(lane, nb == 4 ? 2 : 0);
  const __mmask16 outputs = (__mmask16)((1u << nb) - 1u), rows = (__mmask16)((1u << rb) - 1u);
  const __m512i offsets =
      _mm512_permutexvar_epi32(output, _mm512_maskz_loadu_epi32(outputs, offset + o));
  const __m512 scales = _mm512_permutexvar_ps(output, _mm512_maskz_loadu_ps(outputs, scale + o));
  const __m512 steps = _mm512_permutexvar_ps(row, _mm512_maskz_loadu_ps(rows, t + r0));
  const __m512i exact = _mm512_sub_epi32(reduce16i(acc), _mm512_slli_epi32(offsets, 7));
  const __m512 value = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), scales), steps);
  for (int j = 0; j < rb; j++)
    _mm512_mask_storeu_ps(y + (r0 + j) * out + o - j * nb,
                          (__mmask16)(((1u << nb) - 1u) << (j * nb)), value);
}

/* y[0 .. rows, o .. o + nb] in blocks of ROW_BLOCK pass rows (compile-time nb, 4 or 1). */
static inline __attribute__((always_inline)) void row_blocks(const uint8_t *u, const int8_t *q,
                                                             const float *scale,
                                                             const int32_t *offset,
                                                             const float *t, float *y,
                                                             long rows, long k, long kp,
                                                             long out, long o, const int nb) {
  for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
    switch (rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK) {
      case 1: block(u, q, scale, offset, t, y, k, kp, out, o, r0, nb, 1); break;
      case 2: block(u, q, scale, offset, t, y, k, kp, out, o, r0, nb, 2); break;
      case 3: block(u, q, scale, offset, t, y, k, kp, out, o, r0, nb, 3); break;
      default: block(u, q, scale, offset, t, y, k, kp, out, o, r0, nb, ROW_BLOCK); break;
    }
  }
}

static void columns(const uint8_t *u, const int8_t *q, const float *scale, const int32_t *offset,
                    const float *t, float *y, long rows, long k, long kp, long out, long first,
                    long last) {
  long o = first;
  for (; o + OUT_BLOCK <= last; o += OUT_BLOCK)
    row_blocks(u, q, scale, offset, t, y, rows, k, kp, out, o, OUT_BLOCK);
  for (; o < last; o++) row_blocks(u, q, scale, offset, t, y, rows, k, kp, out, o, 1);
}

/* Per output row j of int8 q [out, k]: the float32 scale (from bfloat16 scales_bf16) and
 * sum_k q_jk (dpbusd's unsigned activations are p + 128; this takes the 128 back out). */
void kenspec_u8s8_prepare(const int8_t *q, const uint16_t *scales_bf16, long k, long out,
                          float *scale, int32_t *offset) {
  for (long j = 0; j < out; j++) {
    int32_t sum = 0;
    for (long c = 0; c < k; c++) sum += q[j * k + c];
    offset[j] = sum;
    scale[j] = from_bf16(scales_bf16[j]);
  }
}

/* y [rows, out] (float32) ~= x [rows, k] (bfloat16) @ (q [out, k] * scale[:, None])^T, and
 * residue[r] >= |x_r - t_r p_r|_2 (module doc). Returns 0, or -1 where memory ran out. */
int kenspec_gemv_u8s8(const uint16_t *x, const int8_t *q, const float *scale,
                      const int32_t *offset, float *y, double *residue, long rows, long k,
                      long out) {
  const long kp = (k + 63) & ~63L; /* each quantized row padded to whole 64-byte loads */
  uint8_t *u = aligned_alloc(64, (size_t)(rows * kp));
  float *t = malloc(sizeof(float) * (size_t)rows);
  if (u == NULL || t == NULL) {
    free(u);
    free(t);
    return -1;
  }
  for (long r = 0; r < rows; r++) {
    float most = 0.0f;
    for (long c = 0; c < k; c++) most = fmaxf(most, fabsf(from_bf16(x[r * k + c])));
    const float step = most / 127.0f;
    double square = 0.0;
    for (long c = 0; c < k; c++) {
      const float value = from_bf16(x[r * k + c]);
      float p = step > 0.0f ? nearbyintf(value / step) : 0.0f;
      p = p > 127.0f ? 127.0f : (p < -127.0f ? -127.0f : p);
      if (p != p) p = 0.0f; /* NaN: its residue is NaN too, and the screen computes the row */
      u[r * kp + c] = (uint8_t)((int)p + 128);
      const double d = (double)value - (double)step * (double)p; /* exact: 24 + 8 bits */
      square += d * d;
    }
    memset(u + r * kp + k, 128, (size_t)(kp - k)); /* (multiplied by masked-out zeros) */
    t[r] = step;
    residue[r] = sqrt(square) * (1.0 + 1e-6);
  }
#pragma omp parallel
  {
    long first, last;
    thread_share(out, OUT_BLOCK, &first, &last);
    if (first < last) columns(u, q, scale, offset, t, y, rows, k, kp, out, first, last);
  }
  free(u);
  free(t);
  return 0;
}
