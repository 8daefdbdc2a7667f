/* y = x @ w^T for bfloat16 x [rows, k] and w [out, k], y [rows, out] in bfloat16, through
 * AMX-BF16's tiles: the decoder's products on CPUs with AMX (Sapphire Rapids and later), where
 * a pass of up to 16 rows costs about what one row does. gemv.c's dpbf16 GEMV is bound by its
 * multiply-adds past ~4 rows there (16 rows cost ~2.7 one-row reads on a 2-core Xeon); a tile
 * multiply-add does 16 x 16 x 32 of them at once, so the pass stays bound by reading w.
 *
 * The weights are read in place as A tiles (16 output rows x 32 inputs, the row stride w's),
 * the pass's rows laid out per call as B tiles (x's pairs of inputs, 16 rows a group, rows
 * past the pass zero), and C = 16 outputs x 16 rows accumulated in float32 over all of k.
 * TDPBF16PS computes each element of C on its own, its pairs in order, so an output's sum
 * depends on its weight row and its input row only: the same bits whatever the row count and
 * whatever shares the pass (one order at every width), and whatever the thread count. One
 * rounding to bfloat16 at the end (nearest even). It is another order than gemv.c's, so a
 * machine runs one of them for the decoder (engine.forward.choose).
 *
 * Linux hands a process AMX's tile state only when asked (kenspec_amx_init, once). Each
 * OpenMP thread loads the tile configuration for its share and releases it after. k must be
 * a multiple of 32 (kenspec_gemv_amx returns -2 otherwise: the plan keeps such models on the
 * GEMV); out need not be a multiple of 16.
 * Compiled with AMX-TILE, AMX-BF16 and AVX512-BF16 into the kernel library.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kenspec.h"
#include "simd.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Ask the kernel for the tile data state; 0 where granted (then every thread may use it). */
int kenspec_amx_init(void) {
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

typedef struct {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* Eight tiles of 16 rows x 64 bytes: 0-3 C (float32 sums), 4-5 A (weights), 6-7 B (x). A
 * pass of fewer than 16 rows computes zeros for the rest (the same instruction time). */
static void configure(void) {
  tile_config config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; t++) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

/* The weights are streamed a chunk ahead (the next outputs' rows, a chunk being the 16 to 64
 * rows a tile loop reads together), into L2, a slice of the chunk each k step: the A tiles'
 * 16 strided rows are too many streams for the prefetchers alone (one row read at ~60% of
 * the memory's speed without it on a 2-core Xeon, bench/results/amx). */
static inline __attribute__((always_inline)) void ahead(const uint16_t *w, long k, long next,
                                                        long b, const int lines) {
  const char *at = (const char *)(w + next * k) + b * 64L * lines;
  for (int r = 0; r < lines; r++) _mm_prefetch(at + 64 * r, _MM_HINT_T1);
}

/* x's row group g (rows 16g .. 16g + 15) as B tiles: for each block of 32 inputs, 16 pairs
 * (tile rows) x 16 pass rows (dwords), zero past the pass. */
static void lay_out_x(const uint16_t *x, long rows, long k, long g, uint32_t *xt) {
  const long blocks = k / 32;
  memset(xt, 0, blocks * 1024);
  for (long m = 0; m < 16 && 16 * g + m < rows; m++) {
    const uint32_t *row = (const uint32_t *)(x + (16 * g + m) * k);
    for (long p = 0; p < k / 2; p++) xt[(p / 16) * 256 + (p % 16) * 16 + m] = row[p];
  }
}

/* y[16g + m, n0 + n] = c[n][m] rounded, for the pass's rows of group g and `count` outputs. */
static inline void store(const float *c, uint16_t *y, long rows, long g, long out, long n0,
                         long count) {
  const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80,
                                          64, 48, 32, 16, 0);
  const __mmask16 mask = (__mmask16)((1u << count) - 1u);
  for (long m = 0; m < 16 && 16 * g + m < rows; m++) {
    const __m512i at = _mm512_add_epi32(column, _mm512_set1_epi32((int)m));
    const __m512 sums = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, at, c, 4);
    _mm256_mask_storeu_epi16(y + (16 * g + m) * out + n0, mask, (__m256i)_mm512_cvtneps_pbh(sums));
  }
}

/* Outputs n0 .. n0 + 63 for one row group: four C tiles, the weights' A tiles in turn. */
static void four_blocks(const uint16_t *w, long k, long n0, const uint32_t *xt, float *c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long b = 0; b < k / 32; b++) {
    ahead(w, k, n0 + 64, b, 64);
    const uint16_t *at = w + n0 * k + 32 * b;
    _tile_loadd(6, xt + b * 256, 64);
    _tile_loadd(4, at, 2 * k);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, at + 16 * k, 2 * k);
    _tile_dpbf16ps(1, 5, 6);
    _tile_loadd(4, at + 32 * k, 2 * k);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(5, at + 48 * k, 2 * k);
    _tile_dpbf16ps(3, 5, 6);
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
  _tile_stored(3, c + 768, 64);
}

/* Outputs n0 .. n0 + 31 for two row groups (x0, x1): the weights read once for 32 rows. C
 * tiles 0, 1: group 0's two blocks; 2, 3: group 1's. */
static void two_groups(const uint16_t *w, long k, long n0, const uint32_t *x0, const uint32_t *x1,
                       float *c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long b = 0; b < k / 32; b++) {
    ahead(w, k, n0 + 32, b, 32);
    const uint16_t *at = w + n0 * k + 32 * b;
    _tile_loadd(6, x0 + b * 256, 64);
    _tile_loadd(7, x1 + b * 256, 64);
    _tile_loadd(4, at, 2 * k);
    _tile_loadd(5, at + 16 * k, 2 * k);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
  _tile_stored(3, c + 768, 64);
}

/* Outputs n0 .. n0 + 15 for one row group, the weights' rows at `stride` elements apart (w's
 * k, or a padded copy's). */
static void one_block(const uint16_t *w, long k, long stride, long n0, const uint32_t *xt,
                      float *c) {
  _tile_zero(0);
  for (long b = 0; b < k / 32; b++) {
    ahead(w, stride, n0 + 16, b, 16);
    _tile_loadd(6, xt + b * 256, 64);
    _tile_loadd(4, w + n0 * stride + 32 * b, 2 * stride);
    _tile_dpbf16ps(0, 4, 6);
  }
  _tile_stored(0, c, 64);
}

/* This thread's outputs [first, last) for every row group. */
static int share(const uint16_t *w, uint16_t *y, const uint32_t *xt, long rows, long k,
                 long out, long first, long last) {
  const long groups = (rows + 15) / 16, size = (k / 32) * 256; /* a group's B tiles, dwords */
  float c[1024] __attribute__((aligned(64)));
  long n0 = first;
  for (; n0 + 64 <= last; n0 += 64)
    for (long g = 0; g < groups; g++) {
      if (g + 1 < groups) { /* two groups, 32 outputs at a time */
        for (long half = 0; half < 64; half += 32) {
          two_groups(w, k, n0 + half, xt + g * size, xt + (g + 1) * size, c);
          for (int t = 0; t < 4; t++)
            store(c + 256 * t, y, rows, g + t / 2, out, n0 + half + 16 * (t % 2), 16);
        }
        g++;
      } else {
        four_blocks(w, k, n0, xt + g * size, c);
        for (int t = 0; t < 4; t++) store(c + 256 * t, y, rows, g, out, n0 + 16 * t, 16);
      }
    }
  for (; n0 + 16 <= last; n0 += 16)
    for (long g = 0; g < groups; g++) {
      one_block(w, k, k, n0, xt + g * size, c);
      store(c, y, rows, g, out, n0, 16);
    }
  if (n0 < last) { /* fewer than 16 outputs: their rows copied into 16 zero-padded ones */
    uint16_t *padded = calloc(16 * k, sizeof(uint16_t));
    if (padded == NULL) return -1;
    memcpy(padded, w + n0 * k, sizeof(uint16_t) * (last - n0) * k);
    for (long g = 0; g < groups; g++) {
      one_block(padded, k, k, 0, xt + g * size, c);
      store(c, y, rows, g, out, n0, last - n0);
    }
    free(padded);
  }
  return 0;
}

/* y [rows, out] = x [rows, k] @ w [out, k]^T, all contiguous bfloat16. Returns 0; -1 where
 * memory ran out, -2 where k is not a multiple of 32. */
int kenspec_gemv_amx(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long k,
                     long out) {
  if (k % 32 != 0) return -2;
  const long groups = (rows + 15) / 16, size = (k / 32) * 256;
  uint32_t *xt = aligned_alloc(64, sizeof(uint32_t) * groups * size);
  if (xt == NULL) return -1;
  for (long g = 0; g < groups; g++) lay_out_x(x, rows, k, g, xt + g * size);
  int failed = 0;
#pragma omp parallel reduction(| : failed)
  {
    long first, last;
    thread_share(out, 64, &first, &last);
    if (first < last) {
      configure();
      failed |= share(w, y, xt, rows, k, out, first, last) != 0;
      _tile_release();
    }
  }
  free(xt);
  return failed ? -1 : 0;
}
