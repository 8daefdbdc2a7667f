/* gemv_grouped.c's product for CPUs with AVX2 and FMA but no AVX512-BF16: y = x @ W^T for
 * weights kept as a GGUF file keeps them (q [out, k] with a float32 scale, and offset, per group
 * of 16 or 32 weights of a row: W[o, i] = q[o, i] * s[o, g] + m[o, g], g = i / group), bfloat16
 * x [rows, k] and y [rows, out]. Same arguments and tiles (engine.quantize.GroupedWeight: 16
 * output rows a block; per block and group, pairs of weights k = 2i, 2i + 1, each pair's 16
 * rows side by side), except that 4-bit weights come in quads (GroupedWeight.quads: per block
 * and group, quads of weights k = 4j .. 4j + 3, 32 bytes, byte 4r + c holding row r's weight
 * k = 4j + c in its low nibble and row r + 8's in its high one); and one more argument:
 * the scales and offsets may be float16 where every one is a float16 exactly (the simple types'
 * d and m are the file's own float16 numbers): Q4_1's groups of 32 then take 5 bits a weight
 * to read (4, and a scale and an offset in 16 bits each), not 6.
 *
 * In integers, as llama.cpp's AVX2 dot products are. int8 weights (Q8_0, Q5, Q6_K...) take
 * 16-bit activations: each row's x is written per group as p * t, p int16 and t = a power of
 * two chosen so that the group's largest |x| takes 15 bits. A bfloat16 has 8 significant bits,
 * so every x within 2^-8 of its group's largest is exactly p * t; smaller ones are rounded to a
 * multiple of t (an error under 2^-16 of the largest, beside bfloat16's own 2^-9 of each).
 * Then a group's products are int16 pairs (vpmaddwd: 16 products an instruction) summed
 * exactly in int32, whatever the order; per group and output, in order of groups:
 * sum += float(group sum) * (s * t) by FMA (s * t exact: t is a power of two), then the
 * offsets' share sum += m * (the group's sum of x, float32, in order) by FMA; one rounding to
 * bfloat16 at the end.
 *
 * 4-bit weights (Q4_0, Q4_1, Q4_K) take 8-bit activations, as llama.cpp's Q8 blocks: per row
 * and group p = x / d rounded to nearest (int8 in [-127, 127]), d = the group's largest |x| /
 * 127 (float32). Weights 0..15 as unsigned bytes times p as signed ones (vpmaddubsw: 32
 * products an instruction, twice vpmaddwd's) summed exactly in int16 within a group (at most
 * 8 * 2 * 15 * 127 < 2^15 a lane), then int32 (quads: a row's 4 weights side by side, so no
 * shuffle of x and one vpmaddwd to widen); per group and output, in order of groups:
 * sum += float(group sum) * (s * d), then sum += m * (d * sum of p): the output is exactly
 * x-as-read times the file's weights, up to float32 sums. The rounding of x costs about what
 * llama.cpp's does: on SmolLM2-135M's Q4_1 file, greedy top-1 agreement with the float32
 * dequantized model 96.5% over 4,821 held-out tokens (16-bit activations: 98.0%, llama.cpp
 * 97.2%), perplexity the same; the unpacking and the products take half the instructions.
 *
 * A row whose x holds an infinity or a NaN gives NaN outputs. So each output is summed in one
 * order whatever the row count, the block or the thread: a row's bits do not depend on its
 * pass, and a verify pass gives plain decoding's tokens. A machine runs this file or
 * gemv_grouped.c (dpbf16 sums pairs in float32): the two differ. Threads split the blocks.
 * Compiled with AVX2, FMA and F16C into the kernel library (engine.forward.cpu_kernels).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "kenspec.h"
#include "avx2.h"

#define TILE 16     /* output rows a block, as gemv_grouped.c's */
#define HALF 8      /* rows a vector holds */
#define ROW_BLOCK 4 /* pass rows a pair is unpacked for: 8 sums, 2 weights and x in 16 */
#ifndef PREFETCH
#define PREFETCH 2048 /* bytes ahead of the tile being read, into L2 */
#endif

/* 8 scales or offsets at p (float16 where half, else float32) as float32, exactly. */
static inline __attribute__((always_inline)) __m256 factors(const void *p, long at,
                                                            const int half) {
  if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
  return _mm256_loadu_ps((const float *)p + at);
}

/* A pass's x as the products read it, per row and group: x ~= p * t, p (k a row) int16 for
 * int8 weights (t a power of two: quantize_group) or int8 for 4-bit ones (t = the group's
 * largest |x| / 127: quantize_group8); t NaN where the group holds an infinity or a NaN, so
 * that each of the row's outputs is NaN; and the x the offsets' share reads (xg). */
typedef kenspec_activations activations;

/* A group's n (16 or 32) x's at x as float32 into v, and the bits of its largest |x| (as
 * integers they order as the floats do; an infinity or a NaN above every finite). */
static inline int32_t widened_largest(const uint16_t *x, long n, __m256 *v) {
  __m256i largest = _mm256_setzero_si256();
  for (long c = 0; c < n / HALF; c++) {
    v[c] = widen8(x + c * HALF);
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(v[c]), _mm256_set1_epi32(0x7fffffff));
    largest = _mm256_max_epi32(largest, bits);
  }
  int32_t each[8], top = 0;
  _mm256_storeu_si256((__m256i *)each, largest);
  for (int i = 0; i < HALF; i++) top = each[i] > top ? each[i] : top;
  return top;
}

/* Group rg of the pass's x (n = 16 or 32 x's at x; groups in order, a row's one after
 * another) into a's entry rg for int8 weights: p int16, t a power of two. */
static void quantize_group(const uint16_t *x, long n, activations *a, long rg) {
  __m256 v[4];
  const int32_t top = widened_largest(x, n, v);
  float sum = 0.0f, lanes[8];
  for (long c = 0; c < n / HALF; c++) {
    _mm256_storeu_ps(lanes, v[c]);
    for (int i = 0; i < HALF; i++) sum += lanes[i];
  }
  a->xg[rg] = sum;
  long exponent = (long)(top >> 23); /* biased: |x| < 2^(exponent - 126) */
  const int finite = exponent < 255;
  if (exponent < 14) exponent = 14; /* t >= 2^-127 (a float32, subnormal at 14) */
  if (exponent > 254) exponent = 254;
  /* p = x * 2^(141 - exponent): |p| <= 2^15 (1 - 2^-8), an integer where |x| >= 2^-8 of the
   * largest; t = 2^(exponent - 141) */
  const uint32_t up = (uint32_t)(268 - exponent) << 23;
  const uint32_t down = exponent > 14 ? (uint32_t)(exponent - 14) << 23 : 1u << 22;
  float scale, t;
  memcpy(&scale, &up, 4);
  memcpy(&t, &down, 4);
  a->t[rg] = finite ? t : __builtin_nanf("");
  int16_t *p = (int16_t *)a->p + rg * n;
  for (long c = 0; c < n / HALF; c++) {
    const __m256i whole = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], _mm256_set1_ps(scale)));
    const __m128i packed =
        _mm_packs_epi32(_mm256_castsi256_si128(whole), _mm256_extracti128_si256(whole, 1));
    _mm_storeu_si128((__m128i *)(p + c * HALF), packed);
  }
}

/* Group rg of the pass's x (n = 16 or 32 x's at x) into a's entry rg for 4-bit weights, as
 * llama.cpp's 8-bit activations are: p = round(x / d) in [-127, 127] (int8), t = d = the
 * group's largest |x| / 127 (0 where the group is all zeros), xg = d * sum p. */
static void quantize_group8(const uint16_t *x, long n, activations *a, long rg) {
  __m256 v[4];
  const int32_t top = widened_largest(x, n, v);
  float amax;
  memcpy(&amax, &top, 4);
  const float d = amax / 127.0f;
  int8_t *p = (int8_t *)a->p + rg * n;
  if (!(amax <= 3.402823466e38f)) { /* an infinity or a NaN: every output of the row NaN */
    a->t[rg] = a->xg[rg] = __builtin_nanf("");
    memset(p, 0, (size_t)n);
    return;
  }
  a->t[rg] = d;
  if (d == 0.0f) { /* all zeros (or below the float32's least step times 63.5) */
    a->xg[rg] = 0.0f;
    memset(p, 0, (size_t)n);
    return;
  }
  const __m256 by = _mm256_set1_ps(d);
  for (long c = 0; c < n / HALF; c++) {
    /* x / d rounds to an integer in [-127, 127] (|x| <= amax = 127 d, up to rounding of d) */
    __m256i whole = _mm256_cvtps_epi32(_mm256_div_ps(v[c], by));
    whole = _mm256_max_epi32(_mm256_min_epi32(whole, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    const __m128i words =
        _mm_packs_epi32(_mm256_castsi256_si128(whole), _mm256_extracti128_si256(whole, 1));
    const __m128i bytes = _mm_packs_epi16(words, words);
    _mm_storel_epi64((__m128i *)(p + c * HALF), bytes);
  }
  int total = 0; /* the offsets' share reads the x the products read: d * sum p */
  for (long i = 0; i < n; i++) total += p[i];
  a->xg[rg] = d * (float)total;
}

/* One group's share of rows r0 .. r0 + rb (rg: row r0's entry of the group in a; the rows'
 * entries count apart) in sums, rows 0-7 and 8-15 of the block's outputs a row: sums +=
 * float(whole) * (s * t), then sums += m * xg, each by FMA (the one order of a row's sums);
 * whole: the group's int32 sums, as sums is laid out; s and m from at_factor on. */
static inline __attribute__((always_inline)) void add_group(
    const activations *a, const __m256i *whole, const void *scales, const void *mins,
    long at_factor, long rg, long count, const int rb, int offsets, int half, __m256 *sums) {
  for (int h = 0; h < 2; h++) {
    const __m256 s = factors(scales, at_factor + h * HALF, half);
    const __m256 m = offsets ? factors(mins, at_factor + h * HALF, half) : _mm256_setzero_ps();
    for (int j = 0; j < rb; j++) {
      const __m256 st = _mm256_mul_ps(s, _mm256_set1_ps(a->t[rg + j * count]));
      sums[2 * j + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(whole[2 * j + h]), st, sums[2 * j + h]);
      if (offsets)
        sums[2 * j + h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->xg[rg + j * count]), sums[2 * j + h]);
    }
  }
}

/* y[r0 + j, 16 b .. + 16] = sums (as add_group lays them out), rounded to bfloat16; a last
 * block's outputs past `out` left alone. */
static inline __attribute__((always_inline)) void store_rows(uint16_t *y, const __m256 *sums,
                                                             long out, long b, long r0,
                                                             const int rb) {
  for (int j = 0; j < rb; j++)
    for (int h = 0; h < 2; h++) {
      const long first = b * TILE + h * HALF;
      if (first >= out) break;
      const long n = out - first < HALF ? out - first : HALF;
      store(y + (r0 + j) * out + first, sums[2 * j + h], n);
    }
}

/* One quad (k = 4j .. 4j + 3 of the block's 16 rows: 32 bytes at `at`) times rows 0 .. rb of x
 * (4 int8 at x, the rows k apart) into acc (rows 0-7 of output pair j's in acc[2 j], 8-15 in
 * acc[2 j + 1]): per pass row one broadcast, two vpmaddubsw and two 16-bit adds, written out
 * so that the sums stay in registers. As intrinsics, GCC 12 kept rb = 4's eight sums in ten
 * registers with a copy each and spilled one to the stack, and its load-add-store chain set
 * the pace: 22 products a cycle on the benchmark VM, against 45 here. */
#define QUAD_UNPACK                                     \
  "vpand (%[at]), %[nibble], %%ymm12\n\t"                \
  "vmovdqu (%[at]), %%ymm13\n\t"                         \
  "vpsrlw $4, %%ymm13, %%ymm13\n\t"                      \
  "vpand %%ymm13, %[nibble], %%ymm13\n\t"
#define QUAD_ROW(X, LOW, HIGH)                          \
  "vpbroadcastd " X ", %%ymm14\n\t"                      \
  "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"             \
  "vpaddw %%ymm15, %" LOW ", %" LOW "\n\t"               \
  "vpmaddubsw %%ymm14, %%ymm13, %%ymm14\n\t"             \
  "vpaddw %%ymm14, %" HIGH ", %" HIGH "\n\t"
#define QUAD_CLOBBERS "xmm12", "xmm13", "xmm14", "xmm15"
static inline __attribute__((always_inline)) void quad8(const uint8_t *at, const int8_t *x,
                                                        long k, __m256i nibble, __m256i *acc,
                                                        const int rb) {
  if (rb == 1) {
    __asm__(QUAD_UNPACK QUAD_ROW("(%[x0])", "[a0]", "[a1]")
            : [a0] "+x"(acc[0]), [a1] "+x"(acc[1])
            : [at] "r"(at), [nibble] "x"(nibble), [x0] "r"(x)
            : QUAD_CLOBBERS);
  } else if (rb == 2) {
    __asm__(QUAD_UNPACK QUAD_ROW("(%[x0])", "[a0]", "[a1]")
                QUAD_ROW("(%[x0], %[k])", "[a2]", "[a3]")
            : [a0] "+x"(acc[0]), [a1] "+x"(acc[1]), [a2] "+x"(acc[2]), [a3] "+x"(acc[3])
            : [at] "r"(at), [nibble] "x"(nibble), [x0] "r"(x), [k] "r"(k)
            : QUAD_CLOBBERS);
  } else if (rb == 3) {
    __asm__(QUAD_UNPACK QUAD_ROW("(%[x0])", "[a0]", "[a1]")
                QUAD_ROW("(%[x0], %[k])", "[a2]", "[a3]")
                QUAD_ROW("(%[x0], %[k], 2)", "[a4]", "[a5]")
            : [a0] "+x"(acc[0]), [a1] "+x"(acc[1]), [a2] "+x"(acc[2]), [a3] "+x"(acc[3]),
              [a4] "+x"(acc[4]), [a5] "+x"(acc[5])
            : [at] "r"(at), [nibble] "x"(nibble), [x0] "r"(x), [k] "r"(k)
            : QUAD_CLOBBERS);
  } else {
    const int8_t *x3 = x + 3 * k;
    __asm__(QUAD_UNPACK QUAD_ROW("(%[x0])", "[a0]", "[a1]")
                QUAD_ROW("(%[x0], %[k])", "[a2]", "[a3]")
                QUAD_ROW("(%[x0], %[k], 2)", "[a4]", "[a5]")
                QUAD_ROW("(%[x3])", "[a6]", "[a7]")
            : [a0] "+x"(acc[0]), [a1] "+x"(acc[1]), [a2] "+x"(acc[2]), [a3] "+x"(acc[3]),
              [a4] "+x"(acc[4]), [a5] "+x"(acc[5]), [a6] "+x"(acc[6]), [a7] "+x"(acc[7])
            : [at] "r"(at), [nibble] "x"(nibble), [x0] "r"(x), [k] "r"(k), [x3] "r"(x3)
            : QUAD_CLOBBERS);
  }
}

/* Rows r0 .. r0 + rb of block b of a 4-bit weight in quads with 8-bit x (vpmaddubsw: 32
 * products an instruction, each 16-bit lane two of one output row, summed in int16: a group's
 * 8 quads add at most 8 * 2 * 15 * 127 < 2^15 a lane). A quad's 32 bytes unpacked once per
 * block of pass rows (a mask, a shift, a mask: rows 0-7 and 8-15, each row's 4 weights in its
 * 32-bit lane, as the row's 4 x's are in a broadcast); per pass row one broadcast, two
 * vpmaddubsw and two 16-bit adds; per group vpmaddwd by ones sums a row's two lanes in int32. */
static inline __attribute__((always_inline)) void block8(
    const activations *a, const uint8_t *q, const void *scales, const void *mins, uint16_t *y,
    long k, long out, long b, long r0, long group, const int rb, int offsets, int half) {
  const long count = k / group, group_bytes = group * TILE / 2; /* 4 bits a weight */
  const uint8_t *tile = q + b * count * group_bytes;
  const long first_factor = b * count * TILE;
  const __m256i nibble = _mm256_set1_epi8(15);
  __m256 sums[2 * ROW_BLOCK];
  for (int j = 0; j < 2 * rb; j++) sums[j] = _mm256_setzero_ps();
  for (long g = 0; g < count; g++) {
    __m256i acc[2 * ROW_BLOCK];
    for (int j = 0; j < 2 * rb; j++) acc[j] = _mm256_setzero_si256();
    const uint8_t *at = tile + g * group_bytes;
    const int8_t *xs = (const int8_t *)a->p + r0 * k + g * group; /* row r0's quad 0 */
    for (long i = 0; i < group; i += 4, at += 2 * TILE) { /* quad i / 4: k = i .. i + 3 */
      if (i % 8 == 0) _mm_prefetch((const char *)at + PREFETCH, _MM_HINT_T1);
      quad8(at, xs + i, k, nibble, acc, rb);
    }
    for (int j = 0; j < 2 * rb; j++) acc[j] = _mm256_madd_epi16(acc[j], _mm256_set1_epi16(1));
    add_group(a, acc, scales, mins, first_factor + g * TILE, r0 * count + g, count, rb,
              offsets, half, sums);
  }
  store_rows(y, sums, out, b, r0, rb);
}

/* One pair (k = 2i, 2i + 1 of the block's 16 rows: 32 bytes at `at`, row o's two at 2o, 2o +
 * 1) times rows 0 .. rb of x (2 int16 at x, the rows `stride` bytes apart) into acc, as quad8
 * lays it out: the pair widened once (vpmovsxbw: rows 0-7, 8-15, row o's k = 2i in the low
 * word of its 32-bit lane, 2i + 1 in the high one), per pass row one broadcast, two vpmaddwd
 * and two 32-bit adds, written out for quad8's reason: as intrinsics GCC 12 kept rb = 4's
 * eight sums with a register copy each and one on the stack (a load-add-store a pair). */
#define PAIR_UNPACK                                     \
  "vpmovsxbw (%[at]), %%ymm12\n\t"                      \
  "vpmovsxbw 16(%[at]), %%ymm13\n\t"
#define PAIR_ROW(X, LOW, HIGH)                          \
  "vpbroadcastd " X ", %%ymm14\n\t"                      \
  "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\t"              \
  "vpaddd %%ymm15, %" LOW ", %" LOW "\n\t"               \
  "vpmaddwd %%ymm14, %%ymm13, %%ymm14\n\t"              \
  "vpaddd %%ymm14, %" HIGH ", %" HIGH "\n\t"
static inline __attribute__((always_inline)) void pair16(const uint8_t *at, const int16_t *x,
                                                         long stride, __m256i *acc,
                                                         const int rb) {
  if (rb == 1) {
    __asm__(PAIR_UNPACK PAIR_ROW("(%[x0])", "[a0]", "[a1]")
            : [a0] "+x"(acc[0]), [a1] "+x"(acc[1])
            : [at] "r"(at), [x0] "r"(x)
            : QUAD_CLOBBERS);
  } else if (rb == 2) {
    __asm__(PAIR_UNPACK PAIR_ROW("(%[x0])", "[a0]", "[a1]")
                PAIR_ROW("(%[x0], %[k])", "[a2]", "[a3]")
            : [a0] "+x"(acc[0]), [a1] "+x"(acc[1]), [a2] "+x"(acc[2]), [a3] "+x"(acc[3])
            : [at] "r"(at), [x0] "r"(x), [k] "r"(stride)
            : QUAD_CLOBBERS);
  } else if (rb == 3) {
    __asm__(PAIR_UNPACK PAIR_ROW("(%[x0])", "[a0]", "[a1]")
                PAIR_ROW("(%[x0], %[k])", "[a2]", "[a3]")
                PAIR_ROW("(%[x0], %[k], 2)", "[a4]", "[a5]")
            : [a0] "+x"(acc[0]), [a1] "+x"(acc[1]), [a2] "+x"(acc[2]), [a3] "+x"(acc[3]),
              [a4] "+x"(acc[4]), [a5] "+x"(acc[5])
            : [at] "r"(at), [x0] "r"(x), [k] "r"(stride)
            : QUAD_CLOBBERS);
  } else {
    const int16_t *x3 = (const int16_t *)((const char *)x + 3 * stride);
    __asm__(PAIR_UNPACK PAIR_ROW("(%[x0])", "[a0]", "[a1]")
                PAIR_ROW("(%[x0], %[k])", "[a2]", "[a3]")
                PAIR_ROW("(%[x0], %[k], 2)", "[a4]", "[a5]")
                PAIR_ROW("(%[x3])", "[a6]", "[a7]")
            : [a0] "+x"(acc[0]), [a1] "+x"(acc[1]), [a2] "+x"(acc[2]), [a3] "+x"(acc[3]),
              [a4] "+x"(acc[4]), [a5] "+x"(acc[5]), [a6] "+x"(acc[6]), [a7] "+x"(acc[7])
            : [at] "r"(at), [x0] "r"(x), [k] "r"(stride), [x3] "r"(x3)
            : QUAD_CLOBBERS);
  }
}

/* Rows r0 .. r0 + rb of block b (both halves): y[r0 + j, 16 b .. + 16], for compile-time rb
 * (int8 weights, 16-bit x). */
static inline __attribute__((always_inline)) void block(
    const activations *a, const uint8_t *q, const void *scales, const void *mins, uint16_t *y,
    long k, long out, long b, long r0, long group, const int rb, int offsets,
    int half) {
  const long count = k / group, pairs = group / 2, pair_bytes = 2 * TILE;
  const uint8_t *tile = q + b * count * pairs * pair_bytes;
  const long first_factor = b * count * TILE;
  __m256 sums[2 * ROW_BLOCK];
  for (int j = 0; j < 2 * rb; j++) sums[j] = _mm256_setzero_ps();
  for (long g = 0; g < count; g++) {
    __m256i acc[2 * ROW_BLOCK];
    for (int j = 0; j < 2 * rb; j++) acc[j] = _mm256_setzero_si256();
    const uint8_t *at = tile + g * pairs * pair_bytes;
    const int16_t *xs = (const int16_t *)a->p + r0 * k + g * group; /* row r0's pair 0 */
    for (long i = 0; i < pairs; i++, at += pair_bytes) {
      if ((i * pair_bytes) % 64 == 0) /* each 64-byte line once */
        _mm_prefetch((const char *)at + PREFETCH, _MM_HINT_T1);
      pair16(at, xs + 2 * i, 2 * k, acc, rb);
    }
    add_group(a, acc, scales, mins, first_factor + g * TILE, r0 * count + g, count, rb,
              offsets, half, sums);
  }
  store_rows(y, sums, out, b, r0, rb);
}

#define BLOCK(rb) block(a, q, scales, mins, y, k, out, b, r0, group, rb, offsets, half)
#define BLOCK8(rb) block8(a, q, scales, mins, y, k, out, b, r0, group, rb, offsets, half)
#define ROWS(BLOCK)                                                 \
  for (long b = first; b < last; b++)                               \
    for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {                 \
      switch (rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK) {      \
        case 1: BLOCK(1); break;                                    \
        case 2: BLOCK(2); break;                                    \
        case 3: BLOCK(3); break;                                    \
        default: BLOCK(ROW_BLOCK);                                  \
      }                                                             \
    }

/* Blocks [first, last) of the product for every row, x as `a` holds it. */
static void blocks(const activations *a, const uint8_t *q, const void *scales, const void *mins,
                   uint16_t *y, long rows, long k, long out, long group, long first, long last,
                   int bits, int half) {
  const int offsets = mins != NULL;
  if (bits == 4) { /* 4-bit weights take 8-bit x */
    ROWS(BLOCK8)
  } else {
    ROWS(BLOCK)
  }
}

/* Group rg of the pass's x into a's entry rg, as the weights' bits ask. */
static inline void quantize(const uint16_t *x, long group, int bits, activations *a, long rg) {
  if (bits == 4)
    quantize_group8(x + rg * group, group, a, rg);
  else
    quantize_group(x + rg * group, group, a, rg);
}

static int takes(long group, long k, int bits) {
  return (group == 16 || group == 32) && k % group == 0 && (bits == 4 || bits == 8);
}

/* kenspec_gemv_grouped's product (same arguments, tiles and results: 0, -1 for arguments it
 * does not take, -2 where memory ran out), in this file's one order; scales and mins float16
 * where `half`, else float32. */
int kenspec_gemv_grouped_avx2(const uint16_t *x, const void *weights, int bits,
                              const void *scales, const void *mins, long group, uint16_t *y,
                              long rows, long k, long out, int half) {
  if (!takes(group, k, bits)) return -1;
  const uint8_t *q = (const uint8_t *)weights;
  const long count = k / group;
  const long tiles = (out + TILE - 1) / TILE;
  activations a;
  a.p = malloc((bits == 4 ? 1 : sizeof(int16_t)) * (size_t)(rows * k));
  a.t = malloc(sizeof(float) * (size_t)(rows * count));
  a.xg = malloc(sizeof(float) * (size_t)(rows * count));
  if (a.p == NULL || a.t == NULL || a.xg == NULL) {
    free(a.p);
    free(a.t);
    free(a.xg);
    return -2;
  }
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (long rg = 0; rg < rows * count; rg++) quantize(x, group, bits, &a, rg);
    long first, last; /* (after the loop's barrier: every row's x is written) */
    thread_share(tiles, 1, &first, &last);
    blocks(&a, q, scales, mins, y, rows, k, out, group, first, last, bits, half);
  }
  free(a.p);
  free(a.t);
  free(a.xg);
  return 0;
}

/* The bytes of a kenspec_activations' p for `rows` rows of k inputs (int16 each, enough for
 * either kind of weights), and in *factors the floats of each of t and xg (groups of 16 or
 * more). */
long kenspec_grouped_room(long rows, long k, long *factors) {
  *factors = rows * (k / 16);
  return (long)sizeof(int16_t) * rows * k;
}

/* A thread of a parallel region: every row's x into its own `a` (each thread the same
 * numbers: the product's x as kenspec_gemv_grouped_avx2 reads it), then its share of the
 * blocks, as kenspec_gemv_grouped_avx2 splits them (its outputs [*first, *last)): the same
 * outputs, bit for bit. Without the fork, the join and the barrier after the x of each
 * product: a decoder pass's team (layer_avx2.c) waits once a product. 0, or -1 for arguments
 * it does not take. */
int kenspec_gemv_grouped_avx2_share(const uint16_t *x, const void *weights, int bits,
                                    const void *scales, const void *mins, long group,
                                    uint16_t *y, long rows, long k, long out, int half,
                                    kenspec_activations *a, long *first, long *last) {
  *first = *last = 0;
  if (!takes(group, k, bits)) return -1;
  for (long rg = 0; rg < rows * (k / group); rg++) quantize(x, group, bits, a, rg);
  long b0, b1;
  thread_share((out + TILE - 1) / TILE, 1, &b0, &b1);
  blocks(a, (const uint8_t *)weights, scales, mins, y, rows, k, out, group, b0, b1, bits, half);
  *first = b0 * TILE < out ? b0 * TILE : out;
  *last = b1 * TILE < out ? b1 * TILE : out;
  return 0;
}
