// Multi-head latent attention (MLA) as llama.cpp runs it in its absorbed form, shared by deepseek2 and
// glm-dsa: per position one cached latent row (the RMS-normed kv_lora compression, then the roped key
// part: StateKind 4, "latent", registered by mla.cpp); attn_k_b is absorbed into the query, which attends
// the latent rows as one shared head; V is a view of the rows' first kv_lora columns, and attn_v_b
// expands the weighted latents per head afterwards.
#pragma once

#include <cstdint>

#include "arch.h"

namespace ggswarm {

constexpr StateKind kLatent = static_cast<StateKind>(4);

// What an MLA handle knows beyond ggswarm_model's common fields (m->arch_data); the architectures
// derive their own from it. m->n_rot is the roped key part.
struct Mla : ArchData {
    int32_t q_lora = 0, kv_lora = 0, nope = 0, k_mla = 0, v_mla = 0;

    int64_t latent() const { return (int64_t)kv_lora + (k_mla - nope); }  // cached columns per position
    // The width of layer il's second cached row per position (glm-dsa's indexer keys), 0 for none.
    virtual int64_t second_row(int32_t il) const {
        (void)il;
        return 0;
    }
};

inline const Mla & mla(const ggswarm_model * m) { return *static_cast<const Mla *>(m->arch_data.get()); }

// attention.q_lora_rank (0 when absent: the query is one attn_q projection, DeepSeek-V2-Lite), kv_lora_rank,
// key_length_mla (> rope.dimension_count, read into m->n_rot), value_length_mla; sets m->n_head_kv = 1
// and m->head_dim to the latent row (what a snapshot header records), every layer's state to kLatent.
ggswarm_status read_mla_hparams(ggswarm_model * m, const Hp & hp, Mla * d);

// Layer il's attention tensors: attn_norm, the query path (q_a, its norm and q_b, or attn_q), attn_kv_a_mqa
// and its norm, attn_k_b, attn_v_b, attn_output.
void want_mla(const ggswarm_model * m, int32_t il, Layer & L, Wants & w);

// The absorbed query [kv_lora + rot, n_head, n] and the new latent rows [latent, 1, n] of layer il, from
// q [n_head * key_length_mla, n] (the query projection) and cur [d_model, n] (the normed input).
struct MlaQk {
    ggml_tensor * q, * k;
};
MlaQk mla_qk(Build & b, int32_t il, ggml_tensor * cur, ggml_tensor * q);

// The causal mask of the window's new positions over the attended span, [n_kv, n] f32: 0 where cache
// row j <= the position, -inf elsewhere; computed in the graph from the positions (log(1 - step(j - p))).
ggml_tensor * causal_mask(Build & b);

// Writes the new latent rows at their positions and attends them with `mask` [n_kv, n] f32 (0 / -inf):
// ggml_flash_attn_ext when `flash` (the mask in f16, exact; n_kv_max > 0 bounds the finite entries of a
// row), else ggml's ops; then attn_v_b. Returns [n_head * value_length_mla, n], before attn_output.
ggml_tensor * mla_attend(Build & b, int32_t il, const MlaQk & qk, ggml_tensor * mask, bool flash, int32_t n_kv_max,
                         float kq_scale);

// llama.cpp's check for a quantized cache on the value head too: whole blocks of kv_lora_rank (Arch's
// check_cache_type for MLA architectures).
ggswarm_status mla_check_cache_type(ggswarm_model * m, ggml_type t);

}  // namespace ggswarm
