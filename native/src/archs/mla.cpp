// Multi-head latent attention (mla.h): hyper-parameters, tensors, the absorbed attention over the
// latent cache, and the latent state kind. Written from llama.cpp's description of the models (which
// ggml ops its deepseek2 and glm-dsa graphs run, in which order), so the numbers follow llama.cpp's.

#include "archs/mla.h"

#include <cmath>
#include <vector>

namespace ggswarm {

ggswarm_status read_mla_hparams(ggswarm_model * m, const Hp & hp, Mla * d) {
    const char * a = hp.prefix.c_str();
    ggswarm_status st;
    if ((st = hp.need_int("attention.head_count", 1, 4096, &m->n_head))) return st;
    if ((st = hp.need_int("rope.dimension_count", 2, 4096, &m->n_rot))) return st;
    if (hp.has("attention.q_lora_rank") && (st = hp.need_int("attention.q_lora_rank", 0, 1 << 16, &d->q_lora))) return st;
    if ((st = hp.need_int("attention.kv_lora_rank", 1, 1 << 16, &d->kv_lora))) return st;
    if (!hp.has("attention.key_length_mla") || !hp.has("attention.value_length_mla")) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "%s without %sattention.key_length_mla / value_length_mla (a file whose "
                    "attn_kv_b is not split into attn_k_b and attn_v_b) is not supported: reconvert it", m->arch.c_str(), a);
    }
    if ((st = hp.need_int("attention.key_length_mla", 1, 4096, &d->k_mla))) return st;
    if ((st = hp.need_int("attention.value_length_mla", 1, 4096, &d->v_mla))) return st;
    if (d->k_mla <= m->n_rot) {
        return fail(m, GGSWARM_E_FORMAT, "%sattention.key_length_mla %d must exceed rope.dimension_count %d", a, d->k_mla,
                    m->n_rot);
    }
    d->nope = d->k_mla - m->n_rot;
    m->n_head_kv = 1;
    m->head_dim = (int32_t)d->latent();  // what a snapshot header records: one latent row per position
    m->rope_mode = GGML_ROPE_TYPE_NORMAL;
    for (LayerHp & l : m->lhp) l.state = kLatent;
    return GGSWARM_OK;
}

void want_mla(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    const Mla & d = mla(m);
    const int64_t dm = m->d_model, nh = m->n_head;
    w.need(blk(il, "attn_norm.weight"), {dm}, &L.attn_norm);
    if (d.q_lora > 0) w.need(blk(il, "attn_q_a_norm.weight"), {d.q_lora}, &L.extra["attn_q_a_norm"]);
    w.need(blk(il, "attn_kv_a_norm.weight"), {d.kv_lora}, &L.extra["attn_kv_a_norm"]);
    if (d.q_lora > 0) {
        w.need(blk(il, "attn_q_a.weight"), {dm, d.q_lora}, &L.extra["attn_q_a"]);
        w.need(blk(il, "attn_q_b.weight"), {d.q_lora, nh * d.k_mla}, &L.extra["attn_q_b"]);
    } else {
        w.need(blk(il, "attn_q.weight"), {dm, nh * d.k_mla}, &L.wq);
    }
    w.need(blk(il, "attn_kv_a_mqa.weight"), {dm, d.latent()}, &L.extra["attn_kv_a_mqa"]);
    w.need(blk(il, "attn_k_b.weight"), {d.nope, d.kv_lora, nh}, &L.extra["attn_k_b"]);
    w.need(blk(il, "attn_v_b.weight"), {d.kv_lora, d.v_mla, nh}, &L.extra["attn_v_b"]);
    w.need(blk(il, "attn_output.weight"), {nh * d.v_mla, dm}, &L.wo);
}

MlaQk mla_qk(Build & b, int32_t il, ggml_tensor * cur, ggml_tensor * q) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const Mla & d = mla(m);
    const Layer & L = b.layer(il);
    const int64_t n = b.n, nh = m->n_head, rot = m->n_rot, lora = d.kv_lora, lat = d.latent();
    const size_t qrow = ggml_row_size(q->type, d.k_mla);
    ggml_tensor * q_nope = ggml_view_3d(c, q, d.nope, nh, n, qrow, qrow * nh, 0);
    ggml_tensor * q_pe = ggml_view_3d(c, q, rot, nh, n, qrow, qrow * nh, ggml_row_size(q->type, d.nope));
    ggml_tensor * kvpe = ggml_mul_mat(c, L.extra.at("attn_kv_a_mqa"), cur);  // [lat, n]
    const size_t krow = ggml_row_size(kvpe->type, lat);
    ggml_tensor * kv = ggml_view_2d(c, kvpe, lora, n, krow, 0);
    ggml_tensor * k_pe = ggml_view_3d(c, kvpe, rot, 1, n, krow, krow, ggml_row_size(kvpe->type, lora));
    q_pe = rope(b, il, q_pe);
    k_pe = rope(b, il, k_pe);
    kv = rms(c, kv, L.extra.at("attn_kv_a_norm"), m->eps);
    // absorb wk_b into the query: attention runs over the latent rows as one shared head
    ggml_tensor * qa = ggml_mul_mat(c, L.extra.at("attn_k_b"), ggml_permute(c, q_nope, 0, 2, 1, 3));
    qa = ggml_permute(c, qa, 0, 2, 1, 3);  // [lora, nh, n]
    return {ggml_concat(c, qa, q_pe, 0), ggml_concat(c, ggml_reshape_3d(c, kv, lora, 1, n), k_pe, 0)};
}

ggml_tensor * causal_mask(Build & b) {
    ggml_context * c = b.c;
    ggml_tensor * j = ggml_reshape_2d(c, ggml_arange(c, 0.0f, (float)b.n_kv, 1.0f), b.n_kv, 1);
    ggml_tensor * p = ggml_reshape_2d(c, ggml_cast(c, b.g.inp_pos, GGML_TYPE_F32), 1, b.n);
    ggml_tensor * later = ggml_step(c, ggml_sub(c, ggml_repeat_4d(c, j, b.n_kv, b.n, 1, 1), p));
    return ggml_log(c, ggml_scale_bias(c, later, -1.0f, 1.0f));
}

ggml_tensor * mla_attend(Build & b, int32_t il, const MlaQk & qk, ggml_tensor * mask, bool flash, int32_t n_kv_max,
                         float kq_scale) {
    ggml_context * c = b.c;
    const Mla & d = mla(b.m);
    const Layer & L = b.layer(il);
    const int64_t n = b.n, lora = d.kv_lora, lat = d.latent();
    ggml_build_forward_expand(b.g.gf, qk.q);
    ggml_build_forward_expand(b.g.gf, qk.k);
    ggml_tensor * cache = b.state(il)[0];
    ggml_build_forward_expand(b.g.gf, ggml_set_rows(c, cache, ggml_reshape_2d(c, qk.k, lat, n), b.g.inp_pos));
    ggml_tensor * kview = ggml_view_3d(c, cache, lat, 1, b.n_kv, cache->nb[1], cache->nb[1], 0);
    ggml_tensor * vview = ggml_view_3d(c, cache, lora, 1, b.n_kv, cache->nb[1], cache->nb[1], 0);
    ggml_tensor * qp = ggml_permute(c, qk.q, 0, 2, 1, 3);
    ggml_tensor * kp = ggml_permute(c, kview, 0, 2, 1, 3);
    ggml_tensor * vp = ggml_permute(c, vview, 0, 2, 1, 3);
    ggml_tensor * kqv;
    if (flash) {
        ggml_tensor * o = ggml_flash_attn_ext(c, qp, kp, vp, ggml_cast(c, mask, GGML_TYPE_F16), kq_scale, 0.0f, 0.0f);
        if (n_kv_max > 0) ggml_flash_attn_ext_set_n_kv_max(o, n_kv_max);
        ggml_prec_set_acc(o, GGML_PREC_F32);
        kqv = ggml_permute(c, o, 0, 2, 1, 3);  // [lora, nh, n] -> [lora, n, nh]
    } else {
        ggml_tensor * kq = ggml_mul_mat(c, kp, qp);  // [n_kv, n, nh]
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        kq = ggml_soft_max_ext(c, kq, mask, kq_scale, 0.0f);
        ggml_tensor * vt = ggml_cont(c, ggml_transpose(c, vp));
        kqv = ggml_mul_mat(c, vt, kq);  // [lora, n, nh]
    }
    kqv = ggml_mul_mat(c, L.extra.at("attn_v_b"), kqv);  // [v_mla, n, nh]
    ggml_tensor * out = ggml_permute(c, kqv, 0, 2, 1, 3);
    return ggml_cont_2d(c, out, out->ne[0] * out->ne[1], out->ne[2] * out->ne[3]);
}

ggswarm_status mla_check_cache_type(ggswarm_model * m, ggml_type t) {
    const int32_t v = mla(m).kv_lora;
    if (v % ggml_blck_size(t) == 0) return GGSWARM_OK;
    return fail(m, GGSWARM_E_UNSUPPORTED, "cache type %s with block size %lld does not divide the value head size %d",
                ggml_type_name(t), (long long)ggml_blck_size(t), v);
}

namespace {

// --- the latent state kind: per position one latent row, and where the architecture says so a second
// row (glm-dsa's indexer keys), both in the cache type; rows are whole positions, so growth, truncation
// and snapshots are exact ---------------------------------------------------------------------------------

std::vector<int64_t> row_elems(const ggswarm_model * m, int32_t il) {
    const Mla & d = mla(m);
    std::vector<int64_t> r{d.latent()};
    if (int64_t e = d.second_row(il)) r.push_back(e);
    return r;
}

void lat_plan(const ggswarm_model * m, int32_t il, int64_t cap, ggml_context * ctx, std::vector<ggml_tensor *> & out) {
    for (int64_t e : row_elems(m, il)) out.push_back(ggml_new_tensor_2d(ctx, m->cache_type, e, cap));
}

void lat_carry(const ggswarm_model *, int32_t, const std::vector<ggml_tensor *> & from,
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

void lat_save(const ggswarm_model *, int32_t, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p) {
    for (ggml_tensor * x : t) {
        const size_t bytes = (size_t)len * x->nb[1];
        ggml_backend_tensor_get(x, p, 0, bytes);
        p += bytes;
    }
}

void lat_load(const ggswarm_model *, int32_t, const std::vector<ggml_tensor *> & t, int32_t len, const uint8_t * p) {
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
