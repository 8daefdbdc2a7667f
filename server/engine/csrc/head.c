/* A learned draft head's chain in one call (engine.draft_head): the head's steps, each three
 * products and the reduced output layer through the caller's bf16 GEMV (AVX512-BF16's or
 * AVX2's, passed in: sources of one instruction set call no other's), and the small work
 * between them here in plain C for any x86-64. In Python each step was ~15 torch calls beside
 * four products, about half its time.
 *
 * A step, as DraftHead._step's torch path has it (float32 but for the products' operands and
 * results, which are bfloat16):
 *   z = bf16(gemv(bf16([f, embed[token]]), fc)) + fc_bias
 *   x = bf16(rmsnorm(z) * norm);  gate, up = bf16(gemv(x, gate_up))
 *   z = z + bf16(gemv(bf16(silu(gate) * up), down));  f = rmsnorm(z) * out_norm
 *   logits = bf16(gemv(bf16(f), rows));  next = keep[argmax logits]
 * The norms' means are summed in another order than torch's and silu's exponent is expf, so a
 * feature may differ from the torch path's in its last bits; the head only proposes (the
 * target verifies every token), so its drafts may differ, never the output.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kenspec.h"
#include "scalar.h"

/* out = bf16(x * rsqrt(mean(x^2) + eps) * weight) or float32 where out_f is given. */
static void rms(const float *x, const float *weight, long n, float eps, uint16_t *out,
                float *out_f) {
  float squares = 0.0f;
  for (long i = 0; i < n; i++) squares += x[i] * x[i];
  const float scale = 1.0f / sqrtf(squares / (float)n + eps);
  for (long i = 0; i < n; i++) {
    const float v = x[i] * scale * weight[i];
    if (out_f != NULL) out_f[i] = v;
    if (out != NULL) out[i] = to_bf16(v);
  }
}

/* The `count` largest of logits[0 .. n) (the earliest of equals first) into at[]. */
static void largest(const float *logits, long n, long count, long *at) {
  for (long j = 0; j < count; j++) {
    long best = -1;
    for (long i = 0; i < n; i++) {
      int taken = 0;
      for (long m = 0; m < j; m++) taken |= at[m] == i;
      if (!taken && (best < 0 || logits[i] > logits[best])) best = i;
    }
    at[j] = best;
  }
}

long kenspec_head_chain(const kenspec_head *h, const float *feature, long token, long steps,
                        float min_prob, long alternatives, int64_t *tokens, float *probs,
                        int64_t *alt_tokens, float *alt_probs) {
  const long hidden = h->hidden, inner = h->inner, vocab = h->vocab;
  if (alternatives > vocab - 1) alternatives = vocab - 1;
  if (alternatives < 0) alternatives = 0;
  for (long j = 0; j < alternatives; j++) alt_tokens[j] = -1, alt_probs[j] = 0.0f;
  /* float32 scratch: f [hidden], z [hidden], gate_up [2 inner], logits [vocab]; bf16: the
   * products' operands and results */
  float *f = malloc(sizeof(float) * (2 * hidden + 2 * inner + vocab));
  uint16_t *b = malloc(sizeof(uint16_t) * (4 * hidden + 4 * inner + vocab));
  long at[16];
  if (f == NULL || b == NULL || alternatives + 1 > 16) {
    free(f);
    free(b);
    return -1;
  }
  float *z = f + hidden, *gu = z + hidden, *logits = gu + 2 * inner;
  uint16_t *x2 = b, *y = x2 + 2 * hidden, *x = y + 2 * inner, *act = x + hidden,
           *yl = act + inner;
  for (long i = 0; i < hidden; i++) f[i] = feature[i];
  long made = 0;
  for (long step = 0; step < steps; step++) {
    if (token < 0 || token >= h->embed_rows) break;
    /* [f, embed[token]] */
    for (long i = 0; i < hidden; i++) x2[i] = to_bf16(f[i]);
    if (h->embed_bf16) {
      const uint16_t *e = (const uint16_t *)h->embed + token * hidden;
      for (long i = 0; i < hidden; i++) x2[hidden + i] = e[i];
    } else {
      const float *e = (const float *)h->embed + token * hidden;
      for (long i = 0; i < hidden; i++) x2[hidden + i] = to_bf16(e[i]);
    }
    h->product(x2, h->fc, y, 1, 2 * hidden, hidden);
    for (long i = 0; i < hidden; i++) z[i] = from_bf16(y[i]) + h->fc_bias[i];
    rms(z, h->norm, hidden, h->eps, x, NULL);
    h->product(x, h->gate_up, y, 1, hidden, 2 * inner);
    for (long i = 0; i < inner; i++) {
      const float gate = from_bf16(y[i]), up = from_bf16(y[inner + i]);
      act[i] = to_bf16(gate / (1.0f + expf(-gate)) * up);
    }
    h->product(act, h->down, y, 1, inner, hidden);
    for (long i = 0; i < hidden; i++) z[i] += from_bf16(y[i]);
    rms(z, h->out_norm, hidden, h->eps, x, f);
    h->product(x, h->rows, yl, 1, hidden, vocab);
    float most = -INFINITY;
    for (long i = 0; i < vocab; i++) {
      logits[i] = from_bf16(yl[i]);
      if (logits[i] > most) most = logits[i];
    }
    double total = 0.0;
    for (long i = 0; i < vocab; i++) total += exp((double)(logits[i] - most));
    const float log_total = most + (float)log(total);
    const long wanted = 1 + (step == 0 ? alternatives : 0);
    largest(logits, vocab, wanted, at);
    const float p = expf(logits[at[0]] - log_total);
    if (!(p >= min_prob)) break;
    if (step == 0)
      for (long j = 1; j < wanted; j++) {
        alt_tokens[j - 1] = h->keep[at[j]];
        alt_probs[j - 1] = expf(logits[at[j]] - log_total);
      }
    token = h->keep[at[0]];
    tokens[made] = token;
    probs[made] = p;
    made++;
  }
  free(f);
  free(b);
  return made;
}
