// The Qwen3.5 hybrid family (`qwen35` dense, `qwen35moe`): gated delta-net (linear attention) layers
// that keep a conv state and an f32 recurrent state per session (StateKind::Recurrent, recurrent.cpp),
// a full-attention layer every `full_attention_interval`-th layer (q projection [q | gate] per head,
// sigmoid gate on the output, interleaved multi-section RoPE), and a dense or routed-expert FFN with a
// sigmoid-gated shared expert (docs/native.md, "Recurrent state, checkpoints and MoE").
#pragma once

#include <cstdint>

#include "model.h"

namespace ggswarm {

// What a handle of this family knows beyond ggswarm_model's common fields (m->arch_data).
struct Hybrid : ArchData {
    bool moe = false;
    int32_t d_conv = 0, d_state = 0, n_group = 0, dt_rank = 0;
    int32_t n_expert = 0, n_used = 0, n_ff_exp = 0, n_ff_shexp = 0;
    float w_scale = 1.0f;
    int sections[4] = {0, 0, 0, 0};

    int64_t key_dim() const { return (int64_t)d_state * n_group; }
    int64_t value_dim() const { return (int64_t)d_state * dt_rank; }
    int64_t conv_channels() const { return 2 * key_dim() + value_dim(); }
    int64_t conv_elems() const { return (int64_t)(d_conv - 1) * conv_channels(); }  // f32
    int64_t ssm_elems() const { return (int64_t)d_state * d_state * dt_rank; }       // f32
    uint64_t layer_state_bytes() const { return (uint64_t)(conv_elems() + ssm_elems()) * sizeof(float); }
};

// The handle's Hybrid, or nullptr for other architectures.
inline const Hybrid * hybrid_of(const ggswarm_model * m) { return dynamic_cast<const Hybrid *>(m->arch_data.get()); }
inline Hybrid * hybrid_of(ggswarm_model * m) { return dynamic_cast<Hybrid *>(m->arch_data.get()); }

}  // namespace ggswarm
