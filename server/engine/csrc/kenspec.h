/* The CPU kernel library's interface: every function it exports and the two structs a decoder
 * pass is described by. One shared object holds them all (engine.forward.cpu_kernels builds
 * it): each source is compiled once, with the instructions it needs, and Python calls only the
 * functions the CPU can run:
 *   gemv_int8.c  AVX-512 F/BW/VL/DQ   int8 weights, float32 or bfloat16 activations
 *   gemv.c       + AVX512-BF16        bfloat16 products (and int8 weights widened to bf16)
 *   gemv_grouped.c + AVX512-BF16      a GGUF file's own groups: int8 or 4-bit q, scales, offsets
 *   gemv_avx2.c  AVX2 and FMA         bfloat16 products where AVX512-BF16 is not there
 *   gemv_grouped_avx2.c  AVX2 and FMA a GGUF file's own groups where AVX512-BF16 is not there
 *   gemv_amx.c   + AMX-TILE, AMX-BF16  bfloat16 products through AMX tiles
 *   layer.c      + AVX512-BF16        the work between a layer's products, top-k, the screen
 *   step.c       + AVX512-BF16        a whole decoder pass in one call
 *   gemv_u8s8.c  + AVX512-VNNI        the screened output layer's int8 x int8 product
 *   layout.c     any x86-64           the structs' sizes and offsets, checked by ctypes at load
 *   norms.c      any x86-64           Gemma's RMSNorm: its residual step and head norms
 *   head.c       any x86-64           a learned draft head's chain (its products passed in)
 */
#ifndef KENSPEC_H
#define KENSPEC_H
#include <stdint.h>

/* A bf16 product y [rows, out] = x [rows, k] @ w [out, k]^T (kenspec_gemv_amx's signature):
 * 0, or non-zero where it failed. */
typedef int (*kenspec_bf16_product)(const uint16_t *x, const uint16_t *w, uint16_t *y,
                                    long rows, long k, long out);

/* One decoder layer's weights: each product's weight [out, in] (bf16, int8 with bf16 scales
 * [out], or a GGUF file's own groups: q with float32 scales and offsets, gemv_grouped.c), its
 * bias [out] or NULL; the two norms' weights; the layer's cache. */
typedef struct {
  const void *qkv, *qkv_scales, *qkv_bias;
  const void *out, *out_scales, *out_bias;
  const void *gate_up, *gate_up_scales;
  const void *down, *down_scales;
  const uint16_t *input_norm, *post_norm;
  uint16_t *keys, *values; /* [slots, kv_heads, capacity, dim] */
  /* a file's own groups (kenspec_pass.quant 2): each product's offsets (or NULL), its group
   * and its bits (4 or 8); its scales and offsets float16 where half (AVX2's pass only) */
  const float *qkv_mins, *out_mins, *gate_up_mins, *down_mins;
  long qkv_group, out_group, gate_up_group, down_group;
  long qkv_bits, out_bits, gate_up_bits, down_bits;
  long qkv_half, out_half, gate_up_half, down_half;
  /* Gemma 3's (kenspec_pass.gemma; AVX2's pass only): the norms of the attention's and the
   * MLP's outputs and of the query and key heads; the layer's rotary table [tokens, dim] and
   * mask where they are not the pass's (a local layer's base, its sliding window), or NULL */
  const uint16_t *attention_out_norm, *mlp_out_norm, *q_norm, *k_norm;
  const uint16_t *cos, *sin;
  const void *mask;
} kenspec_layer;

/* One decoder pass (kenspec_decoder_pass): `tokens` packed tokens through `count` layers.
 * hidden [tokens, size]: the embeddings, updated in place; normed [tokens, size]: the final
 * norm's output. cos, sin [tokens, dim]; cache_rows, positions [tokens]: where each token's
 * keys go; mask rows [queries, kv_length] (bfloat16 when mask_bf16, else float32), token t's
 * being mask_rows[t]. */
typedef struct {
  const kenspec_layer *layers;
  long count;
  const uint16_t *final_norm;
  uint16_t *hidden, *normed;
  long tokens, size, heads, kv_heads, dim, intermediate;
  int quant; /* the layers' weights: 0 bf16, 1 int8 with scales, 2 a file's own groups */
  float eps;
  const uint16_t *cos, *sin;
  const int64_t *cache_rows, *positions;
  long capacity;
  const void *mask;
  int mask_bf16;
  const int64_t *mask_rows;
  long kv_length;
  float scale; /* attention's */
  /* bf16 layers' products (quant 0): kenspec_gemv_amx passed in by the caller where the plan
   * takes AMX (a library's sources of one instruction set call no other set's), or NULL:
   * gemv.c's kenspec_gemv_bf16 */
  kenspec_bf16_product bf16_product;
  /* Gemma 3's layers (AVX2's pass; step.c refuses them): every norm of (1 + weight) in
   * float32, the head norms and the norms of each half's output, GELU (tanh) for SiLU */
  int gemma;
} kenspec_pass;

/* gemv.c */
void kenspec_gemv_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long k,
                       long out);
int kenspec_gemv_int8_bf16(const uint16_t *x, const int8_t *q, const uint16_t *scales,
                           uint16_t *y, long rows, long k, long out);
long kenspec_exact_candidates(const uint16_t *x, const uint16_t *w, long k,
                              const int32_t *candidates, long count, float *approximate);
/* gemv_avx2.c: kenspec_gemv_bf16's product, summed in its own one order (see the file) */
void kenspec_gemv_bf16_avx2(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows,
                            long k, long out);
void kenspec_gemv_bf16_avx2_share(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows,
                                  long k, long out, long *first, long *last);
/* gemv_amx.c: kenspec_gemv_bf16's product through AMX tiles, in its own one order (see the
 * file); kenspec_amx_init asks Linux for the tile state once a process (0: granted) */
int kenspec_amx_init(void);
int kenspec_gemv_amx(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long k,
                     long out);
/* gemv_grouped.c */
int kenspec_gemv_grouped(const uint16_t *x, const void *q, int bits, const float *scales,
                         const float *mins, long group, uint16_t *y, long rows, long k,
                         long out);
/* gemv_grouped_avx2.c: kenspec_gemv_grouped's product, summed in its own one order; scales and
 * mins float16 where half (else float32) */
int kenspec_gemv_grouped_avx2(const uint16_t *x, const void *q, int bits, const void *scales,
                              const void *mins, long group, uint16_t *y, long rows, long k,
                              long out, int half);
/* ... and a thread's part of it inside a parallel region (a decoder pass's team): x as the
 * products read it, per row and group, into the thread's own `a` (kenspec_grouped_room says
 * how large), then its share of the outputs; no barrier (the caller's) */
typedef struct {
  void *p;          /* x per row and group as integers (int8, or int16 for 8-bit weights) */
  float *t, *xg;    /* each group's factor and the x its offsets read */
} kenspec_activations;
long kenspec_grouped_room(long rows, long k, long *factors);
int kenspec_gemv_grouped_avx2_share(const uint16_t *x, const void *q, int bits,
                                    const void *scales, const void *mins, long group,
                                    uint16_t *y, long rows, long k, long out, int half,
                                    kenspec_activations *a, long *first, long *last);
/* gemv_int8.c */
int kenspec_gemv_int8(const void *x, const int8_t *q, const void *scale, void *y, long rows,
                      long k, long out, int bf16);
/* gemv_u8s8.c */
void kenspec_u8s8_prepare(const int8_t *q, const uint16_t *scales_bf16, long k, long out,
                          float *scale, int32_t *offset);
int kenspec_gemv_u8s8(const uint16_t *x, const int8_t *q, const float *scale,
                      const int32_t *offset, float *y, double *residue, long rows, long k,
                      long out);
/* layer.c */
void kenspec_add_rmsnorm(uint16_t *hidden, const uint16_t *delta, const uint16_t *weight,
                         uint16_t *normed, long rows, long n, float eps);
void kenspec_rotary_cache(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, long tokens,
                          long heads, long kv_heads, long dim, uint16_t *keys, uint16_t *values,
                          const int64_t *cache_rows, const int64_t *positions, long capacity);
int kenspec_attention(const uint16_t *qkv, uint16_t *out, long tokens, long heads, long kv_heads,
                      long dim, const uint16_t *keys, const uint16_t *values,
                      const int64_t *cache_rows, long capacity, const void *mask, int mask_bf16,
                      const int64_t *mask_rows, long kv_length, float scale);
void kenspec_silu_mul(const uint16_t *gate_up, uint16_t *out, long rows, long n);
void kenspec_top_probs(const float *logits, long rows, long vocab, long width, int32_t *ids,
                       float *probs);
long kenspec_screen(const float *a, const float *error, float norm, const float *weight,
                    float residue, long vocab, int32_t *out, long room);
/* step.c */
int kenspec_decoder_pass(const kenspec_pass *pass);
/* layer_avx2.c: layer.c's kernels and step.c's pass (bf16 weights or a file's own groups:
 * quant 0 or 2) with AVX2 */
void kenspec_add_rmsnorm_avx2(uint16_t *hidden, const uint16_t *delta, const uint16_t *weight,
                              uint16_t *normed, long rows, long n, float eps);
void kenspec_rotary_cache_avx2(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin,
                               long tokens, long heads, long kv_heads, long dim, uint16_t *keys,
                               uint16_t *values, const int64_t *cache_rows,
                               const int64_t *positions, long capacity);
int kenspec_attention_avx2(const uint16_t *qkv, uint16_t *out, long tokens, long heads,
                           long kv_heads, long dim, const uint16_t *keys, const uint16_t *values,
                           const int64_t *cache_rows, long capacity, const void *mask,
                           int mask_bf16, const int64_t *mask_rows, long kv_length, float scale);
void kenspec_silu_mul_avx2(const uint16_t *gate_up, uint16_t *out, long rows, long n);
void kenspec_gelu_mul_avx2(const uint16_t *gate_up, uint16_t *out, long rows, long n);
void kenspec_gemma_head_norms_avx2(uint16_t *qkv, long tokens, long heads, long kv_heads,
                                   long dim, const uint16_t *q_weight, const uint16_t *k_weight,
                                   float eps);
void kenspec_gemma_add_norm_avx2(uint16_t *hidden, const uint16_t *delta,
                                 const uint16_t *delta_weight, const uint16_t *weight,
                                 uint16_t *normed, long rows, long n, float eps);
void kenspec_top_probs_avx2(const float *logits, long rows, long vocab, long width, int32_t *ids,
                            float *probs);
int kenspec_decoder_pass_avx2(const kenspec_pass *pass);
/* layout.c: which = 0 (kenspec_layer), 1 (kenspec_pass) or 2 (kenspec_head); writes each
 * member's offset, in declaration order, into offsets (at most room of them); returns the
 * struct's size. */
long kenspec_layout(int which, long *offsets, long room);

/* A bf16 product without a result (kenspec_gemv_bf16's and kenspec_gemv_bf16_avx2's
 * signature). */
typedef void (*kenspec_gemv)(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows,
                             long k, long out);

/* A learned draft head (head.c, engine.draft_head): its products' weights [out, in] in bf16,
 * its bias and norms' weights in float32, the reduced vocabulary's token ids, the target's
 * input embedding (bf16 or float32) and the bf16 GEMV its products run through. */
typedef struct {
  long hidden, inner, vocab;
  float eps;
  const uint16_t *fc;      /* [hidden, 2 hidden] */
  const float *fc_bias;    /* [hidden] */
  const float *norm;       /* [hidden] */
  const uint16_t *gate_up; /* [2 inner, hidden]: gate's rows, then up's */
  const uint16_t *down;    /* [hidden, inner] */
  const float *out_norm;   /* [hidden] */
  const uint16_t *rows;    /* [vocab, hidden]: the target's output rows of `keep` */
  const int64_t *keep;     /* [vocab] */
  const void *embed;       /* [embed_rows, hidden] */
  long embed_rows;
  int embed_bf16;
  kenspec_gemv product;
} kenspec_head;

/* head.c: up to `steps` tokens after `token` from the target's hidden state `feature`
 * [hidden] (float32), into tokens[] and probs[] (the head's probability of each), stopping at
 * the first under min_prob; with `alternatives`, the next best first tokens and their
 * probabilities (-1 and 0 where there are fewer) when the first token passed. Returns the
 * tokens made, or -1 where it had no memory (or more than 15 alternatives were asked). */
long kenspec_head_chain(const kenspec_head *head, const float *feature, long token, long steps,
                        float min_prob, long alternatives, int64_t *tokens, float *probs,
                        int64_t *alt_tokens, float *alt_probs);

/* norms.c: Gemma 3's norms for the lean forward (bfloat16 rows, float32 arithmetic). */
void kenspec_gemma_head_norms(uint16_t *qkv, long tokens, long heads, long kv_heads, long dim,
                              const uint16_t *q_weight, const uint16_t *k_weight, float eps);
void kenspec_gemma_add_norm(uint16_t *hidden, uint16_t *delta, const uint16_t *delta_weight,
                            const uint16_t *weight, uint16_t *normed, long rows, long n,
                            float eps);

#endif
