// gemma3: embeddings times sqrt(d_model); per-head RMS norms on q and k; q scaled by
// 1/sqrt(head_dim) before attention (n_embd / n_head for the 27B, as llama.cpp does) with a softmax
// scale of 1; RMS norms on the attention and FFN outputs before their residual adds; GeGLU FFN; five
// sliding-window layers (rope.freq_base_swa) then one global layer (rope.freq_base, linear scaling)
// unless attention.sliding_window_pattern says otherwise; output tied to the embedding. NEOX RoPE.
//
// Sliding-window layers keep every position's K/V like the global ones (the mask limits what they
// attend); only the window's positions are ever read.

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "arch.h"

namespace ggswarm {
namespace {

ggswarm_status read(ggswarm_model * m, const Hp & hp) {
    if (ggswarm_status st = read_attention_hparams(m, hp)) return st;
    m->rope_mode = GGML_ROPE_TYPE_NEOX;
    m->embd_scale = sqrtf((float)m->d_model);
    double f = 0;
    if (hp.opt_float("final_logit_softcapping", &f)) m->logit_softcap = (float)f;
    int64_t v = 0;
    if (hp.opt_int("attention.sliding_window", &v) && v > 0) {
        m->n_swa = (int32_t)std::min<int64_t>(v, INT32_MAX);
        const float base_swa = hp.opt_float("rope.freq_base_swa", &f) ? (float)f : 10000.0f;
        std::vector<int64_t> pat;
        const int32_t nl = m->n_layers_total;
        if (hp.is_array("attention.sliding_window_pattern")) {
            if (!hp.per_layer("attention.sliding_window_pattern", nl, &pat)) {
                return fail(m, GGSWARM_E_FORMAT, "%sattention.sliding_window_pattern: expected %d per-layer flags",
                            hp.prefix.c_str(), nl);
            }
        } else {
            int64_t every = 6;
            hp.opt_int("attention.sliding_window_pattern", &every);
            pat.assign(nl, 0);
            for (int32_t il = 0; il < nl; ++il) pat[il] = every == 0 || (il % every < every - 1);
        }
        for (int32_t il = 0; il < nl; ++il) {
            LayerHp & l = m->lhp[il];
            l.swa = pat[il] != 0;
            if (l.swa) {
                l.rope_base = base_swa;
                l.rope_scale = 1.0f;
            }
        }
    }
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    want_attention(m, il, L, w);
    w.need(blk(il, "attn_q_norm.weight"), {m->head_dim}, &L.q_norm);
    w.need(blk(il, "attn_k_norm.weight"), {m->head_dim}, &L.k_norm);
    w.need(blk(il, "post_attention_norm.weight"), {m->d_model}, &L.attn_post_norm);
    want_ffn(m, il, L, w);
    w.need(blk(il, "post_ffw_norm.weight"), {m->d_model}, &L.ffn_post_norm);
}

ggml_tensor * build(Build & b, ggml_tensor * x) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const float q_scale = m->n_layers_total == 62 ? 1.0f / sqrtf((float)(m->d_model / m->n_head))
                                                  : 1.0f / sqrtf((float)m->head_dim);
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const Layer & L = b.layer(il);
        ggml_tensor * cur = rms(c, x, L.attn_norm, m->eps);
        Qkv a = qkv(b, il, cur);
        ggml_tensor * q = rope(b, il, rms(c, a.q, L.q_norm, m->eps));
        ggml_tensor * k = rope(b, il, rms(c, a.k, L.k_norm, m->eps));
        q = ggml_scale(c, q, q_scale);
        cur = attention(b, il, q, k, a.v, 1.0f);
        cur = linear(c, L.wo, L.bo, cur);
        keep_last(b, il, &cur, &x);
        cur = rms(c, cur, L.attn_post_norm, m->eps);
        ggml_tensor * h = ggml_add(c, cur, x);
        cur = glu_ffn(c, rms(c, h, L.ffn_norm, m->eps), L.w_gate, L.w_up, L.w_down, Act::Gelu);
        cur = rms(c, cur, L.ffn_post_norm, m->eps);
        x = ggml_add(c, cur, h);
    }
    return x;
}

const Arch kGemma3 = {"gemma3", read, want, build, nullptr, true, kKvCacheTypes};
ArchRegistration reg(&kGemma3);

}  // namespace
}  // namespace ggswarm
