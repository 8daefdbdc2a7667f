/* The fast step's whole decoder pass in one call, for passes whose products all take the GEMV
 * (gemv.c) and whose attention is layer.c's: per layer the same kernels, in the same order,
 * as LlamaStep's loop calls them one by one from Python (so the same bits), without the ~10
 * Python and ctypes calls a layer costs between them (~1.5 ms of a one-core step).
 *
 * This file is the library's only source: it includes gemv.c and layer.c, whose functions
 * the library also exports (cpu_gemv.load_layer). Built at start-up by cpu_gemv.py, for CPUs
 * with avx512_bf16 only.
 */
#include "gemv.c"
#include "layer.c"

/* One decoder layer's weights: each product's weight [out, in] (bf16, or int8 with bf16
 * scales [out]), its bias [out] or NULL; the two norms' weights. */
typedef struct {
  const void *qkv, *qkv_scales, *qkv_bias;
  const void *out, *out_scales, *out_bias;
  const void *gate_up, *gate_up_scales;
  const void *down, *down_scales;
  const uint16_t *input_norm, *post_norm;
  uint16_t *keys, *values; /* the layer's cache [slots, kv_heads, capacity, dim] */
} kenspec_layer;

static int linear(const uint16_t *x, const void *w, const void *scales, const void *bias,
                  uint16_t *y, long rows, long k, long n, int int8) {
  if (product(x, w, (const uint16_t *)scales, y, rows, k, n, int8)) return -1;
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

/* hidden [tokens, size] (the embeddings; updated in place) through every layer; normed
 * [tokens, size] gets the final norm's output. cos, sin [tokens, dim]; cache_rows, positions
 * [tokens]: where each token's keys go; mask rows [queries, kv_length], token t's mask_rows[t].
 * Returns 0, or -1 where memory ran out. */
int kenspec_decoder_pass(const kenspec_layer *layers, long count, const uint16_t *final_norm,
                         uint16_t *hidden, uint16_t *normed, long tokens, long size, long heads,
                         long kv_heads, long dim, long intermediate, int int8, float eps,
                         const uint16_t *cos, const uint16_t *sin, const int64_t *cache_rows,
                         const int64_t *positions, long capacity, const void *mask, int mask_bf16,
                         const int64_t *mask_rows, long kv_length, float scale) {
  const long width = (heads + 2 * kv_heads) * dim;
  const long widest = width > 2 * intermediate ? width : 2 * intermediate;
  uint16_t *wide = malloc(sizeof(uint16_t) * tokens * widest);
  long across = intermediate > size ? intermediate : size; /* the MLP's activations, or ... */
  if (heads * dim > across) across = heads * dim;           /* ... the attention's output */
  uint16_t *narrow = malloc(sizeof(uint16_t) * tokens * across);
  uint16_t *delta = malloc(sizeof(uint16_t) * tokens * size);
  int failed = wide == NULL || narrow == NULL || delta == NULL;
  if (!failed) kenspec_add_rmsnorm(hidden, NULL, layers[0].input_norm, normed, tokens, size, eps);
  for (long l = 0; l < count && !failed; l++) {
    const kenspec_layer *L = layers + l;
    failed |= linear(normed, L->qkv, L->qkv_scales, L->qkv_bias, wide, tokens, size, width, int8);
    kenspec_rotary_cache(wide, cos, sin, tokens, heads, kv_heads, dim, L->keys, L->values,
                         cache_rows, positions, capacity);
    failed |= kenspec_attention(wide, narrow, tokens, heads, kv_heads, dim, L->keys, L->values,
                                cache_rows, capacity, mask, mask_bf16, mask_rows, kv_length, scale);
    failed |= linear(narrow, L->out, L->out_scales, L->out_bias, delta, tokens, heads * dim, size, int8);
    kenspec_add_rmsnorm(hidden, delta, L->post_norm, normed, tokens, size, eps);
    failed |= linear(normed, L->gate_up, L->gate_up_scales, NULL, wide, tokens, size, 2 * intermediate, int8);
    kenspec_silu_mul(wide, narrow, tokens, intermediate);
    failed |= linear(narrow, L->down, L->down_scales, NULL, delta, tokens, intermediate, size, int8);
    kenspec_add_rmsnorm(hidden, delta, l + 1 < count ? layers[l + 1].input_norm : final_norm,
                        normed, tokens, size, eps);
  }
  free(wide);
  free(narrow);
  free(delta);
  return failed ? -1 : 0;
}
