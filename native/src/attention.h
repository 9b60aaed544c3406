// Decode-step attention for the CPU backend as two ggml custom ops (scores and weighted values).
#pragma once

#include <cstdint>

#include "ggml.h"

namespace ggswarm {

// True when the custom decode ops can run here and reproduce ggml's own f16 mul_mat bit for bit:
// this CPU has AVX-512 and the loaded ggml CPU backend was built with AVX-512 (so its f16 dot
// product has the reduction order the kernels follow), and the head size is a multiple of 64.
bool decode_attention_supported(int64_t head_dim);

// Scores of one new position against the cache, unscaled: out[j, h] = K[j, group(h)] . q[h] for
// j <= pos, and -inf for later positions (so the softmax needs no mask). The same numbers as
// ggml_mul_mat(K view, q), without a dot product call per (position, head), and reading each K row
// once for all heads of its group.
// q: [head_dim, n_head] f32; k: the layer's K cache [head_dim * n_head_kv, cap] f16; pos: [1] i32.
// after: the op that writes this step's K row (so the graph orders the write first).
ggml_tensor * decode_scores(ggml_context * c, ggml_tensor * q, ggml_tensor * k, ggml_tensor * pos, int64_t n_kv,
                           ggml_tensor * after);

// Weighted values: out[d, h] = sum_j p[j, h] * V[j, group(h), d] over positions up to pos (later
// weights are exactly zero); what ggml_mul_mat(V^T view, p) gives, reading each V row once per group.
// p: softmax weights [n_kv, n_head] f32; vt: the layer's transposed V cache [cap, head_dim * n_head_kv].
ggml_tensor * decode_values(ggml_context * c, ggml_tensor * p, ggml_tensor * vt, ggml_tensor * pos, int64_t head_dim,
                           ggml_tensor * after);

}  // namespace ggswarm
