// Attention of new positions over a session's KV cache: with ggml's own ops, with ggml's flash
// attention, and on CPU decode steps with two ggml custom ops of our own (scores and weighted values),
// checked against ggml's ops at open.
#pragma once

#include <cstdint>
#include <string>

#include "ggml-backend.h"
#include "ggml.h"

namespace ggswarm {

// ggml's CPU softmax splits the rows of one head across threads, never the heads: on a decode step
// (one row per head) a single thread would exponentiate every head's n_kv scores. Viewing the scores
// as one row per head spreads them over the threads; each row is computed exactly as before, so the
// numerics do not change. The mask then needs one (identical) row per head.
inline bool decode_rows(int32_t n) { return n == 1; }

// Attention of n new positions (already in the cache) over the first n_kv cached ones with ggml's ops:
// mul_mat(K, q) -> soft_max_ext(mask, kq_scale) -> mul_mat(V^T, p); returns [hd * nh, n].
// q: [hd, nh, n] f32; kc: K cache [hd * nkv, cap] f16; vc: transposed V cache [cap, hd * nkv] f16;
// mask: [n_kv, n], or [n_kv, nh] when decode_rows(n). scores (optional) gets the unscaled K.q
// product [n_kv, n, nh] that feeds the softmax. sinks (optional, f32 [nh]): one more logit per head in
// each softmax's denominator (ggml_soft_max_add_sinks, as llama.cpp for gpt-oss); the decode rows' view
// is then not taken (ggml indexes the sinks by the softmax's third dimension, the head).
ggml_tensor * ops_attention(ggml_context * c, ggml_tensor * q, ggml_tensor * kc, ggml_tensor * vc, ggml_tensor * mask,
                            int32_t n, int32_t n_kv, float kq_scale, ggml_tensor ** scores = nullptr,
                            ggml_tensor * sinks = nullptr);

// True when this CPU has AVX-512 and the loaded ggml CPU backend was built with AVX-512 (so its f16
// dot product has the reduction order the kernels follow).
bool decode_attention_cpu();

// True when the custom decode ops can run here and reproduce ggml's own f16 mul_mat bit for bit:
// decode_attention_cpu(), and the head size is a multiple of 64.
bool decode_attention_supported(int64_t head_dim);

// ggml-cpu's GGML_FA_TILE_Q: from this many queries its flash kernel takes the tiled path with f16/f32 K/V
constexpr int32_t kFlashTileQ = 64;

// Attention of n new positions over the first n_kv cached ones with ggml_flash_attn_ext, as llama.cpp
// builds it with flash attention on: [hd * nh, n]. vc: the V cache NOT transposed, [hd * nkv, cap]
// f16 like kc; mask: f16 [n_kv, n]; sinks (optional): as ops_attention's (ggml_flash_attn_ext_add_sinks).
// tile_queries (GraphKey::tile_queries): n < kFlashTileQ positions cut from a longer call get zero query
// and mask rows up to the tile, so ggml's CPU kernel runs them tiled, as llama.cpp ran the whole call.
ggml_tensor * flash_attention(ggml_context * c, ggml_tensor * q, ggml_tensor * kc, ggml_tensor * vc, ggml_tensor * mask,
                              int32_t n, int32_t n_kv, float kq_scale, ggml_tensor * sinks = nullptr,
                              bool tile_queries = false);

// ggml_flash_attn_ext of qp [hd, n, nh] over k and v, with sinks (optional) and f32 accumulation, as
// llama.cpp runs it: [hd, nh, n]. With tile_queries (GraphKey::tile_queries: a micro-batch cut from a
// llama.cpp ubatch of kFlashTileQ+ positions) and f16/f32 K, q and mask (f16 or f32) get zero rows up to
// the tile so that ggml's CPU kernel runs its tiled path, and the output is cut back to n positions.
ggml_tensor * flash_attn_ext_tiled_as_llama(ggml_context * c, ggml_tensor * qp, ggml_tensor * k, ggml_tensor * v,
                                            ggml_tensor * mask, float kq_scale, ggml_tensor * sinks,
                                            bool tile_queries);


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

// A whole decode step with the custom ops: decode_scores -> soft_max_ext(no mask, kq_scale) -> decode_values,
// [hd * nh, 1], the same bits as ops_attention(n = 1) over any span that covers pos. k_put / v_put:
// the ops writing this step's K and V (ordered before the reads). scores (optional) gets
// decode_scores' output.
ggml_tensor * kernel_attention(ggml_context * c, ggml_tensor * q, ggml_tensor * kc, ggml_tensor * vc,
                               ggml_tensor * pos, int32_t n_kv, ggml_tensor * k_put, ggml_tensor * v_put,
                               float kq_scale, ggml_tensor ** scores = nullptr);

// Runs kernel_attention and ops_attention once on random data of this head shape (a span crossing a
// 64-position step, stale rows past it) on the given CPU backend and compares every bit of their
// scores and outputs, so a compiler or ggml build whose dot products reduce in another order can never
// silently change logits. (The outputs alone would miss most score differences: the softmax weights
// are rounded to f16 before the values' dot products, which hides a last-bit change in a score.) Returns true when all bits agree; otherwise false with *why saying where they differ.
// corrupt (a test hook, GGSWARM_KERNEL_SELFCHECK=corrupt): flip one bit of the kernels' result
// before comparing, to exercise the fallback.
bool decode_attention_self_check(ggml_backend_t cpu, int64_t head_dim, int64_t n_head, int64_t n_head_kv,
                                 bool corrupt, std::string * why);

}  // namespace ggswarm
