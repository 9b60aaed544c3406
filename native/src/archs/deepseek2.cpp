// deepseek2 (DeepSeek-V2/V2.5/V3/R1, Kimi-K2, GLM-4.7-Flash): multi-head latent attention (mla.h) over the
// whole history (a causal mask; no indexer), the query through a low-rank q_a/q_b (or one attn_q, the
// Lite files); the first leading_dense_block_count layers a SwiGLU FFN, the rest a mixture of experts
// (expert_gating_func: sigmoid for V3 and later, softmax for V2's files that name none; selection biased
// by exp_probs_b, limited to expert_group_used_count groups when expert_group_count > 1; weights
// normalised and times expert_weights_scale) plus the shared experts. The MTP block (nextn_predict_layers)
// is not part of the trunk and not loaded.
//
// RoPE is the normal (not NEOX) kind over the key's last rope.dimension_count channels, with the file's
// scaling. Under YaRN the real files (DeepSeek-V3: factor 40 over 4K positions) carry
// rope.scaling.yarn_log_multiplier = 0.1 x mscale_all_dim; llama.cpp then ropes at unit magnitude and
// pre-scales the attention by mscale^2 = (1 + 0.1 ln(factor) x mscale_all_dim)^2 instead
// (llama_context's yarn_attn_factor for this architecture, and its graph's kq_scale).

#include <cmath>
#include <memory>

#include "arch.h"
#include "archs/mla.h"

namespace ggswarm {
namespace {

// What a deepseek2 handle knows beyond MLA's (m->arch_data).
struct Ds2 : Mla {
    MoeHp e;
    float kq_scale = 1.0f;
};

const Ds2 & ds2(const ggswarm_model * m) { return *static_cast<const Ds2 *>(m->arch_data.get()); }

// llama.cpp's get_mscale(factor, 1): YaRN's magnitude
float yarn_mscale(float factor) { return factor <= 1.0f ? 1.0f : 1.0f + 0.1f * logf(factor); }

ggswarm_status read(ggswarm_model * m, const Hp & hp) {
    const char * a = hp.prefix.c_str();
    auto d = std::make_shared<Ds2>();
    ggswarm_status st;
    if ((st = drop_mtp_layers(m, hp))) return st;
    if (hp.has("feed_forward_length") && (st = hp.need_int("feed_forward_length", 1, 1 << 22, &m->n_ff))) return st;
    if ((st = read_mla_hparams(m, hp, d.get()))) return st;
    if ((st = hp.need_int("expert_feed_forward_length", 1, 1 << 22, &d->e.n_ff_exp))) return st;
    if ((st = hp.need_int("expert_shared_count", 0, 64, &d->e.n_shexp))) return st;
    // the gating when the file names none: softmax (DeepSeek-V2's files), sigmoid for GLM-4.7-Flash's
    int64_t vocab = 0;
    const int64_t tok = gguf_find_key(hp.g, "tokenizer.ggml.tokens");
    if (!hp.opt_int("vocab_size", &vocab) && tok >= 0) vocab = (int64_t)gguf_get_arr_n(hp.g, tok);
    const bool glm_lite = (m->n_layers_total == 47 || m->n_layers_total == 48) && vocab == 154880;
    d->e.gating = glm_lite ? Gating::Sigmoid : Gating::Softmax;
    if ((st = read_moe_hparams(m, hp, &d->e))) return st;
    if (d->e.dense_lead > 0 && m->n_ff <= 0) {
        return fail(m, GGSWARM_E_FORMAT, "%sfeed_forward_length is missing (leading dense layers)", a);
    }
    double f = 0;
    if (!hp.opt_float("attention.layer_norm_rms_epsilon", &f)) {
        return fail(m, GGSWARM_E_FORMAT, "%sattention.layer_norm_rms_epsilon is missing", a);
    }
    m->eps = (float)f;
    if (hp.opt_float("attention.temperature_scale", &f) && f != 0.0) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "%sattention.temperature_scale (Mistral Large's) is not supported", a);
    }
    double log_mul = 0;
    if (hp.has("rope.scaling.yarn_log_multiplier") && !hp.opt_float("rope.scaling.yarn_log_multiplier", &log_mul)) {
        return fail(m, GGSWARM_E_FORMAT, "%srope.scaling.yarn_log_multiplier is not a number", a);
    }
    log_mul /= 0.1;  // the converter's 0.1 x mscale_all_dim, as llama.cpp undoes it
    RopeScaling & r = m->rope;
    const float factor = 1.0f / r.freq_scale;
    if (log_mul != 0.0 && r.ext_factor != 0.0f) {
        r.attn_factor /= yarn_mscale(factor);  // rope at unit magnitude (net of ggml's own correction)
        for (LayerHp & l : m->lhp) l.rope_attn = r.attn_factor;
    }
    const float mscale = r.attn_factor * (1.0f + 0.1f * logf(factor)) * (1.0f + 0.1f * (float)log_mul * logf(factor));
    d->kq_scale = mscale * mscale / sqrtf((float)d->k_mla);
    m->arch_data = d;
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    const Ds2 & d = ds2(m);
    const int64_t dm = m->d_model;
    want_mla(m, il, L, w);
    w.need(blk(il, "ffn_norm.weight"), {dm}, &L.ffn_norm);
    if (d.e.dense(il)) {
        w.need(blk(il, "ffn_gate.weight"), {dm, m->n_ff}, &L.w_gate);
        w.need(blk(il, "ffn_up.weight"), {dm, m->n_ff}, &L.w_up);
        w.need(blk(il, "ffn_down.weight"), {m->n_ff, dm}, &L.w_down);
    } else {
        want_experts(m, d.e, il, L, w, true);
    }
}

ggml_tensor * build(Build & b, ggml_tensor * x) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const Ds2 & d = ds2(m);
    ggml_tensor * mask = causal_mask(b);
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const Layer & L = b.layer(il);
        ggml_tensor * cur = rms(c, x, L.attn_norm, m->eps);
        ggml_tensor * q;
        if (d.q_lora > 0) {
            q = rms(c, ggml_mul_mat(c, L.extra.at("attn_q_a"), cur), L.extra.at("attn_q_a_norm"), m->eps);
            q = ggml_mul_mat(c, L.extra.at("attn_q_b"), q);
        } else {
            q = ggml_mul_mat(c, L.wq, cur);
        }
        // flash attention in the handle's flash mode (and so with a quantized cache, unrotated as llama.cpp's)
        cur = mla_attend(b, il, mla_qk(b, il, cur, q), mask, m->flash(), 0, d.kq_scale);
        cur = ggml_mul_mat(c, L.wo, cur);
        keep_last(b, il, &cur, &x);
        ggml_tensor * h = ggml_add(c, cur, x);
        cur = rms(c, h, L.ffn_norm, m->eps);
        if (d.e.dense(il)) {
            cur = glu_ffn(c, cur, L.w_gate, L.w_up, L.w_down, Act::Silu);
        } else {
            Moe p = routed_experts(d.e, L);
            p.sh_gate = L.ffn_gate_shexp;
            p.sh_up = L.ffn_up_shexp;
            p.sh_down = L.ffn_down_shexp;
            cur = moe_ffn(c, cur, p);
        }
        x = ggml_add(c, cur, h);
    }
    return x;
}

const Arch kDeepseek2 = {"deepseek2", read, want, build, nullptr, false, kKvCacheTypes, mla_check_cache_type};
ArchRegistration reg(&kDeepseek2);

}  // namespace
}  // namespace ggswarm
