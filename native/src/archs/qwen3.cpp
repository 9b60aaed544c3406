// qwen3: the llama layer with per-head RMS norms on q and k before RoPE (NEOX), no biases.

#include "arch.h"

namespace ggswarm {
namespace {

ggswarm_status read(ggswarm_model * m, const Hp & hp) {
    if (ggswarm_status st = read_attention_hparams(m, hp)) return st;
    m->rope_mode = GGML_ROPE_TYPE_NEOX;
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    want_qk_norm_attention(m, il, L, w);
    want_ffn(m, il, L, w);
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
        cur = glu_ffn(c, rms(c, h, L.ffn_norm, m->eps), L.w_gate, L.w_up, L.w_down, Act::Silu);
        x = ggml_add(c, cur, h);
    }
    return x;
}

const Arch kQwen3 = {"qwen3", read, want, build, nullptr, true, kKvCacheTypes};
ArchRegistration reg(&kQwen3);

}  // namespace
}  // namespace ggswarm
