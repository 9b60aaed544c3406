// glm-dsa (GLM-5.x): multi-head latent attention (MLA) with DeepSeek sparse attention (DSA), leading
// dense layers, then a sigmoid-gated mixture of experts with a selection bias and a shared expert.
// Written from llama.cpp's description of the model (which GGUF keys and tensors exist, which ggml ops
// its reference graph runs, in which order), so the numbers follow llama.cpp's; no code is copied.
//
// Every layer keeps a latent cache row per position: the normed kv_lora compression followed by the
// roped key part (mla.h's latent state kind); V is a view of its first kv_lora columns, and the absorbed
// query attends it as one shared head. Full-indexer layers also keep an indexer-K row per position
// and pick, per query, the top_k cached positions by the lightning indexer's score; shared-indexer
// layers attend the top-k positions of the previous full-indexer layer. That index tensor never
// crosses a window boundary: a window must start at a full-indexer layer (the planner places seams
// only there, docs/native.md "glm-dsa").

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "arch.h"
#include "archs/mla.h"

namespace ggswarm {
namespace {

// What a glm-dsa handle knows beyond MLA's (m->arch_data).
struct Dsa : Mla {
    int32_t idx_heads = 0, idx_len = 0, top_k = 0;
    int32_t n_expert = 0, n_used = 0, n_ff_exp = 0, n_shexp = 0, dense_lead = 0;
    float w_scale = 1.0f;
    bool norm_w = false;
    bool sigmoid = true;
    std::vector<uint8_t> full;  // per layer of the model: 1 = full indexer, 0 = shares the previous one's

    int64_t second_row(int32_t il) const override { return full[il] ? idx_len : 0; }  // indexer keys
};

const Dsa & dsa(const ggswarm_model * m) { return *static_cast<const Dsa *>(m->arch_data.get()); }

bool is_power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

ggswarm_status read(ggswarm_model * m, const Hp & hp) {
    const char * a = hp.prefix.c_str();
    auto d = std::make_shared<Dsa>();
    ggswarm_status st;
    if ((st = hp.need_int("feed_forward_length", 1, 1 << 22, &m->n_ff))) return st;
    if ((st = hp.need_int("attention.head_count", 1, 4096, &m->n_head))) return st;
    if ((st = hp.need_int("rope.dimension_count", 2, 4096, &m->n_rot))) return st;
    if ((st = hp.need_int("attention.q_lora_rank", 1, 1 << 16, &d->q_lora))) return st;
    if ((st = hp.need_int("attention.kv_lora_rank", 1, 1 << 16, &d->kv_lora))) return st;
    if ((st = hp.need_int("attention.key_length_mla", 1, 4096, &d->k_mla))) return st;
    if ((st = hp.need_int("attention.value_length_mla", 1, 4096, &d->v_mla))) return st;
    if ((st = hp.need_int("attention.indexer.head_count", 1, 4096, &d->idx_heads))) return st;
    if ((st = hp.need_int("attention.indexer.key_length", 1, 1 << 16, &d->idx_len))) return st;
    if ((st = hp.need_int("attention.indexer.top_k", 1, 1 << 20, &d->top_k))) return st;
    if ((st = hp.need_int("expert_count", 1, 1 << 16, &d->n_expert))) return st;
    if ((st = hp.need_int("expert_used_count", 1, d->n_expert, &d->n_used))) return st;
    if ((st = hp.need_int("expert_feed_forward_length", 1, 1 << 22, &d->n_ff_exp))) return st;
    if ((st = hp.need_int("expert_shared_count", 0, 64, &d->n_shexp))) return st;
    int32_t nextn = 0;
    if (hp.has("nextn_predict_layers") && (st = hp.need_int("nextn_predict_layers", 0, 16, &nextn))) return st;
    if (nextn >= m->n_layers_total) {
        return fail(m, GGSWARM_E_FORMAT, "%snextn_predict_layers %d >= block_count %d", a, nextn, m->n_layers_total);
    }
    if (m->mtp_block && nextn != 1) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "%snextn_predict_layers is %d: multi-token prediction needs exactly 1 block",
                    a, nextn);
    }
    const int32_t n_trunk = m->n_layers_total - nextn;
    // the trunk never runs the multi-token-prediction block; the block's own handle (mtp.cpp) keeps it
    if (!m->mtp_block) m->n_layers_total = n_trunk;
    m->lhp.resize(m->n_layers_total);
    int64_t v = 0;
    if (hp.opt_int("leading_dense_block_count", &v)) d->dense_lead = (int32_t)v;
    if (d->k_mla <= m->n_rot) {
        return fail(m, GGSWARM_E_FORMAT, "%sattention.key_length_mla %d must exceed rope.dimension_count %d", a, d->k_mla,
                    m->n_rot);
    }
    d->nope = d->k_mla - m->n_rot;
    if (!is_power_of_two(d->idx_len) || d->idx_len < 64 || d->idx_len < m->n_rot) {
        return fail(m, GGSWARM_E_FORMAT, "%sattention.indexer.key_length %d must be a power of two >= 64 and >= %d", a,
                    d->idx_len, m->n_rot);
    }
    if (hp.opt_int("expert_gating_func", &v) && v != 0 && v != 2) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "%sexpert_gating_func %lld: only sigmoid (2) is supported", a, (long long)v);
    }
    double f = 0;
    if (hp.opt_float("expert_weights_scale", &f)) d->w_scale = (float)f;
    if (hp.opt_bool("expert_weights_norm", &d->norm_w) < 0) {
        return fail(m, GGSWARM_E_FORMAT, "%sexpert_weights_norm is not a bool", a);
    }
    if (!hp.opt_float("attention.layer_norm_rms_epsilon", &f)) {
        return fail(m, GGSWARM_E_FORMAT, "%sattention.layer_norm_rms_epsilon is missing", a);
    }
    m->eps = (float)f;
    const int32_t nl = n_trunk;  // the indexer types are the trunk's
    std::vector<int64_t> types;
    if (hp.has("attention.indexer.types")) {
        if (!hp.per_layer("attention.indexer.types", nl, &types)) {
            return fail(m, GGSWARM_E_FORMAT, "%sattention.indexer.types: expected %d per-layer values", a, nl);
        }
    } else if (m->n_ctx_train < 1048576) {
        types.assign(nl, 1);  // GLM-5 and 5.1: every layer has its own indexer
    } else {
        types.assign(nl, 0);  // GLM-5.2's published layout: layers 0 and 1, then every fourth from 2
        for (int32_t il = 0; il < nl; ++il) types[il] = il < 2 || (il < 78 && (il - 2) % 4 == 0);
    }
    if (types[0] == 0) return fail(m, GGSWARM_E_FORMAT, "%sattention.indexer.types: layer 0 must be a full indexer", a);
    d->full.assign(types.begin(), types.end());
    d->full.resize(m->n_layers_total, 0);  // the nextn block attends densely (llama.cpp's graph_mtp)
    if (m->mtp_block) m->ids_layers = m->n_layers_total;  // the block embeds each position's token
    m->n_head_kv = 1;
    m->head_dim = (int32_t)d->latent();  // what a snapshot header records: one latent row per position
    m->rope_mode = GGML_ROPE_TYPE_NORMAL;
    for (int32_t il = 0; il < m->n_layers_total; ++il) {
        LayerHp & l = m->lhp[il];
        l.state = kLatent;
    }
    m->arch_data = d;
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    const Dsa & d = dsa(m);
    const int64_t dm = m->d_model;
    if (il == m->layer_start && !d.full[il] && !m->mtp_block) {
        // the planner never places a seam here; a window handed such a range is refused at open
        int32_t prev = il;
        while (prev > 0 && !d.full[prev]) --prev;
        w.need("(a glm-dsa window cannot start at layer " + std::to_string(il) + ": it reuses layer " +
                   std::to_string(prev) + "'s indexer top-k; start windows at full-indexer layers)",
               {1}, &L.extra["refused"]);
    }
    want_mla(m, il, L, w);
    w.need(blk(il, "ffn_norm.weight"), {dm}, &L.ffn_norm);
    if (m->mtp_block) {  // the nextn block's own tensors (the optional ones fall back to the trunk's)
        w.need(blk(il, "nextn.eh_proj.weight"), {2 * dm, dm}, &L.extra["eh_proj"]);
        w.need(blk(il, "nextn.enorm.weight"), {dm}, &L.extra["enorm"]);
        w.need(blk(il, "nextn.hnorm.weight"), {dm}, &L.extra["hnorm"]);
        const std::string emb = blk(il, "nextn.embed_tokens.weight");
        w.need_plain(w.in_file(emb) ? emb : std::string("token_embd.weight"), {dm, m->n_vocab}, &L.extra["embed_tokens"]);
        w.opt(blk(il, "nextn.shared_head_head.weight"), {dm, m->n_vocab}, &L.extra["shared_head_head"]);
        w.opt(blk(il, "nextn.shared_head_norm.weight"), {dm}, &L.extra["shared_head_norm"]);
    }
    if (d.full[il]) {
        w.need(blk(il, "indexer.k_norm.weight"), {d.idx_len}, &L.extra["indexer_k_norm"]);
        w.need(blk(il, "indexer.k_norm.bias"), {d.idx_len}, &L.extra["indexer_k_norm_b"]);
        w.need(blk(il, "indexer.proj.weight"), {dm, d.idx_heads}, &L.extra["indexer_proj"]);
        w.need(blk(il, "indexer.attn_k.weight"), {dm, d.idx_len}, &L.extra["indexer_attn_k"]);
        w.need(blk(il, "indexer.attn_q_b.weight"), {d.q_lora, (int64_t)d.idx_heads * d.idx_len},
               &L.extra["indexer_attn_q_b"]);
    }
    if (il < d.dense_lead) {
        w.need(blk(il, "ffn_gate.weight"), {dm, m->n_ff}, &L.w_gate);
        w.need(blk(il, "ffn_up.weight"), {dm, m->n_ff}, &L.w_up);
        w.need(blk(il, "ffn_down.weight"), {m->n_ff, dm}, &L.w_down);
        return;
    }
    const int64_t ne = d.n_expert, ff = d.n_ff_exp, sh = (int64_t)d.n_ff_exp * d.n_shexp;
    w.need(blk(il, "ffn_gate_inp.weight"), {dm, ne}, &L.ffn_gate_inp);
    w.opt(blk(il, "exp_probs_b.bias"), {ne}, &L.extra["exp_probs_b"]);
    w.need(blk(il, "ffn_gate_exps.weight"), {dm, ff, ne}, &L.ffn_gate_exps);
    w.need(blk(il, "ffn_up_exps.weight"), {dm, ff, ne}, &L.ffn_up_exps);
    w.need(blk(il, "ffn_down_exps.weight"), {ff, dm, ne}, &L.ffn_down_exps);
    if (sh > 0) {
        w.need(blk(il, "ffn_gate_shexp.weight"), {dm, sh}, &L.ffn_gate_shexp);
        w.need(blk(il, "ffn_up_shexp.weight"), {dm, sh}, &L.ffn_up_shexp);
        w.need(blk(il, "ffn_down_shexp.weight"), {sh, dm}, &L.ffn_down_shexp);
    }
}

ggml_tensor * extra(const Layer & L, const char * name) {
    auto it = L.extra.find(name);
    return it == L.extra.end() ? nullptr : it->second;
}

// The orthonormal Walsh-Hadamard matrix of order n (a power of two), built in the graph by Sylvester's
// doubling from the 1x1 entry 1/sqrt(n); the same values llama.cpp rotates the indexer's q and k by.
ggml_tensor * hadamard(ggml_context * c, int64_t n) {
    ggml_tensor * h = ggml_fill(c, ggml_arange(c, 0.0f, 1.0f, 1.0f), (float)(1.0 / sqrtf((float)n)));
    h = ggml_reshape_2d(c, h, 1, 1);
    for (int64_t s = 1; s < n; s *= 2) {
        ggml_tensor * top = ggml_concat(c, h, h, 0);
        ggml_tensor * bottom = ggml_concat(c, h, ggml_neg(c, h), 0);
        h = ggml_concat(c, top, bottom, 1);
    }
    return h;
}


// Lightning indexer of a full-indexer layer: appends the new positions' indexer keys to the cache and
// returns the top-k cached positions per new position, [k, n] i32.
// rot: the Hadamard block (one per graph, shared by its full-indexer layers).
ggml_tensor * indexer_top_k(Build & b, int32_t il, ggml_tensor * cur, ggml_tensor * qr, ggml_tensor * mask,
                            ggml_tensor * rot) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const Dsa & d = dsa(m);
    const Layer & L = b.layer(il);
    const int64_t n = b.n, len = d.idx_len, heads = d.idx_heads;
    ggml_tensor * q = ggml_reshape_3d(c, ggml_mul_mat(c, extra(L, "indexer_attn_q_b"), qr), len, heads, n);
    q = rope(b, il, q);
    ggml_tensor * k = ggml_mul_mat(c, extra(L, "indexer_attn_k"), cur);
    k = ggml_add(c, ggml_mul(c, ggml_norm(c, k, 0.0f), extra(L, "indexer_k_norm")), extra(L, "indexer_k_norm_b"));
    k = rope(b, il, ggml_reshape_3d(c, k, len, 1, n));
    q = rotate(c, q, rot);
    k = rotate(c, k, rot);
    ggml_tensor * kc = b.state(il)[1];
    ggml_build_forward_expand(b.g.gf, ggml_set_rows(c, kc, ggml_reshape_2d(c, k, len, n), b.g.inp_pos));
    ggml_tensor * w = ggml_mul_mat(c, extra(L, "indexer_proj"), cur);  // [heads, n]
    w = ggml_scale(c, w, 1.0f / sqrtf((float)(len * heads)));
    ggml_tensor * keys = ggml_view_4d(c, kc, len, 1, b.n_kv, 1, kc->nb[1], kc->nb[1], kc->nb[1] * b.n_kv, 0);
    ggml_tensor * q4 = ggml_reshape_4d(c, q, len, heads, n, 1);
    ggml_tensor * w4 = ggml_reshape_4d(c, w, heads, n, 1, 1);
    ggml_tensor * score = ggml_lightning_indexer(c, q4, keys, w4, ggml_cast(c, mask, GGML_TYPE_F16));
    const int32_t k_top = (int32_t)std::min<int64_t>(score->ne[0], d.top_k);
    return ggml_cont(c, ggml_top_k(c, score, k_top));
}

// llama.cpp pre-scales by YaRN's magnitude squared: attn_factor with ggml's own correction undone
// (glm-dsa reads no yarn_log_multiplier); 1 for files without rope scaling
float kq_scale(const ggswarm_model * m) {
    const RopeScaling & rs = m->rope;
    const float mscale = rs.attn_factor * (1.0f + 0.1f * logf(1.0f / rs.freq_scale));
    return mscale * mscale / sqrtf((float)dsa(m).k_mla);
}

// MLA attention of layer il over the latent cache, restricted to top_k [k, n] (plus causality).
ggml_tensor * mla_attention(Build & b, int32_t il, ggml_tensor * cur, ggml_tensor * qr, ggml_tensor * top_k,
                            ggml_tensor * mask) {
    ggml_context * c = b.c;
    const Layer & L = b.layer(il);
    const MlaQk qk = mla_qk(b, il, cur, ggml_mul_mat(c, extra(L, "attn_q_b"), qr));
    // the sparse mask: -inf except at the top-k positions, plus causality
    ggml_tensor * all = ggml_fill(c, mask, -INFINITY);
    all = ggml_view_3d(c, all, 1, all->ne[0], all->ne[1], all->nb[0], all->nb[1], 0);
    ggml_tensor * zeros = ggml_fill(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 1, top_k->ne[0], top_k->ne[1]), 0.0f);
    ggml_tensor * sparse = ggml_set_rows(c, all, zeros, top_k);
    sparse = ggml_view_2d(c, sparse, sparse->ne[1], sparse->ne[2], sparse->nb[2], 0);
    sparse = ggml_add(c, sparse, mask);
    // llama.cpp runs a quantized cache with flash attention (the mask in f16: 0 and -inf, exact); its
    // latent cache is not rotated (build_attn for the DSA input applies no k_rot)
    const bool flash = b.m->flash();  // the handle's mode: flash attention on (or a quantized cache) or off
    return ggml_mul_mat(c, L.wo, mla_attend(b, il, qk, sparse, flash, (int32_t)top_k->ne[0], kq_scale(b.m)));
}

// Sigmoid-gated routed experts (selection biased by exp_probs_b, weights from the unbiased
// probabilities, normalised and scaled) plus the shared expert.
ggml_tensor * moe(Build & b, int32_t il, ggml_tensor * x) {
    const Dsa & d = dsa(b.m);
    const Layer & L = b.layer(il);
    Moe p;
    p.gate_inp = L.ffn_gate_inp;
    p.exp_probs_b = extra(L, "exp_probs_b");
    p.gate_exps = L.ffn_gate_exps;
    p.up_exps = L.ffn_up_exps;
    p.down_exps = L.ffn_down_exps;
    p.sh_gate = L.ffn_gate_shexp;
    p.sh_up = L.ffn_up_shexp;
    p.sh_down = L.ffn_down_shexp;
    p.n_expert = d.n_expert;
    p.n_used = d.n_used;
    p.gating = Gating::Sigmoid;
    p.norm_w = d.norm_w;
    p.w_scale = d.w_scale;
    return moe_ffn(b.c, x, p);
}

// Every position's rows as llama.cpp's h_nextn (after the output norm: the trunk's, or the block's
// shared head norm, which mtp.cpp makes the block's output norm), then only the last position's where
// the graph samples only it.
ggml_tensor * nextn_rows(Build & b, ggml_tensor * x) {
    b.g.out_hidden = rms(b.c, x, b.m->output_norm, b.m->eps);
    ggml_set_output(b.g.out_hidden);
    ggml_build_forward_expand(b.g.gf, b.g.out_hidden);
    if (!b.last_only || b.n == 1) return x;
    return ggml_view_2d(b.c, x, x->ne[0], 1, x->nb[1], (size_t)(b.n - 1) * x->nb[1]);
}

// The nextn block (llama.cpp's graph_mtp): the token's embedding and the trunk's row of the position
// before (h [d, n]), each RMS normed, concatenated and projected; then a decoder layer with dense MLA
// over the block's own latent cache, the routed and shared experts.
ggml_tensor * build_mtp(Build & b, ggml_tensor * h) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const int32_t il = m->layer_start;
    const Layer & L = b.layer(il);
    if (!b.g.inp_tokens) {
        b.g.inp_tokens = ggml_new_tensor_1d(c, GGML_TYPE_I32, b.n);
        ggml_set_input(b.g.inp_tokens);
    }
    ggml_tensor * e = rms(c, ggml_get_rows(c, extra(L, "embed_tokens"), b.g.inp_tokens), extra(L, "enorm"), m->eps);
    ggml_tensor * x = ggml_mul_mat(c, extra(L, "eh_proj"), ggml_concat(c, e, rms(c, h, extra(L, "hnorm"), m->eps), 0));
    ggml_tensor * cur = rms(c, x, L.attn_norm, m->eps);
    ggml_tensor * qr = rms(c, ggml_mul_mat(c, extra(L, "attn_q_a"), cur), extra(L, "attn_q_a_norm"), m->eps);
    const MlaQk qk = mla_qk(b, il, cur, ggml_mul_mat(c, extra(L, "attn_q_b"), qr));
    cur = ggml_mul_mat(c, L.wo, mla_attend(b, il, qk, causal_mask(b), m->flash(), 0, kq_scale(m)));
    ggml_tensor * ffn_inp = ggml_add(c, cur, x);
    cur = moe(b, il, rms(c, ffn_inp, L.ffn_norm, m->eps));
    return nextn_rows(b, ggml_add(c, cur, ffn_inp));
}

ggml_tensor * build(Build & b, ggml_tensor * x) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const Dsa & d = dsa(m);
    if (m->mtp_block) return build_mtp(b, x);
    ggml_tensor * mask = causal_mask(b);
    ggml_tensor * rot = nullptr;
    ggml_tensor * top_k = nullptr;  // the last full-indexer layer's choice (windows start at one)
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const Layer & L = b.layer(il);
        ggml_tensor * cur = rms(c, x, L.attn_norm, m->eps);
        ggml_tensor * qr = rms(c, ggml_mul_mat(c, extra(L, "attn_q_a"), cur), extra(L, "attn_q_a_norm"), m->eps);
        if (d.full[il]) {
            if (!rot) rot = hadamard(c, rot_size(d.idx_len));
            top_k = indexer_top_k(b, il, cur, qr, mask, rot);
        }
        cur = mla_attention(b, il, cur, qr, top_k, mask);
        if (!m->mtp) keep_last(b, il, &cur, &x);  // an attached nextn block reads every position's row
        ggml_tensor * h = ggml_add(c, cur, x);
        cur = rms(c, h, L.ffn_norm, m->eps);
        cur = il < d.dense_lead ? glu_ffn(c, cur, L.w_gate, L.w_up, L.w_down, Act::Silu) : moe(b, il, cur);
        x = ggml_add(c, cur, h);
    }
    return m->mtp && m->is_last() ? nextn_rows(b, x) : x;
}

const Arch kGlmDsa = {"glm-dsa", read, want, build, nullptr, false, kKvCacheTypes, mla_check_cache_type};
ArchRegistration reg(&kGlmDsa);

}  // namespace
}  // namespace ggswarm
