// libggswarm loading: GGUF hyper-parameters and checks, the window's tensors read into one backend
// buffer, the ggml device, scheduler and threads.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "arch.h"
#ifdef GGSWARM_OWN_THREADPOOL
#include "ggml-cpu.h"
#endif

namespace ggswarm {
namespace {

bool get_int(const gguf_context * g, const std::string & key, int64_t * out) {
    int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8: *out = gguf_get_val_u8(g, id); return true;
        case GGUF_TYPE_INT8: *out = gguf_get_val_i8(g, id); return true;
        case GGUF_TYPE_UINT16: *out = gguf_get_val_u16(g, id); return true;
        case GGUF_TYPE_INT16: *out = gguf_get_val_i16(g, id); return true;
        case GGUF_TYPE_UINT32: *out = gguf_get_val_u32(g, id); return true;
        case GGUF_TYPE_INT32: *out = gguf_get_val_i32(g, id); return true;
        case GGUF_TYPE_UINT64: *out = (int64_t)gguf_get_val_u64(g, id); return true;
        case GGUF_TYPE_INT64: *out = gguf_get_val_i64(g, id); return true;
        default: return false;
    }
}

bool get_float(const gguf_context * g, const std::string & key, double * out) {
    int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_FLOAT32: *out = gguf_get_val_f32(g, id); return true;
        case GGUF_TYPE_FLOAT64: *out = gguf_get_val_f64(g, id); return true;
        default: {
            int64_t v;
            if (get_int(g, key, &v)) {
                *out = (double)v;
                return true;
            }
            return false;
        }
    }
}

bool get_str(const gguf_context * g, const std::string & key, std::string * out) {
    int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) return false;
    *out = gguf_get_val_str(g, id);
    return true;
}

}  // namespace

bool Hp::has(const char * key) const { return gguf_find_key(g, (prefix + key).c_str()) >= 0; }

bool Hp::is_array(const char * key) const {
    int64_t id = gguf_find_key(g, (prefix + key).c_str());
    return id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_ARRAY;
}

ggswarm_status Hp::need_int(const char * key, int64_t lo, int64_t hi, int32_t * dst) const {
    const std::string k = prefix + key;
    if (is_array(key)) return fail(m, GGSWARM_E_UNSUPPORTED, "%s: per-layer values are not supported", k.c_str());
    int64_t v = 0;
    if (!get_int(g, k, &v)) return fail(m, GGSWARM_E_FORMAT, "%s is missing", k.c_str());
    if (v < lo || v > hi) {
        return fail(m, GGSWARM_E_FORMAT, "%s = %lld is out of range [%lld, %lld]", k.c_str(), (long long)v,
                    (long long)lo, (long long)hi);
    }
    *dst = (int32_t)v;
    return GGSWARM_OK;
}

bool Hp::opt_int(const char * key, int64_t * out) const { return get_int(g, prefix + key, out); }

int Hp::opt_bool(const char * key, bool * out) const {
    const int64_t id = gguf_find_key(g, (prefix + key).c_str());
    if (id < 0) return 0;
    if (gguf_get_kv_type(g, id) == GGUF_TYPE_BOOL) {
        *out = gguf_get_val_bool(g, id);
        return 1;
    }
    int64_t v = 0;
    if (!get_int(g, prefix + key, &v)) return -1;
    *out = v != 0;
    return 1;
}

int Hp::per_layer_float(const char * key, int32_t n, std::vector<float> * out) const {
    const int64_t id = gguf_find_key(g, (prefix + key).c_str());
    if (id < 0) return 0;
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY) {
        double v = 0;
        if (!get_float(g, prefix + key, &v)) return -1;
        out->assign(n, (float)v);
        return 1;
    }
    // llama.cpp's get_key_or_arr: an array holds exactly one value per layer of the file
    if (gguf_get_arr_type(g, id) != GGUF_TYPE_FLOAT32 || (int64_t)gguf_get_arr_n(g, id) != n) return -1;
    const float * d = static_cast<const float *>(gguf_get_arr_data(g, id));
    out->assign(d, d + n);
    return 1;
}
bool Hp::opt_float(const char * key, double * out) const { return get_float(g, prefix + key, out); }
bool Hp::opt_str(const char * key, std::string * out) const { return get_str(g, prefix + key, out); }

bool Hp::int_array(const char * key, std::vector<int64_t> * out) const {
    const int64_t id = gguf_find_key(g, (prefix + key).c_str());
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY) return false;
    const gguf_type t = gguf_get_arr_type(g, id);
    const size_t n = gguf_get_arr_n(g, id);
    const void * d = gguf_get_arr_data(g, id);
    out->clear();
    for (size_t i = 0; i < n; ++i) {
        if (t == GGUF_TYPE_INT32) out->push_back(static_cast<const int32_t *>(d)[i]);
        else if (t == GGUF_TYPE_UINT32) out->push_back(static_cast<const uint32_t *>(d)[i]);
        else return false;
    }
    return true;
}

bool Hp::per_layer(const char * key, int32_t n, std::vector<int64_t> * out) const {
    const std::string k = prefix + key;
    int64_t id = gguf_find_key(g, k.c_str());
    if (id < 0) return false;
    out->assign(n, 0);
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY) {
        int64_t v = 0;
        if (!get_int(g, k, &v)) {
            if (gguf_get_kv_type(g, id) != GGUF_TYPE_BOOL) return false;
            v = gguf_get_val_bool(g, id);
        }
        out->assign(n, v);
        return true;
    }
    const enum gguf_type at = gguf_get_arr_type(g, id);
    const size_t cnt = gguf_get_arr_n(g, id);
    if ((int64_t)cnt < n) return false;
    const void * data = gguf_get_arr_data(g, id);
    for (int32_t i = 0; i < n; ++i) {
        switch (at) {
            case GGUF_TYPE_BOOL: case GGUF_TYPE_INT8: (*out)[i] = static_cast<const int8_t *>(data)[i]; break;
            case GGUF_TYPE_UINT8: (*out)[i] = static_cast<const uint8_t *>(data)[i]; break;
            case GGUF_TYPE_INT32: (*out)[i] = static_cast<const int32_t *>(data)[i]; break;
            case GGUF_TYPE_UINT32: (*out)[i] = static_cast<const uint32_t *>(data)[i]; break;
            case GGUF_TYPE_INT64: (*out)[i] = static_cast<const int64_t *>(data)[i]; break;
            case GGUF_TYPE_UINT64: (*out)[i] = (int64_t) static_cast<const uint64_t *>(data)[i]; break;
            default: return false;
        }
    }
    return true;
}

// general.architecture, its table entry, the block count and width, then the architecture's own reader.
ggswarm_status read_hparams(ggswarm_model * m, const Meta & meta) {
    const gguf_context * g = meta.g;
    if (!get_str(g, "general.architecture", &m->arch)) {
        return fail(m, GGSWARM_E_FORMAT, "general.architecture is missing");
    }
    m->archp = find_arch(m->arch);
    if (!m->archp) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "architecture '%s' is not supported by the native backend (supported: %s)",
                    m->arch.c_str(), arch_names().c_str());
    }
    Hp hp{m, g, m->arch + "."};
    ggswarm_status st;
    if ((st = hp.need_int("block_count", 1, 4096, &m->n_layers_total))) return st;
    if ((st = hp.need_int("embedding_length", 1, 1 << 20, &m->d_model))) return st;
    m->lhp.assign(m->n_layers_total, LayerHp{});
    m->n_ctx_train = 4096;
    int64_t v = 0;
    if (hp.opt_int("context_length", &v) && v > 0) m->n_ctx_train = (int32_t)std::min<int64_t>(v, INT32_MAX);
    m->n_ctx_max = std::min(m->n_ctx_train, (int32_t)GGSWARM_MAX_CONTEXT);
    if ((st = read_rope_scaling(m, hp))) return st;
    for (LayerHp & l : m->lhp) {
        l.rope_base = m->rope_base;
        l.rope_scale = m->rope.freq_scale;
        l.rope_ext = m->rope.ext_factor;
        l.rope_attn = m->rope.attn_factor;
    }
    if ((st = m->archp->read_hparams(m, hp))) return st;
    const RopeScaling & r = m->rope;
    if (r.ext_factor != 0.0f || r.freq_scale != 1.0f) {  // the set-up a user compares with llama.cpp's log
        fprintf(stderr,
                "libggswarm: %s rope: base %g, scaling %s, freq_scale %g, ext_factor %g, attn_factor %g, "
                "beta %g/%g, n_ctx_orig %d\n",
                m->arch.c_str(), (double)m->rope_base, r.type.c_str(), (double)r.freq_scale, (double)r.ext_factor,
                (double)r.attn_factor, (double)r.beta_fast, (double)r.beta_slow, r.n_ctx_orig);
    }
    return GGSWARM_OK;
}

// RoPE scaling with llama.cpp's keys, types and fallbacks (llama_model::load_hparams, then the context's
// defaults): type absent = linear; factor from rope.scaling.factor, else rope.scale_linear, 0 = none;
// YaRN sets ext_factor 1 and an attn_factor that cancels ggml's own magnitude correction (net 1, times
// rope.scaling.attn_factor); the original context falls back to context_length. llama.cpp reads no
// yarn_beta_* keys (it uses 32 / 1): a file whose values differ is refused rather than run differently.
ggswarm_status read_rope_scaling(ggswarm_model * m, const Hp & hp) {
    const char * a = hp.prefix.c_str();
    RopeScaling & r = m->rope;
    r = RopeScaling{};
    double f = 0;
    m->rope_base = 10000.0f;
    if (hp.has("rope.freq_base")) {
        if (!hp.opt_float("rope.freq_base", &f) || !(f > 0)) return fail(m, GGSWARM_E_FORMAT, "%srope.freq_base is not a positive number", a);
        m->rope_base = (float)f;
    }
    if (hp.has("rope.scaling.type") && !hp.opt_str("rope.scaling.type", &r.type)) {
        return fail(m, GGSWARM_E_FORMAT, "%srope.scaling.type is not a string", a);
    }
    if (r.type != "none" && r.type != "linear" && r.type != "yarn" && r.type != "longrope") {
        return fail(m, GGSWARM_E_FORMAT, "%srope.scaling.type '%s' is unknown (llama.cpp knows none, linear, yarn, longrope)",
                    a, r.type.c_str());
    }
    double factor = 0;
    const char * fkey = hp.has("rope.scaling.factor") ? "rope.scaling.factor" : "rope.scale_linear";
    if (hp.has(fkey) && (!hp.opt_float(fkey, &factor) || factor < 0 || !std::isfinite(factor))) {
        return fail(m, GGSWARM_E_FORMAT, "%s%s is not a non-negative number", a, fkey);
    }
    r.freq_scale = factor == 0.0 ? 1.0f : (float)(1.0 / factor);
    if (r.type == "none") r.freq_scale = 1.0f;
    r.n_ctx_orig = m->n_ctx_train;
    int64_t v = 0;
    if (hp.has("rope.scaling.original_context_length")) {
        if (!hp.opt_int("rope.scaling.original_context_length", &v) || v < 0 || v > INT32_MAX) {
            return fail(m, GGSWARM_E_FORMAT, "%srope.scaling.original_context_length is not a context length", a);
        }
        if (v > 0) r.n_ctx_orig = (int32_t)v;
    }
    double rope_attn = 1.0;
    if (hp.has("rope.scaling.attn_factor") && !hp.opt_float("rope.scaling.attn_factor", &rope_attn)) {
        return fail(m, GGSWARM_E_FORMAT, "%srope.scaling.attn_factor is not a number", a);
    }
    const struct { const char * key; double llama; } betas[] = {{"rope.scaling.yarn_beta_fast", 32.0},
                                                               {"rope.scaling.yarn_beta_slow", 1.0}};
    for (const auto & bk : betas) {
        if (hp.has(bk.key) && (!hp.opt_float(bk.key, &f) || f != bk.llama)) {
            return fail(m, GGSWARM_E_UNSUPPORTED, "%s%s must be %g: llama.cpp ignores the key and uses %g", a, bk.key,
                        bk.llama, bk.llama);
        }
    }
    if (r.type == "yarn") {
        r.ext_factor = 1.0f;
        // llama.cpp: mscale(factor) = 1 + 0.1 ln(factor), divided by ggml's own 1 + 0.1 ln(1 / freq_scale)
        const float fac = 1.0f / r.freq_scale;
        const float mscale = fac <= 1.0f ? 1.0f : 0.1f * logf(fac) + 1.0f;
        r.attn_factor = mscale / (1.0f + 0.1f * logf(fac));
    }
    r.attn_factor *= (float)rope_attn;
    return GGSWARM_OK;
}

ggswarm_status read_attention_hparams(ggswarm_model * m, const Hp & hp, AttnOpts opts) {
    const char * a = hp.prefix.c_str();
    ggswarm_status st;
    int64_t v = 0;
    if (!opts.experts && hp.opt_int("expert_count", &v) && v > 0) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "%s with %lld experts (MoE) is not supported by the native backend",
                    m->arch.c_str(), (long long)v);
    }
    if ((st = hp.need_int("feed_forward_length", 1, 1 << 22, &m->n_ff))) return st;
    if ((st = hp.need_int("attention.head_count", 1, 4096, &m->n_head))) return st;
    m->n_head_kv = m->n_head;
    if (hp.has("attention.head_count_kv")) {
        if ((st = hp.need_int("attention.head_count_kv", 1, 4096, &m->n_head_kv))) return st;
    }
    if (m->n_head % m->n_head_kv != 0) {
        return fail(m, GGSWARM_E_FORMAT, "head_count %d is not a multiple of head_count_kv %d", m->n_head,
                    m->n_head_kv);
    }
    m->head_dim = m->d_model / m->n_head;
    if (hp.opt_int("attention.key_length", &v)) m->head_dim = (int32_t)v;
    int64_t vlen = m->head_dim;
    if (hp.opt_int("attention.value_length", &vlen) && vlen != m->head_dim) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "key_length %d != value_length %lld", m->head_dim, (long long)vlen);
    }
    if (m->head_dim <= 0 || m->head_dim % 2 != 0 || m->head_dim > 1024) {
        return fail(m, GGSWARM_E_FORMAT, "head dimension %d is invalid", m->head_dim);
    }
    m->n_rot = m->head_dim;
    if (hp.opt_int("rope.dimension_count", &v)) m->n_rot = (int32_t)v;
    if (m->n_rot != m->head_dim && !(opts.partial_rope && m->n_rot > 0 && m->n_rot < m->head_dim && m->n_rot % 2 == 0)) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "partial rotary embedding (%d of %d dims) is not supported", m->n_rot,
                    m->head_dim);
    }
    double f = 0;
    if (!hp.opt_float("attention.layer_norm_rms_epsilon", &f)) {
        return fail(m, GGSWARM_E_FORMAT, "%sattention.layer_norm_rms_epsilon is missing", a);
    }
    m->eps = (float)f;
    for (LayerHp & l : m->lhp) l.state = StateKind::KV;  // RoPE: read_rope_scaling's, set before
    return GGSWARM_OK;
}

ggswarm_status drop_mtp_layers(ggswarm_model * m, const Hp & hp) {
    int32_t nextn = 0;
    if (hp.has("nextn_predict_layers")) {
        if (ggswarm_status st = hp.need_int("nextn_predict_layers", 0, 16, &nextn)) return st;
    }
    if (nextn >= m->n_layers_total) {
        return fail(m, GGSWARM_E_FORMAT, "%snextn_predict_layers %d >= block_count %d", hp.prefix.c_str(), nextn,
                    m->n_layers_total);
    }
    m->n_layers_total -= nextn;
    m->lhp.resize(m->n_layers_total);
    return GGSWARM_OK;
}

// --- weights -------------------------------------------------------------------------------------------

void want_attention(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    const int64_t d = m->d_model, dq = (int64_t)m->n_head * m->head_dim, dkv = m->d_kv();
    w.need(blk(il, "attn_norm.weight"), {d}, &L.attn_norm);
    w.need(blk(il, "attn_q.weight"), {d, dq}, &L.wq);
    w.need(blk(il, "attn_k.weight"), {d, dkv}, &L.wk);
    w.need(blk(il, "attn_v.weight"), {d, dkv}, &L.wv);
    w.opt(blk(il, "attn_q.bias"), {dq}, &L.bq);
    w.opt(blk(il, "attn_k.bias"), {dkv}, &L.bk);
    w.opt(blk(il, "attn_v.bias"), {dkv}, &L.bv);
    w.need(blk(il, "attn_output.weight"), {dq, d}, &L.wo);
    w.opt(blk(il, "attn_output.bias"), {d}, &L.bo);
}

void want_ffn(const ggswarm_model * m, int32_t il, Layer & L, Wants & w) {
    const int64_t d = m->d_model;
    w.need(blk(il, "ffn_norm.weight"), {d}, &L.ffn_norm);
    w.need(blk(il, "ffn_gate.weight"), {d, m->n_ff}, &L.w_gate);
    w.need(blk(il, "ffn_up.weight"), {d, m->n_ff}, &L.w_up);
    w.need(blk(il, "ffn_down.weight"), {m->n_ff, d}, &L.w_down);
}

namespace {

// The CPU's repacked-weights buffer type (ggml's CPU_REPACK: interleaved quant blocks for its SIMD
// matmul kernels), which llama.cpp puts every weight matrix it supports in; nullptr on other devices,
// when the ggml build has none, or with GGSWARM_REPACK=0.
ggml_backend_buffer_type_t repack_buft(const ggswarm_model * m) {
    const char * env = getenv("GGSWARM_REPACK");
    if (env && strcmp(env, "0") == 0) return nullptr;
    if (ggml_backend_dev_type(m->dev) != GGML_BACKEND_DEVICE_TYPE_CPU) return nullptr;
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(m->dev);
    auto get = reg ? (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(
                         reg, "ggml_backend_dev_get_extra_bufts")
                   : nullptr;
    if (!get) return nullptr;
    for (ggml_backend_buffer_type_t * b = get(m->dev); b && *b; ++b) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
    }
    return nullptr;
}

// Whether the device multiplies a weight like src held in buft (llama.cpp's test: a 512-column
// product, the weight in a dummy buffer of that type).
bool matmul_ok(const ggswarm_model * m, const ggml_tensor * src, ggml_backend_buffer_type_t buft) {
    ggml_init_params ip = {ggml_tensor_overhead() * 8, nullptr, true};
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) return false;
    ggml_tensor * w = ggml_new_tensor(ctx, src->type, GGML_MAX_DIMS, src->ne);
    ggml_tensor * x = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, w->ne[0], 512, w->ne[2], w->ne[3]);
    ggml_tensor * op = ggml_mul_mat(ctx, w, x);
    w->buffer = ggml_backend_buft_alloc_buffer(buft, 0);
    const bool ok = w->buffer && ggml_backend_dev_supports_op(m->dev, op);
    if (w->buffer) ggml_backend_buffer_free(w->buffer);
    w->buffer = nullptr;
    ggml_free(ctx);
    return ok;
}

}  // namespace

// The tensors of the window [layer_start, layer_end) with their expected shapes, into wants.
ggswarm_status want_window(ggswarm_model * m, const Meta & meta, Wants & wants) {
    wants.g = meta.g;
    const int64_t d = m->d_model;
    if (m->is_first()) wants.need("token_embd.weight", {d, m->n_vocab}, &m->tok_embd);
    if (m->is_last()) {
        wants.need("output_norm.weight", {d}, &m->output_norm);
        if (wants.in_file("output.weight")) {
            wants.need("output.weight", {d, m->n_vocab}, &m->output);
        } else if (!m->is_first()) {
            wants.need("token_embd.weight", {d, m->n_vocab}, &m->tok_embd);
        }
    }
    if (wants.in_file("rope_freqs.weight")) wants.need("rope_freqs.weight", {m->n_rot / 2}, &m->rope_freqs);
    m->layers.resize(m->layer_end - m->layer_start);
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        if (m->lhp[il].state == StateKind::KV && wants.in_file(blk(il, "attn_qkv.weight"))) {
            return fail(m, GGSWARM_E_UNSUPPORTED, "fused attn_qkv tensors are not supported (layer %d)", il);
        }
        m->archp->want_layer(m, il, m->layers[il - m->layer_start], wants);
    }
    return GGSWARM_OK;
}

// A wanted tensor against the file's table: present (unless optional: *src stays null), of the
// expected shape, f32 when it is a vector (norms, biases).
ggswarm_status resolve_want(ggswarm_model * m, const Meta & meta, const Wants::Item & w, const ggml_tensor ** src,
                            int64_t * tid) {
    *src = nullptr;
    *tid = gguf_find_tensor(meta.g, w.name.c_str());
    if (*tid < 0) return w.optional ? GGSWARM_OK : fail(m, GGSWARM_E_FORMAT, "tensor %s is missing", w.name.c_str());
    const ggml_tensor * t = ggml_get_tensor(meta.ctx, w.name.c_str());
    if (!t) return fail(m, GGSWARM_E_FORMAT, "tensor %s has no metadata", w.name.c_str());
    for (int i = 0; i < GGML_MAX_DIMS; ++i) {
        int64_t expect = i < (int)w.shape.size() ? w.shape[i] : 1;
        if (t->ne[i] != expect) {
            return fail(m, GGSWARM_E_FORMAT, "tensor %s has shape [%lld, %lld, %lld, %lld], expected dim %d = %lld",
                        w.name.c_str(), (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                        (long long)t->ne[3], i, (long long)expect);
        }
    }
    if (w.shape.size() == 1 && t->type != GGML_TYPE_F32) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "tensor %s has type %s; norms and biases must be f32", w.name.c_str(),
                    ggml_type_name(t->type));
    }
    *src = t;
    return GGSWARM_OK;
}

ggswarm_status check_window(ggswarm_model * m, const Meta & meta) {
    Wants wants;
    ggswarm_status st = want_window(m, meta, wants);
    for (const Wants::Item & w : wants.items) {
        if (st) break;
        const ggml_tensor * src;
        int64_t tid;
        st = resolve_want(m, meta, w, &src, &tid);
    }
    m->layers.clear();
    return st;
}

ggswarm_status load_weights(ggswarm_model * m, const Meta & meta, const char * path, uint64_t file_size) {
    Wants wants;
    if (ggswarm_status st = want_window(m, meta, wants)) return st;
    const std::vector<Wants::Item> & want = wants.items;
    ggml_init_params ip = {ggml_tensor_overhead() * (want.size() + 4), nullptr, true};
    m->wctx = ggml_init(ip);
    m->wctx_extra = ggml_init(ip);
    if (!m->wctx || !m->wctx_extra) return fail(m, GGSWARM_E_NO_MEMORY, "cannot create the weights context");
    ggml_backend_buffer_type_t extra = repack_buft(m);
    std::vector<std::pair<ggml_tensor *, int64_t>> to_read;  // tensor, gguf id
    for (const Wants::Item & w : want) {
        const ggml_tensor * src;
        int64_t tid;
        if (ggswarm_status st = resolve_want(m, meta, w, &src, &tid)) return st;
        if (!src) continue;  // optional and absent
        // matrices the CPU's repacked layout can multiply go there, as llama.cpp places them (the same
        // kernels, so the same numbers, and faster); token_embd stays (get_rows reads it)
        const bool repack = extra && !w.plain && w.shape.size() >= 2 && w.name != "token_embd.weight" &&
                            matmul_ok(m, src, extra);
        ggml_tensor * t = ggml_new_tensor(repack ? m->wctx_extra : m->wctx, src->type, (int)w.shape.size(), src->ne);
        ggml_set_name(t, w.name.c_str());
        *w.dst = t;
        to_read.push_back({t, tid});
    }
    if (m->is_last() && !m->output) m->output = m->tok_embd;
    m->wbuf = ggml_backend_alloc_ctx_tensors_from_buft(m->wctx, m->buft);
    if (!m->wbuf) return fail(m, GGSWARM_E_NO_MEMORY, "cannot allocate %s weights buffer", m->device_name.c_str());
    ggml_backend_buffer_set_usage(m->wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    if (ggml_get_first_tensor(m->wctx_extra)) {
        m->wbuf_extra = ggml_backend_alloc_ctx_tensors_from_buft(m->wctx_extra, extra);
        if (!m->wbuf_extra) return fail(m, GGSWARM_E_NO_MEMORY, "cannot allocate the repacked weights buffer");
        ggml_backend_buffer_set_usage(m->wbuf_extra, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }

    FILE * fp = fopen(path, "rb");
    if (!fp) return fail(m, GGSWARM_E_IO, "cannot open %s: %s", path, strerror(errno));
    const uint64_t data_off = gguf_get_data_offset(meta.g);
    ggswarm_status st = GGSWARM_OK;
    for (auto & tr : to_read) {
        ggml_tensor * t = tr.first;
        const uint64_t off = data_off + gguf_get_tensor_offset(meta.g, tr.second);
        const size_t nbytes = ggml_nbytes(t);
        if (off + nbytes > file_size) {
            st = fail(m, GGSWARM_E_FORMAT, "tensor %s ends at byte %llu but the file has %llu bytes (truncated file?)",
                      ggml_get_name(t), (unsigned long long)(off + nbytes), (unsigned long long)file_size);
            break;
        }
        const bool host = ggml_backend_buffer_is_host(t->buffer) && t->buffer != m->wbuf_extra;
        void * dst = t->data;
        if (!host) {
            m->staging.resize(nbytes);
            dst = m->staging.data();
        }
        if (fseeko(fp, (off_t)off, SEEK_SET) != 0 || fread(dst, 1, nbytes, fp) != nbytes) {
            st = fail(m, GGSWARM_E_IO, "cannot read tensor %s (%zu bytes at %llu)", ggml_get_name(t), nbytes,
                      (unsigned long long)off);
            break;
        }
        if (!ggml_validate_row_data(t->type, dst, nbytes)) {
            st = fail(m, GGSWARM_E_FORMAT, "tensor %s: corrupt data (NaN/Inf values or invalid block scales)",
                      ggml_get_name(t));
            break;
        }
        if (!host) ggml_backend_tensor_set(t, dst, 0, nbytes);
        m->weight_bytes += nbytes;
    }
    fclose(fp);
    std::vector<uint8_t>().swap(m->staging);
    return st;
}

// Fingerprint of the metadata region when the caller gives no model id.
std::string fingerprint(const char * path, uint64_t data_off, uint64_t file_size) {
    FILE * fp = fopen(path, "rb");
    if (!fp) return "fp:unknown";
    uint64_t h = 1469598103934665603ULL;
    std::vector<uint8_t> buf(1 << 16);
    uint64_t left = data_off;
    while (left > 0) {
        size_t n = fread(buf.data(), 1, std::min<uint64_t>(left, buf.size()), fp);
        if (n == 0) break;
        h = fnv1a(buf.data(), n, h);
        left -= n;
    }
    fclose(fp);
    h = fnv1a(reinterpret_cast<const uint8_t *>(&file_size), sizeof(file_size), h);
    char s[32];
    snprintf(s, sizeof(s), "fp:%016llx", (unsigned long long)h);
    return s;
}

ggswarm_status apply_threads(ggswarm_model * m, int32_t n) {
    m->n_threads = n;
    ggml_backend_t targets[2] = {m->backend, m->backend_cpu};
    for (ggml_backend_t b : targets) {
        if (!b) continue;
        ggml_backend_dev_t dev = ggml_backend_get_device(b);
        ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
        if (!reg) continue;
        auto fn = (ggml_backend_set_n_threads_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
        if (fn) fn(b, n);
    }
#ifdef GGSWARM_OWN_THREADPOOL
    // An explicit threadpool that does not poll: between graphs its workers sleep on a condition variable
    // instead of spinning (as OpenMP's do, GOMP_SPINCOUNT) on cores the next hop of a served route needs.
    // Within a graph ggml's barrier still spins. Made again only when more threads are asked for than it
    // has (fewer reuse it: ggml kicks off only the first n workers, the others stay asleep); the old one is
    // freed once no backend points at it (never during a compute: calls on a handle are serialised).
    if (!m->threadpool || m->threadpool_n < n) {
        ggml_threadpool_params tpp = ggml_threadpool_params_default(n);
        tpp.poll = 0;
        ggml_threadpool * tp = ggml_threadpool_new(&tpp);
        if (!tp) return fail(m, GGSWARM_E_NO_MEMORY, "cannot create a ggml threadpool of %d threads", n);
        for (ggml_backend_t b : targets) {
            if (b && ggml_backend_is_cpu(b)) ggml_backend_cpu_set_threadpool(b, tp);
        }
        if (m->threadpool) ggml_threadpool_free(m->threadpool);
        m->threadpool = tp;
        m->threadpool_n = n;
    }
#endif
    return GGSWARM_OK;
}

ggswarm_status init_backends(ggswarm_model * m) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_dev_t dev = nullptr;
    const char * want = getenv("GGSWARM_DEVICE");
    if (want && *want) {
        dev = ggml_backend_dev_by_name(want);
        if (!dev) return fail(m, GGSWARM_E_UNSUPPORTED, "GGSWARM_DEVICE=%s: no such ggml device", want);
    } else {
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
        if (!dev) dev = cpu;
    }
    if (!dev) return fail(m, GGSWARM_E_UNSUPPORTED, "no ggml backend device is available");
    m->dev = dev;
    m->device_name = ggml_backend_dev_name(dev);
    m->backend = ggml_backend_dev_init(dev, nullptr);
    if (!m->backend) return fail(m, GGSWARM_E_NO_MEMORY, "cannot initialise ggml device %s", m->device_name.c_str());
    if (dev == cpu || !cpu) {
        m->backend_cpu = m->backend;
    } else {
        m->backend_cpu = ggml_backend_dev_init(cpu, nullptr);
        if (!m->backend_cpu) return fail(m, GGSWARM_E_NO_MEMORY, "cannot initialise the ggml CPU device");
    }
    m->buft = ggml_backend_dev_buffer_type(dev);
    return GGSWARM_OK;
}

// Size the window graph; every cached graph gets a scheduler of its own (new_sched), made with it.
ggswarm_status init_sched(ggswarm_model * m) {
    const int32_t nl = m->layer_end - m->layer_start;
    m->graph_size = (size_t)std::max(4096, m->nodes_per_layer * nl + 512);  // room for norms, gates and experts per layer
    return GGSWARM_OK;
}

// A scheduler over the model's device (and the CPU as fallback) for graphs of up to graph_size nodes
// (0: the window graph's m->graph_size); NULL when ggml cannot make one.
ggml_backend_sched_t new_sched(const ggswarm_model * m, size_t graph_size) {
    ggml_backend_t bs[2] = {m->backend, m->backend_cpu};
    int n = m->backend_cpu == m->backend ? 1 : 2;
    return ggml_backend_sched_new(bs, nullptr, n, graph_size ? graph_size : m->graph_size, false, false);
}

}  // namespace ggswarm
