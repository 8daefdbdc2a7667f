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

#include "simd.h"

/* Output rows x pass rows a block takes at once: 16 accumulators, reduced together. One-row
 * passes take 8 weight rows at once, others 4 x 4. */
#ifndef ONE_ROW_BLOCK
#define ONE_ROW_BLOCK 8
#endif
#ifndef OUT_BLOCK
#define OUT_BLOCK 4
#endif
#define ROW_BLOCK (16 / OUT_BLOCK)
/* Bytes ahead of each weight row's next load to prefetch: about 14 rows of a 576-wide layer.
 * Measured on a 2-core Xeon (AVX-512, AMX): a one-row pass through SmolLM2's 212 MB of layers
 * 12.9 ms without, 9.5 ms with (2,048: 11.6; 4,096: 10.2; 32,768: 10.1). */
#ifndef PREFETCH
#define PREFETCH 16384
#endif

/* y[r0 .. r0 + rb, o .. o + nb] for compile-time nb * rb <= 16 (each call site passes
 * constants, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void block(const uint16_t *x, const uint16_t *w,
                                                        uint16_t *y, long k, long out, long o,
                                                        long r0, const int nb, const int rb) {
  const long whole = k & ~31L;
  const __mmask32 tail = (__mmask32)((1ULL << (k - whole)) - 1ULL);
  __m512 acc[16];
  for (int a = 0; a < nb * rb; a++) acc[a] = _mm512_setzero_ps();
  for (long c = 0; c < k; c += 32) {
    const __mmask32 mask = c < whole ? (__mmask32)0xffffffffu : tail;
    __m512bh xs[16];
    for (int j = 0; j < rb; j++)
      xs[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (r0 + j) * k + c);
    for (int i = 0; i < nb; i++) {
      _mm_prefetch((const char *)(w + (o + i) * k + c) + PREFETCH, _MM_HINT_T0);
      const __m512bh ws = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (o + i) * k + c);
      for (int j = 0; j < rb; j++) acc[j * nb + i] = _mm512_dpbf16_ps(acc[j * nb + i], ws, xs[j]);
    }
  }
  /* One horizontal sum for the block, by reduce16's tree: the same for every output whatever
   * the block's shape (unused vectors are zeros), so a row's bits do not depend on the row
   * count. Lane j * nb + i: pass row j, output i; rounded to nearest even, as to_bf16. */
  for (int a = nb * rb; a < 16; a++) acc[a] = _mm512_setzero_ps();
  const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(reduce16(acc));
  for (int j = 0; j < rb; j++)
    _mm256_mask_storeu_epi16(y + (r0 + j) * out + o - j * nb,
                             (__mmask16)(((1u << nb) - 1u) << (j * nb)), rounded);
}

#define ROWS(nb)                                                      \
  for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {                     \
    switch (rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK) {          \
      case 1: block(x, w, y, k, out, o, r0, nb, 1); break;            \
      case 2: block(x, w, y, k, out, o, r0, nb, 2); break;            \
      case 3: block(x, w, y, k, out, o, r0, nb, 3); break;            \
      default: block(x, w, y, k, out, o, r0, nb, ROW_BLOCK); break;   \
    }                                                                 \
  }

static void columns(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long k,
                    long out, long first, long last) {
  long o = first;
  if (rows == 1) {
    for (; o + ONE_ROW_BLOCK <= last; o += ONE_ROW_BLOCK) block(x, w, y, k, out, o, 0, ONE_ROW_BLOCK, 1);
    for (; o + OUT_BLOCK <= last; o += OUT_BLOCK) block(x, w, y, k, out, o, 0, OUT_BLOCK, 1);
    for (; o < last; o++) block(x, w, y, k, out, o, 0, 1, 1);
    return;
  }
  for (; o + OUT_BLOCK <= last; o += OUT_BLOCK) ROWS(OUT_BLOCK)
  for (; o < last; o++) ROWS(1)
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
