/* The fast step's whole decoder pass in one call, for passes whose products all take the GEMV
 * (gemv.c, gemv_grouped.c, or gemv_amx.c's tiles through kenspec_pass.bf16_product) and whose
 * attention is layer.c's: per layer the same kernels, in the same order, as the lean
 * forward's loop calls them one by one from Python (so the same bits), without
 * the ~10 Python and ctypes calls a layer costs between them.
 * Compiled with AVX512-BF16 into the kernel library (engine.forward.cpu_kernels).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "kenspec.h"
#include "simd.h"
#include "bf16.h"

/* y = x @ W^T (+ bias) for one product, its weights as `quant` says (kenspec_pass). */
static int linear(const uint16_t *x, const void *w, const void *scales, const float *mins,
                  long group, long bits, const void *bias, uint16_t *y, long rows, long k,
                  long n, int quant, kenspec_bf16_product bf16) {
  if (quant == 2) {
    if (kenspec_gemv_grouped(x, w, (int)bits, (const float *)scales, mins, group, y, rows, k, n))
      return -1;
  } else if (quant == 1) {
    if (kenspec_gemv_int8_bf16(x, (const int8_t *)w, (const uint16_t *)scales, y, rows, k, n))
      return -1;
  } else if (bf16 != NULL) {
    if (bf16(x, (const uint16_t *)w, y, rows, k, n)) return -1;
  } else {
    kenspec_gemv_bf16(x, (const uint16_t *)w, y, rows, k, n);
  }
  if (bias) { /* y += bias, each sum rounded to bf16, as torch's in-place bf16 add */
    const uint16_t *b = (const uint16_t *)bias;
    for (long r = 0; r < rows; r++)
      for (long i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        store16(y + r * n + i, _mm512_add_ps(load16(y + r * n + i, m), load16(b + i, m)), m);
      }
  }
  return 0;
}

/* A layer's product by name: its weights, scales, offsets, group and bits. */
#define PRODUCT(L, name) L->name, L->name##_scales, L->name##_mins, L->name##_group, L->name##_bits

/* Every layer of the pass (kenspec.h's kenspec_pass). Returns 0, -1 where memory ran out, -2
 * for Gemma's layers (AVX2's pass computes them, this one not). */
int kenspec_decoder_pass(const kenspec_pass *p) {
  if (p->gemma) return -2;
  const long tokens = p->tokens, size = p->size, dim = p->dim, heads = p->heads;
  const long kv_heads = p->kv_heads, intermediate = p->intermediate;
  const long width = (heads + 2 * kv_heads) * dim;
  const long widest = width > 2 * intermediate ? width : 2 * intermediate;
  uint16_t *wide = malloc(sizeof(uint16_t) * tokens * widest);
  long across = intermediate > size ? intermediate : size; /* the MLP's activations, or ... */
  if (heads * dim > across) across = heads * dim;           /* ... the attention's output */
  uint16_t *narrow = malloc(sizeof(uint16_t) * tokens * across);
  uint16_t *delta = malloc(sizeof(uint16_t) * tokens * size);
  int failed = wide == NULL || narrow == NULL || delta == NULL;
  if (!failed)
    kenspec_add_rmsnorm(p->hidden, NULL, p->layers[0].input_norm, p->normed, tokens, size, p->eps);
  for (long l = 0; l < p->count && !failed; l++) {
    const kenspec_layer *L = p->layers + l;
    failed |= linear(p->normed, PRODUCT(L, qkv), L->qkv_bias, wide, tokens, size, width, p->quant,
                     p->bf16_product);
    kenspec_rotary_cache(wide, p->cos, p->sin, tokens, heads, kv_heads, dim, L->keys, L->values,
                         p->cache_rows, p->positions, p->capacity);
    failed |= kenspec_attention(wide, narrow, tokens, heads, kv_heads, dim, L->keys, L->values,
                                p->cache_rows, p->capacity, p->mask, p->mask_bf16, p->mask_rows,
                                p->kv_length, p->scale);
    failed |= linear(narrow, PRODUCT(L, out), L->out_bias, delta, tokens, heads * dim, size,
                     p->quant, p->bf16_product);
    kenspec_add_rmsnorm(p->hidden, delta, L->post_norm, p->normed, tokens, size, p->eps);
    failed |= linear(p->normed, PRODUCT(L, gate_up), NULL, wide, tokens, size, 2 * intermediate,
                     p->quant, p->bf16_product);
    kenspec_silu_mul(wide, narrow, tokens, intermediate);
    failed |= linear(narrow, PRODUCT(L, down), NULL, delta, tokens, intermediate, size, p->quant,
                     p->bf16_product);
    const uint16_t *next = l + 1 < p->count ? p->layers[l + 1].input_norm : p->final_norm;
    kenspec_add_rmsnorm(p->hidden, delta, next, p->normed, tokens, size, p->eps);
  }
  free(wide);
  free(narrow);
  free(delta);
  return failed ? -1 : 0;
}
