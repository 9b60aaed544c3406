// minimax-m2 (MiniMax-M2, M2.1): pre-norm attention without biases whose q and k RMS norms span the
// whole projection (all heads together: [n_head * head] and [n_head_kv * head] weights, not per head),
// NEOX RoPE on the first rope.dimension_count channels of each head (64 of 128 in the real files); then
// ffn_norm and a sigmoid-routed mixture of experts (the file's expert_gating_func, which llama.cpp
// requires), chosen by the probabilities plus the exp_probs_b selection bias, weighted by the unbiased
// ones renormalised to sum 1 (llama.cpp passes norm_w = true and reads no expert_weights_scale). No
// shared expert, no dense layer; the published files carry no multi-token-prediction blocks.

#include <cmath>
#include <memory>

#include "arch.h"

namespace ggswarm {
namespace {

ggswarm_status read(ggswarm_model * m, const Hp & hp) {
    if (ggswarm_status st = read_attention_hparams(m, hp, {true, true})) return st;
    auto d = std::make_shared<MoeData>();
    if (ggswarm_status st = read_moe_hparams(m, hp, &d->e)) return st;
    int64_t gating = 0;
    if (!hp.opt_int("expert_gating_func", &gating) || gating == 0) {
        return fail(m, GGSWARM_E_FORMAT, "%sexpert_gating_func is missing (llama.cpp requires it for %s)",
                    hp.prefix.c_str(), m->arch.c_str());
    }
    d->e.norm_w = true;  // as llama.cpp's graph hard-codes them, whatever the keys say
    d->e.w_scale = 0.0f;
    d->e.n_shexp = 0;
    d->e.dense_lead = 0;
    m->rope_mode = GGML_ROPE_TYPE_NEOX;
    m->arch_data = d;
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    want_attention(m, il, L, w);
    w.need(blk(il, "attn_q_norm.weight"), {(int64_t)m->head_dim * m->n_head}, &L.q_norm);
    w.need(blk(il, "attn_k_norm.weight"), {(int64_t)m->head_dim * m->n_head_kv}, &L.k_norm);
    w.need(blk(il, "ffn_norm.weight"), {m->d_model}, &L.ffn_norm);
    want_experts(m, moe_hp(m), il, L, w, true, true);
}

// the RMS norm of x [hd, heads, n] over each position's heads together
ggml_tensor * norm_all_heads(Build & b, ggml_tensor * x, ggml_tensor * w) {
    ggml_tensor * flat = ggml_reshape_2d(b.c, x, x->ne[0] * x->ne[1], x->ne[2]);
    return ggml_reshape_3d(b.c, rms(b.c, flat, w, b.m->eps), x->ne[0], x->ne[1], x->ne[2]);
}

ggml_tensor * build(Build & b, ggml_tensor * x) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const float kq_scale = 1.0f / sqrtf((float)m->head_dim);
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const Layer & L = b.layer(il);
        ggml_tensor * cur = rms(c, x, L.attn_norm, m->eps);
        Qkv a = qkv(b, il, cur);
        ggml_tensor * q = rope(b, il, norm_all_heads(b, a.q, L.q_norm));
        ggml_tensor * k = rope(b, il, norm_all_heads(b, a.k, L.k_norm));
        cur = ggml_mul_mat(c, L.wo, attention(b, il, q, k, a.v, kq_scale));
        keep_last(b, il, &cur, &x);
        ggml_tensor * h = ggml_add(c, cur, x);
        cur = moe_ffn(c, rms(c, h, L.ffn_norm, m->eps), routed_experts(moe_hp(m), L));
        x = ggml_add(c, cur, h);
    }
    return x;
}

const Arch kMinimaxM2 = {"minimax-m2", read, want, build, nullptr, true, kKvCacheTypes};
ArchRegistration reg(&kMinimaxM2);

}  // namespace
}  // namespace ggswarm
