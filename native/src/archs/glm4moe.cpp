// glm4moe (GLM-4.5, 4.6, 4.7): pre-norm attention with q/k/v biases, optional per-head RMS norms of q and
// k (the 355B files have them, Air's not), NEOX RoPE on the first rope.dimension_count channels of each
// head (half of it); post_attention_norm before the FFN; the first leading_dense_block_count layers a
// SwiGLU FFN, the rest a sigmoid-routed mixture of experts (selection biased by exp_probs_b, weights
// normalised and times expert_weights_scale) plus the shared expert. llama.cpp accumulates the attention
// output and the FFNs' down projections in f32 for this family (a GPU's matter: the CPU always does).
// The file's last block is the multi-token-prediction layer (nextn_predict_layers), which the trunk
// never runs and no window loads.

#include <cmath>
#include <memory>
#include <vector>

#include "arch.h"

namespace ggswarm {
namespace {

ggswarm_status read(ggswarm_model * m, const Hp & hp) {
    if (ggswarm_status st = drop_mtp_layers(m, hp)) return st;
    if (ggswarm_status st = read_attention_hparams(m, hp, {true, true})) return st;
    std::vector<int64_t> sec;
    if (hp.int_array("rope.dimension_sections", &sec) && sec.size() >= 2 && sec[0] > 0 && sec[1] > 0) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "%s with multi-section RoPE (the vision files) is not supported",
                    m->arch.c_str());
    }
    auto d = std::make_shared<MoeData>();
    d->e.gating = Gating::Sigmoid;  // llama.cpp's default for this family when the file names none
    if (ggswarm_status st = read_moe_hparams(m, hp, &d->e)) return st;
    m->rope_mode = GGML_ROPE_TYPE_NEOX;
    m->arch_data = d;
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    const MoeHp & e = moe_hp(m);
    const int64_t d = m->d_model;
    want_attention(m, il, L, w);
    w.opt(blk(il, "attn_q_norm.weight"), {m->head_dim}, &L.q_norm);
    w.opt(blk(il, "attn_k_norm.weight"), {m->head_dim}, &L.k_norm);
    w.need(blk(il, "post_attention_norm.weight"), {d}, &L.attn_post_norm);
    if (e.dense(il)) {
        w.need(blk(il, "ffn_gate.weight"), {d, m->n_ff}, &L.w_gate);
        w.need(blk(il, "ffn_up.weight"), {d, m->n_ff}, &L.w_up);
        w.need(blk(il, "ffn_down.weight"), {m->n_ff, d}, &L.w_down);
    } else {
        want_experts(m, e, il, L, w, true, true);
    }
}

// down(silu(gate.x) * up.x), the down projection accumulated in f32
ggml_tensor * ffn(ggml_context * c, ggml_tensor * x, ggml_tensor * gate, ggml_tensor * up, ggml_tensor * down) {
    ggml_tensor * y = glu_ffn(c, x, gate, up, down, Act::Silu);
    ggml_prec_set_acc(y, GGML_PREC_F32);
    return y;
}

ggml_tensor * build(Build & b, ggml_tensor * x) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const MoeHp & e = moe_hp(m);
    const float kq_scale = 1.0f / sqrtf((float)m->head_dim);
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const Layer & L = b.layer(il);
        ggml_tensor * cur = rms(c, x, L.attn_norm, m->eps);
        Qkv a = qkv(b, il, cur);
        ggml_tensor * q = L.q_norm ? rms(c, a.q, L.q_norm, m->eps) : a.q;
        ggml_tensor * k = L.k_norm ? rms(c, a.k, L.k_norm, m->eps) : a.k;
        cur = attention(b, il, rope(b, il, q), rope(b, il, k), a.v, kq_scale);
        cur = ggml_mul_mat(c, L.wo, cur);
        ggml_prec_set_acc(cur, GGML_PREC_F32);
        keep_last(b, il, &cur, &x);
        ggml_tensor * h = ggml_add(c, cur, x);
        cur = rms(c, h, L.attn_post_norm, m->eps);
        if (e.dense(il)) {
            cur = ffn(c, cur, L.w_gate, L.w_up, L.w_down);
        } else {
            ggml_tensor * routed = moe_ffn(c, cur, routed_experts(e, L));
            cur = L.ffn_up_shexp ? ggml_add(c, routed, ffn(c, cur, L.ffn_gate_shexp, L.ffn_up_shexp, L.ffn_down_shexp))
                                 : routed;
        }
        x = ggml_add(c, cur, h);
    }
    return x;
}

const Arch kGlm4Moe = {"glm4moe", read, want, build, nullptr, true, kKvCacheTypes};
ArchRegistration reg(&kGlm4Moe);

}  // namespace
}  // namespace ggswarm
