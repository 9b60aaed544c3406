// The pieces every architecture's window graph is built from (norms, RoPE, attention over the session's
// cache in the model's attention mode, gated FFNs, mixture of experts), and the architecture table.

#include <algorithm>
#include <cmath>
#include <map>

#include "arch.h"
#include "attention.h"

namespace ggswarm {

ggml_tensor * rms(ggml_context * c, ggml_tensor * x, ggml_tensor * w, float eps) {
    return ggml_mul(c, ggml_rms_norm(c, x, eps), w);
}

ggml_tensor * linear(ggml_context * c, ggml_tensor * w, ggml_tensor * b, ggml_tensor * x) {
    ggml_tensor * y = ggml_mul_mat(c, w, x);
    return b ? ggml_add(c, y, b) : y;
}

ggml_tensor * rope(Build & b, int32_t il, ggml_tensor * x) {
    const ggswarm_model * m = b.m;
    const LayerHp & h = b.hp(il);
    return ggml_rope_ext(b.c, x, b.g.inp_pos, m->rope_freqs, m->n_rot, m->rope_mode, m->rope.n_ctx_orig, h.rope_base,
                         h.rope_scale, h.rope_ext, h.rope_attn, m->rope.beta_fast, m->rope.beta_slow);
}

std::vector<float> hadamard(int64_t n) {
    std::vector<float> h((size_t)(n * n), 0.0f);
    h[0] = 1.0 / sqrtf((float)n);
    for (int64_t s = 1; s < n; s *= 2) {  // each doubling copies the block right and down, negated on the diagonal
        for (int64_t i = 0; i < s; ++i) {
            for (int64_t j = 0; j < s; ++j) {
                const float v = h[(size_t)(i * n + j)];
                h[(size_t)((i + s) * n + j)] = v;
                h[(size_t)(i * n + j + s)] = v;
                h[(size_t)((i + s) * n + j + s)] = -v;
            }
        }
    }
    return h;
}

int64_t rot_size(int64_t n) {
    int64_t r = 64;
    do r *= 2;
    while (n % r == 0);
    return r / 2;
}

ggml_tensor * rotate(ggml_context * c, ggml_tensor * x, ggml_tensor * rot) {
    const int64_t r = rot->ne[0];
    ggml_tensor * y = ggml_is_contiguous(x) ? ggml_reshape_2d(c, x, r, ggml_nelements(x) / r)
                                            : ggml_cont_2d(c, x, r, ggml_nelements(x) / r);
    y = ggml_mul_mat(c, rot, y);
    ggml_mul_mat_set_hint(y, GGML_HINT_SRC0_IS_HADAMARD);
    return ggml_reshape_4d(c, y, x->ne[0], x->ne[1], x->ne[2], x->ne[3]);
}

Qkv qkv(Build & b, int32_t il, ggml_tensor * cur) {
    const Layer & L = b.layer(il);
    const ggswarm_model * m = b.m;
    Qkv r;
    r.q = ggml_reshape_3d(b.c, linear(b.c, L.wq, L.bq, cur), m->head_dim, m->n_head, b.n);
    r.k = ggml_reshape_3d(b.c, linear(b.c, L.wk, L.bk, cur), m->head_dim, m->n_head_kv, b.n);
    r.v = linear(b.c, L.wv, L.bv, cur);
    return r;
}

namespace {

ggml_tensor * attend(Build & b, int32_t il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale);

}  // namespace

// A quantized cache holds rotated rows, as llama.cpp's (build_attn): queries and keys by rot_k, values by
// rot_v, and the output rotated back by rot_v (H H = I).
ggml_tensor * attention(Build & b, int32_t il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale) {
    const ggswarm_model * m = b.m;
    if (m->rot_k) {
        q = rotate(b.c, q, m->rot_k);
        k = rotate(b.c, k, m->rot_k);
    }
    if (m->rot_v) v = rotate(b.c, v, m->rot_v);
    ggml_tensor * o = b.g.members.empty() ? attend(b, il, q, k, v, kq_scale) : attention_many(b, il, q, k, v, kq_scale);
    return m->rot_v ? rotate(b.c, o, m->rot_v) : o;
}

ggml_tensor * qk_norm_attention(Build & b, int32_t il, ggml_tensor * cur) {
    const ggswarm_model * m = b.m;
    const Layer & L = b.layer(il);
    Qkv a = qkv(b, il, cur);
    ggml_tensor * q = rope(b, il, rms(b.c, a.q, L.q_norm, m->eps));
    ggml_tensor * k = rope(b, il, rms(b.c, a.k, L.k_norm, m->eps));
    cur = attention(b, il, q, k, a.v, 1.0f / sqrtf((float)m->head_dim));
    return linear(b.c, L.wo, L.bo, cur);
}

void want_qk_norm_attention(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    want_attention(m, il, L, w);
    w.need(blk(il, "attn_q_norm.weight"), {m->head_dim}, &L.q_norm);
    w.need(blk(il, "attn_k_norm.weight"), {m->head_dim}, &L.k_norm);
}

namespace {

ggml_tensor * attend(Build & b, int32_t il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale) {
    ggswarm_model * m = b.m;
    Graph & g = b.g;
    ggml_context * c = b.c;
    const int32_t n = b.n;
    const int64_t dkv = m->d_kv();
    // append the new positions to the bound session's cache (K rows; V transposed, or V rows for flash
    // attention); index inputs instead of view offsets keep the graph independent of the position
    ggml_tensor * kc = b.state(il)[0];
    ggml_tensor * vc = b.state(il)[1];
    // a sliding-window layer's cache is a ring (swa_rows slots): its own indices, span and mask
    const bool swa = swa_ring(m, il);
    ggml_tensor * kidx = swa ? g.inp_kidx_swa : g.inp_kidx;
    const int32_t n_kv = swa ? (int32_t)std::min<int64_t>(b.n_kv, swa_rows(m, b.cap)) : b.n_kv;
    ggml_tensor * k_put = ggml_set_rows(c, kc, ggml_reshape_2d(c, k, dkv, n), kidx);
    ggml_build_forward_expand(g.gf, k_put);
    ggml_tensor * v_put;
    if (m->flash()) {
        v_put = ggml_set_rows(c, vc, ggml_reshape_2d(c, v, dkv, n), kidx);
    } else {
        ggml_tensor * v_elems = ggml_reshape_2d(c, vc, 1, ggml_nelements(vc));
        v_put = ggml_set_rows(c, v_elems, ggml_reshape_2d(c, v, 1, (int64_t)n * dkv), swa ? g.inp_vidx_swa : g.inp_vidx);
    }
    ggml_build_forward_expand(g.gf, v_put);
    ggml_tensor * mask = swa ? g.inp_mask_swa : g.inp_mask;
    ggml_tensor * sinks = b.layer(il).attn_sinks;
    if (m->flash()) return flash_attention(c, q, kc, vc, mask, n, n_kv, kq_scale, sinks, b.tile_queries);
    // the kernels attend every position up to the new one: a sliding-window layer takes ggml's ops and
    // its mask instead (the same numbers as the kernels wherever the window covers the whole span), as
    // does a layer with attention sinks (the kernels' softmax has none)
    if (kernel_step(m, n) && !swa && !sinks) {
        return kernel_attention(c, q, kc, vc, g.inp_pos, b.n_kv, k_put, v_put, kq_scale);
    }
    return ops_attention(c, q, kc, vc, mask, n, n_kv, kq_scale, nullptr, sinks);
}

}  // namespace

void keep_last(Build & b, int32_t il, ggml_tensor ** cur, ggml_tensor ** x) {
    if (!b.g.members.empty()) {  // several sessions: their final rows, by index (inp_last)
        if (!b.last_only || il != b.m->layer_end - 1 || !b.g.inp_last) return;
        *cur = ggml_get_rows(b.c, *cur, b.g.inp_last);
        *x = ggml_get_rows(b.c, *x, b.g.inp_last);
        return;
    }
    if (!b.last_only || il != b.m->layer_end - 1 || b.n <= 1) return;
    ggml_tensor * t = *cur;
    *cur = ggml_view_2d(b.c, t, t->ne[0], 1, t->nb[1], (size_t)(b.n - 1) * t->nb[1]);
    t = *x;
    *x = ggml_view_2d(b.c, t, t->ne[0], 1, t->nb[1], (size_t)(b.n - 1) * t->nb[1]);
}

ggml_tensor * glu_ffn(ggml_context * c, ggml_tensor * x, ggml_tensor * gate, ggml_tensor * up, ggml_tensor * down,
                      Act act) {
    ggml_tensor * g = ggml_mul_mat(c, gate, x);
    ggml_tensor * u = ggml_mul_mat(c, up, x);
    ggml_tensor * h = act == Act::Gelu ? ggml_geglu_split(c, g, u) : ggml_swiglu_split(c, g, u);
    return ggml_mul_mat(c, down, h);
}

namespace {

// DeepSeek-V3's group-limited routing: keep the selection scores of the n_group_used groups whose two
// best experts score highest, -inf elsewhere; select [n_expert, n] -> the same.
ggml_tensor * limit_to_groups(ggml_context * c, ggml_tensor * select, const Moe & p) {
    const int64_t n = select->ne[1], per = p.n_expert / p.n_groups;
    ggml_tensor * groups = ggml_reshape_3d(c, select, per, p.n_groups, n);
    ggml_tensor * best2 = ggml_argsort_top_k(c, groups, 2);  // [2, n_groups, n]
    ggml_tensor * score = ggml_get_rows(c, ggml_reshape_4d(c, groups, 1, per, p.n_groups, n), best2);
    score = ggml_sum_rows(c, ggml_reshape_3d(c, score, 2, p.n_groups, n));  // [1, n_groups, n]
    ggml_tensor * kept = ggml_argsort_top_k(c, ggml_reshape_2d(c, score, p.n_groups, n), p.n_group_used);
    ggml_tensor * rows = ggml_get_rows(c, groups, kept);  // [per, n_group_used, n]
    ggml_tensor * out = ggml_set_rows(c, ggml_fill(c, groups, -INFINITY), rows, kept);
    return ggml_reshape_2d(c, out, p.n_expert, n);
}

}  // namespace

ggml_tensor * moe_ffn(ggml_context * c, ggml_tensor * x, const Moe & p) {
    const int64_t d = x->ne[0], n = x->ne[1];
    ggml_tensor * logits = ggml_mul_mat(c, p.gate_inp, x);  // [n_expert, n]
    if (p.gate_inp_b) logits = ggml_add(c, logits, p.gate_inp_b);
    ggml_tensor * probs = p.gating == Gating::Sigmoid         ? ggml_sigmoid(c, logits)
                          : p.gating == Gating::SoftmaxWeight ? logits
                                                              : ggml_soft_max(c, logits);
    // the selection bias chooses the experts; their weights stay the unbiased probabilities
    ggml_tensor * select = p.exp_probs_b ? ggml_add(c, probs, p.exp_probs_b) : probs;
    if (p.n_groups > 1 && n > 0) select = limit_to_groups(c, select, p);
    ggml_tensor * sel = ggml_argsort_top_k(c, select, p.n_used);  // [n_used, n] expert ids
    ggml_tensor * w = ggml_get_rows(c, ggml_reshape_3d(c, probs, 1, p.n_expert, n), sel);  // [1, n_used, n]
    if (p.gating == Gating::SoftmaxWeight) {
        w = ggml_reshape_3d(c, ggml_soft_max(c, ggml_reshape_2d(c, w, p.n_used, n)), 1, p.n_used, n);
    }
    if (p.norm_w) {
        ggml_tensor * w2 = ggml_reshape_2d(c, w, p.n_used, n);
        // a sum below f16's smallest normal is clamped there, as llama.cpp does (exact otherwise)
        w2 = ggml_div(c, w2, ggml_clamp(c, ggml_sum_rows(c, w2), 6.103515625e-5f, INFINITY));
        w = ggml_reshape_3d(c, w2, 1, p.n_used, n);
    }
    if (p.w_scale != 0.0f && p.w_scale != 1.0f) w = ggml_scale(c, w, p.w_scale);
    ggml_tensor * x3 = ggml_reshape_3d(c, x, d, 1, n);
    ggml_tensor * up = ggml_mul_mat_id(c, p.up_exps, x3, sel);     // [ff, n_used, n]
    if (p.up_b) up = ggml_add_id(c, up, p.up_b, sel);
    ggml_tensor * gate = ggml_mul_mat_id(c, p.gate_exps, x3, sel);
    if (p.gate_b) gate = ggml_add_id(c, gate, p.gate_b, sel);
    ggml_tensor * h = p.act == Act::Gelu        ? ggml_geglu_split(c, gate, up)
                      : p.act == Act::SwigluOai ? ggml_swiglu_oai(c, gate, up, 1.702f, 7.0f)
                                                : ggml_swiglu_split(c, gate, up);
    ggml_tensor * out = ggml_mul_mat_id(c, p.down_exps, h, sel);  // [d, n_used, n]
    if (p.down_b) out = ggml_add_id(c, out, p.down_b, sel);
    out = ggml_mul(c, out, w);
    ggml_tensor * sum = ggml_view_2d(c, out, d, n, out->nb[2], 0);
    for (int32_t i = 1; i < p.n_used; ++i) {
        sum = ggml_add(c, sum, ggml_view_2d(c, out, d, n, out->nb[2], (size_t)i * out->nb[1]));
    }
    if (p.n_used == 1) sum = ggml_cont(c, sum);
    if (p.sh_up) {
        ggml_tensor * sh = glu_ffn(c, x, p.sh_gate, p.sh_up, p.sh_down, p.act);
        if (p.sh_gate_inp) sh = ggml_mul(c, sh, ggml_sigmoid(c, ggml_mul_mat(c, p.sh_gate_inp, x)));
        sum = ggml_add(c, sum, sh);
    }
    return sum;
}

ggswarm_status read_moe_hparams(ggswarm_model * m, const Hp & hp, MoeHp * e) {
    const char * a = hp.prefix.c_str();
    ggswarm_status st;
    if ((st = hp.need_int("expert_count", 1, 4096, &e->n_expert))) return st;
    if ((st = hp.need_int("expert_used_count", 1, e->n_expert, &e->n_used))) return st;
    int64_t v = 0;
    if (hp.has("expert_feed_forward_length")) {
        if ((st = hp.need_int("expert_feed_forward_length", 1, 1 << 22, &e->n_ff_exp))) return st;
    } else if (m->n_ff > 0) {
        e->n_ff_exp = m->n_ff / e->n_used;  // llama.cpp's fallback
    } else {
        return fail(m, GGSWARM_E_FORMAT, "%sexpert_feed_forward_length is missing", a);
    }
    if (hp.has("expert_shared_count") && (st = hp.need_int("expert_shared_count", 0, 64, &e->n_shexp))) return st;
    if (hp.has("leading_dense_block_count")) {
        if ((st = hp.need_int("leading_dense_block_count", 0, m->n_layers_total, &e->dense_lead))) return st;
    }
    if (hp.has("expert_group_count") && (st = hp.need_int("expert_group_count", 0, e->n_expert, &e->n_groups))) return st;
    if (hp.has("expert_group_used_count")) {
        if ((st = hp.need_int("expert_group_used_count", 0, e->n_expert, &e->n_group_used))) return st;
    }
    if (e->n_groups > 1 && (e->n_expert % e->n_groups != 0 || e->n_group_used < 1 || e->n_group_used >= e->n_groups ||
                            e->n_expert / e->n_groups < 2)) {
        return fail(m, GGSWARM_E_FORMAT, "%sexpert_group_count %d / expert_group_used_count %d do not fit %d experts", a,
                    e->n_groups, e->n_group_used, e->n_expert);
    }
    double f = 0;
    if (hp.has("expert_weights_scale") && !hp.opt_float("expert_weights_scale", &f)) {
        return fail(m, GGSWARM_E_FORMAT, "%sexpert_weights_scale is not a number", a);
    }
    e->w_scale = (float)f;
    if (hp.opt_bool("expert_weights_norm", &e->norm_w) < 0) {
        return fail(m, GGSWARM_E_FORMAT, "%sexpert_weights_norm is not a bool", a);
    }
    if (hp.opt_int("expert_gating_func", &v) && v != 0) {
        if (v != 1 && v != 2) {
            return fail(m, GGSWARM_E_UNSUPPORTED, "%sexpert_gating_func %lld: only softmax (1) and sigmoid (2) are supported",
                        a, (long long)v);
        }
        e->gating = v == 2 ? Gating::Sigmoid : Gating::Softmax;
    }
    m->nodes_per_layer = std::max(m->nodes_per_layer, 96 + 4 * e->n_used);  // a view and an add per expert used
    return GGSWARM_OK;
}

void want_experts(const ggswarm_model * m, const MoeHp & e, int32_t il, Layer & L, Wants & w, bool bias, bool need_bias) {
    const int64_t d = m->d_model, ne = e.n_expert, ff = e.n_ff_exp, sh = (int64_t)e.n_ff_exp * e.n_shexp;
    w.need(blk(il, "ffn_gate_inp.weight"), {d, ne}, &L.ffn_gate_inp);
    if (bias && need_bias) w.need(blk(il, "exp_probs_b.bias"), {ne}, &L.extra["exp_probs_b"]);
    else if (bias) w.opt(blk(il, "exp_probs_b.bias"), {ne}, &L.extra["exp_probs_b"]);
    w.need(blk(il, "ffn_gate_exps.weight"), {d, ff, ne}, &L.ffn_gate_exps);
    w.need(blk(il, "ffn_up_exps.weight"), {d, ff, ne}, &L.ffn_up_exps);
    w.need(blk(il, "ffn_down_exps.weight"), {ff, d, ne}, &L.ffn_down_exps);
    if (sh > 0) {
        w.need(blk(il, "ffn_gate_shexp.weight"), {d, sh}, &L.ffn_gate_shexp);
        w.need(blk(il, "ffn_up_shexp.weight"), {d, sh}, &L.ffn_up_shexp);
        w.need(blk(il, "ffn_down_shexp.weight"), {sh, d}, &L.ffn_down_shexp);
    }
}

Moe routed_experts(const MoeHp & e, const Layer & L) {
    Moe p;
    p.gate_inp = L.ffn_gate_inp;
    auto b = L.extra.find("exp_probs_b");
    p.exp_probs_b = b == L.extra.end() ? nullptr : b->second;
    p.gate_exps = L.ffn_gate_exps;
    p.up_exps = L.ffn_up_exps;
    p.down_exps = L.ffn_down_exps;
    p.n_expert = e.n_expert;
    p.n_used = e.n_used;
    p.n_groups = e.n_groups;
    p.n_group_used = e.n_group_used;
    p.gating = e.gating;
    p.norm_w = e.norm_w;
    p.w_scale = e.w_scale;
    return p;
}

// --- the tables ------------------------------------------------------------------------------------------

namespace {

std::map<std::string, const Arch *> & arch_table() {
    static std::map<std::string, const Arch *> t;
    return t;
}

std::map<int32_t, const StateOps *> & state_table() {
    static std::map<int32_t, const StateOps *> t;
    return t;
}

}  // namespace

void register_arch(const Arch * a) { arch_table()[a->name] = a; }

const Arch * find_arch(const std::string & name) {
    auto it = arch_table().find(name);
    return it == arch_table().end() ? nullptr : it->second;
}

std::string arch_names() {
    std::string s;
    for (const auto & kv : arch_table()) s += (s.empty() ? "" : ", ") + kv.first;
    return s;
}

void register_state_kind(const StateOps * ops) { state_table()[(int32_t)ops->kind] = ops; }

const StateOps * state_ops(StateKind k) {
    auto it = state_table().find((int32_t)k);
    return it == state_table().end() ? nullptr : it->second;
}

}  // namespace ggswarm
