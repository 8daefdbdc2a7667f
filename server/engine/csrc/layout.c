/* The sizes and member offsets of the structs in kenspec.h, for engine.forward.cpu_kernels to
 * check its ctypes mirrors against at load: a member added on one side only fails there,
 * loudly, instead of shifting every pointer after it. Compiled for any x86-64. */
#include <stddef.h>

#include "kenspec.h"

#define AT(type, member) offsetof(type, member)

static const long layer_offsets[] = {
    AT(kenspec_layer, qkv),         AT(kenspec_layer, qkv_scales), AT(kenspec_layer, qkv_bias),
    AT(kenspec_layer, out),         AT(kenspec_layer, out_scales), AT(kenspec_layer, out_bias),
    AT(kenspec_layer, gate_up),     AT(kenspec_layer, gate_up_scales),
    AT(kenspec_layer, down),        AT(kenspec_layer, down_scales),
    AT(kenspec_layer, input_norm),  AT(kenspec_layer, post_norm),
    AT(kenspec_layer, keys),        AT(kenspec_layer, values),
    AT(kenspec_layer, qkv_mins),    AT(kenspec_layer, out_mins),
    AT(kenspec_layer, gate_up_mins), AT(kenspec_layer, down_mins),
    AT(kenspec_layer, qkv_group),   AT(kenspec_layer, out_group),
    AT(kenspec_layer, gate_up_group), AT(kenspec_layer, down_group),
    AT(kenspec_layer, qkv_bits),    AT(kenspec_layer, out_bits),
    AT(kenspec_layer, gate_up_bits), AT(kenspec_layer, down_bits),
    AT(kenspec_layer, qkv_half),    AT(kenspec_layer, out_half),
    AT(kenspec_layer, gate_up_half), AT(kenspec_layer, down_half),
    AT(kenspec_layer, attention_out_norm), AT(kenspec_layer, mlp_out_norm),
    AT(kenspec_layer, q_norm),      AT(kenspec_layer, k_norm),
    AT(kenspec_layer, cos),         AT(kenspec_layer, sin),       AT(kenspec_layer, mask),
};

static const long pass_offsets[] = {
    AT(kenspec_pass, layers),     AT(kenspec_pass, count),      AT(kenspec_pass, final_norm),
    AT(kenspec_pass, hidden),     AT(kenspec_pass, normed),     AT(kenspec_pass, tokens),
    AT(kenspec_pass, size),       AT(kenspec_pass, heads),      AT(kenspec_pass, kv_heads),
    AT(kenspec_pass, dim),        AT(kenspec_pass, intermediate), AT(kenspec_pass, quant),
    AT(kenspec_pass, eps),        AT(kenspec_pass, cos),        AT(kenspec_pass, sin),
    AT(kenspec_pass, cache_rows), AT(kenspec_pass, positions),  AT(kenspec_pass, capacity),
    AT(kenspec_pass, mask),       AT(kenspec_pass, mask_bf16),  AT(kenspec_pass, mask_rows),
    AT(kenspec_pass, kv_length),  AT(kenspec_pass, scale),      AT(kenspec_pass, bf16_product),
    AT(kenspec_pass, gemma),
};

static const long head_offsets[] = {
    AT(kenspec_head, hidden),  AT(kenspec_head, inner),      AT(kenspec_head, vocab),
    AT(kenspec_head, eps),     AT(kenspec_head, fc),         AT(kenspec_head, fc_bias),
    AT(kenspec_head, norm),    AT(kenspec_head, gate_up),    AT(kenspec_head, down),
    AT(kenspec_head, out_norm), AT(kenspec_head, rows),      AT(kenspec_head, keep),
    AT(kenspec_head, embed),   AT(kenspec_head, embed_rows), AT(kenspec_head, embed_bf16),
    AT(kenspec_head, product),
};

#define COUNT(table) (long)(sizeof table / sizeof *table)

long kenspec_layout(int which, long *offsets, long room) {
  const long *table = which == 0 ? layer_offsets : which == 1 ? pass_offsets : head_offsets;
  const long count = which == 0   ? COUNT(layer_offsets)
                     : which == 1 ? COUNT(pass_offsets)
                                  : COUNT(head_offsets);
  for (long i = 0; i < count && i < room; i++) offsets[i] = table[i];
  if (room > count) offsets[count] = -1; /* where the members end */
  return which == 0   ? (long)sizeof(kenspec_layer)
         : which == 1 ? (long)sizeof(kenspec_pass)
                      : (long)sizeof(kenspec_head);
}
