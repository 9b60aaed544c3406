// gpt-oss (gpt-oss-20b, gpt-oss-120b): pre-norm attention with q/k/v/o biases, NEOX RoPE (YaRN factor 32
// over 4,096 positions in the real files: the loader's RoPE scaling), per-head attention sinks (one
// more logit in each softmax's denominator: attention() applies Layer::attn_sinks), sliding-window and
// full layers in turn (attention.sliding_window_pattern, else every second layer full: 0, 2, 4, ...
// slide); post_attention_norm before the FFN, a mixture of experts with a biased router whose top
// expert_used_count logits choose the experts and a softmax over those logits weights them, biased
// experts (gate, up, down) and the clamped SwiGLU (ggml_swiglu_oai). No shared expert, no dense layer.

#include <climits>
#include <cmath>
#include <memory>
#include <vector>

#include "arch.h"

namespace ggswarm {
namespace {

ggswarm_status read(ggswarm_model * m, const Hp & hp) {
    if (ggswarm_status st = read_attention_hparams(m, hp, {true, false})) return st;
    auto d = std::make_shared<MoeData>();
    if (ggswarm_status st = read_moe_hparams(m, hp, &d->e)) return st;
    fixed_routing(&d->e, Gating::SoftmaxWeight, false);
    const char * a = hp.prefix.c_str();
    const int32_t nl = m->n_layers_total;
    if (ggswarm_status st = hp.need_int("attention.sliding_window", 1, INT32_MAX, &m->n_swa)) return st;
    std::vector<int64_t> pat;
    if (hp.is_array("attention.sliding_window_pattern")) {
        if (!hp.per_layer("attention.sliding_window_pattern", nl, &pat)) {
            return fail(m, GGSWARM_E_FORMAT, "%sattention.sliding_window_pattern: expected %d per-layer flags", a, nl);
        }
    } else {
        int64_t every = 2;
        hp.opt_int("attention.sliding_window_pattern", &every);
        pat.assign(nl, 0);
        for (int32_t il = 0; il < nl; ++il) pat[il] = every == 0 || (il % every < every - 1);
    }
    double base_swa = 0;
    const bool own_base = hp.opt_float("rope.freq_base_swa", &base_swa);
    for (int32_t il = 0; il < nl; ++il) {
        m->lhp[il].swa = pat[il] != 0;
        if (m->lhp[il].swa && own_base) m->lhp[il].rope_base = (float)base_swa;  // same scaling (llama.cpp)
    }
    m->rope_mode = GGML_ROPE_TYPE_NEOX;
    m->arch_data = d;
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    const MoeHp & e = moe_hp(m);
    const int64_t d = m->d_model, ne = e.n_expert, ff = e.n_ff_exp;
    want_attention(m, il, L, w);
    w.need(blk(il, "attn_sinks.weight"), {m->n_head}, &L.attn_sinks);
    w.need(blk(il, "post_attention_norm.weight"), {d}, &L.attn_post_norm);
    want_experts(m, e, il, L, w, false);
    w.need(blk(il, "ffn_gate_inp.bias"), {ne}, &L.extra["ffn_gate_inp.bias"]);
    w.need(blk(il, "ffn_gate_exps.bias"), {ff, ne}, &L.extra["ffn_gate_exps.bias"]);
    w.need(blk(il, "ffn_up_exps.bias"), {ff, ne}, &L.extra["ffn_up_exps.bias"]);
    w.need(blk(il, "ffn_down_exps.bias"), {d, ne}, &L.extra["ffn_down_exps.bias"]);
}

ggml_tensor * build(Build & b, ggml_tensor * x) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const float kq_scale = 1.0f / sqrtf((float)m->head_dim);
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const Layer & L = b.layer(il);
        ggml_tensor * cur = rms(c, x, L.attn_norm, m->eps);
        Qkv a = qkv(b, il, cur);
        cur = attention(b, il, rope(b, il, a.q), rope(b, il, a.k), a.v, kq_scale);
        cur = linear(c, L.wo, L.bo, cur);
        keep_last(b, il, &cur, &x);
        ggml_tensor * h = ggml_add(c, cur, x);
        Moe p = routed_experts(moe_hp(m), L);
        p.gate_inp_b = L.extra.at("ffn_gate_inp.bias");
        p.gate_b = L.extra.at("ffn_gate_exps.bias");
        p.up_b = L.extra.at("ffn_up_exps.bias");
        p.down_b = L.extra.at("ffn_down_exps.bias");
        p.act = Act::SwigluOai;
        cur = moe_ffn(c, rms(c, h, L.attn_post_norm, m->eps), p);
        x = ggml_add(c, cur, h);
    }
    return x;
}

const Arch kGptOss = {"gpt-oss", read, want, build, nullptr, true, kKvCacheTypes};
ArchRegistration reg(&kGptOss);

}  // namespace
}  // namespace ggswarm
