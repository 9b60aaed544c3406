// libggswarm's GGUF hyper-parameters: typed key reads (Hp), read_hparams, RoPE scaling, the common
// attention hyper-parameters and multi-token-prediction blocks, each checked as llama.cpp checks it.

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "arch.h"

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

}  // namespace ggswarm
