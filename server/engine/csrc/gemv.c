/* y = x @ w^T for bfloat16 x [rows, k] and w [out, k], y [rows, out] in bfloat16: a product
 * for the few rows of a decoding step or a verify pass, streaming w once at memory speed.
 *
 * Each output is one dot product summed in float32 in a fixed order (32-wide partial sums
 * with AVX512-BF16's dpbf16, then one horizontal sum), whatever the row count: a row's
 * result does not depend on what else is in the pass. Threads split the output columns.
 * Built at start-up by server/engine/cpu_gemv.py, for CPUs with avx512_bf16 only.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#ifndef OUT_BLOCK
#define OUT_BLOCK 4
#endif
#define ROW_BLOCK 4
/* Bytes ahead of each weight row's next load to prefetch: about 14 rows of a 576-wide layer.
 * Measured on a 2-core Xeon (AVX-512, AMX): a one-row pass through SmolLM2's 212 MB of layers
 * 12.9 ms without, 9.5 ms with (2,048: 11.6; 4,096: 10.2; 32,768: 10.1). */
#ifndef PREFETCH
#define PREFETCH 16384
#endif

static inline uint16_t to_bf16(float value) { /* round to nearest even, as torch does */
  uint32_t bits;
  memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

static void columns(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long k,
                    long out, long first, long last) {
  const long whole = k & ~31L;
  const __mmask32 tail = (__mmask32)((1ULL << (k - whole)) - 1ULL);
  for (long o = first; o < last; o += OUT_BLOCK) {
    const long nb = last - o < OUT_BLOCK ? last - o : OUT_BLOCK;
    for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
      const long rb = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
      __m512 acc[OUT_BLOCK][ROW_BLOCK];
      for (int i = 0; i < OUT_BLOCK; i++)
        for (int j = 0; j < ROW_BLOCK; j++) acc[i][j] = _mm512_setzero_ps();
      for (long c = 0; c < k; c += 32) {
        const __mmask32 mask = c < whole ? (__mmask32)0xffffffffu : tail;
        __m512bh xs[ROW_BLOCK];
        for (int j = 0; j < rb; j++)
          xs[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (r0 + j) * k + c);
        for (int i = 0; i < nb; i++) {
          _mm_prefetch((const char *)(w + (o + i) * k + c) + PREFETCH, _MM_HINT_T0);
          const __m512bh ws = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (o + i) * k + c);
          for (int j = 0; j < rb; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], ws, xs[j]);
        }
      }
      for (int i = 0; i < nb; i++)
        for (int j = 0; j < rb; j++) y[(r0 + j) * out + o + i] = to_bf16(_mm512_reduce_add_ps(acc[i][j]));
    }
  }
}

/* y [rows, out] = x [rows, k] @ w [out, k]^T, all contiguous bfloat16. */
void kenspec_gemv_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long k,
                       long out) {
  const long blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp parallel
  {
    const long t = omp_get_thread_num(), n = omp_get_num_threads();
    const long first = blocks * t / n * OUT_BLOCK;
    long last = blocks * (t + 1) / n * OUT_BLOCK;
    if (last > out) last = out;
    if (first < last) columns(x, w, y, rows, k, out, first, last);
  }
}
