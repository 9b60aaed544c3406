// DeepSeek-V4's window graph: the hyper-connections, attention over the raw window and the compressed caches
// (the compressors, the lightning indexer), the hash-routed and top-k experts, and the streams' head.

#include <algorithm>
#include <cmath>
#include <vector>

#include "archs/deepseek4.h"
#include "attention.h"

namespace ggswarm {
namespace deepseek4 {
namespace {

// --- graph pieces ----------------------------------------------------------------------------------------

// llama.cpp rotates a cache's K (and the queries, and the attention output back) by an orthonormal
// Walsh-Hadamard matrix where its rows are as wide as the indexer's keys (always the indexer's own
// cache; for the others a quirk of small files, where head_dim = indexer key length) or where the
// cache is quantized (llama-kv-cache.cpp, attn_rot_k). In f32 the rotation changes nothing but
// rounding; in f16 it decides what is rounded, so the cache must hold what llama.cpp's holds.
bool rotates(const ggswarm_model * m, int64_t width) {
    return width == dsv4(m).idx_len || (ggml_is_quantized(m->cache_type) && width % 64 == 0);
}

ggml_tensor * ex(const Layer & L, const char * name) { return L.extra.at(name); }

// RoPE of the last n_rot channels of x [hd, heads, n] (the first hd - n_rot pass through), with layer
// il's base, scale and YaRN (deepseek4's per-layer rule, read)
ggml_tensor * rope_tail(Build & b, int32_t il, ggml_tensor * x, ggml_tensor * pos, bool back = false) {
    const int32_t nr = dsv4(b.m).n_rot;
    const LayerHp & l = b.m->lhp[il];
    const RopeScaling & rs = b.m->rope;
    const int32_t orig = l.rope_ext != 0.0f ? rs.n_ctx_orig : 0;
    const float bf = l.rope_ext != 0.0f ? rs.beta_fast : 0.0f, bs = l.rope_ext != 0.0f ? rs.beta_slow : 0.0f;
    ggml_tensor * r = back ? ggml_rope_ext_back(b.c, x, pos, nullptr, nr, GGML_ROPE_TYPE_NORMAL, orig, l.rope_base,
                                                l.rope_scale, l.rope_ext, l.rope_attn, bf, bs)
                           : ggml_rope_ext(b.c, x, pos, nullptr, nr, GGML_ROPE_TYPE_NORMAL, orig, l.rope_base,
                                           l.rope_scale, l.rope_ext, l.rope_attn, bf, bs);
    return ggml_rope_set_offset(r, (int)(x->ne[0] - nr));
}

ggml_tensor * view1(ggml_context * c, ggml_tensor * t, int64_t n, int64_t off) {
    return ggml_view_1d(c, t, n, ggml_row_size(t->type, off));
}

// sum over streams of x [d, hc, n] weighted by w [hc, n]: the head's (llama.cpp fuses the layers' only)
ggml_tensor * weigh_streams(Build & b, ggml_tensor * x, ggml_tensor * w) {
    ggml_tensor * r = nullptr;
    for (int64_t s = 0; s < x->ne[1]; ++s) {
        ggml_tensor * xs = ggml_view_2d(b.c, x, x->ne[0], x->ne[2], x->nb[2], s * x->nb[1]);
        ggml_tensor * ws = ggml_view_2d(b.c, w, 1, x->ne[2], w->nb[1], s * w->nb[0]);
        ggml_tensor * t = ggml_mul(b.c, xs, ws);
        r = r ? ggml_add(b.c, r, t) : t;
    }
    return r;
}

struct HcMix {
    ggml_tensor * post;
    ggml_tensor * comb;
};

// The hyper-connection read of x [d, hc, n]: mixing weights from the RMS-normed streams, the pre
// weights' sum of the streams (returned, [d, n]), the post weights and the stream mixing matrix (its
// Sinkhorn normalisation: softmax over dst, then alternate column and row sums). llama.cpp runs the sum
// and the mixing matrix as ggml's fused dsv4_hc_pre and dsv4_hc_comb (cparams.fused_dsv4_hc_*, on in
// every context the backend takes them), which round otherwise than the separate ops: so here too.
ggml_tensor * hc_pre(Build & b, ggml_tensor * x, ggml_tensor * fn, ggml_tensor * scale, ggml_tensor * base, HcMix * out) {
    ggml_context * c = b.c;
    const Dsv4 & h = dsv4(b.m);
    const int64_t hc = h.hc, n = x->ne[2];
    ggml_tensor * flat = ggml_rms_norm(c, ggml_reshape_2d(c, x, x->ne[0] * hc, n), b.m->eps);
    ggml_tensor * mix = ggml_mul_mat(c, fn, flat);  // [(2 + hc) hc, n]
    auto part = [&](int64_t w, int64_t off, int64_t si) {
        ggml_tensor * v = ggml_view_2d(c, mix, w, n, mix->nb[1], ggml_row_size(mix->type, off));
        v = ggml_mul(c, v, view1(c, scale, 1, si));
        return ggml_add(c, v, view1(c, base, w, off));
    };
    ggml_tensor * pre = ggml_scale_bias(c, ggml_sigmoid(c, part(hc, 0, 0)), 1.0f, h.hc_eps);
    out->post = ggml_scale(c, ggml_sigmoid(c, part(hc, hc, 1)), 2.0f);
    out->comb = ggml_dsv4_hc_comb(c, mix, scale, base, h.hc_eps, h.sinkhorn);  // [dst, src, n]
    return ggml_dsv4_hc_pre(c, x, pre);
}

// The hyper-connection write: stream dst = f * post[dst] + sum_src residual[src] * comb[dst, src]
// (llama.cpp's fused dsv4_hc_post).
ggml_tensor * hc_post(Build & b, ggml_tensor * f, ggml_tensor * res, const HcMix & mx) {
    return ggml_dsv4_hc_post(b.c, f, res, mx.post, mx.comb);
}

// One compressor: per-position rows (kv, score + the position's ape row), after the ring's rows of the
// positions before the graph; then for each block slot a softmax over its rows (per channel) of the
// score, weighting the kv rows; RMS norm, RoPE at the block's first position, written to the compressed
// cache. The ring keeps the last rows (read before they are written over: the write takes them from the
// concatenation). Returns the compressed cache after the write, viewed over the graph's span.
ggml_tensor * compress(Build & b, int32_t il, ggml_tensor * cur, ggml_tensor * w_kv, ggml_tensor * w_gate,
                       ggml_tensor * ape, ggml_tensor * norm, int64_t width, int32_t r, ggml_tensor * comp_cache,
                       ggml_tensor * kv_ring, ggml_tensor * sc_ring) {
    ggml_context * c = b.c;
    const std::vector<ggml_tensor *> & in = b.g.arch_in;
    const bool overlap = r == kCsa;
    const int64_t nb = n_blocks(b.n, r), ring = kv_ring->ne[1], keep = std::min<int64_t>(b.n, ring);
    ggml_tensor * kv = ggml_mul_mat(c, w_kv, cur);
    ggml_tensor * sc = ggml_add(c, ggml_mul_mat(c, w_gate, cur), ggml_get_rows(c, ape, in[overlap ? kApe4 : kApe128]));
    ggml_tensor * all_kv = ggml_concat(c, kv_ring, kv, 1);  // [rw, ring + n]
    ggml_tensor * all_sc = ggml_concat(c, sc_ring, sc, 1);
    for (auto [all, dst] : {std::pair{all_kv, kv_ring}, std::pair{all_sc, sc_ring}}) {
        ggml_tensor * last = ggml_view_2d(c, all, all->ne[0], keep, all->nb[1], (size_t)(ring + b.n - keep) * all->nb[1]);
        ggml_build_forward_expand(b.g.gf, ggml_set_rows(c, dst, last, in[overlap ? kRows4 : kRows128]));
    }
    ggml_tensor * rows_kv = ggml_get_rows(c, all_kv, in[overlap ? kRead4 : kRead128]);
    ggml_tensor * rows_sc = ggml_get_rows(c, all_sc, in[overlap ? kRead4 : kRead128]);
    ggml_tensor * vals, * scores;
    if (overlap) {
        const int64_t nr = r * nb;
        auto half = [&](ggml_tensor * t, int64_t row0, int64_t col0) {
            ggml_tensor * v = ggml_view_2d(c, t, width, nr, t->nb[1], row0 * t->nb[1] + ggml_row_size(t->type, col0));
            return ggml_reshape_3d(c, ggml_cont(c, v), width, r, nb);
        };
        vals = ggml_concat(c, half(rows_kv, 0, 0), half(rows_kv, nr, width), 1);
        scores = ggml_concat(c, half(rows_sc, 0, 0), half(rows_sc, nr, width), 1);
        scores = ggml_add(c, scores, in[kBias4]);
    } else {
        vals = ggml_reshape_3d(c, rows_kv, width, r, nb);
        scores = ggml_reshape_3d(c, rows_sc, width, r, nb);
    }
    vals = ggml_cont(c, ggml_permute(c, vals, 1, 0, 2, 3));  // [rows, width, nb]
    scores = ggml_soft_max(c, ggml_cont(c, ggml_permute(c, scores, 1, 0, 2, 3)));
    ggml_tensor * comp = ggml_sum_rows(c, ggml_mul(c, vals, scores));  // [1, width, nb]
    comp = ggml_cont(c, ggml_permute(c, comp, 1, 0, 2, 3));            // [width, 1, nb]
    comp = rms(c, comp, norm, b.m->eps);
    comp = rope_tail(b, il, comp, in[overlap ? kCpos4 : kCpos128]);
    if (rotates(b.m, width)) comp = rotate(b.c, comp, in[width == dsv4(b.m).idx_len ? kRotIdx : kRotHead]);
    ggml_tensor * cc = ggml_set_rows(c, comp_cache, ggml_reshape_2d(c, comp, width, nb), in[overlap ? kWrite4 : kWrite128]);
    const int64_t held = n_comp_held(b.n_kv, b.cap, r);
    return ggml_view_2d(c, cc, width, held, cc->nb[1], 0);
}

// The compressed entries comp [width, held] padded to the mask's width `span` (n_comp_span) where the
// session holds fewer: llama.cpp's cache has zeros there, masked; any finite rows weigh 0 as well, so
// the first rows of the raw ring (in the cache type, always at least 256 of them) stand in.
ggml_tensor * comp_pad(Build & b, ggml_tensor * comp, ggml_tensor * ring, int64_t span) {
    const int64_t held = comp->ne[1];
    if (held >= span) return comp;
    return ggml_concat(b.c, comp, ggml_view_2d(b.c, ring, ring->ne[0], span - held, ring->nb[1], 0), 1);
}

// The lightning indexer's choice among the visible compressed entries: per position the top_k entries
// by sum over indexer heads of relu(q_h . k) * w_h. Returns the attention mask over the compressed
// span ([span, n]): 0 on the chosen visible entries, -inf elsewhere.
ggml_tensor * indexer_mask(Build & b, int32_t il, ggml_tensor * qr, ggml_tensor * cur, ggml_tensor * idx_k) {
    ggml_context * c = b.c;
    const Dsv4 & h = dsv4(b.m);
    const Layer & L = b.layer(il);
    const int64_t n = b.n, ih = h.idx_heads, il_ = h.idx_len;
    // the entries the session holds (idx_k's rows) of the mask's span; the rest stay masked
    ggml_tensor * mask_all = b.g.arch_in[kMask4];
    const int64_t held = idx_k->ne[1], span = mask_all->ne[0];
    ggml_tensor * mask = held < span ? ggml_cont(c, ggml_view_2d(c, mask_all, held, n, mask_all->nb[1], 0)) : mask_all;
    ggml_tensor * q = ggml_reshape_3d(c, ggml_mul_mat(c, ex(L, "idx_q_b"), qr), il_, ih, n);
    q = rotate(b.c, rope_tail(b, il, q, b.g.inp_pos), b.g.arch_in[kRotIdx]);  // the indexer's cache always rotates
    ggml_tensor * w = ggml_scale(c, ggml_mul_mat(c, ex(L, "idx_proj"), cur), 1.0f / sqrtf((float)(il_ * ih)));
    // llama.cpp's fused op (cparams.fused_lid, on for every context): the keys read back to f32 in
    // whatever type the cache holds, the sum over heads of relu(q . k) * w, plus the mask (f16, exact)
    ggml_tensor * keys = ggml_view_4d(c, idx_k, il_, 1, held, 1, idx_k->nb[1], idx_k->nb[1], idx_k->nb[1] * held, 0);
    ggml_tensor * score = ggml_lightning_indexer(c, ggml_reshape_4d(c, q, il_, ih, n, 1), keys,
                                                 ggml_reshape_4d(c, w, ih, n, 1, 1), ggml_cast(c, mask, GGML_TYPE_F16));
    score = ggml_reshape_2d(c, score, held, n);  // [held, n]
    const int64_t k_top = std::min<int64_t>(mask->ne[0], h.top_k);
    ggml_tensor * top = ggml_cont(c, ggml_top_k(c, score, (int)k_top));  // [k_top, n]
    ggml_tensor * all = ggml_fill(c, mask, -INFINITY);
    all = ggml_view_4d(c, all, 1, all->ne[0], all->ne[1], 1, all->nb[0], all->nb[1], all->nb[1] * all->ne[1], 0);
    ggml_tensor * zeros = ggml_fill(c, ggml_new_tensor_4d(c, GGML_TYPE_F32, 1, k_top, n, 1), 0.0f);
    ggml_tensor * sel = ggml_set_rows(c, all, zeros, top);
    sel = ggml_view_2d(c, sel, mask->ne[0], n, sel->nb[2], 0);
    sel = ggml_add(c, sel, mask);
    if (held < span) {
        sel = ggml_concat(c, sel, ggml_view_2d(c, mask_all, span - held, n, mask_all->nb[1], ggml_row_size(mask_all->type, held)), 0);
    }
    return sel;
}

// Attention of layer il on the normed stream sum cur [d, n]; returns the output projection [d, n].
ggml_tensor * attention_dsv4(Build & b, int32_t il, ggml_tensor * cur) {
    ggml_context * c = b.c;
    const ggswarm_model * m = b.m;
    const Dsv4 & h = dsv4(m);
    const Layer & L = b.layer(il);
    const std::vector<ggml_tensor *> & st = b.state(il);
    const std::vector<ggml_tensor *> & in = b.g.arch_in;
    const int64_t hd = m->head_dim, nh = m->n_head, n = b.n;
    const int32_t r = h.ratio[il];
    ggml_tensor * qr = rms(c, ggml_mul_mat(c, ex(L, "wq_a"), cur), ex(L, "q_a_norm"), m->eps);
    ggml_tensor * q = ggml_reshape_3d(c, ggml_mul_mat(c, ex(L, "wq_b"), qr), hd, nh, n);
    q = rope_tail(b, il, ggml_rms_norm(c, q, m->eps), b.g.inp_pos);
    ggml_tensor * kv = rms(c, ggml_mul_mat(c, ex(L, "wkv"), cur), ex(L, "kv_norm"), m->eps);
    kv = rope_tail(b, il, ggml_reshape_3d(c, kv, hd, 1, n), b.g.inp_pos);
    const bool rot = rotates(m, hd);
    ggml_tensor * rot_head = rot ? in[kRotHead] : nullptr;  // rot_size(hd) == rot_size(idx_len) when hd == idx_len
    if (rot) {
        q = rotate(b.c, q, rot_head);
        kv = rotate(b.c, kv, rot_head);
    }
    ggml_tensor * ring = ggml_set_rows(c, st[0], ggml_reshape_2d(c, kv, hd, n), in[kKidx]);
    ggml_tensor * raw = ggml_view_2d(c, ring, hd, raw_span(m, b.n_kv), ring->nb[1], 0);  // in the cache type, as llama.cpp reads it
    ggml_tensor * k_all = raw, * mask = in[kMaskRaw];
    if (r == kCsa) {
        ggml_tensor * comp = compress(b, il, cur, ex(L, "comp_kv"), ex(L, "comp_gate"), ex(L, "comp_ape"),
                                      ex(L, "comp_norm"), hd, r, st[1], st[2], st[3]);
        ggml_tensor * idx_k = compress(b, il, cur, ex(L, "idx_kv"), ex(L, "idx_gate"), ex(L, "idx_ape"),
                                       ex(L, "idx_norm"), h.idx_len, r, st[4], st[5], st[6]);
        k_all = ggml_concat(c, raw, comp_pad(b, comp, ring, in[kMask4]->ne[0]), 1);
        mask = ggml_concat(c, mask, indexer_mask(b, il, qr, cur, idx_k), 0);
    } else if (r == kHca) {
        ggml_tensor * comp = compress(b, il, cur, ex(L, "comp_kv"), ex(L, "comp_gate"), ex(L, "comp_ape"),
                                      ex(L, "comp_norm"), hd, r, st[1], st[2], st[3]);
        k_all = ggml_concat(c, raw, comp_pad(b, comp, ring, in[kMask128]->ne[0]), 1);
        mask = ggml_concat(c, mask, in[kMask128], 0);
    }
    // one K = V head shared by every query head, with a per-head sink in the softmax
    ggml_tensor * o;
    // Flash attention (on, or a quantized cache, where llama.cpp requires it): llama.cpp runs
    // ggml_flash_attn_ext for f16/f32 caches too. ggml's CPU kernel takes one of two paths by the number
    // of queries: its tiled one (f32 GEMM of Q and K) from GGML_FA_TILE_Q = 64 queries with f16/f32 K/V,
    // else its scalar one (Q rounded to f16): they round otherwise, and the indexer's and the experts'
    // top-k turn that into other logits. llama.cpp's ubatch of a long prompt runs whole (tiled), while
    // here micro-batches also end every ckpt_every positions when periodic checkpoints are set (at 256,
    // 44 queries of a 300-position prompt): those cut from what is one ubatch of 64 or more in llama.cpp
    // (b.tile_queries) get zero queries up to 64 so that they too run tiled (each query's row comes out
    // the same whatever the tile). A shorter ubatch, a decode step included, runs scalar as in llama.cpp.
    if (m->flash() || ggml_is_quantized(m->cache_type)) {
        // the mask in f16 (0 and -inf, exact), the sinks on the fused op
        const int64_t N = k_all->ne[1];
        ggml_tensor * kv3 = ggml_view_3d(c, k_all, hd, N, 1, k_all->nb[1], k_all->nb[1] * N, 0);  // [hd, N, 1]
        if (kv3->type == GGML_TYPE_F32) kv3 = ggml_cast(c, kv3, GGML_TYPE_F16);  // as llama.cpp's build_attn_mha
        o = flash_attn_ext_tiled_as_llama(c, ggml_permute(c, q, 0, 2, 1, 3), kv3, kv3, ggml_cast(c, mask, GGML_TYPE_F16),
                                          1.0f / sqrtf((float)hd), ex(L, "sinks"), b.tile_queries);  // [hd, heads, n]
    } else {
        ggml_tensor * kq = ggml_mul_mat(c, k_all, ggml_permute(c, q, 0, 2, 1, 3));  // [N, n, heads]
        kq = ggml_soft_max_ext(c, kq, mask, 1.0f / sqrtf((float)hd), 0.0f);
        ggml_soft_max_add_sinks(kq, ex(L, "sinks"));
        o = ggml_mul_mat(c, ggml_cont(c, ggml_transpose(c, k_all)), kq);  // [hd, n, heads]
        o = ggml_cont(c, ggml_permute(c, o, 0, 2, 1, 3));                // [hd, heads, n]
    }
    if (rot) o = rotate(b.c, o, rot_head);                                         // back (H H = I)
    o = rope_tail(b, il, o, b.g.inp_pos, true);                               // undo V's RoPE
    // grouped output projection: each group of heads through its own low-rank map, then one more
    const int64_t gd = hd * nh / h.o_groups;
    o = ggml_permute(c, ggml_reshape_3d(c, o, gd, h.o_groups, n), 0, 2, 1, 3);  // [gd, n, groups]
    ggml_tensor * wa = ggml_reshape_3d(c, ex(L, "wo_a"), gd, h.o_lora, h.o_groups);
    ggml_tensor * oa = ggml_mul_mat(c, wa, o);                                   // [o_lora, n, groups]
    oa = ggml_cont_2d(c, ggml_permute(c, oa, 0, 2, 1, 3), (int64_t)h.o_lora * h.o_groups, n);
    return ggml_mul_mat(c, ex(L, "wo_b"), oa);
}

ggml_tensor * swiglu(ggml_context * c, ggml_tensor * g, ggml_tensor * u, float limit) {
    return limit > 1e-6f ? ggml_swiglu_clamp(c, g, u, limit) : ggml_swiglu_split(c, g, u);
}

// The experts: sqrt(softplus) scores; hash layers take their experts from the token id, the others the
// top n_used of score + bias; weights are the chosen scores, normalised and scaled; plus the shared expert.
ggml_tensor * ffn(Build & b, int32_t il, ggml_tensor * x) {
    ggml_context * c = b.c;
    const Dsv4 & h = dsv4(b.m);
    const Layer & L = b.layer(il);
    const int64_t d = x->ne[0], n = x->ne[1];
    ggml_tensor * logits = ggml_mul_mat(c, L.ffn_gate_inp, x);
    ggml_tensor * probs = ggml_sqrt(c, ggml_softplus(c, logits));  // [n_expert, n]
    ggml_tensor * sel;
    if (il < h.hash_layers) {
        sel = ggml_get_rows(c, ex(L, "tid2eid"), b.g.inp_tokens);  // [n_used, n]
    } else {
        sel = ggml_argsort_top_k(c, ggml_add(c, probs, ex(L, "exp_probs_b")), h.n_used);
    }
    ggml_tensor * w = ggml_get_rows(c, ggml_reshape_3d(c, probs, 1, h.n_expert, n), sel);  // [1, n_used, n]
    if (h.norm_w) {
        ggml_tensor * w2 = ggml_reshape_2d(c, w, h.n_used, n);
        ggml_tensor * sum = ggml_clamp(c, ggml_sum_rows(c, w2), 6.103515625e-5f, INFINITY);
        w = ggml_reshape_3d(c, ggml_div(c, w2, sum), 1, h.n_used, n);
    }
    if (h.w_scale != 1.0f) w = ggml_scale(c, w, h.w_scale);
    ggml_tensor * x3 = ggml_reshape_3d(c, x, d, 1, n);
    ggml_tensor * up = ggml_mul_mat_id(c, L.ffn_up_exps, x3, sel);
    ggml_tensor * gate = ggml_mul_mat_id(c, L.ffn_gate_exps, x3, sel);
    ggml_tensor * e = ggml_mul_mat_id(c, L.ffn_down_exps, swiglu(c, gate, up, h.clamp_exp[il]), sel);  // [d, n_used, n]
    e = ggml_mul(c, e, w);
    ggml_tensor * sum = ggml_view_2d(c, e, d, n, e->nb[2], 0);
    for (int32_t i = 1; i < h.n_used; ++i) sum = ggml_add(c, sum, ggml_view_2d(c, e, d, n, e->nb[2], (size_t)i * e->nb[1]));
    if (h.n_used == 1) sum = ggml_cont(c, sum);
    ggml_tensor * sh = swiglu(c, ggml_mul_mat(c, L.ffn_gate_shexp, x), ggml_mul_mat(c, L.ffn_up_shexp, x), h.clamp_shexp[il]);
    return ggml_add(c, sum, ggml_mul_mat(c, L.ffn_down_shexp, sh));
}

// One layer on the streams x [d, hc, n]: attention and experts, each between its hyper-connection read
// and write.
ggml_tensor * layer(Build & b, int32_t il, ggml_tensor * x) {
    const Layer & L = b.layer(il);
    HcMix mx;
    ggml_tensor * cur = hc_pre(b, x, ex(L, "hc_attn_fn"), ex(L, "hc_attn_scale"), ex(L, "hc_attn_base"), &mx);
    cur = attention_dsv4(b, il, rms(b.c, cur, L.attn_norm, b.m->eps));
    x = hc_post(b, cur, x, mx);
    cur = hc_pre(b, x, ex(L, "hc_ffn_fn"), ex(L, "hc_ffn_scale"), ex(L, "hc_ffn_base"), &mx);
    cur = ffn(b, il, rms(b.c, cur, L.ffn_norm, b.m->eps));
    return hc_post(b, cur, x, mx);
}

// The nextn block's input (llama.cpp's graph_mtp): the token's embedding and the trunk's row, each RMS
// normed (the embedding repeated into the streams), concatenated per stream and projected back to d.
ggml_tensor * mtp_input(Build & b, ggml_tensor * h_rows) {
    ggml_context * c = b.c;
    const Layer & L = b.layer(b.m->layer_start);
    const int64_t d = b.m->d_model, hc = dsv4(b.m).hc;
    ggml_tensor * h = rms(c, ggml_reshape_3d(c, h_rows, d, hc, b.n), ex(L, "hnorm"), b.m->eps);
    ggml_tensor * e = rms(c, ggml_get_rows(c, ex(L, "embed_tokens"), b.g.inp_tokens), ex(L, "enorm"), b.m->eps);
    e = ggml_repeat_4d(c, ggml_reshape_3d(c, e, d, 1, b.n), d, hc, b.n, 1);
    return ggml_mul_mat(c, ex(L, "eh_proj"), ggml_concat(c, e, h, 0));  // [d, hc, n]
}

}  // namespace

ggml_tensor * build(Build & b, ggml_tensor * x) {
    ggswarm_model * m = b.m;
    ggml_context * c = b.c;
    const Dsv4 & h = dsv4(m);
    const int64_t d = m->d_model, hc = h.hc;
    make_inputs(b);
    if (m->needs_ids() && !b.g.inp_tokens) {  // hash-routed layers after the first window: ids come with the hidden rows
        b.g.inp_tokens = ggml_new_tensor_1d(c, GGML_TYPE_I32, b.n);
        ggml_set_input(b.g.inp_tokens);
    }
    // the embedding repeated into the streams on the first window; the boundary rows otherwise (the
    // nextn block: its token's embedding and the trunk's row of the position before, mtp_input)
    if (m->mtp_block) {
        x = mtp_input(b, x);
    } else {
        x = m->is_first() ? ggml_repeat_4d(c, ggml_reshape_3d(c, x, d, 1, b.n), d, hc, b.n, 1)
                          : ggml_reshape_3d(c, x, d, hc, b.n);
    }
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) x = layer(b, il, x);
    if (!m->is_last()) return ggml_reshape_2d(c, x, d * hc, b.n);
    if (m->mtp || m->mtp_block) {  // every position's streams, as llama.cpp's h_nextn: what the block reads
        b.g.out_hidden = ggml_cont_2d(c, x, d * hc, b.n);
        ggml_set_output(b.g.out_hidden);
        ggml_build_forward_expand(b.g.gf, b.g.out_hidden);
    }
    if (b.last_only && b.n > 1) x = ggml_view_3d(c, x, d, hc, 1, x->nb[1], x->nb[2], (size_t)(b.n - 1) * x->nb[2]);
    // the head collapses the streams (the output norm and projection follow in graph.cpp)
    const Layer & L = b.layer(m->layer_end - 1);
    const int64_t nt = x->ne[2];
    ggml_tensor * flat = ggml_rms_norm(c, ggml_cont_2d(c, x, d * hc, nt), m->eps);
    ggml_tensor * mix = ggml_mul_mat(c, ex(L, "hc_head_fn"), flat);  // [hc, nt]
    ggml_tensor * pre = ggml_add(c, ggml_mul(c, mix, ex(L, "hc_head_scale")), ex(L, "hc_head_base"));
    pre = ggml_scale_bias(c, ggml_sigmoid(c, pre), 1.0f, h.hc_eps);
    return weigh_streams(b, ggml_reshape_3d(c, ggml_cont(c, x), d, hc, nt), pre);
}

}  // namespace deepseek4
}  // namespace ggswarm
