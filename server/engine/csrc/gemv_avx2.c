/* y = x @ w^T for bfloat16 x [rows, k] and w [out, k], y [rows, out] in bfloat16, on CPUs with
 * AVX2 and FMA but no AVX512-BF16 (gemv.c's dpbf16 is not there): the same role as gemv.c's
 * kenspec_gemv_bf16, so a decoding step and a verify pass stream the weights once.
 *
 * bf16 -> float32 is a shift: a 32-bit lane holding two bf16 values (element 2l low, 2l + 1
 * high) gives element 2l shifted left 16 and element 2l + 1 with its low half cleared, so 16
 * weights take one load and two instructions, as even and odd vectors.
 *
 * Each output (pass row r, output o) is summed in one order, whatever the row count, the block
 * it falls in or the thread computing it: one 8-lane float32 accumulator, over k in chunks of
 * 16 in order (the last zero-padded), lane l adding x[c+2l] w[c+2l] then x[c+2l+1] w[c+2l+1]
 * by FMA; then lanes (l, l+4), (l, l+2), (0, 1) added (hsum8); rounded to bfloat16 once, to
 * nearest even. So a row's bits never depend on its pass. Threads split the output columns.
 * Compiled with AVX2 and FMA into the kernel library (engine.forward.cpu_kernels).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "kenspec.h"
#include "avx2.h"

/* Outputs x pass rows a block takes at once, one accumulator each: one-row passes 8 outputs,
 * others 4 x 2 (8 accumulators, 4 vectors of the rows and 2 of weights in 16 registers; 4 x 3
 * would spill). Every output's arithmetic is the same in any block. The rows are widened for
 * each block: widened once into a float32 copy for all blocks instead was no faster. */
#ifndef ONE_ROW_BLOCK
#define ONE_ROW_BLOCK 8
#endif
#ifndef OUT_BLOCK
#define OUT_BLOCK 4
#endif
#ifndef ROW_BLOCK
#define ROW_BLOCK 2
#endif
/* Bytes ahead of each weight row's next load to prefetch, into L2, as gemv.c's PREFETCH: on
 * one core of an EPYC a one-row pass of SmolLM2's layers streamed 21 GB/s with it, 13 with
 * 4096 ahead. A pass of several rows is bound by its FMAs (8 products each, where dpbf16 does
 * 32), not by the weights' bytes: 8 rows about 9.5 GB/s a core (bench/gemv_avx2.py). */
#ifndef PREFETCH
#define PREFETCH 16384
#endif

/* 16 bf16 at p as float32: elements 0, 2, .., 14 (even) and 1, 3, .., 15 (odd). */
static inline __attribute__((always_inline)) void split(const uint16_t *p, __m256 *even,
                                                        __m256 *odd) {
  const __m256i v = _mm256_loadu_si256((const __m256i *)p);
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* The sum of v's 8 lanes, by one tree: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). */
static inline float hsum8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

/* One chunk of 16 (x rows at xs, weight rows at ws, each `stride` apart) into the block's
 * accumulators: acc[j * nb + i] (pass row j, output i) += even products, then odd ones. */
static inline __attribute__((always_inline)) void chunk(const uint16_t *xs, long xstride,
                                                        const uint16_t *ws, long wstride,
                                                        __m256 *acc, const int nb, const int rb,
                                                        const int prefetch) {
  __m256 xe[ROW_BLOCK > 1 ? ROW_BLOCK : 1], xo[ROW_BLOCK > 1 ? ROW_BLOCK : 1];
  for (int j = 0; j < rb; j++) split(xs + j * xstride, &xe[j], &xo[j]);
  for (int i = 0; i < nb; i++) {
    if (prefetch) _mm_prefetch((const char *)(ws + i * wstride) + PREFETCH, _MM_HINT_T1);
    __m256 we, wo;
    split(ws + i * wstride, &we, &wo);
    for (int j = 0; j < rb; j++) {
      acc[j * nb + i] = _mm256_fmadd_ps(we, xe[j], acc[j * nb + i]);
      acc[j * nb + i] = _mm256_fmadd_ps(wo, xo[j], acc[j * nb + i]);
    }
  }
}

/* y[r0 .. r0 + rb, o .. o + nb] for compile-time nb, rb (each call site passes constants, so
 * the accumulators stay in registers). */
static inline __attribute__((always_inline)) void block(const uint16_t *x, const uint16_t *w,
                                                        uint16_t *y, long k, long out, long o,
                                                        long r0, const int nb, const int rb) {
  const long whole = k & ~15L;
  __m256 acc[ONE_ROW_BLOCK > OUT_BLOCK * ROW_BLOCK ? ONE_ROW_BLOCK : OUT_BLOCK * ROW_BLOCK];
  for (int a = 0; a < nb * rb; a++) acc[a] = _mm256_setzero_ps();
  /* prefetched by a block's first rows, a weight row's next 64-byte line every other chunk */
  for (long c = 0; c < whole; c += 16)
    chunk(x + r0 * k + c, k, w + o * k + c, k, acc, nb, rb, r0 == 0 && (c & 16) == 0);
  if (whole < k) { /* the last chunk, zero-padded (both sides: no 0 * inf) */
    uint16_t xt[ROW_BLOCK > 1 ? ROW_BLOCK : 1][16] = {{0}};
    uint16_t wt[ONE_ROW_BLOCK > OUT_BLOCK ? ONE_ROW_BLOCK : OUT_BLOCK][16] = {{0}};
    for (int j = 0; j < rb; j++) memcpy(xt[j], x + (r0 + j) * k + whole, (k - whole) * 2);
    for (int i = 0; i < nb; i++) memcpy(wt[i], w + (o + i) * k + whole, (k - whole) * 2);
    chunk(xt[0], 16, wt[0], 16, acc, nb, rb, 0);
  }
  for (int j = 0; j < rb; j++)
    for (int i = 0; i < nb; i++) y[(r0 + j) * out + o + i] = to_bf16(hsum8(acc[j * nb + i]));
}

#define ROWS(nb)                                                                 \
  for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {                                \
    if (rows - r0 >= ROW_BLOCK)                                                  \
      block(x, w, y, k, out, o, r0, nb, ROW_BLOCK);                              \
    else                                                                         \
      for (long r = r0; r < rows; r++) block(x, w, y, k, out, o, r, nb, 1);      \
  }

static void columns(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long k,
                    long out, long first, long last) {
  long o = first;
  if (rows == 1)
    for (; o + ONE_ROW_BLOCK <= last; o += ONE_ROW_BLOCK)
      block(x, w, y, k, out, o, 0, ONE_ROW_BLOCK, 1);
  /* a pass's rows, ROW_BLOCK at a time, over each block of weights while it is in L1 */
  for (; o + OUT_BLOCK <= last; o += OUT_BLOCK) ROWS(OUT_BLOCK)
  for (; o < last; o++) ROWS(1)
}

/* y [rows, out] = x [rows, k] @ w [out, k]^T, all contiguous bfloat16. */
void kenspec_gemv_bf16_avx2(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long k,
                            long out) {
#pragma omp parallel
  {
    long first, last;
    thread_share(out, OUT_BLOCK, &first, &last);
    if (first < last) columns(x, w, y, rows, k, out, first, last);
  }
}

/* A thread's part of kenspec_gemv_bf16_avx2 inside a parallel region (a decoder pass's team,
 * layer_avx2.c): its share of the outputs, [*first, *last), as the product alone splits them,
 * the same bits; no barrier. */
void kenspec_gemv_bf16_avx2_share(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows,
                                  long k, long out, long *first, long *last) {
  thread_share(out, OUT_BLOCK, first, last);
  if (*first < *last) columns(x, w, y, rows, k, out, *first, *last);
}
