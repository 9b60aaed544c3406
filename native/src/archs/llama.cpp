// llama family (llama, mistral, qwen2): pre-norm attention with optional q/k/v/o biases (qwen2), RoPE
// (NEOX for qwen2), SwiGLU FFN; every layer keeps K/V.

#include <cmath>

#include "arch.h"

namespace ggswarm {
namespace {

ggswarm_status read(ggswarm_model * m, const Hp & hp) {
    if (ggswarm_status st = read_attention_hparams(m, hp)) return st;
    m->rope_mode = m->arch == "qwen2" ? GGML_ROPE_TYPE_NEOX : GGML_ROPE_TYPE_NORMAL;
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    want_attention(m, il, L, w);
    want_ffn(m, il, L, w);
}

ggml_tensor * build(Build & b, ggml_tensor * x) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const float kq_scale = 1.0f / sqrtf((float)m->head_dim);
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const Layer & L = b.layer(il);
        ggml_tensor * cur = rms(c, x, L.attn_norm, m->eps);
        Qkv a = qkv(b, il, cur);
        ggml_tensor * q = rope(b, il, a.q);
        ggml_tensor * k = rope(b, il, a.k);
        cur = attention(b, il, q, k, a.v, kq_scale);
        cur = linear(c, L.wo, L.bo, cur);
        keep_last(b, il, &cur, &x);
        ggml_tensor * h = ggml_add(c, cur, x);
        cur = glu_ffn(c, rms(c, h, L.ffn_norm, m->eps), L.w_gate, L.w_up, L.w_down, Act::Silu);
        x = ggml_add(c, cur, h);
    }
    return x;
}

const Arch kLlama = {"llama", read, want, build, nullptr, true, kKvCacheTypes};
const Arch kMistral = {"mistral", read, want, build, nullptr, true, kKvCacheTypes};
const Arch kQwen2 = {"qwen2", read, want, build, nullptr, true, kKvCacheTypes};
ArchRegistration reg_llama(&kLlama);
ArchRegistration reg_mistral(&kMistral);
ArchRegistration reg_qwen2(&kQwen2);

}  // namespace
}  // namespace ggswarm
