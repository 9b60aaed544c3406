// The Qwen3.5 hybrid family in the architecture table (arch.h): hyper-parameters, each layer's
// tensors, and the window graph. Written from llama.cpp's description of the model (which GGUF keys
// and tensors exist, which ggml ops its reference graph runs, in which order), so the numbers follow
// llama.cpp's; no code is copied.

#include "archs/qwen35.h"

#include <cmath>
#include <cstring>

#include "arch.h"

namespace ggswarm {
namespace {

ggswarm_status read(ggswarm_model * m, const Hp & hp) {
    const char * a = hp.prefix.c_str();
    auto h = std::make_shared<Hybrid>();
    h->moe = m->arch == "qwen35moe";
    ggswarm_status st;
    int64_t v = 0;
    // multi-token-prediction blocks follow the trunk in the block count; the trunk never runs them
    int32_t nextn = 0;
    if (hp.has("nextn_predict_layers") && (st = hp.need_int("nextn_predict_layers", 0, 16, &nextn))) return st;
    if (nextn >= m->n_layers_total) {
        return fail(m, GGSWARM_E_FORMAT, "%snextn_predict_layers %d >= block_count %d", a, nextn, m->n_layers_total);
    }
    m->n_layers_total -= nextn;
    m->lhp.resize(m->n_layers_total);
    if ((st = hp.need_int("attention.head_count", 1, 4096, &m->n_head))) return st;
    if ((st = hp.need_int("attention.head_count_kv", 1, 4096, &m->n_head_kv))) return st;
    if (m->n_head % m->n_head_kv != 0) {
        return fail(m, GGSWARM_E_FORMAT, "head_count %d is not a multiple of head_count_kv %d", m->n_head, m->n_head_kv);
    }
    int32_t vlen = 0;
    if ((st = hp.need_int("attention.key_length", 2, 1024, &m->head_dim))) return st;
    if ((st = hp.need_int("attention.value_length", 2, 1024, &vlen))) return st;
    if (vlen != m->head_dim) return fail(m, GGSWARM_E_UNSUPPORTED, "key_length %d != value_length %d", m->head_dim, vlen);
    if ((st = hp.need_int("rope.dimension_count", 2, m->head_dim, &m->n_rot))) return st;
    std::vector<int64_t> sec;
    if (!hp.int_array("rope.dimension_sections", &sec) || sec.size() < 3 || sec.size() > 4) {
        return fail(m, GGSWARM_E_FORMAT, "%srope.dimension_sections (3 or 4 integers) is missing", a);
    }
    for (size_t i = 0; i < sec.size(); ++i) h->sections[i] = (int)sec[i];
    m->rope_mode = GGML_ROPE_TYPE_IMROPE;
    m->n_pos_per_token = 4;  // text positions in the t, h and w sections, 0 in the fourth
    if ((st = hp.need_int("ssm.conv_kernel", 2, 64, &h->d_conv))) return st;
    if ((st = hp.need_int("ssm.state_size", 1, 1024, &h->d_state))) return st;
    if ((st = hp.need_int("ssm.group_count", 1, 1024, &h->n_group))) return st;
    if ((st = hp.need_int("ssm.time_step_rank", 1, 4096, &h->dt_rank))) return st;
    int32_t d_inner = 0;
    if ((st = hp.need_int("ssm.inner_size", 1, 1 << 20, &d_inner))) return st;
    if (d_inner != h->d_state * h->dt_rank || h->dt_rank % h->n_group != 0) {
        return fail(m, GGSWARM_E_UNSUPPORTED,
                    "delta-net shape: inner_size %d must be state_size %d x time_step_rank %d, and time_step_rank "
                    "a multiple of group_count %d",
                    d_inner, h->d_state, h->dt_rank, h->n_group);
    }
    std::vector<int64_t> rec;
    if (!hp.per_layer("attention.recurrent_layers", m->n_layers_total, &rec)) {
        int32_t interval = 4;
        if (hp.has("full_attention_interval") && (st = hp.need_int("full_attention_interval", 1, 4096, &interval))) {
            return st;
        }
        rec.assign(m->n_layers_total, 0);
        for (int32_t i = 0; i < m->n_layers_total; ++i) rec[i] = (i + 1) % interval != 0;
    }
    m->n_ff = 0;
    if (hp.has("feed_forward_length") && (st = hp.need_int("feed_forward_length", 0, 1 << 22, &m->n_ff))) return st;
    if (h->moe) {
        if ((st = hp.need_int("expert_count", 1, 4096, &h->n_expert))) return st;
        if ((st = hp.need_int("expert_used_count", 1, h->n_expert, &h->n_used))) return st;
        h->n_ff_exp = m->n_ff / h->n_used;
        h->n_ff_shexp = m->n_ff;
        if (hp.opt_int("expert_feed_forward_length", &v)) h->n_ff_exp = (int32_t)v;
        if (hp.opt_int("expert_shared_feed_forward_length", &v)) h->n_ff_shexp = (int32_t)v;
        if (h->n_ff_exp <= 0) return fail(m, GGSWARM_E_FORMAT, "%sexpert_feed_forward_length is missing", a);
        double s = 0;
        if (hp.opt_float("expert_weights_scale", &s) && s != 0.0) h->w_scale = (float)s;
    } else if (m->n_ff <= 0) {
        return fail(m, GGSWARM_E_FORMAT, "%sfeed_forward_length is missing", a);
    }
    double f = 0;
    if (!hp.opt_float("attention.layer_norm_rms_epsilon", &f)) {
        return fail(m, GGSWARM_E_FORMAT, "%sattention.layer_norm_rms_epsilon is missing", a);
    }
    m->eps = (float)f;
    for (int32_t i = 0; i < m->n_layers_total; ++i) {
        // ggml's conv over the state takes an f32 kernel (llama.cpp's converter keeps it f32)
        const int64_t tid = gguf_find_tensor(hp.g, blk(i, "ssm_conv1d.weight").c_str());
        if (rec[i] && tid >= 0 && gguf_get_tensor_type(hp.g, tid) != GGML_TYPE_F32) {
            return fail(m, GGSWARM_E_UNSUPPORTED, "%s has type %s; the delta-net conv kernel must be f32",
                        blk(i, "ssm_conv1d.weight").c_str(), ggml_type_name(gguf_get_tensor_type(hp.g, tid)));
        }
        m->lhp[i].state = rec[i] ? StateKind::Recurrent : StateKind::KV;
    }
    m->arch_data = h;
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    const Hybrid & h = *hybrid_of(m);
    const int64_t d = m->d_model, hd = m->head_dim, nh = m->n_head, dkv = m->d_kv();
    w.need(blk(il, "attn_norm.weight"), {d}, &L.attn_norm);
    w.need(blk(il, "post_attention_norm.weight"), {d}, &L.attn_post_norm);
    if (m->lhp[il].state == StateKind::Recurrent) {
        const int64_t hv = h.dt_rank;
        auto x = [&](const char * name) { return &L.extra[name]; };
        w.need(blk(il, "attn_qkv.weight"), {d, h.conv_channels()}, x("attn_qkv"));
        w.need(blk(il, "attn_gate.weight"), {d, h.value_dim()}, x("attn_gate"));
        w.need(blk(il, "ssm_conv1d.weight"), {h.d_conv, h.conv_channels()}, x("ssm_conv1d"));
        w.need(blk(il, "ssm_dt.bias"), {hv}, x("ssm_dt"));
        w.need(blk(il, "ssm_a"), {hv}, x("ssm_a"));
        w.need(blk(il, "ssm_beta.weight"), {d, hv}, x("ssm_beta"));
        w.need(blk(il, "ssm_alpha.weight"), {d, hv}, x("ssm_alpha"));
        w.need(blk(il, "ssm_norm.weight"), {h.d_state}, x("ssm_norm"));
        w.need(blk(il, "ssm_out.weight"), {h.value_dim(), d}, x("ssm_out"));
    } else {
        w.need(blk(il, "attn_q.weight"), {d, 2 * hd * nh}, &L.wq);
        w.need(blk(il, "attn_k.weight"), {d, dkv}, &L.wk);
        w.need(blk(il, "attn_v.weight"), {d, dkv}, &L.wv);
        w.need(blk(il, "attn_output.weight"), {hd * nh, d}, &L.wo);
        w.need(blk(il, "attn_q_norm.weight"), {hd}, &L.q_norm);
        w.need(blk(il, "attn_k_norm.weight"), {hd}, &L.k_norm);
    }
    if (h.moe) {
        w.need(blk(il, "ffn_gate_inp.weight"), {d, h.n_expert}, &L.ffn_gate_inp);
        w.need(blk(il, "ffn_gate_exps.weight"), {d, h.n_ff_exp, h.n_expert}, &L.ffn_gate_exps);
        w.need(blk(il, "ffn_up_exps.weight"), {d, h.n_ff_exp, h.n_expert}, &L.ffn_up_exps);
        w.need(blk(il, "ffn_down_exps.weight"), {h.n_ff_exp, d, h.n_expert}, &L.ffn_down_exps);
        if (w.in_file(blk(il, "ffn_up_shexp.weight"))) {
            w.need(blk(il, "ffn_gate_inp_shexp.weight"), {d}, &L.ffn_gate_inp_shexp);
            w.need(blk(il, "ffn_gate_shexp.weight"), {d, h.n_ff_shexp}, &L.ffn_gate_shexp);
            w.need(blk(il, "ffn_up_shexp.weight"), {d, h.n_ff_shexp}, &L.ffn_up_shexp);
            w.need(blk(il, "ffn_down_shexp.weight"), {h.n_ff_shexp, d}, &L.ffn_down_shexp);
        }
    } else {
        w.need(blk(il, "ffn_gate.weight"), {d, m->n_ff}, &L.w_gate);
        w.need(blk(il, "ffn_up.weight"), {d, m->n_ff}, &L.w_up);
        w.need(blk(il, "ffn_down.weight"), {m->n_ff, d}, &L.w_down);
    }
}

ggml_tensor * extra(const Layer & L, const char * name) { return L.extra.at(name); }

// Interleaved multi-section RoPE of x [hd, heads, n] over the graph's 4 x n positions.
ggml_tensor * imrope(Build & b, int32_t il, ggml_tensor * x) {
    const ggswarm_model * m = b.m;
    int sections[4];
    memcpy(sections, hybrid_of(m)->sections, sizeof(sections));
    const LayerHp & h = b.hp(il);
    return ggml_rope_multi(b.c, x, b.g.inp_pos, nullptr, m->n_rot, sections, m->rope_mode, m->rope.n_ctx_orig,
                           h.rope_base, h.rope_scale, h.rope_ext, h.rope_attn, m->rope.beta_fast, m->rope.beta_slow);
}

// Full attention: q and its gate from one projection ([q | gate] per head), q/k RMS norms, RoPE, the
// session's cache (arch.h attention), then the output times sigmoid(gate), projected.
ggml_tensor * gated_attention(Build & b, int32_t il, ggml_tensor * cur) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const Layer & L = b.layer(il);
    const int64_t hd = m->head_dim, nh = m->n_head, n = b.n;
    ggml_tensor * qg = ggml_mul_mat(c, L.wq, cur);  // [2 * hd * nh, n]
    const size_t es = ggml_element_size(qg);
    ggml_tensor * q = ggml_view_3d(c, qg, hd, nh, n, es * hd * 2, es * hd * 2 * nh, 0);
    q = rms(c, q, L.q_norm, m->eps);
    ggml_tensor * gate = ggml_view_3d(c, qg, hd, nh, n, es * hd * 2, es * hd * 2 * nh, es * hd);
    gate = ggml_cont_2d(c, gate, hd * nh, n);
    ggml_tensor * k = ggml_reshape_3d(c, ggml_mul_mat(c, L.wk, cur), hd, m->n_head_kv, n);
    k = rms(c, k, L.k_norm, m->eps);
    ggml_tensor * v = ggml_mul_mat(c, L.wv, cur);
    q = imrope(b, il, q);
    k = imrope(b, il, k);
    ggml_tensor * out = attention(b, il, q, k, v, 1.0f / sqrtf((float)hd));
    out = ggml_mul(c, out, ggml_sigmoid(c, gate));
    return ggml_mul_mat(c, L.wo, out);
}

// L2 normalisation as the reference forms it for the delta-net's q and k: RMS norm with eps / n, then
// times 1 / sqrt(n).
ggml_tensor * l2(ggml_context * c, ggml_tensor * x, float eps) {
    const float n = (float)x->ne[0];
    return ggml_scale(c, ggml_rms_norm(c, x, eps / n), 1.0f / sqrtf(n));
}

// Gated delta-net over the n new positions: projections; the causal conv over the session's conv state
// followed by the new rows, whose last d_conv - 1 rows become the new conv state; L2-normed q and k;
// the recurrent update (ggml_gated_delta_net, which also returns the new recurrent state); the gated
// RMS norm and the output projection. state: the graph's leaves bound to the session's conv state and
// recurrent state (recurrent.cpp plans them).
ggml_tensor * delta_net(Build & b, int32_t il, ggml_tensor * cur) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const Hybrid & h = *hybrid_of(m);
    const Layer & L = b.layer(il);
    const int64_t S = h.d_state, Hk = h.n_group, Hv = h.dt_rank, C = h.conv_channels(), K = h.d_conv, n = b.n;
    ggml_tensor * conv_s = b.state(il)[0];
    ggml_tensor * ssm_s = b.state(il)[1];
    ggml_tensor * qkv = ggml_mul_mat(c, extra(L, "attn_qkv"), cur);  // [C, n]
    ggml_tensor * z = ggml_mul_mat(c, extra(L, "attn_gate"), cur);   // [value_dim, n]
    ggml_tensor * beta = ggml_mul_mat(c, extra(L, "ssm_beta"), cur);
    beta = ggml_sigmoid(c, ggml_reshape_4d(c, beta, 1, Hv, n, 1));
    ggml_tensor * alpha = ggml_reshape_3d(c, ggml_mul_mat(c, extra(L, "ssm_alpha"), cur), Hv, n, 1);
    ggml_tensor * decay = ggml_softplus(c, ggml_add(c, alpha, extra(L, "ssm_dt")));
    decay = ggml_reshape_4d(c, ggml_mul(c, decay, extra(L, "ssm_a")), 1, Hv, n, 1);

    ggml_tensor * prev = ggml_reshape_3d(c, conv_s, K - 1, C, 1);
    ggml_tensor * conv_in = ggml_concat(c, prev, ggml_transpose(c, ggml_reshape_3d(c, qkv, C, n, 1)), 0);
    ggml_tensor * tail = ggml_view_3d(c, conv_in, K - 1, C, 1, conv_in->nb[1], conv_in->nb[2],
                                      ggml_row_size(conv_in->type, n));
    ggml_build_forward_expand(b.g.gf, ggml_cpy(c, tail, conv_s));
    ggml_tensor * conv = ggml_silu(c, ggml_ssm_conv(c, conv_in, extra(L, "ssm_conv1d")));  // [C, n, 1]

    const size_t es = ggml_element_size(conv);
    const size_t row = ggml_row_size(conv->type, C);
    ggml_tensor * q = ggml_view_4d(c, conv, S, Hk, n, 1, es * S, row, row * n, 0);
    ggml_tensor * k = ggml_view_4d(c, conv, S, Hk, n, 1, es * S, row, row * n, es * S * Hk);
    ggml_tensor * v = ggml_view_4d(c, conv, S, Hv, n, 1, es * S, row, row * n, es * 2 * S * Hk);
    q = l2(c, q, m->eps);
    k = l2(c, k, m->eps);
    ggml_tensor * state = ggml_reshape_4d(c, ssm_s, S, S, Hv, 1);
    ggml_tensor * r = ggml_gated_delta_net(c, q, k, v, decay, beta, state, 1);
    const size_t rs = ggml_element_size(r);
    ggml_tensor * o = ggml_view_4d(c, r, S, Hv, n, 1, rs * S, rs * S * Hv, rs * S * Hv * n, 0);
    ggml_tensor * s_new = ggml_view_4d(c, r, S, S, Hv, 1, rs * S, rs * S * S, rs * S * S * Hv, rs * S * Hv * n);
    ggml_build_forward_expand(b.g.gf, ggml_cpy(c, s_new, ssm_s));

    o = ggml_mul(c, rms(c, o, extra(L, "ssm_norm"), m->eps), ggml_silu(c, ggml_reshape_4d(c, z, S, Hv, n, 1)));
    o = ggml_reshape_3d(c, o, S * Hv, n, 1);
    return ggml_reshape_2d(c, ggml_mul_mat(c, extra(L, "ssm_out"), o), m->d_model, n);
}

ggml_tensor * build(Build & b, ggml_tensor * x) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const Hybrid & h = *hybrid_of(m);
    bool any_kv = false;
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const Layer & L = b.layer(il);
        const bool recurrent = m->lhp[il].state == StateKind::Recurrent;
        any_kv = any_kv || !recurrent;
        ggml_tensor * cur = rms(c, x, L.attn_norm, m->eps);
        cur = recurrent ? delta_net(b, il, cur) : gated_attention(b, il, cur);
        keep_last(b, il, &cur, &x);
        ggml_tensor * res = ggml_add(c, cur, x);
        cur = rms(c, res, L.attn_post_norm, m->eps);
        if (h.moe) {
            Moe p;
            p.gate_inp = L.ffn_gate_inp;
            p.gate_exps = L.ffn_gate_exps;
            p.up_exps = L.ffn_up_exps;
            p.down_exps = L.ffn_down_exps;
            p.sh_gate_inp = L.ffn_gate_inp_shexp;
            p.sh_gate = L.ffn_gate_shexp;
            p.sh_up = L.ffn_up_shexp;
            p.sh_down = L.ffn_down_shexp;
            p.n_expert = h.n_expert;
            p.n_used = h.n_used;
            p.gating = Gating::Softmax;
            p.norm_w = true;
            p.w_scale = h.w_scale;
            cur = moe_ffn(c, cur, p);
        } else {
            cur = glu_ffn(c, cur, L.w_gate, L.w_up, L.w_down, Act::Silu);
        }
        x = ggml_add(c, cur, res);
    }
    // a window of delta-net layers only reads no position; keep the input allocated all the same
    if (!any_kv && b.g.inp_pos) ggml_build_forward_expand(b.g.gf, b.g.inp_pos);
    return x;
}

const Arch kQwen35 = {"qwen35", read, want, build, nullptr, false, kKvCacheTypes};
const Arch kQwen35Moe = {"qwen35moe", read, want, build, nullptr, false, kKvCacheTypes};
ArchRegistration reg_qwen35(&kQwen35);
ArchRegistration reg_qwen35moe(&kQwen35Moe);

}  // namespace
}  // namespace ggswarm
