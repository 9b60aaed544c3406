// glm-dsa (GLM-5.x): multi-head latent attention (MLA) with DeepSeek sparse attention (DSA), leading
// dense layers, then a sigmoid-gated mixture of experts with a selection bias and a shared expert.
// Written from llama.cpp's description of the model (which GGUF keys and tensors exist, which ggml ops
// its reference graph runs, in which order), so the numbers follow llama.cpp's; no code is copied.
//
// Every layer keeps a latent cache row per position: the normed kv_lora compression followed by the
// roped key part (StateKind::Latent); V is a view of its first kv_lora columns, and the absorbed
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

namespace ggswarm {
namespace {

// This unit's state kind (registered below; model.h's StateKind names the shared ones).
constexpr StateKind kLatent = static_cast<StateKind>(4);

// What a glm-dsa handle knows beyond ggswarm_model's common fields (m->arch_data).
struct Dsa : ArchData {
    int32_t q_lora = 0, kv_lora = 0, nope = 0, k_mla = 0, v_mla = 0;
    int32_t idx_heads = 0, idx_len = 0, top_k = 0;
    int32_t n_expert = 0, n_used = 0, n_ff_exp = 0, n_shexp = 0, dense_lead = 0;
    float w_scale = 1.0f;
    bool norm_w = false;
    bool sigmoid = true;
    std::vector<uint8_t> full;  // per layer of the model: 1 = full indexer, 0 = shares the previous one's

    int64_t latent() const { return (int64_t)kv_lora + (k_mla - nope); }  // cached columns per position
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
    m->n_layers_total -= nextn;  // the trunk never runs the multi-token-prediction block
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
    const int32_t nl = m->n_layers_total;
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
    m->n_head_kv = 1;
    m->head_dim = (int32_t)d->latent();  // what a snapshot header records: one latent row per position
    m->rope_mode = GGML_ROPE_TYPE_NORMAL;
    for (int32_t il = 0; il < nl; ++il) {
        LayerHp & l = m->lhp[il];
        l.state = kLatent;
    }
    m->arch_data = d;
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    const Dsa & d = dsa(m);
    const int64_t dm = m->d_model, nh = m->n_head;
    if (il == m->layer_start && !d.full[il]) {
        // the planner never places a seam here; a window handed such a range is refused at open
        int32_t prev = il;
        while (prev > 0 && !d.full[prev]) --prev;
        w.need("(a glm-dsa window cannot start at layer " + std::to_string(il) + ": it reuses layer " +
                   std::to_string(prev) + "'s indexer top-k; start windows at full-indexer layers)",
               {1}, &L.extra["refused"]);
    }
    w.need(blk(il, "attn_norm.weight"), {dm}, &L.attn_norm);
    w.need(blk(il, "attn_q_a_norm.weight"), {d.q_lora}, &L.extra["attn_q_a_norm"]);
    w.need(blk(il, "attn_kv_a_norm.weight"), {d.kv_lora}, &L.extra["attn_kv_a_norm"]);
    w.need(blk(il, "attn_q_a.weight"), {dm, d.q_lora}, &L.extra["attn_q_a"]);
    w.need(blk(il, "attn_q_b.weight"), {d.q_lora, nh * d.k_mla}, &L.extra["attn_q_b"]);
    w.need(blk(il, "attn_kv_a_mqa.weight"), {dm, d.latent()}, &L.extra["attn_kv_a_mqa"]);
    w.need(blk(il, "attn_k_b.weight"), {d.nope, d.kv_lora, nh}, &L.extra["attn_k_b"]);
    w.need(blk(il, "attn_v_b.weight"), {d.kv_lora, d.v_mla, nh}, &L.extra["attn_v_b"]);
    w.need(blk(il, "attn_output.weight"), {nh * d.v_mla, dm}, &L.wo);
    w.need(blk(il, "ffn_norm.weight"), {dm}, &L.ffn_norm);
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


// The causal mask of the window's new positions over the attended span, [n_kv, n] f32: 0 where cache
// row j <= the position, -inf elsewhere; computed in the graph from the positions (log(1 - step(j - p))).
ggml_tensor * causal_mask(Build & b) {
    ggml_context * c = b.c;
    ggml_tensor * j = ggml_reshape_2d(c, ggml_arange(c, 0.0f, (float)b.n_kv, 1.0f), b.n_kv, 1);
    ggml_tensor * p = ggml_reshape_2d(c, ggml_cast(c, b.g.inp_pos, GGML_TYPE_F32), 1, b.n);
    ggml_tensor * later = ggml_step(c, ggml_sub(c, ggml_repeat_4d(c, j, b.n_kv, b.n, 1, 1), p));
    return ggml_log(c, ggml_scale_bias(c, later, -1.0f, 1.0f));
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

// MLA attention of layer il over the latent cache, restricted to top_k [k, n] (plus causality).
ggml_tensor * mla_attention(Build & b, int32_t il, ggml_tensor * cur, ggml_tensor * qr, ggml_tensor * top_k,
                            ggml_tensor * mask) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const Dsa & d = dsa(m);
    const Layer & L = b.layer(il);
    const int64_t n = b.n, nh = m->n_head, rot = m->n_rot, lora = d.kv_lora, lat = d.latent();
    ggml_tensor * q = ggml_mul_mat(c, extra(L, "attn_q_b"), qr);  // [nh * k_mla, n]
    const size_t qrow = ggml_row_size(q->type, d.k_mla);
    ggml_tensor * q_nope = ggml_view_3d(c, q, d.nope, nh, n, qrow, qrow * nh, 0);
    ggml_tensor * q_pe = ggml_view_3d(c, q, rot, nh, n, qrow, qrow * nh, ggml_row_size(q->type, d.nope));
    ggml_tensor * kvpe = ggml_mul_mat(c, extra(L, "attn_kv_a_mqa"), cur);  // [lat, n]
    const size_t krow = ggml_row_size(kvpe->type, lat);
    ggml_tensor * kv = ggml_view_2d(c, kvpe, lora, n, krow, 0);
    ggml_tensor * k_pe = ggml_view_3d(c, kvpe, rot, 1, n, krow, krow, ggml_row_size(kvpe->type, lora));
    q_pe = rope(b, il, q_pe);
    k_pe = rope(b, il, k_pe);
    kv = rms(c, kv, extra(L, "attn_kv_a_norm"), m->eps);
    // absorb wk_b into the query: attention runs over the latent rows as one shared head
    ggml_tensor * qa = ggml_mul_mat(c, extra(L, "attn_k_b"), ggml_permute(c, q_nope, 0, 2, 1, 3));
    qa = ggml_permute(c, qa, 0, 2, 1, 3);  // [lora, nh, n]
    ggml_tensor * Q = ggml_concat(c, qa, q_pe, 0);
    ggml_tensor * K = ggml_concat(c, ggml_reshape_3d(c, kv, lora, 1, n), k_pe, 0);
    ggml_build_forward_expand(b.g.gf, Q);
    ggml_build_forward_expand(b.g.gf, K);
    ggml_tensor * cache = b.state(il)[0];
    ggml_build_forward_expand(b.g.gf, ggml_set_rows(c, cache, ggml_reshape_2d(c, K, lat, n), b.g.inp_pos));
    // the sparse mask: -inf except at the top-k positions, plus causality
    ggml_tensor * all = ggml_fill(c, mask, -INFINITY);
    all = ggml_view_3d(c, all, 1, all->ne[0], all->ne[1], all->nb[0], all->nb[1], 0);
    ggml_tensor * zeros = ggml_fill(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 1, top_k->ne[0], top_k->ne[1]), 0.0f);
    ggml_tensor * sparse = ggml_set_rows(c, all, zeros, top_k);
    sparse = ggml_view_2d(c, sparse, sparse->ne[1], sparse->ne[2], sparse->nb[2], 0);
    sparse = ggml_add(c, sparse, mask);
    ggml_tensor * kview = ggml_view_3d(c, cache, lat, 1, b.n_kv, cache->nb[1], cache->nb[1], 0);
    ggml_tensor * vview = ggml_view_3d(c, cache, lora, 1, b.n_kv, cache->nb[1], cache->nb[1], 0);
    ggml_tensor * qp = ggml_permute(c, Q, 0, 2, 1, 3);
    ggml_tensor * kp = ggml_permute(c, kview, 0, 2, 1, 3);
    ggml_tensor * vp = ggml_permute(c, vview, 0, 2, 1, 3);
    // llama.cpp pre-scales by YaRN's magnitude squared: attn_factor with ggml's own correction undone
    // (glm-dsa reads no yarn_log_multiplier); 1 for files without rope scaling
    const RopeScaling & rs = b.m->rope;
    const float mscale = rs.attn_factor * (1.0f + 0.1f * logf(1.0f / rs.freq_scale));
    const float kq_scale = mscale * mscale / sqrtf((float)d.k_mla);
    ggml_tensor * kqv;
    if (ggml_is_quantized(m->cache_type)) {
        // llama.cpp runs a quantized cache with flash attention (the mask in f16: 0 and -inf, exact);
        // its latent cache is not rotated (build_attn for the DSA input applies no k_rot)
        ggml_tensor * o = ggml_flash_attn_ext(c, qp, kp, vp, ggml_cast(c, sparse, GGML_TYPE_F16), kq_scale, 0.0f, 0.0f);
        ggml_flash_attn_ext_set_n_kv_max(o, (int32_t)top_k->ne[0]);
        ggml_prec_set_acc(o, GGML_PREC_F32);
        kqv = ggml_permute(c, o, 0, 2, 1, 3);  // [lora, nh, n] -> [lora, n, nh]
    } else {
        ggml_tensor * kq = ggml_mul_mat(c, kp, qp);  // [n_kv, n, nh]
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        kq = ggml_soft_max_ext(c, kq, sparse, kq_scale, 0.0f);
        ggml_tensor * vt = ggml_cont(c, ggml_transpose(c, vp));
        kqv = ggml_mul_mat(c, vt, kq);  // [lora, n, nh]
    }
    kqv = ggml_mul_mat(c, extra(L, "attn_v_b"), kqv);  // [v_mla, n, nh]
    ggml_tensor * out = ggml_permute(c, kqv, 0, 2, 1, 3);
    out = ggml_cont_2d(c, out, out->ne[0] * out->ne[1], out->ne[2] * out->ne[3]);
    return ggml_mul_mat(c, L.wo, out);
}

// Sigmoid-gated routed experts (selection biased by exp_probs_b, weights from the unbiased
// probabilities, normalised and scaled) plus the shared expert.
ggml_tensor * moe(Build & b, int32_t il, ggml_tensor * x) {
    ggml_context * c = b.c;
    const Dsa & d = dsa(b.m);
    const Layer & L = b.layer(il);
    const int64_t dm = x->ne[0], n = x->ne[1], ne = d.n_expert, nu = d.n_used;
    ggml_tensor * probs = ggml_sigmoid(c, ggml_mul_mat(c, L.ffn_gate_inp, x));  // [ne, n]
    ggml_tensor * bias = extra(L, "exp_probs_b");
    ggml_tensor * select = bias ? ggml_add(c, probs, bias) : probs;
    ggml_tensor * sel = ggml_argsort_top_k(c, select, (int)nu);  // [nu, n]
    ggml_tensor * w = ggml_get_rows(c, ggml_reshape_3d(c, probs, 1, ne, n), sel);  // [1, nu, n]
    if (d.norm_w) {
        ggml_tensor * w2 = ggml_reshape_2d(c, w, nu, n);
        ggml_tensor * sum = ggml_clamp(c, ggml_sum_rows(c, w2), 6.103515625e-5f, INFINITY);
        w = ggml_reshape_3d(c, ggml_div(c, w2, sum), 1, nu, n);
    }
    if (d.w_scale != 0.0f && d.w_scale != 1.0f) w = ggml_scale(c, w, d.w_scale);
    ggml_build_forward_expand(b.g.gf, w);
    ggml_tensor * x3 = ggml_reshape_3d(c, x, dm, 1, n);
    ggml_tensor * up = ggml_mul_mat_id(c, L.ffn_up_exps, x3, sel);
    ggml_tensor * gate = ggml_mul_mat_id(c, L.ffn_gate_exps, x3, sel);
    ggml_tensor * h = ggml_swiglu_split(c, gate, up);
    ggml_tensor * out = ggml_mul(c, ggml_mul_mat_id(c, L.ffn_down_exps, h, sel), w);  // [dm, nu, n]
    ggml_tensor * sum = ggml_view_2d(c, out, dm, n, out->nb[2], 0);
    for (int64_t i = 1; i < nu; ++i) sum = ggml_add(c, sum, ggml_view_2d(c, out, dm, n, out->nb[2], (size_t)i * out->nb[1]));
    if (nu == 1) sum = ggml_cont(c, sum);
    if (L.ffn_up_shexp) sum = ggml_add(c, sum, glu_ffn(c, x, L.ffn_gate_shexp, L.ffn_up_shexp, L.ffn_down_shexp, Act::Silu));
    return sum;
}

ggml_tensor * build(Build & b, ggml_tensor * x) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const Dsa & d = dsa(m);
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
        keep_last(b, il, &cur, &x);
        ggml_tensor * h = ggml_add(c, cur, x);
        cur = rms(c, h, L.ffn_norm, m->eps);
        cur = il < d.dense_lead ? glu_ffn(c, cur, L.w_gate, L.w_up, L.w_down, Act::Silu) : moe(b, il, cur);
        x = ggml_add(c, cur, h);
    }
    return x;
}

const Arch kGlmDsa = {"glm-dsa", read, want, build, nullptr, false, kKvCacheTypes};
ArchRegistration reg(&kGlmDsa);

// --- the latent state kind: per position one latent row, and on full-indexer layers one indexer-K row,
// both in the cache type; rows are whole positions, so growth, truncation and snapshots are exact -------

std::vector<int64_t> row_elems(const ggswarm_model * m, int32_t il) {
    const Dsa & d = dsa(m);
    std::vector<int64_t> r{d.latent()};
    if (d.full[il]) r.push_back(d.idx_len);
    return r;
}

void lat_plan(const ggswarm_model * m, int32_t il, int64_t cap, ggml_context * ctx, std::vector<ggml_tensor *> & out) {
    for (int64_t e : row_elems(m, il)) out.push_back(ggml_new_tensor_2d(ctx, m->cache_type, e, cap));
}

void lat_carry(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & from,
               const std::vector<ggml_tensor *> & to, int32_t len) {
    std::vector<uint8_t> tmp;
    for (size_t i = 0; i < from.size(); ++i) {
        const size_t bytes = (size_t)len * from[i]->nb[1];
        tmp.resize(bytes);
        ggml_backend_tensor_get(from[i], tmp.data(), 0, bytes);
        ggml_backend_tensor_set(to[i], tmp.data(), 0, bytes);
    }
}

uint64_t lat_per_token(const ggswarm_model * m, int32_t il) {
    uint64_t b = 0;
    for (int64_t e : row_elems(m, il)) b += ggml_row_size(m->cache_type, e);
    return b;
}

uint64_t lat_snapshot_bytes(const ggswarm_model * m, int32_t il, int32_t len) { return (uint64_t)len * lat_per_token(m, il); }

void lat_save(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p) {
    for (ggml_tensor * x : t) {
        const size_t bytes = (size_t)len * x->nb[1];
        ggml_backend_tensor_get(x, p, 0, bytes);
        p += bytes;
    }
}

void lat_load(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, const uint8_t * p) {
    for (ggml_tensor * x : t) {
        const size_t bytes = (size_t)len * x->nb[1];
        ggml_backend_tensor_set(x, p, 0, bytes);
        p += bytes;
    }
}

const StateOps kLatentState = {kLatent, "latent", 2, lat_plan, lat_carry, lat_per_token, lat_snapshot_bytes,
                               lat_save, lat_load};
StateRegistration reg_latent(&kLatentState);

}  // namespace
}  // namespace ggswarm
