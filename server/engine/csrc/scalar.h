/* Helpers without vector instructions, for every instruction set's sources: one bfloat16 to
 * float32 and back (round to nearest even, as torch does) and a thread's share of a product's
 * outputs. Included (by simd.h and avx2.h), not compiled on its own. */
#ifndef KENSPEC_SCALAR_H
#define KENSPEC_SCALAR_H
#include <omp.h>
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

/* This OpenMP thread's share [first, last) of `out` outputs, in whole blocks of `block`. */
static inline void thread_share(long out, long block, long *first, long *last) {
  const long blocks = (out + block - 1) / block;
  const long t = omp_get_thread_num(), n = omp_get_num_threads();
  *first = blocks * t / n * block;
  *last = blocks * (t + 1) / n * block;
  if (*last > out) *last = out;
}

/* top_probs' running list of a row's `width` largest logits: `value` (at `index`) into best[]
 * and at[], best first, the earlier of equal values first; once full, *threshold is its last
 * (a value must beat it to enter: the vector loops test lanes against it). */
static inline void keep_top(float *best, int32_t *at, long *kept, float *threshold, long width,
                            float value, long index) {
  if (*kept == width && !(value > best[width - 1])) return; /* (threshold moved) */
  long j = *kept < width ? (*kept)++ : width - 1;
  for (; j > 0 && best[j - 1] < value; j--) {
    best[j] = best[j - 1];
    at[j] = at[j - 1];
  }
  best[j] = value;
  at[j] = (int32_t)index;
  if (*kept == width) *threshold = best[width - 1];
}

#endif
