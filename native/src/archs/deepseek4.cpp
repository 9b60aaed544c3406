// DeepSeek-V4 (deepseek4) in the architecture table (arch.h): its hyper-parameters and each layer's tensors
// here; its session state kind (StateKind::Dsv4) in deepseek4_state.cpp, the window graph in deepseek4_graph.cpp
// (its inputs: deepseek4_inputs.cpp; shared declarations: deepseek4.h). Written from llama.cpp's description of
// the model (which GGUF keys and tensors exist, which ggml ops its reference graph runs, in which order), so
// the numbers follow llama.cpp's; no code is copied.
//
// Between layers flow 4 hyper-connection streams of d_model each (the boundary row is 4 x d_model);
// every layer attends a raw sliding window of single-head K (K = V) plus, on compressing layers, a
// compressed K cache: ratio 4 ("CSA") with overlapping blocks and a lightning indexer that picks the
// top-k compressed entries, ratio 128 ("HCA") over all of them. The state is held as llama.cpp holds
// it: the raw window and the compressor's inputs (a kv row and a score row per position) in rings of the
// last positions, the compressed caches per block; going back further than the rings reach takes a
// checkpoint (see "the state kind", deepseek4_state.cpp).

#include <algorithm>
#include <cmath>
#include <cstring>

#include "archs/deepseek4.h"

namespace ggswarm {
namespace deepseek4 {
namespace {

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
    if (m->mtp_block) {  // the nextn block's own handle (mtp.cpp): its one layer follows the trunk
        if (nextn != 1) {
            return fail(m, GGSWARM_E_UNSUPPORTED, "%snextn_predict_layers is %d: multi-token prediction needs exactly 1 block",
                        a, nextn);
        }
    } else {
        m->n_layers_total -= nextn;  // the trunk never runs the multi-token-prediction blocks
    }
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
    if (m->mtp_block) {
        // the block embeds the token of each position (its graph reads the ids: validate_step checks
        // them); llama.cpp's MTP graph attends the raw window only (it asserts ratio 0) and routes by score
        m->ids_layers = m->n_layers_total;
        if (h->ratio.back() != 0 || h->hash_layers >= m->n_layers_total) {
            return fail(m, GGSWARM_E_UNSUPPORTED, "the nextn block compresses or routes by token id (llama.cpp refuses it too)");
        }
    }
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
    if (m->mtp_block) {  // the nextn block's own tensors (llama.cpp's nextn.*; the optional ones fall back
        // to the trunk's token embedding, output norm and head)
        w.need(blk(il, "nextn.eh_proj.weight"), {2 * d, d}, x("eh_proj"));
        w.need(blk(il, "nextn.enorm.weight"), {d}, x("enorm"));
        w.need(blk(il, "nextn.hnorm.weight"), {d}, x("hnorm"));
        const std::string emb = blk(il, "nextn.embed_tokens.weight");
        w.need_plain(w.in_file(emb) ? emb : std::string("token_embd.weight"), {d, m->n_vocab}, x("embed_tokens"));  // get_rows reads it
        w.opt(blk(il, "nextn.shared_head_head.weight"), {d, m->n_vocab}, x("shared_head_head"));
        w.opt(blk(il, "nextn.shared_head_norm.weight"), {d}, x("shared_head_norm"));
    }
    if (il == m->n_layers_total - 1) {  // the head that collapses the streams before the output norm
        w.need("output_hc_fn.weight", {hcd, h.hc}, x("hc_head_fn"));
        w.need("output_hc_base.weight", {h.hc}, x("hc_head_base"));
        w.need("output_hc_scale.weight", {1}, x("hc_head_scale"));
    }
}

// caches in f16 (llama.cpp's default), f32 (llama.cpp's type_k = 0), q8_0 or q4_0, ggswarm_set_cache_type
const Arch kDeepseek4 = {"deepseek4", read, want, build, set_inputs, false, kKvCacheTypes | (1u << GGML_TYPE_F32)};
ArchRegistration reg(&kDeepseek4);

}  // namespace
}  // namespace deepseek4
}  // namespace ggswarm
