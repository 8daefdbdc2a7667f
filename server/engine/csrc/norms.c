/* Gemma's RMSNorm for the lean forward's Gemma 3 layers (engine.forward.lean), in plain C for
 * any x86-64 (a row is a few hundred values: the call, not the arithmetic, is the cost, and one
 * source gives every CPU the same bits).
 *
 * transformers' Gemma3RMSNorm: out = bf16(float(x) * rsqrt(mean(float(x)^2) + eps) *
 * (1 + float(weight))), every step in float32 (where Llama's rounds to bfloat16 before its
 * weight). Here the same steps in the same order; the mean's sum runs in another order than
 * torch's and the reciprocal square root is 1 / sqrtf (as layer.c's RMSNorm), so an output may
 * differ from transformers' in its last bit.
 */
#include <math.h>
#include <stdint.h>

#include "kenspec.h"
#include "scalar.h"

/* out[0 .. n) = Gemma's RMSNorm of x[0 .. n) with `weight` (each bfloat16). */
static void norm_row(const uint16_t *x, const uint16_t *weight, uint16_t *out, long n,
                     float eps) {
  float squares = 0.0f;
  for (long i = 0; i < n; i++) {
    const float v = from_bf16(x[i]);
    squares += v * v;
  }
  const float scale = 1.0f / sqrtf(squares / (float)n + eps);
  for (long i = 0; i < n; i++) {
    const float normed = from_bf16(x[i]) * scale;
    out[i] = to_bf16(normed * (1.0f + from_bf16(weight[i])));
  }
}

/* Each token's query heads (weight q_weight) and key heads (k_weight) of qkv [tokens, (heads
 * + 2 kv_heads) * dim], normed in place (Gemma 3's q_norm and k_norm, before rotary). */
void kenspec_gemma_head_norms(uint16_t *qkv, long tokens, long heads, long kv_heads, long dim,
                              const uint16_t *q_weight, const uint16_t *k_weight, float eps) {
  const long width = (heads + 2 * kv_heads) * dim;
  for (long t = 0; t < tokens; t++)
    for (long h = 0; h < heads + kv_heads; h++) {
      uint16_t *head = qkv + t * width + h * dim;
      norm_row(head, h < heads ? q_weight : k_weight, head, dim, eps);
    }
}

/* Gemma's residual step for rows [rows, n]: where delta is given, hidden = bf16(hidden +
 * norm(delta; delta_weight)) in place (the attention's or the MLP's output normed, then
 * added); then normed = norm(hidden; weight), the next norm's input. */
void kenspec_gemma_add_norm(uint16_t *hidden, uint16_t *delta, const uint16_t *delta_weight,
                            const uint16_t *weight, uint16_t *normed, long rows, long n,
                            float eps) {
  for (long r = 0; r < rows; r++) {
    uint16_t *h = hidden + r * n;
    if (delta != NULL) {
      uint16_t *d = delta + r * n;
      norm_row(d, delta_weight, d, n, eps); /* (delta is scratch: normed in place) */
      for (long i = 0; i < n; i++) h[i] = to_bf16(from_bf16(h[i]) + from_bf16(d[i]));
    }
    norm_row(h, weight, normed + r * n, n, eps);
  }
}
