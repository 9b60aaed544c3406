// qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-480B-A35B): the qwen3 layer (per-head RMS norms of
// q and k before NEOX RoPE) with a softmax-routed mixture of experts in place of the FFN: the top
// expert_used_count experts, their weights renormalised to sum 1 (llama.cpp passes norm_w = true and
// reads no expert_weights_scale for it), no shared expert. The long-context files declare YaRN, which
// the loader's RoPE scaling covers.

#include <memory>

#include "arch.h"

namespace ggswarm {
namespace {

ggswarm_status read(ggswarm_model * m, const Hp & hp) {
    if (ggswarm_status st = read_attention_hparams(m, hp, {true, false})) return st;
    auto d = std::make_shared<MoeData>();
    if (ggswarm_status st = read_moe_hparams(m, hp, &d->e)) return st;
    fixed_routing(&d->e, Gating::Softmax, true);
    m->rope_mode = GGML_ROPE_TYPE_NEOX;
    m->arch_data = d;
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    want_qk_norm_attention(m, il, L, w);
    w.need(blk(il, "ffn_norm.weight"), {m->d_model}, &L.ffn_norm);
    want_experts(m, moe_hp(m), il, L, w, false);
}

ggml_tensor * build(Build & b, ggml_tensor * x) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const Layer & L = b.layer(il);
        ggml_tensor * cur = rms(c, x, L.attn_norm, m->eps);
        cur = qk_norm_attention(b, il, cur);
        keep_last(b, il, &cur, &x);
        ggml_tensor * h = ggml_add(c, cur, x);
        cur = moe_ffn(c, rms(c, h, L.ffn_norm, m->eps), routed_experts(moe_hp(m), L));
        x = ggml_add(c, cur, h);
    }
    return x;
}

const Arch kQwen3Moe = {"qwen3moe", read, want, build, nullptr, true, kKvCacheTypes};
ArchRegistration reg(&kQwen3Moe);

}  // namespace
}  // namespace ggswarm
