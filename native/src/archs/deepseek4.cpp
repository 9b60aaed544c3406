// DeepSeek-V4 (deepseek4) in the architecture table (arch.h): hyper-parameters, each layer's tensors,
// its session state kind (StateKind::Dsv4) and the window graph. Written from llama.cpp's description
// of the model (which GGUF keys and tensors exist, which ggml ops its reference graph runs, in which
// order), so the numbers follow llama.cpp's; no code is copied.
//
// Between layers flow 4 hyper-connection streams of d_model each (the boundary row is 4 x d_model);
// every layer attends a raw sliding window of single-head K (K = V) plus, on compressing layers, a
// compressed K cache: ratio 4 ("CSA") with overlapping blocks and a lightning indexer that picks the
// top-k compressed entries, ratio 128 ("HCA") over all of them. The state is held as llama.cpp holds
// it: the raw window and the compressor's inputs (a kv row and a score row per position) in rings of the
// last positions, the compressed caches per block; going back further than the rings reach takes a
// checkpoint (see "the state kind" below).

#include <algorithm>
#include <cmath>
#include <cstring>

#include "arch.h"

namespace ggswarm {
namespace {

struct Dsv4 : ArchData {
    int32_t n_rot = 0, q_lora = 0, o_groups = 0, o_lora = 0;
    int32_t n_expert = 0, n_used = 0, n_ff_exp = 0, n_shexp = 1;
    int32_t idx_heads = 0, idx_len = 0, top_k = 0;
    int32_t hc = 4, sinkhorn = 1, hash_layers = 0;
    float hc_eps = 1e-6f, w_scale = 1.0f, comp_base = 10000.0f;
    std::vector<float> clamp_exp, clamp_shexp;  // per layer of the file (0: no clamp)
    bool norm_w = true;
    std::vector<int32_t> ratio;  // per layer: 0, 4 or 128
    // llama.cpp's Hadamard rotations of indexer-key-wide and head-wide rows (see rotates()), made once
    std::vector<float> rot_idx, rot_head;
};

const Dsv4 & dsv4(const ggswarm_model * m) { return *static_cast<const Dsv4 *>(m->arch_data.get()); }

// llama.cpp rotates a cache's K (and the queries, and the attention output back) by an orthonormal
// Walsh-Hadamard matrix where its rows are as wide as the indexer's keys (always the indexer's own
// cache; for the others a quirk of small files, where head_dim = indexer key length) or where the
// cache is quantized (llama-kv-cache.cpp, attn_rot_k). In f32 the rotation changes nothing but
// rounding; in f16 it decides what is rounded, so the cache must hold what llama.cpp's holds.
bool rotates(const ggswarm_model * m, int64_t width) {
    return width == dsv4(m).idx_len || (ggml_is_quantized(m->cache_type) && width % 64 == 0);
}
constexpr int32_t kCsa = 4;
constexpr int32_t kHca = 128;

int64_t pad256(int64_t n) { return std::max<int64_t>(256, (n + 255) / 256 * 256); }
// compressed entries a session of cap positions holds: every block, and a scratch entry for the blocks
// a graph computes but that do not complete (never visible)
int64_t n_comp(int64_t cap, int32_t r) { return cap / r + 1; }
// compressed entries a graph attending n_kv positions reads: padded as llama.cpp pads its mask, within
// what the session holds
int64_t n_comp_span(int64_t n_kv, int64_t cap, int32_t r) { return std::min(pad256(n_kv / r + 1), n_comp(cap, r)); }
// blocks that can complete among nc new positions
int64_t n_blocks(int64_t nc, int32_t r) { return nc / r + 1; }

ggswarm_status read(ggswarm_model * m, const Hp & hp) {
    const char * a = hp.prefix.c_str();
    auto h = std::make_shared<Dsv4>();
    ggswarm_status st;
    int32_t nextn = 0;
    if (hp.has("nextn_predict_layers") && (st = hp.need_int("nextn_predict_layers", 0, 16, &nextn))) return st;
    if (nextn >= m->n_layers_total) {
        return fail(m, GGSWARM_E_FORMAT, "%snextn_predict_layers %d >= block_count %d", a, nextn, m->n_layers_total);
    }
    const int32_t n_all = m->n_layers_total;
    m->n_layers_total -= nextn;  // the trunk never runs the multi-token-prediction blocks
    m->lhp.resize(m->n_layers_total);
    if ((st = hp.need_int("attention.head_count", 1, 4096, &m->n_head))) return st;
    if ((st = hp.need_int("attention.head_count_kv", 1, 1, &m->n_head_kv))) return st;
    int32_t vlen = 0;
    if ((st = hp.need_int("attention.key_length", 2, 4096, &m->head_dim))) return st;
    if ((st = hp.need_int("attention.value_length", 2, 4096, &vlen))) return st;
    if (vlen != m->head_dim) return fail(m, GGSWARM_E_UNSUPPORTED, "key_length %d != value_length %d", m->head_dim, vlen);
    if ((st = hp.need_int("rope.dimension_count", 2, m->head_dim, &h->n_rot))) return st;
    m->n_rot = h->n_rot;
    if ((st = hp.need_int("attention.q_lora_rank", 1, 1 << 16, &h->q_lora))) return st;
    if ((st = hp.need_int("attention.sliding_window", 1, 1 << 20, &m->n_swa))) return st;
    if ((st = hp.need_int("expert_count", 1, 4096, &h->n_expert))) return st;
    if ((st = hp.need_int("expert_used_count", 1, h->n_expert, &h->n_used))) return st;
    if ((st = hp.need_int("expert_feed_forward_length", 1, 1 << 20, &h->n_ff_exp))) return st;
    if ((st = hp.need_int("expert_shared_count", 1, 64, &h->n_shexp))) return st;
    if ((st = hp.need_int("attention.indexer.head_count", 1, 1024, &h->idx_heads))) return st;
    if ((st = hp.need_int("attention.indexer.key_length", 64, 4096, &h->idx_len))) return st;
    if (h->idx_len % 64 != 0) return fail(m, GGSWARM_E_UNSUPPORTED, "%sattention.indexer.key_length %d is not a multiple of 64", a, h->idx_len);
    if ((st = hp.need_int("attention.indexer.top_k", 1, 1 << 20, &h->top_k))) return st;
    if ((st = hp.need_int("attention.output_group_count", 1, 1024, &h->o_groups))) return st;
    if ((st = hp.need_int("attention.output_lora_rank", 1, 1 << 16, &h->o_lora))) return st;
    if (m->n_head % h->o_groups != 0) {
        return fail(m, GGSWARM_E_FORMAT, "head_count %d is not a multiple of output_group_count %d", m->n_head, h->o_groups);
    }
    if ((st = hp.need_int("hyper_connection.count", 4, 4, &h->hc))) return st;
    if ((st = hp.need_int("hyper_connection.sinkhorn_iterations", 1, 1000, &h->sinkhorn))) return st;
    if ((st = hp.need_int("hash_layer_count", 0, n_all, &h->hash_layers))) return st;
    int32_t gating = 0;
    if ((st = hp.need_int("expert_gating_func", 0, 16, &gating))) return st;
    if (gating != 4) return fail(m, GGSWARM_E_UNSUPPORTED, "%sexpert_gating_func %d: only 4 (sqrt softplus) is supported", a, gating);
    double f = 0;
    if (!hp.opt_float("attention.layer_norm_rms_epsilon", &f)) {
        return fail(m, GGSWARM_E_FORMAT, "%sattention.layer_norm_rms_epsilon is missing", a);
    }
    m->eps = (float)f;
    if (!hp.opt_float("attention.compress_rope_freq_base", &f)) {
        return fail(m, GGSWARM_E_FORMAT, "%sattention.compress_rope_freq_base is missing", a);
    }
    h->comp_base = (float)f;
    if (hp.opt_float("hyper_connection.epsilon", &f)) h->hc_eps = (float)f;
    // llama.cpp reads both clamps with get_key_or_arr (one value or one per layer of the file, the MTP
    // blocks included) and requires the first; the shared experts' falls back to the routed ones'
    int got = hp.per_layer_float("swiglu_clamp_exp", n_all, &h->clamp_exp);
    if (got <= 0) {
        return fail(m, GGSWARM_E_FORMAT, "%sswiglu_clamp_exp is %s (one number, or an f32 array of %d: one per layer)", a,
                    got ? "malformed" : "missing", n_all);
    }
    got = hp.per_layer_float("swiglu_clamp_shexp", n_all, &h->clamp_shexp);
    if (got < 0) return fail(m, GGSWARM_E_FORMAT, "%sswiglu_clamp_shexp: one number, or an f32 array of %d", a, n_all);
    if (got == 0) h->clamp_shexp = h->clamp_exp;
    if (hp.opt_bool("expert_weights_norm", &h->norm_w) <= 0) {
        return fail(m, GGSWARM_E_FORMAT, "%sexpert_weights_norm is missing or not a bool", a);
    }
    if (!hp.opt_float("expert_weights_scale", &f)) return fail(m, GGSWARM_E_FORMAT, "%sexpert_weights_scale is missing", a);
    if (f != 0.0) h->w_scale = (float)f;
    std::vector<int64_t> ratios;
    if (!hp.int_array("attention.compress_ratios", &ratios) || (int32_t)ratios.size() < m->n_layers_total) {
        return fail(m, GGSWARM_E_FORMAT, "%sattention.compress_ratios (one per layer) is missing or short", a);
    }
    for (int32_t i = 0; i < m->n_layers_total; ++i) {
        if (ratios[i] != 0 && ratios[i] != kCsa && ratios[i] != kHca) {
            return fail(m, GGSWARM_E_UNSUPPORTED, "layer %d: compress ratio %lld (only 0, 4 and 128)", i, (long long)ratios[i]);
        }
        h->ratio.push_back((int32_t)ratios[i]);
        m->lhp[i].state = StateKind::Dsv4;
        m->lhp[i].swa = true;
        // llama.cpp's rule: compressing layers rope at the compress base with the file's scaling (YaRN in
        // the real files, with an attn_factor that cancels ggml's magnitude: net 1); ratio-0 layers plainly
        LayerHp & l = m->lhp[i];
        const bool scaled = ratios[i] != 0;
        l.rope_base = scaled ? h->comp_base : m->rope_base;
        l.rope_scale = scaled ? m->rope.freq_scale : 1.0f;
        l.rope_ext = scaled ? m->rope.ext_factor : 0.0f;
        l.rope_attn = l.rope_ext == 0.0f ? 1.0f : 1.0f / (1.0f + 0.1f * logf(1.0f / l.rope_scale));
    }
    m->n_ff = h->n_ff_exp;
    m->n_streams = h->hc;
    m->ids_layers = std::min(h->hash_layers, m->n_layers_total);
    m->nodes_per_layer = 1200 + 16 * h->sinkhorn * 2;
    m->rope_mode = GGML_ROPE_TYPE_NORMAL;
    h->rot_idx = hadamard(rot_size(h->idx_len));
    h->rot_head = hadamard(rot_size(m->head_dim));
    m->arch_data = h;
    return GGSWARM_OK;
}

void want(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    const Dsv4 & h = dsv4(m);
    const int64_t d = m->d_model, hd = m->head_dim, nh = m->n_head, hcd = h.hc * d, mix = (2 + h.hc) * h.hc;
    auto x = [&](const char * name) { return &L.extra[name]; };
    w.need(blk(il, "attn_norm.weight"), {d}, &L.attn_norm);
    w.need(blk(il, "attn_sinks.weight"), {nh}, x("sinks"));
    w.need(blk(il, "attn_q_a.weight"), {d, h.q_lora}, x("wq_a"));
    w.need(blk(il, "attn_q_a_norm.weight"), {h.q_lora}, x("q_a_norm"));
    w.need(blk(il, "attn_q_b.weight"), {h.q_lora, nh * hd}, x("wq_b"));
    w.need(blk(il, "attn_kv.weight"), {d, hd}, x("wkv"));
    w.need(blk(il, "attn_kv_a_norm.weight"), {hd}, x("kv_norm"));
    // [gd, o_lora x groups] in the file, viewed per group as [gd, o_lora, groups] (llama.cpp loads it 3-D):
    // a repacked Q4_K matrix cannot be viewed so (ggml's repack asserts 2-D operands)
    w.need_plain(blk(il, "attn_output_a.weight"), {nh * hd / h.o_groups, (int64_t)h.o_lora * h.o_groups}, x("wo_a"));
    w.need(blk(il, "attn_output_b.weight"), {(int64_t)h.o_groups * h.o_lora, d}, x("wo_b"));
    w.need(blk(il, "hc_attn_fn.weight"), {hcd, mix}, x("hc_attn_fn"));
    w.need(blk(il, "hc_attn_base.weight"), {mix}, x("hc_attn_base"));
    w.need(blk(il, "hc_attn_scale.weight"), {3}, x("hc_attn_scale"));
    w.need(blk(il, "hc_ffn_fn.weight"), {hcd, mix}, x("hc_ffn_fn"));
    w.need(blk(il, "hc_ffn_base.weight"), {mix}, x("hc_ffn_base"));
    w.need(blk(il, "hc_ffn_scale.weight"), {3}, x("hc_ffn_scale"));
    const int32_t r = h.ratio[il];
    if (r) {
        const int64_t coff = r == kCsa ? 2 : 1;
        w.need(blk(il, "attn_compressor_kv.weight"), {d, coff * hd}, x("comp_kv"));
        w.need(blk(il, "attn_compressor_gate.weight"), {d, coff * hd}, x("comp_gate"));
        w.need(blk(il, "attn_compressor_ape.weight"), {coff * hd, r}, x("comp_ape"));
        w.need(blk(il, "attn_compressor_norm.weight"), {hd}, x("comp_norm"));
        if (r == kCsa) {
            const int64_t il_ = h.idx_len;
            w.need(blk(il, "indexer.proj.weight"), {d, h.idx_heads}, x("idx_proj"));
            w.need(blk(il, "indexer.attn_q_b.weight"), {h.q_lora, h.idx_heads * il_}, x("idx_q_b"));
            w.need(blk(il, "indexer_compressor_kv.weight"), {d, 2 * il_}, x("idx_kv"));
            w.need(blk(il, "indexer_compressor_gate.weight"), {d, 2 * il_}, x("idx_gate"));
            w.need(blk(il, "indexer_compressor_ape.weight"), {2 * il_, r}, x("idx_ape"));
            w.need(blk(il, "indexer_compressor_norm.weight"), {il_}, x("idx_norm"));
        }
    }
    w.need(blk(il, "ffn_gate_inp.weight"), {d, h.n_expert}, &L.ffn_gate_inp);
    if (il < h.hash_layers) {
        w.need(blk(il, "ffn_gate_tid2eid.weight"), {h.n_used, m->n_vocab}, x("tid2eid"));
    } else {
        w.need(blk(il, "exp_probs_b.bias"), {h.n_expert}, x("exp_probs_b"));
    }
    w.need(blk(il, "ffn_norm.weight"), {d}, &L.ffn_norm);
    w.need(blk(il, "ffn_gate_exps.weight"), {d, h.n_ff_exp, h.n_expert}, &L.ffn_gate_exps);
    w.need(blk(il, "ffn_up_exps.weight"), {d, h.n_ff_exp, h.n_expert}, &L.ffn_up_exps);
    w.need(blk(il, "ffn_down_exps.weight"), {h.n_ff_exp, d, h.n_expert}, &L.ffn_down_exps);
    const int64_t ffs = (int64_t)h.n_ff_exp * h.n_shexp;
    w.need(blk(il, "ffn_gate_shexp.weight"), {d, ffs}, &L.ffn_gate_shexp);
    w.need(blk(il, "ffn_up_shexp.weight"), {d, ffs}, &L.ffn_up_shexp);
    w.need(blk(il, "ffn_down_shexp.weight"), {ffs, d}, &L.ffn_down_shexp);
    if (il == m->n_layers_total - 1) {  // the head that collapses the streams before the output norm
        w.need("output_hc_fn.weight", {hcd, h.hc}, x("hc_head_fn"));
        w.need("output_hc_base.weight", {h.hc}, x("hc_head_base"));
        w.need("output_hc_scale.weight", {1}, x("hc_head_scale"));
    }
}

// --- the state kind --------------------------------------------------------------------------------------
// Per layer, as llama.cpp keeps it (src/llama-kv-cache-dsv4.cpp): the raw K (K = V) in a ring of
// raw_rows() slots, the last positions only (the window attends n_swa of them; the ring also holds a
// micro-batch's new rows); ratio 4 adds compressed K and indexer K, one entry per block of 4 positions,
// and the compressor's and the indexer's kv and score rows ([2 width] each, f32) in rings of 8 slots
// (the block being filled and the one before, which the overlapping windows read); ratio 128 adds
// compressed K per block of 128 and its compressor rows ([width] each, f32) in rings of 128 slots. A
// position's row sits in slot position % slots. Entries are a prefix (a truncate keeps len / ratio of
// them); the rings are not, so going back further than they still hold takes a checkpoint (recurrent.h).

enum class Lay { Raw, Rows, Entries };

struct Part {
    int64_t width;
    ggml_type type;
    int32_t ratio;  // the layer's compression ratio (1 for the raw window)
    Lay lay;
};

// llama.cpp's raw window: GGML_PAD(min(n_ctx, n_swa + n_ubatch), 256) slots, whatever the capacity
int64_t raw_rows(const ggswarm_model * m) { return window_ring(m); }
// compressor rows a ratio keeps: the block being filled, and the one before where windows overlap
int64_t ring_rows(int32_t r) { return r == kCsa ? 2 * kCsa : kHca; }
// the first position whose compressor row a session of len positions still needs
int64_t rows_from(int32_t r, int64_t len) {
    return r == kCsa ? std::max<int64_t>(0, len / kCsa * kCsa - kCsa) : len / kHca * kHca;
}

std::vector<Part> parts(const ggswarm_model * m, int32_t il) {
    const Dsv4 & h = dsv4(m);
    const int64_t hd = m->head_dim, ix = h.idx_len;
    const ggml_type kCacheType = m->cache_type;  // the node's, like llama.cpp's --cache-type-k (f16 default)
    std::vector<Part> p = {{hd, kCacheType, 1, Lay::Raw}};
    if (h.ratio[il] == kCsa) {
        p.push_back({hd, kCacheType, kCsa, Lay::Entries});
        p.push_back({2 * hd, GGML_TYPE_F32, kCsa, Lay::Rows});
        p.push_back({2 * hd, GGML_TYPE_F32, kCsa, Lay::Rows});
        p.push_back({ix, kCacheType, kCsa, Lay::Entries});
        p.push_back({2 * ix, GGML_TYPE_F32, kCsa, Lay::Rows});
        p.push_back({2 * ix, GGML_TYPE_F32, kCsa, Lay::Rows});
    } else if (h.ratio[il] == kHca) {
        p.push_back({hd, kCacheType, kHca, Lay::Entries});
        p.push_back({hd, GGML_TYPE_F32, kHca, Lay::Rows});
        p.push_back({hd, GGML_TYPE_F32, kHca, Lay::Rows});
    }
    return p;
}

int64_t part_rows(const ggswarm_model * m, const Part & p, int64_t cap) {
    switch (p.lay) {
        case Lay::Raw: return raw_rows(m);
        case Lay::Rows: return ring_rows(p.ratio);
        default: return n_comp(cap, p.ratio);
    }
}

// The positions [from, len) whose rows a ring part holds for a session of len positions.
int64_t ring_from(const ggswarm_model * m, const Part & p, int64_t len) {
    return p.lay == Lay::Raw ? std::max<int64_t>(0, len - m->n_swa) : rows_from(p.ratio, len);
}

size_t row_bytes(const Part & p) { return ggml_row_size(p.type, p.width); }

// Bytes of a part at len positions as a snapshot (and, for rings, a checkpoint) holds it.
size_t part_bytes(const ggswarm_model * m, const Part & p, int32_t len) {
    const int64_t rows = p.lay == Lay::Entries ? len / p.ratio : len - ring_from(m, p, len);
    return (size_t)rows * row_bytes(p);
}

// Copy a ring part's rows of positions [from(len), len), in position order, out to p or in from p.
void ring_io(const ggswarm_model * m, const Part & p, ggml_tensor * t, int32_t len, uint8_t * buf, bool save) {
    const int64_t rows = t->ne[1], rb = (int64_t)row_bytes(p);
    for (int64_t q = ring_from(m, p, len); q < len;) {
        const int64_t slot = q % rows, run = std::min<int64_t>(len - q, rows - slot);  // up to the ring's end
        if (save) ggml_backend_tensor_get(t, buf, (size_t)(slot * rb), (size_t)(run * rb));
        else ggml_backend_tensor_set(t, buf, (size_t)(slot * rb), (size_t)(run * rb));
        buf += run * rb;
        q += run;
    }
}

void st_plan(const ggswarm_model * m, int32_t il, int64_t cap, ggml_context * ctx, std::vector<ggml_tensor *> & out) {
    for (const Part & p : parts(m, il)) out.push_back(ggml_new_tensor_2d(ctx, p.type, p.width, part_rows(m, p, cap)));
}

void st_carry(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & from,
              const std::vector<ggml_tensor *> & to, int32_t len) {
    const std::vector<Part> ps = parts(m, il);
    std::vector<uint8_t> tmp;
    for (size_t i = 0; i < ps.size(); ++i) {  // rings keep their shape: copied whole; entries: the prefix
        tmp.resize(ps[i].lay == Lay::Entries ? part_bytes(m, ps[i], len) : ggml_nbytes(from[i]));
        if (tmp.empty()) continue;
        ggml_backend_tensor_get(from[i], tmp.data(), 0, tmp.size());
        ggml_backend_tensor_set(to[i], tmp.data(), 0, tmp.size());
    }
}

// Only the entries grow with the context; the rings are fixed (ggswarm_model_info.kv_bytes_per_token).
uint64_t st_per_token(const ggswarm_model * m, int32_t il) {
    uint64_t b = 0;
    for (const Part & p : parts(m, il)) {
        if (p.lay == Lay::Entries) b += (row_bytes(p) + p.ratio - 1) / p.ratio;
    }
    return b;
}

uint64_t st_snapshot_bytes(const ggswarm_model * m, int32_t il, int32_t len) {
    uint64_t b = 0;
    for (const Part & p : parts(m, il)) b += part_bytes(m, p, len);
    return b;
}

// A snapshot: per part, the entries' prefix or the rings' rows that position len onwards reads.
void st_io(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p,
           bool save, bool rings_only) {
    const std::vector<Part> ps = parts(m, il);
    for (size_t i = 0; i < ps.size(); ++i) {
        const size_t n = part_bytes(m, ps[i], len);
        if (ps[i].lay != Lay::Entries) ring_io(m, ps[i], t[i], len, p, save);
        else if (rings_only) continue;
        else if (n && save) ggml_backend_tensor_get(t[i], p, 0, n);
        else if (n) ggml_backend_tensor_set(t[i], p, 0, n);
        p += n;
    }
}

void st_save(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p) {
    st_io(m, il, t, len, p, true, false);
}

void st_load(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, const uint8_t * p) {
    st_io(m, il, t, len, const_cast<uint8_t *>(p), false, false);
}

// A checkpoint holds the rings' rows only: the entries are a prefix the live state keeps.
uint64_t st_ckpt_bytes(const ggswarm_model * m, int32_t il, int32_t len) {
    uint64_t b = 0;
    for (const Part & p : parts(m, il)) {
        if (p.lay != Lay::Entries) b += part_bytes(m, p, len);
    }
    return b;
}

void st_ckpt_io(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p,
                bool save) {
    st_io(m, il, t, len, p, save, true);
}

// The rings still hold what target needs when no slot it reads was written over since, nor lost to a
// rewind (s.ring_lo): a retried decode step or a few positions back, not a long edit.
bool st_rewinds_to(const ggswarm_model * m, int32_t il, const Session & s, int32_t target) {
    if (target == s.len) return true;
    for (const Part & p : parts(m, il)) {
        if (p.lay == Lay::Entries) continue;
        const int64_t rows = part_rows(m, p, s.cap);
        if (ring_from(m, p, target) < std::max<int64_t>(s.ring_lo, (int64_t)s.len - rows)) return false;
    }
    return true;
}

const StateOps kDsv4State = {StateKind::Dsv4, "dsv4",          7,           st_plan,         st_carry,
                             st_per_token,    st_snapshot_bytes, st_save,   st_load,         st_ckpt_bytes,
                             st_ckpt_io,      st_rewinds_to};
StateRegistration reg_state(&kDsv4State);

// --- inputs (Graph::arch_in) -----------------------------------------------------------------------------

enum In {
    kKidx,      // i64 [n]: raw ring slot of each new position
    kMaskRaw,   // f32 [raw span, n]: the sliding window over the ring's slots
    kApe4,      // i32 [n]: position % 4
    kApe128,    // i32 [n]: position % 128
    kRead4,     // i32 [2 * 4 * nb4]: rows of the previous blocks, then of the completing blocks (rows of
                //   the ring, then the graph's new rows, as compress() concatenates them)
    kBias4,     // f32 [1, 8, nb4]: -inf for the first block's missing previous rows
    kWrite4,    // i64 [nb4]: the completing blocks' entries (or the scratch entry)
    kCpos4,     // i32 [nb4]: their first position (their RoPE position)
    kMask4,     // f32 [nc4, n]: visible compressed entries
    kRead128,   // i32 [128 * nb128]
    kWrite128,  // i64 [nb128]
    kCpos128,   // i32 [nb128]
    kMask128,   // f32 [nc128, n]
    kRows4,     // i64 [min(n, 8)]: ring slots of the last new positions, whose rows the ring keeps
    kRows128,   // i64 [min(n, 128)]
    kRotIdx,    // f32 [r, r]: the Hadamard rotation of indexer-key-wide rows (rot_size(idx_len))
    kRotHead,   // f32 [r, r]: of head-wide rows, where rotates(head_dim) (else unused)
    kInputs
};

// The raw ring's slots a graph of span n_kv attends: the whole ring once positions wrap around it.
int64_t raw_span(const ggswarm_model * m, int64_t n_kv) { return std::min(n_kv, raw_rows(m)); }

ggml_tensor * input(ggml_context * c, ggml_type t, int64_t a, int64_t b = 1, int64_t e = 1) {
    ggml_tensor * x = ggml_new_tensor_3d(c, t, a, b, e);
    ggml_set_input(x);
    return x;
}

void make_inputs(Build & b) {
    ggml_context * c = b.c;
    const int64_t n = b.n;
    std::vector<ggml_tensor *> & in = b.g.arch_in;
    in.assign(kInputs, nullptr);
    in[kKidx] = input(c, GGML_TYPE_I64, n);
    in[kMaskRaw] = input(c, GGML_TYPE_F32, raw_span(b.m, b.n_kv), n);
    in[kApe4] = input(c, GGML_TYPE_I32, n);
    in[kApe128] = input(c, GGML_TYPE_I32, n);
    const int64_t nb4 = n_blocks(n, kCsa), nb128 = n_blocks(n, kHca);
    in[kRead4] = input(c, GGML_TYPE_I32, 2 * kCsa * nb4);
    in[kBias4] = input(c, GGML_TYPE_F32, 1, 2 * kCsa, nb4);
    in[kWrite4] = input(c, GGML_TYPE_I64, nb4);
    in[kCpos4] = input(c, GGML_TYPE_I32, nb4);
    in[kMask4] = input(c, GGML_TYPE_F32, n_comp_span(b.n_kv, b.cap, kCsa), n);
    in[kRead128] = input(c, GGML_TYPE_I32, kHca * nb128);
    in[kWrite128] = input(c, GGML_TYPE_I64, nb128);
    in[kCpos128] = input(c, GGML_TYPE_I32, nb128);
    in[kMask128] = input(c, GGML_TYPE_F32, n_comp_span(b.n_kv, b.cap, kHca), n);
    in[kRows4] = input(c, GGML_TYPE_I64, std::min<int64_t>(n, ring_rows(kCsa)));
    in[kRows128] = input(c, GGML_TYPE_I64, std::min<int64_t>(n, ring_rows(kHca)));
    const int64_t ri = rot_size(dsv4(b.m).idx_len), rh = rot_size(b.m->head_dim);
    in[kRotIdx] = input(c, GGML_TYPE_F32, ri, ri);
    in[kRotHead] = input(c, GGML_TYPE_F32, rh, rh);
}

template <typename T>
void put(ggml_tensor * t, const std::vector<T> & v) {
    if (t && t->buffer) ggml_backend_tensor_set(t, v.data(), 0, sizeof(T) * v.size());
}

// The compression plan of ratio r for positions [pos, pos + nc): per block slot its entry, first
// position and source rows (overlapping: the previous block's rows first, then the block's own).
void set_comp(const Graph & g, int32_t r, int32_t pos, int32_t nc, In read, In write, In cpos, In bias) {
    const int64_t nb = n_blocks(nc, r), scratch = n_comp(g.key.cap, r) - 1, ring = ring_rows(r);
    const bool overlap = bias != kInputs;
    // a row of position q in compress()'s concatenation: its ring slot if older than the graph, else new
    auto row = [&](int32_t q) { return (int32_t)(q < pos ? q % ring : ring + (q - pos)); };
    std::vector<int64_t> wr(nb, scratch);
    std::vector<int32_t> cp(nb, 0), rd((overlap ? 2 : 1) * r * nb, 0);
    std::vector<float> bi(overlap ? 2 * r * nb : 0, 0.0f);
    int64_t i = 0;
    for (int32_t p = pos; p < pos + nc; ++p) {
        if ((p + 1) % r != 0) continue;
        const int32_t j = p / r, start = j * r;
        wr[i] = j;
        cp[i] = start;
        for (int32_t k = 0; k < r; ++k) {
            if (overlap) {
                rd[i * r + k] = j > 0 ? row(start - r + k) : 0;
                if (j == 0) bi[i * 2 * r + k] = -INFINITY;
                rd[nb * r + i * r + k] = row(start + k);
            } else {
                rd[i * r + k] = row(start + k);
            }
        }
        ++i;
    }
    put(g.arch_in[read], rd);
    put(g.arch_in[write], wr);
    put(g.arch_in[cpos], cp);
    if (overlap) put(g.arch_in[bias], bi);
}

void set_comp_mask(ggswarm_model * m, ggml_tensor * t, int32_t r, int32_t pos, int32_t nc) {
    if (!t || !t->buffer) return;
    const int64_t w = t->ne[0];
    m->mask_host.assign((size_t)w * nc, -INFINITY);
    for (int32_t i = 0; i < nc; ++i) {
        const int64_t vis = (int64_t)(pos + i + 1) / r;
        for (int64_t j = 0; j < std::min(vis, w); ++j) m->mask_host[(size_t)i * w + j] = 0.0f;
    }
    put(t, m->mask_host);
}

// The ring slots of the last min(nc, ring) new positions (their rows are what the ring keeps).
void set_ring_writes(ggml_tensor * t, int32_t pos, int32_t nc, int64_t ring) {
    const int64_t k = std::min<int64_t>(nc, ring);
    std::vector<int64_t> slots(k);
    for (int64_t i = 0; i < k; ++i) slots[i] = (pos + nc - k + i) % ring;
    put(t, slots);
}

void set_inputs(ggswarm_model * m, Graph & g, int32_t pos, int32_t nc) {
    std::vector<ggml_tensor *> & in = g.arch_in;
    const int64_t rr = raw_rows(m);
    std::vector<int64_t> kidx(nc);
    std::vector<int32_t> a4(nc), a128(nc);
    for (int32_t t = 0; t < nc; ++t) {
        kidx[t] = (pos + t) % rr;
        a4[t] = (pos + t) % kCsa;
        a128[t] = (pos + t) % kHca;
    }
    put(in[kKidx], kidx);
    put(in[kApe4], a4);
    put(in[kApe128], a128);
    if (in[kMaskRaw]->buffer) {
        // slot j holds the newest position q <= top with q = j (mod ring), after this graph's writes
        const int64_t w = in[kMaskRaw]->ne[0], top = pos + nc - 1;
        m->mask_host.assign((size_t)w * nc, -INFINITY);
        for (int64_t j = 0; j < w; ++j) {
            const int64_t q = top - (((top - j) % rr) + rr) % rr;
            if (q < 0) continue;
            for (int32_t i = 0; i < nc; ++i) {
                const int64_t p = pos + i;
                if (q <= p && q > p - m->n_swa) m->mask_host[(size_t)i * w + j] = 0.0f;
            }
        }
        put(in[kMaskRaw], m->mask_host);
    }
    set_comp(g, kCsa, pos, nc, kRead4, kWrite4, kCpos4, kBias4);
    set_comp(g, kHca, pos, nc, kRead128, kWrite128, kCpos128, kInputs);
    set_comp_mask(m, in[kMask4], kCsa, pos, nc);
    set_comp_mask(m, in[kMask128], kHca, pos, nc);
    set_ring_writes(in[kRows4], pos, nc, ring_rows(kCsa));
    set_ring_writes(in[kRows128], pos, nc, ring_rows(kHca));
    const Dsv4 & h = dsv4(m);
    put(in[kRotIdx], h.rot_idx);
    put(in[kRotHead], h.rot_head);
}

// --- graph pieces ----------------------------------------------------------------------------------------

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

// Sinkhorn normalisation of comb [dst, src, n]: softmax over dst, then alternate column and row sums.
ggml_tensor * sinkhorn(Build & b, ggml_tensor * comb) {
    ggml_context * c = b.c;
    const Dsv4 & h = dsv4(b.m);
    comb = ggml_scale_bias(c, ggml_soft_max(c, comb), 1.0f, h.hc_eps);
    auto cols = [&]() {
        ggml_tensor * s = ggml_sum_rows(c, ggml_cont(c, ggml_permute(c, comb, 1, 0, 2, 3)));
        s = ggml_permute(c, ggml_scale_bias(c, s, 1.0f, h.hc_eps), 1, 0, 2, 3);
        comb = ggml_div(c, comb, s);
    };
    auto rows = [&]() { comb = ggml_div(c, comb, ggml_scale_bias(c, ggml_sum_rows(c, comb), 1.0f, h.hc_eps)); };
    cols();
    for (int32_t i = 1; i < h.sinkhorn; ++i) {
        rows();
        cols();
    }
    return comb;
}

// sum over streams of x [d, hc, n] weighted by w [hc, n]
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
// weights' sum of the streams (returned, [d, n]), the post weights and the stream mixing matrix.
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
    out->comb = sinkhorn(b, ggml_reshape_3d(c, part(hc * hc, 2 * hc, 2), hc, hc, n));
    return weigh_streams(b, x, pre);
}

// The hyper-connection write: stream dst = f * post[dst] + sum_src residual[src] * comb[dst, src].
ggml_tensor * hc_post(Build & b, ggml_tensor * f, ggml_tensor * res, const HcMix & mx) {
    ggml_context * c = b.c;
    const int64_t hc = res->ne[1], n = res->ne[2], d = res->ne[0];
    ggml_tensor * out = nullptr;
    for (int64_t dst = 0; dst < hc; ++dst) {
        ggml_tensor * cur = ggml_mul(c, f, ggml_view_2d(c, mx.post, 1, n, mx.post->nb[1], dst * mx.post->nb[0]));
        for (int64_t src = 0; src < hc; ++src) {
            ggml_tensor * rs = ggml_view_2d(c, res, d, n, res->nb[2], src * res->nb[1]);
            ggml_tensor * w = ggml_view_2d(c, mx.comb, 1, n, mx.comb->nb[2], dst * mx.comb->nb[0] + src * mx.comb->nb[1]);
            cur = ggml_add(c, cur, ggml_mul(c, rs, w));
        }
        cur = ggml_reshape_3d(c, cur, d, 1, n);
        out = out ? ggml_concat(c, out, cur, 1) : cur;
    }
    return out;
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
    const int64_t span = n_comp_span(b.n_kv, b.cap, r);
    return ggml_view_2d(c, cc, width, span, cc->nb[1], 0);
}

// The lightning indexer's choice among the visible compressed entries: per position the top_k entries
// by sum over indexer heads of relu(q_h . k) * w_h. Returns the attention mask over the compressed
// span ([span, n]): 0 on the chosen visible entries, -inf elsewhere.
ggml_tensor * indexer_mask(Build & b, int32_t il, ggml_tensor * qr, ggml_tensor * cur, ggml_tensor * idx_k) {
    ggml_context * c = b.c;
    const Dsv4 & h = dsv4(b.m);
    const Layer & L = b.layer(il);
    const int64_t n = b.n, ih = h.idx_heads, il_ = h.idx_len;
    ggml_tensor * mask = b.g.arch_in[kMask4];
    ggml_tensor * q = ggml_reshape_3d(c, ggml_mul_mat(c, ex(L, "idx_q_b"), qr), il_, ih, n);
    q = rotate(b.c, rope_tail(b, il, q, b.g.inp_pos), b.g.arch_in[kRotIdx]);  // the indexer's cache always rotates
    ggml_tensor * w = ggml_scale(c, ggml_mul_mat(c, ex(L, "idx_proj"), cur), 1.0f / sqrtf((float)(il_ * ih)));
    // llama.cpp's fused op (cparams.fused_lid, on for every context): the keys read back to f32 in
    // whatever type the cache holds, the sum over heads of relu(q . k) * w, plus the mask (f16, exact)
    const int64_t span = idx_k->ne[1];
    ggml_tensor * keys = ggml_view_4d(c, idx_k, il_, 1, span, 1, idx_k->nb[1], idx_k->nb[1], idx_k->nb[1] * span, 0);
    ggml_tensor * score = ggml_lightning_indexer(c, ggml_reshape_4d(c, q, il_, ih, n, 1), keys,
                                                 ggml_reshape_4d(c, w, ih, n, 1, 1), ggml_cast(c, mask, GGML_TYPE_F16));
    score = ggml_reshape_2d(c, score, span, n);  // [span, n]
    const int64_t k_top = std::min<int64_t>(mask->ne[0], h.top_k);
    ggml_tensor * top = ggml_cont(c, ggml_top_k(c, score, (int)k_top));  // [k_top, n]
    ggml_tensor * all = ggml_fill(c, mask, -INFINITY);
    all = ggml_view_4d(c, all, 1, all->ne[0], all->ne[1], 1, all->nb[0], all->nb[1], all->nb[1] * all->ne[1], 0);
    ggml_tensor * zeros = ggml_fill(c, ggml_new_tensor_4d(c, GGML_TYPE_F32, 1, k_top, n, 1), 0.0f);
    ggml_tensor * sel = ggml_set_rows(c, all, zeros, top);
    sel = ggml_view_2d(c, sel, mask->ne[0], n, sel->nb[2], 0);
    return ggml_add(c, sel, mask);
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
    ggml_tensor * raw = ggml_set_rows(c, st[0], ggml_reshape_2d(c, kv, hd, n), in[kKidx]);
    raw = ggml_view_2d(c, raw, hd, raw_span(m, b.n_kv), raw->nb[1], 0);  // in the cache type, as llama.cpp reads it
    ggml_tensor * k_all = raw, * mask = in[kMaskRaw];
    if (r == kCsa) {
        ggml_tensor * comp = compress(b, il, cur, ex(L, "comp_kv"), ex(L, "comp_gate"), ex(L, "comp_ape"),
                                      ex(L, "comp_norm"), hd, r, st[1], st[2], st[3]);
        ggml_tensor * idx_k = compress(b, il, cur, ex(L, "idx_kv"), ex(L, "idx_gate"), ex(L, "idx_ape"),
                                       ex(L, "idx_norm"), h.idx_len, r, st[4], st[5], st[6]);
        k_all = ggml_concat(c, raw, comp, 1);
        mask = ggml_concat(c, mask, indexer_mask(b, il, qr, cur, idx_k), 0);
    } else if (r == kHca) {
        ggml_tensor * comp = compress(b, il, cur, ex(L, "comp_kv"), ex(L, "comp_gate"), ex(L, "comp_ape"),
                                      ex(L, "comp_norm"), hd, r, st[1], st[2], st[3]);
        k_all = ggml_concat(c, raw, comp, 1);
        mask = ggml_concat(c, mask, in[kMask128], 0);
    }
    // one K = V head shared by every query head, with a per-head sink in the softmax
    ggml_tensor * o;
    if (ggml_is_quantized(m->cache_type)) {
        // llama.cpp runs a quantized cache with flash attention (it requires it for V, here K itself):
        // the mask in f16 (0 and -inf, exact), the sinks on the fused op
        const int64_t N = k_all->ne[1];
        ggml_tensor * kv3 = ggml_view_3d(c, k_all, hd, N, 1, k_all->nb[1], k_all->nb[1] * N, 0);  // [hd, N, 1]
        o = ggml_flash_attn_ext(c, ggml_permute(c, q, 0, 2, 1, 3), kv3, kv3, ggml_cast(c, mask, GGML_TYPE_F16),
                                1.0f / sqrtf((float)hd), 0.0f, 0.0f);  // [hd, heads, n]
        ggml_flash_attn_ext_add_sinks(o, ex(L, "sinks"));
        ggml_prec_set_acc(o, GGML_PREC_F32);
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
    // the embedding repeated into the streams on the first window; the boundary rows otherwise
    x = m->is_first() ? ggml_repeat_4d(c, ggml_reshape_3d(c, x, d, 1, b.n), d, hc, b.n, 1)
                      : ggml_reshape_3d(c, x, d, hc, b.n);
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const Layer & L = b.layer(il);
        HcMix mx;
        ggml_tensor * cur = hc_pre(b, x, ex(L, "hc_attn_fn"), ex(L, "hc_attn_scale"), ex(L, "hc_attn_base"), &mx);
        cur = attention_dsv4(b, il, rms(c, cur, L.attn_norm, m->eps));
        x = hc_post(b, cur, x, mx);
        cur = hc_pre(b, x, ex(L, "hc_ffn_fn"), ex(L, "hc_ffn_scale"), ex(L, "hc_ffn_base"), &mx);
        cur = ffn(b, il, rms(c, cur, L.ffn_norm, m->eps));
        x = hc_post(b, cur, x, mx);
    }
    if (!m->is_last()) return ggml_reshape_2d(c, x, d * hc, b.n);
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

// caches in f16 (llama.cpp's default), f32 (llama.cpp's type_k = 0), q8_0 or q4_0, ggswarm_set_cache_type
const Arch kDeepseek4 = {"deepseek4", read, want, build, set_inputs, false, kKvCacheTypes | (1u << GGML_TYPE_F32)};
ArchRegistration reg(&kDeepseek4);

}  // namespace
}  // namespace ggswarm
