// libggswarm: runs layers [a, b) of a llama-family GGUF with ggml, hidden state in/out at the seam.
//
// Weights stay in their GGUF (quantized) types in one backend buffer of the chosen ggml device; only
// the window's tensors and its role tensors are read from the file. Every session owns a KV buffer
// (f16; K as [head_dim * n_head_kv, capacity], V transposed as [capacity, head_dim * n_head_kv] per
// layer) that grows by doubling inside the model's byte budget. A forward call builds the window's
// graph in a preallocated metadata arena and runs it through ggml_backend_sched, so the same code
// drives a CPU or a GPU build of ggml. See include/ggswarm.h and docs/native.md.

#include "ggswarm.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"
#include "attention.h"
#include "sampler.h"

namespace {

thread_local std::string g_last_error;

constexpr char kSnapMagic[8] = {'G', 'G', 'S', 'W', 'K', 'V', 'S', 'N'};
constexpr uint32_t kSnapVersion = 1;

// Snapshot header (little-endian, packed by construction: every field is naturally aligned).
struct SnapHeader {
    char magic[8];
    uint32_t format_version;
    uint32_t header_size;
    char model_id[72];
    char architecture[32];
    int32_t layer_start;
    int32_t layer_end;
    int32_t n_layers_total;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t kv_type;  // ggml_type of K and V (GGML_TYPE_F16)
    int32_t n_pos;
    int32_t reserved;
    uint64_t payload_bytes;
    uint64_t payload_fnv1a;
};
static_assert(sizeof(SnapHeader) == 168, "snapshot header layout changed: bump kSnapVersion");

uint64_t fnv1a(const uint8_t * p, size_t n, uint64_t h = 1469598103934665603ULL) {
    for (size_t i = 0; i < n; ++i) {
        h ^= p[i];
        h *= 1099511628211ULL;
    }
    return h;
}

struct Layer {
    ggml_tensor * attn_norm = nullptr;
    ggml_tensor * wq = nullptr;
    ggml_tensor * wk = nullptr;
    ggml_tensor * wv = nullptr;
    ggml_tensor * bq = nullptr;
    ggml_tensor * bk = nullptr;
    ggml_tensor * bv = nullptr;
    ggml_tensor * wo = nullptr;
    ggml_tensor * bo = nullptr;
    ggml_tensor * ffn_norm = nullptr;
    ggml_tensor * w_gate = nullptr;
    ggml_tensor * w_up = nullptr;
    ggml_tensor * w_down = nullptr;
};

struct Session {
    int32_t max_tokens = 0;
    int32_t len = 0;
    int32_t cap = 0;
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    std::vector<ggml_tensor *> k;
    std::vector<ggml_tensor *> v;
    uint64_t bytes = 0;

    void release() {
        if (buf) ggml_backend_buffer_free(buf);
        if (ctx) ggml_free(ctx);
        buf = nullptr;
        ctx = nullptr;
        k.clear();
        v.clear();
        bytes = 0;
        cap = 0;
    }
};

// A built and allocated window graph; kept between calls and reused while its key matches (a decode
// loop on one session rebuilds nothing: only the inputs change).
struct GraphKey {
    int64_t sid = -1;
    int32_t n = 0;
    int32_t n_kv = 0;
    const void * kv = nullptr;  // identity of the session's KV buffer (changes when it grows)
    bool last_only = false;
    bool operator==(const GraphKey & o) const {
        return sid == o.sid && n == o.n && n_kv == o.n_kv && kv == o.kv && last_only == o.last_only;
    }
};

struct Graph {
    ggml_context * ctx = nullptr;
    ggml_cgraph * gf = nullptr;
    ggml_tensor * inp_tokens = nullptr;
    ggml_tensor * inp_hidden = nullptr;
    ggml_tensor * inp_pos = nullptr;
    ggml_tensor * inp_mask = nullptr;
    ggml_tensor * inp_kidx = nullptr;  // row of each new position in K
    ggml_tensor * inp_vidx = nullptr;  // element index of each new (channel, position) in transposed V
    ggml_tensor * out = nullptr;
    ggml_tensor * out_prob = nullptr;  // last window: softmax of the final position's logits
    GraphKey key;
    bool valid = false;
    void clear() {
        if (ctx) ggml_free(ctx);
        *this = Graph();
    }
};

}  // namespace

struct ggswarm_model {
    mutable std::string error;

    std::string arch;
    std::string model_id;
    std::string device_name;
    int32_t n_layers_total = 0, layer_start = 0, layer_end = 0;
    int32_t d_model = 0, n_vocab = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_ff = 0, n_rot = 0;
    int32_t n_ctx_train = 0, n_ctx_max = 0, n_threads = 1;
    float eps = 1e-5f, rope_base = 10000.0f, rope_freq_scale = 1.0f;
    int rope_mode = GGML_ROPE_TYPE_NORMAL;
    bool decode_kernels = false;  // CPU decode steps use attention.cpp's kernels (see kernel_step)
    uint64_t kv_budget = 0;
    uint64_t weight_bytes = 0;

    ggml_backend_dev_t dev = nullptr;
    ggml_backend_t backend = nullptr;      // device the weights and KV live on
    ggml_backend_t backend_cpu = nullptr;  // CPU fallback for the scheduler (== backend on CPU hosts)
    ggml_backend_buffer_type_t buft = nullptr;
    ggml_backend_sched_t sched = nullptr;
    ggml_context * wctx = nullptr;
    ggml_backend_buffer_t wbuf = nullptr;

    ggml_tensor * tok_embd = nullptr;
    ggml_tensor * output_norm = nullptr;
    ggml_tensor * output = nullptr;
    ggml_tensor * rope_freqs = nullptr;
    std::vector<Layer> layers;

    std::map<int64_t, Session> sessions;
    int64_t next_sid = 1;

    size_t graph_size = 0;
    std::vector<uint8_t> graph_meta;
    Graph graph;  // last built graph (see GraphKey)
    std::vector<float> mask_host;
    std::vector<int64_t> kidx_host;
    std::vector<int64_t> vidx_host;
    std::vector<int32_t> pos_host;
    std::vector<float> hidden_host;
    std::vector<float> logits_host;
    std::vector<uint8_t> staging;
    ggswarm::SamplerScratch scratch;

    bool is_first() const { return layer_start == 0; }
    bool is_last() const { return layer_end == n_layers_total; }
    int32_t d_kv() const { return head_dim * n_head_kv; }
    uint64_t kv_bytes_per_token() const {
        return 2ULL * (uint64_t)(layer_end - layer_start) * (uint64_t)d_kv() * sizeof(ggml_fp16_t);
    }
    uint64_t kv_total() const {
        uint64_t t = 0;
        for (const auto & kv : sessions) t += kv.second.bytes;
        return t;
    }

    ~ggswarm_model() {
        graph.clear();
        for (auto & kv : sessions) kv.second.release();
        sessions.clear();
        if (sched) ggml_backend_sched_free(sched);
        if (wbuf) ggml_backend_buffer_free(wbuf);
        if (wctx) ggml_free(wctx);
        if (backend_cpu && backend_cpu != backend) ggml_backend_free(backend_cpu);
        if (backend) ggml_backend_free(backend);
    }
};

namespace {

ggswarm_status fail(const ggswarm_model * m, ggswarm_status code, const char * fmt, ...)
    __attribute__((format(printf, 3, 4)));

ggswarm_status fail(const ggswarm_model * m, ggswarm_status code, const char * fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    g_last_error = buf;
    if (m) m->error = buf;
    return code;
}

ggswarm_status ok(const ggswarm_model * m) {
    (void)m;
    return GGSWARM_OK;
}

// --- GGUF metadata helpers -------------------------------------------------------------------------

struct Meta {
    gguf_context * g = nullptr;
    ggml_context * ctx = nullptr;  // tensor metadata only (no_alloc)
    ~Meta() {
        if (g) gguf_free(g);
        if (ctx) ggml_free(ctx);
    }
};

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

const char * kSupportedArchs[] = {"llama", "mistral", "qwen2"};

bool arch_supported(const std::string & a) {
    for (const char * s : kSupportedArchs) {
        if (a == s) return true;
    }
    return false;
}

// Read hyper-parameters and validate them; fills m.
ggswarm_status read_hparams(ggswarm_model * m, const Meta & meta) {
    const gguf_context * g = meta.g;
    if (!get_str(g, "general.architecture", &m->arch)) {
        return fail(m, GGSWARM_E_FORMAT, "general.architecture is missing");
    }
    if (!arch_supported(m->arch)) {
        return fail(m, GGSWARM_E_UNSUPPORTED,
                    "architecture '%s' is not supported by the native backend (supported: llama, mistral, qwen2)",
                    m->arch.c_str());
    }
    const std::string a = m->arch + ".";
    int64_t v = 0;
    auto need_int = [&](const char * key, int64_t lo, int64_t hi, int32_t * dst) -> ggswarm_status {
        std::string k = a + key;
        int64_t id = gguf_find_key(g, k.c_str());
        if (id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_ARRAY) {
            return fail(m, GGSWARM_E_UNSUPPORTED, "%s: per-layer values are not supported", k.c_str());
        }
        if (!get_int(g, k, &v)) return fail(m, GGSWARM_E_FORMAT, "%s is missing", k.c_str());
        if (v < lo || v > hi) {
            return fail(m, GGSWARM_E_FORMAT, "%s = %lld is out of range [%lld, %lld]", k.c_str(), (long long)v,
                        (long long)lo, (long long)hi);
        }
        *dst = (int32_t)v;
        return GGSWARM_OK;
    };
    ggswarm_status st;
    if ((st = need_int("block_count", 1, 4096, &m->n_layers_total))) return st;
    if ((st = need_int("embedding_length", 1, 1 << 20, &m->d_model))) return st;
    if ((st = need_int("feed_forward_length", 1, 1 << 22, &m->n_ff))) return st;
    if ((st = need_int("attention.head_count", 1, 4096, &m->n_head))) return st;
    m->n_head_kv = m->n_head;
    if (gguf_find_key(g, (a + "attention.head_count_kv").c_str()) >= 0) {
        if ((st = need_int("attention.head_count_kv", 1, 4096, &m->n_head_kv))) return st;
    }
    if (m->n_head % m->n_head_kv != 0) {
        return fail(m, GGSWARM_E_FORMAT, "head_count %d is not a multiple of head_count_kv %d", m->n_head,
                    m->n_head_kv);
    }
    if (get_int(g, a + "expert_count", &v) && v > 0) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "%s with %lld experts (MoE) is not supported by the native backend",
                    m->arch.c_str(), (long long)v);
    }
    m->head_dim = m->d_model / m->n_head;
    if (get_int(g, a + "attention.key_length", &v)) m->head_dim = (int32_t)v;
    int64_t vlen = m->head_dim;
    if (get_int(g, a + "attention.value_length", &vlen) && vlen != m->head_dim) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "key_length %d != value_length %lld", m->head_dim, (long long)vlen);
    }
    if (m->head_dim <= 0 || m->head_dim % 2 != 0 || m->head_dim > 1024) {
        return fail(m, GGSWARM_E_FORMAT, "head dimension %d is invalid", m->head_dim);
    }
    m->n_rot = m->head_dim;
    if (get_int(g, a + "rope.dimension_count", &v)) m->n_rot = (int32_t)v;
    if (m->n_rot != m->head_dim) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "partial rotary embedding (%d of %d dims) is not supported", m->n_rot,
                    m->head_dim);
    }
    double f = 0;
    if (!get_float(g, a + "attention.layer_norm_rms_epsilon", &f)) {
        return fail(m, GGSWARM_E_FORMAT, "%sattention.layer_norm_rms_epsilon is missing", a.c_str());
    }
    m->eps = (float)f;
    m->rope_base = get_float(g, a + "rope.freq_base", &f) ? (float)f : 10000.0f;
    std::string scaling = "none";
    get_str(g, a + "rope.scaling.type", &scaling);
    if (scaling == "linear") {
        if (get_float(g, a + "rope.scaling.factor", &f) && f > 0) m->rope_freq_scale = (float)(1.0 / f);
    } else if (scaling != "none" && !scaling.empty()) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "rope scaling '%s' is not supported by the native backend",
                    scaling.c_str());
    }
    if (get_float(g, a + "rope.scale_linear", &f) && f > 0) m->rope_freq_scale = (float)(1.0 / f);
    m->rope_mode = m->arch == "qwen2" ? GGML_ROPE_TYPE_NEOX : GGML_ROPE_TYPE_NORMAL;
    m->n_ctx_train = 4096;
    if (get_int(g, a + "context_length", &v) && v > 0) m->n_ctx_train = (int32_t)std::min<int64_t>(v, INT32_MAX);
    m->n_ctx_max = std::min(m->n_ctx_train, (int32_t)GGSWARM_MAX_CONTEXT);
    return GGSWARM_OK;
}

// --- weights -------------------------------------------------------------------------------------------

struct Wanted {
    std::string name;
    std::vector<int64_t> shape;
    bool optional;
    ggml_tensor ** dst;
};

ggswarm_status load_weights(ggswarm_model * m, const Meta & meta, const char * path, uint64_t file_size) {
    std::vector<Wanted> want;
    const int64_t d = m->d_model, dq = (int64_t)m->n_head * m->head_dim, dkv = m->d_kv();
    if (m->is_first()) want.push_back({"token_embd.weight", {d, m->n_vocab}, false, &m->tok_embd});
    if (m->is_last()) {
        want.push_back({"output_norm.weight", {d}, false, &m->output_norm});
        if (gguf_find_tensor(meta.g, "output.weight") >= 0) {
            want.push_back({"output.weight", {d, m->n_vocab}, false, &m->output});
        } else if (!m->is_first()) {
            want.push_back({"token_embd.weight", {d, m->n_vocab}, false, &m->tok_embd});
        }
    }
    if (gguf_find_tensor(meta.g, "rope_freqs.weight") >= 0) {
        want.push_back({"rope_freqs.weight", {m->n_rot / 2}, false, &m->rope_freqs});
    }
    m->layers.resize(m->layer_end - m->layer_start);
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        Layer & L = m->layers[il - m->layer_start];
        auto n = [il](const char * s) { return "blk." + std::to_string(il) + "." + s; };
        want.push_back({n("attn_norm.weight"), {d}, false, &L.attn_norm});
        want.push_back({n("attn_q.weight"), {d, dq}, false, &L.wq});
        want.push_back({n("attn_k.weight"), {d, dkv}, false, &L.wk});
        want.push_back({n("attn_v.weight"), {d, dkv}, false, &L.wv});
        want.push_back({n("attn_q.bias"), {dq}, true, &L.bq});
        want.push_back({n("attn_k.bias"), {dkv}, true, &L.bk});
        want.push_back({n("attn_v.bias"), {dkv}, true, &L.bv});
        want.push_back({n("attn_output.weight"), {dq, d}, false, &L.wo});
        want.push_back({n("attn_output.bias"), {d}, true, &L.bo});
        want.push_back({n("ffn_norm.weight"), {d}, false, &L.ffn_norm});
        want.push_back({n("ffn_gate.weight"), {d, m->n_ff}, false, &L.w_gate});
        want.push_back({n("ffn_up.weight"), {d, m->n_ff}, false, &L.w_up});
        want.push_back({n("ffn_down.weight"), {m->n_ff, d}, false, &L.w_down});
        if (gguf_find_tensor(meta.g, n("attn_qkv.weight").c_str()) >= 0) {
            return fail(m, GGSWARM_E_UNSUPPORTED, "fused attn_qkv tensors are not supported (layer %d)", il);
        }
    }
    ggml_init_params ip = {ggml_tensor_overhead() * (want.size() + 4), nullptr, true};
    m->wctx = ggml_init(ip);
    if (!m->wctx) return fail(m, GGSWARM_E_NO_MEMORY, "cannot create the weights context");
    std::vector<std::pair<ggml_tensor *, int64_t>> to_read;  // tensor, gguf id
    for (const Wanted & w : want) {
        int64_t tid = gguf_find_tensor(meta.g, w.name.c_str());
        if (tid < 0) {
            if (w.optional) continue;
            return fail(m, GGSWARM_E_FORMAT, "tensor %s is missing", w.name.c_str());
        }
        const ggml_tensor * src = ggml_get_tensor(meta.ctx, w.name.c_str());
        if (!src) return fail(m, GGSWARM_E_FORMAT, "tensor %s has no metadata", w.name.c_str());
        for (int i = 0; i < GGML_MAX_DIMS; ++i) {
            int64_t expect = i < (int)w.shape.size() ? w.shape[i] : 1;
            if (src->ne[i] != expect) {
                return fail(m, GGSWARM_E_FORMAT, "tensor %s has shape [%lld, %lld, %lld, %lld], expected dim %d = %lld",
                            w.name.c_str(), (long long)src->ne[0], (long long)src->ne[1], (long long)src->ne[2],
                            (long long)src->ne[3], i, (long long)expect);
            }
        }
        bool is_vec = w.shape.size() == 1;
        if (is_vec && src->type != GGML_TYPE_F32) {
            return fail(m, GGSWARM_E_UNSUPPORTED, "tensor %s has type %s; norms and biases must be f32", w.name.c_str(),
                        ggml_type_name(src->type));
        }
        ggml_tensor * t = ggml_new_tensor(m->wctx, src->type, (int)w.shape.size(), src->ne);
        ggml_set_name(t, w.name.c_str());
        *w.dst = t;
        to_read.push_back({t, tid});
    }
    if (m->is_last() && !m->output) m->output = m->tok_embd;
    m->wbuf = ggml_backend_alloc_ctx_tensors_from_buft(m->wctx, m->buft);
    if (!m->wbuf) return fail(m, GGSWARM_E_NO_MEMORY, "cannot allocate %s weights buffer", m->device_name.c_str());
    ggml_backend_buffer_set_usage(m->wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    const bool host = ggml_backend_buffer_is_host(m->wbuf);

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

ggswarm_status init_sched(ggswarm_model * m) {
    const int32_t nl = m->layer_end - m->layer_start;
    m->graph_size = (size_t)std::max(2048, 48 * nl + 256);
    m->graph_meta.resize(ggml_tensor_overhead() * m->graph_size + ggml_graph_overhead_custom(m->graph_size, false));
    ggml_backend_t bs[2] = {m->backend, m->backend_cpu};
    int n = m->backend_cpu == m->backend ? 1 : 2;
    m->sched = ggml_backend_sched_new(bs, nullptr, n, m->graph_size, false, false);
    if (!m->sched) return fail(m, GGSWARM_E_NO_MEMORY, "cannot create the ggml scheduler");
    return GGSWARM_OK;
}

bool kernel_step(const ggswarm_model * m, int32_t n) { return n == 1 && m->decode_kernels; }

// --- KV -----------------------------------------------------------------------------------------------

Session * find_session(const ggswarm_model * m, int64_t sid) {
    auto it = const_cast<ggswarm_model *>(m)->sessions.find(sid);
    return it == m->sessions.end() ? nullptr : &it->second;
}

ggswarm_status no_session(const ggswarm_model * m, int64_t sid) {
    return fail(m, GGSWARM_E_NO_SESSION, "unknown session id %lld", (long long)sid);
}

// Attention spans n_kv rounded up to this many positions (masked), like llama.cpp's KV cache, so the
// reduction order inside softmax and KQV, and therefore the numerics, match llama.cpp's.
constexpr int64_t kKvPad = 256;

int64_t pad_kv(int64_t n) { return (n + kKvPad - 1) / kKvPad * kKvPad; }

// A CPU decode step runs attention.cpp's kernels: no mask input (they write -inf past the new
// position themselves), and a span padded only to their 64-position step, since padding adds exact
// zeros to softmax's and the values' sums and so changes nothing but the work done (kernel_step).
constexpr int64_t kKernelPad = 64;

// Make room for `need` positions, keeping the first s.len positions.
ggswarm_status ensure_capacity(ggswarm_model * m, Session & s, int32_t need) {
    if (need <= s.cap) return GGSWARM_OK;
    // capacity is a multiple of kKvPad so the attention always spans whole padded blocks
    const int64_t need_pad = pad_kv(need);
    int64_t cap = std::max<int64_t>(need_pad, 2LL * s.cap);
    cap = std::min<int64_t>(cap, pad_kv(s.max_tokens));
    const uint64_t new_bytes = (uint64_t)cap * m->kv_bytes_per_token();
    const uint64_t others = m->kv_total() - s.bytes;
    if (m->kv_budget && others + new_bytes > m->kv_budget) {
        // retry with the padded need before giving up
        const uint64_t exact = (uint64_t)need_pad * m->kv_bytes_per_token();
        if (others + exact > m->kv_budget) {
            return fail(m, GGSWARM_E_BUDGET,
                        "KV budget exhausted: %d positions need %llu bytes, %llu of %llu bytes are held by other sessions",
                        need, (unsigned long long)exact, (unsigned long long)others,
                        (unsigned long long)m->kv_budget);
        }
        cap = need_pad;
    }
    const int32_t nl = m->layer_end - m->layer_start;
    ggml_init_params ip = {ggml_tensor_overhead() * (size_t)(2 * nl + 2), nullptr, true};
    Session n;
    n.ctx = ggml_init(ip);
    if (!n.ctx) return fail(m, GGSWARM_E_NO_MEMORY, "cannot create a KV context");
    for (int32_t i = 0; i < nl; ++i) {
        n.k.push_back(ggml_new_tensor_2d(n.ctx, GGML_TYPE_F16, m->d_kv(), cap));
        n.v.push_back(ggml_new_tensor_2d(n.ctx, GGML_TYPE_F16, cap, m->d_kv()));
    }
    n.buf = ggml_backend_alloc_ctx_tensors_from_buft(n.ctx, m->buft);
    if (!n.buf) {
        n.release();
        return fail(m, GGSWARM_E_NO_MEMORY, "cannot allocate %llu KV bytes on %s",
                    (unsigned long long)new_bytes, m->device_name.c_str());
    }
    ggml_backend_buffer_set_usage(n.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_clear(n.buf, 0);  // padded positions are read (times a zero weight): keep them finite
    n.cap = (int32_t)cap;
    n.bytes = ggml_backend_buffer_get_size(n.buf);
    n.max_tokens = s.max_tokens;
    n.len = s.len;
    if (s.len > 0) {
        const size_t row = (size_t)m->d_kv() * sizeof(ggml_fp16_t);
        std::vector<uint8_t> tmp((size_t)s.len * row);
        for (int32_t i = 0; i < nl; ++i) {
            ggml_backend_tensor_get(s.k[i], tmp.data(), 0, (size_t)s.len * row);
            ggml_backend_tensor_set(n.k[i], tmp.data(), 0, (size_t)s.len * row);
            const size_t vrow = (size_t)s.len * sizeof(ggml_fp16_t);
            for (int32_t r = 0; r < m->d_kv(); ++r) {
                ggml_backend_tensor_get(s.v[i], tmp.data(), (size_t)r * s.v[i]->nb[1], vrow);
                ggml_backend_tensor_set(n.v[i], tmp.data(), (size_t)r * n.v[i]->nb[1], vrow);
            }
        }
    }
    s.release();
    s = n;
    return GGSWARM_OK;
}

// --- graph ---------------------------------------------------------------------------------------------


ggml_tensor * rms(ggml_context * c, ggml_tensor * x, ggml_tensor * w, float eps) {
    return ggml_mul(c, ggml_rms_norm(c, x, eps), w);
}

ggml_tensor * linear(ggml_context * c, ggml_tensor * w, ggml_tensor * b, ggml_tensor * x) {
    ggml_tensor * y = ggml_mul_mat(c, w, x);
    return b ? ggml_add(c, y, b) : y;
}

// ggml's CPU softmax splits the rows of one head across threads, never the heads: on a decode step
// (one row per head) a single thread would exponentiate every head's n_kv scores. Viewing the scores
// as one row per head spreads them over the threads; each row is computed exactly as before, so the
// numerics do not change. The mask then needs one (identical) row per head.
bool decode_rows(int32_t n) { return n == 1; }

// Attention of n new positions (already in the cache) over all n_kv cached ones, with ggml ops:
// [hd * nh, n].
ggml_tensor * attention(ggml_context * c, const Graph & g, ggml_tensor * q, ggml_tensor * kc, ggml_tensor * vc,
                        int32_t n, int32_t n_kv) {
    const int64_t hd = q->ne[0], nh = q->ne[1], nkv = kc->ne[0] / hd;
    const float kq_scale = 1.0f / sqrtf((float)hd);
    ggml_tensor * kall = ggml_view_3d(c, kc, hd, n_kv, nkv, kc->nb[1], hd * sizeof(ggml_fp16_t), 0);
    ggml_tensor * vall = ggml_view_3d(c, vc, n_kv, hd, nkv, vc->nb[1], vc->nb[1] * hd, 0);
    ggml_tensor * qp = ggml_permute(c, q, 0, 2, 1, 3);  // [hd, n, nh]
    ggml_tensor * kq = ggml_mul_mat(c, kall, qp);        // [n_kv, n, nh]
    if (decode_rows(n)) {
        // [n_kv, 1, nh] -> [n_kv, nh]: the heads become softmax rows, which ggml splits across threads
        kq = ggml_reshape_2d(c, kq, n_kv, nh);
        kq = ggml_reshape_3d(c, ggml_soft_max_ext(c, kq, g.inp_mask, kq_scale, 0.0f), n_kv, 1, nh);
    } else {
        kq = ggml_soft_max_ext(c, kq, g.inp_mask, kq_scale, 0.0f);
    }
    ggml_tensor * kqv = ggml_mul_mat(c, vall, kq);  // [hd, n, nh]
    return ggml_cont_2d(c, ggml_permute(c, kqv, 0, 2, 1, 3), hd * nh, n);
}

// Build the window's graph for n new positions after pos_start. last_only: on the last window, keep
// only the final position after the last attention (sampling needs nothing else).
void build_graph(ggswarm_model * m, Session & s, Graph & g, int32_t n, int32_t n_kv, bool last_only) {
    ggml_init_params ip = {m->graph_meta.size(), m->graph_meta.data(), true};
    g.ctx = ggml_init(ip);
    ggml_context * c = g.ctx;
    g.gf = ggml_new_graph_custom(c, m->graph_size, false);
    const int64_t hd = m->head_dim, nh = m->n_head, nkv = m->n_head_kv, dkv = m->d_kv();
    const float kq_scale = 1.0f / sqrtf((float)hd);

    ggml_tensor * x;
    if (m->is_first()) {
        g.inp_tokens = ggml_new_tensor_1d(c, GGML_TYPE_I32, n);
        ggml_set_input(g.inp_tokens);
        x = ggml_get_rows(c, m->tok_embd, g.inp_tokens);
    } else {
        g.inp_hidden = ggml_new_tensor_2d(c, GGML_TYPE_F32, m->d_model, n);
        ggml_set_input(g.inp_hidden);
        x = g.inp_hidden;
    }
    g.inp_pos = ggml_new_tensor_1d(c, GGML_TYPE_I32, n);
    ggml_set_input(g.inp_pos);
    // one mask row per softmax row: per position, or per head on a decode step (see decode_rows)
    if (!kernel_step(m, n)) {
        g.inp_mask = ggml_new_tensor_2d(c, GGML_TYPE_F32, n_kv, decode_rows(n) ? nh : n);
        ggml_set_input(g.inp_mask);
    }
    g.inp_kidx = ggml_new_tensor_1d(c, GGML_TYPE_I64, n);
    ggml_set_input(g.inp_kidx);
    g.inp_vidx = ggml_new_tensor_1d(c, GGML_TYPE_I64, (int64_t)n * m->d_kv());
    ggml_set_input(g.inp_vidx);

    int32_t rows = n;
    const int32_t nl = m->layer_end - m->layer_start;
    for (int32_t i = 0; i < nl; ++i) {
        const Layer & L = m->layers[i];
        ggml_tensor * cur = rms(c, x, L.attn_norm, m->eps);
        ggml_tensor * q = linear(c, L.wq, L.bq, cur);
        ggml_tensor * k = linear(c, L.wk, L.bk, cur);
        ggml_tensor * v = linear(c, L.wv, L.bv, cur);
        q = ggml_reshape_3d(c, q, hd, nh, n);
        k = ggml_reshape_3d(c, k, hd, nkv, n);
        q = ggml_rope_ext(c, q, g.inp_pos, m->rope_freqs, m->n_rot, m->rope_mode, m->n_ctx_train, m->rope_base,
                          m->rope_freq_scale, 0.0f, 1.0f, 32.0f, 1.0f);
        k = ggml_rope_ext(c, k, g.inp_pos, m->rope_freqs, m->n_rot, m->rope_mode, m->n_ctx_train, m->rope_base,
                          m->rope_freq_scale, 0.0f, 1.0f, 32.0f, 1.0f);
        // append the new positions to this session's cache (K rows; V transposed)
        ggml_tensor * kc = s.k[i];
        ggml_tensor * vc = s.v[i];
        // (index inputs instead of view offsets keep the graph independent of the position)
        ggml_tensor * k_put = ggml_set_rows(c, kc, ggml_reshape_2d(c, k, dkv, n), g.inp_kidx);
        ggml_build_forward_expand(g.gf, k_put);
        ggml_tensor * v_elems = ggml_reshape_2d(c, vc, 1, ggml_nelements(vc));
        ggml_tensor * v_put = ggml_set_rows(c, v_elems, ggml_reshape_2d(c, v, 1, (int64_t)n * dkv), g.inp_vidx);
        ggml_build_forward_expand(g.gf, v_put);
        if (kernel_step(m, n)) {
            // same numbers as attention() below (see attention.cpp)
            ggml_tensor * kq = ggswarm::decode_scores(c, q, kc, g.inp_pos, n_kv, k_put);
            kq = ggml_soft_max_ext(c, kq, nullptr, kq_scale, 0.0f);
            cur = ggml_reshape_2d(c, ggswarm::decode_values(c, kq, vc, g.inp_pos, hd, v_put), hd * nh, 1);
        } else {
            cur = attention(c, g, q, kc, vc, n, n_kv);
        }
        cur = linear(c, L.wo, L.bo, cur);
        if (last_only && i == nl - 1 && n > 1) {
            cur = ggml_view_2d(c, cur, m->d_model, 1, cur->nb[1], (size_t)(n - 1) * cur->nb[1]);
            x = ggml_view_2d(c, x, m->d_model, 1, x->nb[1], (size_t)(n - 1) * x->nb[1]);
            rows = 1;
        }
        ggml_tensor * h = ggml_add(c, cur, x);
        cur = rms(c, h, L.ffn_norm, m->eps);
        ggml_tensor * gate = ggml_mul_mat(c, L.w_gate, cur);
        ggml_tensor * up = ggml_mul_mat(c, L.w_up, cur);
        cur = ggml_mul_mat(c, L.w_down, ggml_swiglu_split(c, gate, up));
        x = ggml_add(c, cur, h);
    }
    (void)rows;
    if (m->is_last()) {
        x = rms(c, x, m->output_norm, m->eps);
        x = ggml_mul_mat(c, m->output, x);
    }
    g.out = x;
    ggml_set_output(g.out);
    ggml_build_forward_expand(g.gf, g.out);
    if (m->is_last()) {
        // probabilities of the final position, for the logprob (SIMD exp on the compute threads)
        const int64_t rows = x->ne[1];
        ggml_tensor * last = ggml_view_2d(c, x, x->ne[0], 1, x->nb[1], (size_t)(rows - 1) * x->nb[1]);
        g.out_prob = ggml_soft_max(c, last);
        ggml_set_output(g.out_prob);
        ggml_build_forward_expand(g.gf, g.out_prob);
    }
}

constexpr int32_t kUBatch = 512;

// One micro-batch: positions [b->pos_start + off, + nc). On the last window *last points at the logits
// of the chunk's final position afterwards.
ggswarm_status forward_chunk(ggswarm_model * m, int64_t sid, Session & s, const ggswarm_batch * b, int32_t off,
                             int32_t nc, bool final_chunk, const float ** last) {
    const int32_t pos = b->pos_start + off;
    const int64_t d = m->d_model;
    const bool last_only = m->is_last() && !b->logits_out;
    const int64_t span = kernel_step(m, nc) ? (pos + nc + kKernelPad - 1) / kKernelPad * kKernelPad : pad_kv(pos + nc);
    const int32_t n_kv = (int32_t)std::min<int64_t>(span, s.cap);
    GraphKey key;
    key.sid = sid;
    key.n = nc;
    key.n_kv = n_kv;
    key.kv = s.buf;
    key.last_only = last_only;
    Graph & g = m->graph;
    if (!(g.valid && g.key == key)) {
        g.clear();
        build_graph(m, s, g, nc, n_kv, last_only);
        ggml_backend_sched_reset(m->sched);
        if (!ggml_backend_sched_alloc_graph(m->sched, g.gf)) {
            g.clear();
            return fail(m, GGSWARM_E_COMPUTE, "ggml could not allocate the compute graph (%d tokens)", nc);
        }
        g.key = key;
        g.valid = true;
    }
    m->kidx_host.resize(nc);
    m->vidx_host.resize((size_t)nc * m->d_kv());
    for (int32_t t = 0; t < nc; ++t) {
        m->kidx_host[t] = pos + t;
        int64_t * vi = m->vidx_host.data() + (size_t)t * m->d_kv();
        for (int32_t ch = 0; ch < m->d_kv(); ++ch) vi[ch] = (int64_t)ch * s.cap + pos + t;
    }
    ggml_backend_tensor_set(g.inp_kidx, m->kidx_host.data(), 0, sizeof(int64_t) * m->kidx_host.size());
    ggml_backend_tensor_set(g.inp_vidx, m->vidx_host.data(), 0, sizeof(int64_t) * m->vidx_host.size());
    m->pos_host.resize(nc);
    for (int32_t i = 0; i < nc; ++i) m->pos_host[i] = pos + i;
    ggml_backend_tensor_set(g.inp_pos, m->pos_host.data(), 0, sizeof(int32_t) * nc);
    if (g.inp_mask) {
        const int32_t mask_rows = (int32_t)g.inp_mask->ne[1];
        m->mask_host.resize((size_t)mask_rows * n_kv);
        for (int32_t i = 0; i < (decode_rows(nc) ? 1 : mask_rows); ++i) {
            float * row = m->mask_host.data() + (size_t)i * n_kv;
            const int32_t lim = pos + i;
            for (int32_t j = 0; j < n_kv; ++j) row[j] = j <= lim ? 0.0f : -INFINITY;
        }
        for (int32_t i = 1; decode_rows(nc) && i < mask_rows; ++i) {
            memcpy(m->mask_host.data() + (size_t)i * n_kv, m->mask_host.data(), sizeof(float) * n_kv);
        }
        ggml_backend_tensor_set(g.inp_mask, m->mask_host.data(), 0, sizeof(float) * m->mask_host.size());
    }
    const int64_t n_hidden = (int64_t)nc * d;
    if (g.inp_tokens) {
        ggml_backend_tensor_set(g.inp_tokens, b->token_ids + off, 0, sizeof(int32_t) * nc);
    } else if (b->hidden_in_type == GGSWARM_TYPE_F32) {
        const float * src = static_cast<const float *>(b->hidden_in) + (int64_t)off * d;
        ggml_backend_tensor_set(g.inp_hidden, src, 0, sizeof(float) * n_hidden);
    } else {
        const ggml_fp16_t * src = static_cast<const ggml_fp16_t *>(b->hidden_in) + (int64_t)off * d;
        m->hidden_host.resize(n_hidden);
        ggml_fp16_to_fp32_row(src, m->hidden_host.data(), n_hidden);
        ggml_backend_tensor_set(g.inp_hidden, m->hidden_host.data(), 0, sizeof(float) * n_hidden);
    }
    if (ggml_backend_sched_graph_compute(m->sched, g.gf) != GGML_STATUS_SUCCESS) {
        g.clear();
        return fail(m, GGSWARM_E_COMPUTE, "ggml graph compute failed");
    }
    s.len = pos + nc;
    if (!m->is_last()) {
        if (b->hidden_out_type == GGSWARM_TYPE_F32) {
            float * dst = static_cast<float *>(b->hidden_out) + (int64_t)off * d;
            ggml_backend_tensor_get(g.out, dst, 0, sizeof(float) * n_hidden);
        } else {
            ggml_fp16_t * dst = static_cast<ggml_fp16_t *>(b->hidden_out) + (int64_t)off * d;
            m->hidden_host.resize(n_hidden);
            ggml_backend_tensor_get(g.out, m->hidden_host.data(), 0, sizeof(float) * n_hidden);
            ggml_fp32_to_fp16_row(m->hidden_host.data(), dst, n_hidden);
        }
    } else if (b->logits_out) {
        float * dst = b->logits_out + (int64_t)off * m->n_vocab;
        ggml_backend_tensor_get(g.out, dst, 0, sizeof(float) * (size_t)nc * m->n_vocab);
        *last = dst + (int64_t)(nc - 1) * m->n_vocab;
    } else if (final_chunk) {
        const int64_t rows = g.out->ne[1];
        m->logits_host.resize((size_t)m->n_vocab);
        ggml_backend_tensor_get(g.out, m->logits_host.data(), (size_t)(rows - 1) * g.out->nb[1],
                                sizeof(float) * m->n_vocab);
        *last = m->logits_host.data();
    }
    return GGSWARM_OK;
}

}  // namespace

// --- C API ---------------------------------------------------------------------------------------------

extern "C" {

int32_t ggswarm_api_version(void) { return GGSWARM_API_VERSION; }

const char * ggswarm_last_error(void) { return g_last_error.c_str(); }

const char * ggswarm_model_last_error(const ggswarm_model * model) {
    return model ? model->error.c_str() : "model handle is NULL";
}

ggswarm_status ggswarm_model_open(const char * path, int32_t layer_start, int32_t layer_end, int32_t n_threads,
                                  uint64_t kv_budget_bytes, const char * model_id, ggswarm_model ** out) {
    g_last_error.clear();
    if (!out) return fail(nullptr, GGSWARM_E_INVALID_ARG, "out is NULL");
    *out = nullptr;
    if (!path) return fail(nullptr, GGSWARM_E_INVALID_ARG, "path is NULL");
    if (n_threads <= 0 || n_threads > 1024) {
        return fail(nullptr, GGSWARM_E_INVALID_ARG, "n_threads must be in 1..1024, got %d", n_threads);
    }
    struct stat st;
    if (stat(path, &st) != 0) return fail(nullptr, GGSWARM_E_IO, "cannot open %s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return fail(nullptr, GGSWARM_E_IO, "%s is not a regular file", path);
    const uint64_t file_size = (uint64_t)st.st_size;
    {
        FILE * fp = fopen(path, "rb");
        if (!fp) return fail(nullptr, GGSWARM_E_IO, "cannot open %s: %s", path, strerror(errno));
        char magic[4] = {0};
        size_t got = fread(magic, 1, 4, fp);
        fclose(fp);
        if (got != 4 || memcmp(magic, "GGUF", 4) != 0) {
            return fail(nullptr, GGSWARM_E_FORMAT, "%s is not a GGUF file (bad magic)", path);
        }
    }
    Meta meta;
    gguf_init_params gp = {true, &meta.ctx};
    meta.g = gguf_init_from_file(path, gp);
    if (!meta.g) return fail(nullptr, GGSWARM_E_FORMAT, "%s: malformed GGUF header, metadata or tensor table", path);

    auto * m = new (std::nothrow) ggswarm_model();
    if (!m) return fail(nullptr, GGSWARM_E_NO_MEMORY, "out of memory");
    auto bail = [&](ggswarm_status s) {
        g_last_error = m->error;
        delete m;
        return s;
    };
    ggswarm_status s = read_hparams(m, meta);
    if (s) return bail(s);
    if (!(0 <= layer_start && layer_start < layer_end && layer_end <= m->n_layers_total)) {
        return bail(fail(m, GGSWARM_E_RANGE, "layer range %d:%d is outside 0:%d (need 0 <= start < end <= %d)",
                         layer_start, layer_end, m->n_layers_total, m->n_layers_total));
    }
    m->layer_start = layer_start;
    m->layer_end = layer_end;
    const ggml_tensor * emb = ggml_get_tensor(meta.ctx, "token_embd.weight");
    if (!emb) return bail(fail(m, GGSWARM_E_FORMAT, "tensor token_embd.weight is missing"));
    if (emb->ne[0] != m->d_model || emb->ne[1] <= 0 || emb->ne[1] > INT32_MAX) {
        return bail(fail(m, GGSWARM_E_FORMAT, "token_embd.weight has shape [%lld, %lld], expected [%d, n_vocab]",
                         (long long)emb->ne[0], (long long)emb->ne[1], m->d_model));
    }
    m->n_vocab = (int32_t)emb->ne[1];
    m->kv_budget = kv_budget_bytes;
    if ((s = init_backends(m))) return bail(s);
    // GGSWARM_GGML_ATTENTION=1 keeps ggml's own ops (to compare the two, or to rule ours out)
    const char * ggml_attn = getenv("GGSWARM_GGML_ATTENTION");
    const bool ggml_forced = ggml_attn && *ggml_attn && strcmp(ggml_attn, "0") != 0;
    m->decode_kernels = ggml_backend_dev_type(m->dev) == GGML_BACKEND_DEVICE_TYPE_CPU &&
                        ggswarm::decode_attention_supported(m->head_dim) && !ggml_forced;
    if ((s = load_weights(m, meta, path, file_size))) return bail(s);
    if ((s = init_sched(m))) return bail(s);
    apply_threads(m, n_threads);
    m->model_id = (model_id && *model_id) ? std::string(model_id) : fingerprint(path, gguf_get_data_offset(meta.g), file_size);
    if (m->model_id.size() > 71) m->model_id.resize(71);
    *out = m;
    return GGSWARM_OK;
}

void ggswarm_model_free(ggswarm_model * model) { delete model; }

ggswarm_status ggswarm_model_info_get(const ggswarm_model * m, ggswarm_model_info * out) {
    if (!m || !out) return fail(m, GGSWARM_E_INVALID_ARG, "model or out is NULL");
    memset(out, 0, sizeof(*out));
    snprintf(out->architecture, sizeof(out->architecture), "%s", m->arch.c_str());
    snprintf(out->device, sizeof(out->device), "%s", m->device_name.c_str());
    snprintf(out->model_id, sizeof(out->model_id), "%s", m->model_id.c_str());
    out->n_layers_total = m->n_layers_total;
    out->layer_start = m->layer_start;
    out->layer_end = m->layer_end;
    out->is_first = m->is_first();
    out->is_last = m->is_last();
    out->d_model = m->d_model;
    out->n_vocab = m->n_vocab;
    out->n_head = m->n_head;
    out->n_head_kv = m->n_head_kv;
    out->head_dim = m->head_dim;
    out->n_ff = m->n_ff;
    out->n_ctx_train = m->n_ctx_train;
    out->n_ctx_max = m->n_ctx_max;
    out->n_threads = m->n_threads;
    out->decode_kernels = m->decode_kernels ? 1 : 0;
    out->weight_bytes = m->weight_bytes;
    out->kv_bytes_per_token = m->kv_bytes_per_token();
    out->kv_budget_bytes = m->kv_budget;
    return ok(m);
}

ggswarm_status ggswarm_set_threads(ggswarm_model * m, int32_t n_threads) {
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    if (n_threads <= 0 || n_threads > 1024) {
        return fail(m, GGSWARM_E_INVALID_ARG, "n_threads must be in 1..1024, got %d", n_threads);
    }
    return apply_threads(m, n_threads);
}

ggswarm_status ggswarm_session_open(ggswarm_model * m, int32_t max_tokens, int64_t * out_sid) {
    if (!m || !out_sid) return fail(m, GGSWARM_E_INVALID_ARG, "model or out_sid is NULL");
    if (max_tokens <= 0 || max_tokens > m->n_ctx_max) {
        return fail(m, GGSWARM_E_RANGE, "max_tokens %d is outside 1..%d (model context, capped at %d)", max_tokens,
                    m->n_ctx_max, GGSWARM_MAX_CONTEXT);
    }
    Session s;
    s.max_tokens = max_tokens;
    const int64_t sid = m->next_sid++;
    m->sessions.emplace(sid, s);
    *out_sid = sid;
    return ok(m);
}

ggswarm_status ggswarm_session_close(ggswarm_model * m, int64_t sid) {
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    auto it = m->sessions.find(sid);
    if (it == m->sessions.end()) return no_session(m, sid);
    it->second.release();
    m->sessions.erase(it);
    return ok(m);
}

ggswarm_status ggswarm_session_len(const ggswarm_model * m, int64_t sid, int32_t * out_len) {
    if (!m || !out_len) return fail(m, GGSWARM_E_INVALID_ARG, "model or out_len is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    *out_len = s->len;
    return ok(m);
}

ggswarm_status ggswarm_session_truncate(ggswarm_model * m, int64_t sid, int32_t n_tokens) {
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    if (n_tokens < 0 || n_tokens > s->len) {
        return fail(m, GGSWARM_E_RANGE, "cannot truncate to %d positions: the session holds %d", n_tokens, s->len);
    }
    s->len = n_tokens;
    return ok(m);
}

ggswarm_status ggswarm_kv_bytes(const ggswarm_model * m, int64_t sid, uint64_t * out_bytes) {
    if (!m || !out_bytes) return fail(m, GGSWARM_E_INVALID_ARG, "model or out_bytes is NULL");
    if (sid < 0) {
        *out_bytes = m->kv_total();
        return ok(m);
    }
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    *out_bytes = s->bytes;
    return ok(m);
}

ggswarm_status ggswarm_forward(ggswarm_model * m, int64_t sid, const ggswarm_batch * b) {
    if (!m || !b) return fail(m, GGSWARM_E_INVALID_ARG, "model or batch is NULL");
    const auto t0 = std::chrono::steady_clock::now();
    Session * sp = find_session(m, sid);
    if (!sp) return no_session(m, sid);
    Session & s = *sp;
    const int32_t n = b->n_tokens;
    if (n <= 0 || n > GGSWARM_MAX_BATCH) {
        return fail(m, GGSWARM_E_INVALID_ARG, "n_tokens %d is outside 1..%d", n, GGSWARM_MAX_BATCH);
    }
    if (b->pos_start != s.len) {
        return fail(m, GGSWARM_E_RANGE, "pos_start %d does not follow the session's %d positions (truncate first)",
                    b->pos_start, s.len);
    }
    if ((int64_t)b->pos_start + n > s.max_tokens) {
        return fail(m, GGSWARM_E_RANGE, "positions up to %lld exceed the session cap of %d tokens",
                    (long long)b->pos_start + n, s.max_tokens);
    }
    const int64_t n_hidden = (int64_t)n * m->d_model;
    if (m->is_first()) {
        if (!b->token_ids) return fail(m, GGSWARM_E_INVALID_ARG, "the first window takes token_ids");
        for (int32_t i = 0; i < n; ++i) {
            if (b->token_ids[i] < 0 || b->token_ids[i] >= m->n_vocab) {
                return fail(m, GGSWARM_E_INVALID_ARG, "token id %d at index %d is outside 0..%d", b->token_ids[i], i,
                            m->n_vocab - 1);
            }
        }
    } else {
        if (!b->hidden_in) return fail(m, GGSWARM_E_INVALID_ARG, "a window after the first takes hidden_in");
        if (b->hidden_in_type != GGSWARM_TYPE_F32 && b->hidden_in_type != GGSWARM_TYPE_F16) {
            return fail(m, GGSWARM_E_INVALID_ARG, "hidden_in_type %d is not f32 (0) or f16 (1)", b->hidden_in_type);
        }
        if (b->hidden_in_count != n_hidden) {
            return fail(m, GGSWARM_E_INVALID_ARG,
                        "hidden size mismatch: got %lld elements, expected n_tokens %d x d_model %d = %lld",
                        (long long)b->hidden_in_count, n, m->d_model, (long long)n_hidden);
        }
    }
    if (m->is_last()) {
        if (!b->token_out) return fail(m, GGSWARM_E_INVALID_ARG, "the last window needs token_out");
        if (b->logits_out && b->logits_out_count < (int64_t)n * m->n_vocab) {
            return fail(m, GGSWARM_E_INVALID_ARG, "logits_out holds %lld elements, need %lld",
                        (long long)b->logits_out_count, (long long)n * m->n_vocab);
        }
        if (b->history && b->n_history < 0) return fail(m, GGSWARM_E_INVALID_ARG, "n_history is negative");
        const ggswarm_sampling * p = b->sampling;
        if (p && (std::isnan(p->temperature) || std::isnan(p->top_p) || std::isnan(p->min_p) ||
                  !(p->repeat_penalty > 0) || p->top_k < 0)) {
            return fail(m, GGSWARM_E_INVALID_ARG, "invalid sampling parameters");
        }
    } else {
        if (!b->hidden_out) return fail(m, GGSWARM_E_INVALID_ARG, "a window before the last needs hidden_out");
        if (b->hidden_out_type != GGSWARM_TYPE_F32 && b->hidden_out_type != GGSWARM_TYPE_F16) {
            return fail(m, GGSWARM_E_INVALID_ARG, "hidden_out_type %d is not f32 (0) or f16 (1)", b->hidden_out_type);
        }
        if (b->hidden_out_count < n_hidden) {
            return fail(m, GGSWARM_E_INVALID_ARG, "hidden_out holds %lld elements, need %lld",
                        (long long)b->hidden_out_count, (long long)n_hidden);
        }
    }
    ggswarm_status st = ensure_capacity(m, s, b->pos_start + n);
    if (st) return st;

    // run in micro-batches of at most kUBatch positions (bounded compute memory, like llama.cpp's n_ubatch)
    const float * last = nullptr;
    for (int32_t off = 0; off < n; off += kUBatch) {
        const int32_t nc = std::min(kUBatch, n - off);
        const bool final_chunk = off + nc == n;
        if ((st = forward_chunk(m, sid, s, b, off, nc, final_chunk, &last))) {
            // a failed call leaves the session at its previous length; rows written beyond it are ignored
            s.len = b->pos_start;
            return st;
        }
    }
    if (m->is_last()) {
        ggswarm_sampling greedy = {0.0, 0, 64, 1.0, 0.0, 1.0, 0};
        const ggswarm_sampling & p = b->sampling ? *b->sampling : greedy;
        ggswarm::SampleResult r = ggswarm::sample(last, m->n_vocab, p, (int64_t)b->pos_start + n - 1, b->history,
                                                  b->history ? b->n_history : 0, m->scratch, false);
        *b->token_out = r.token;
        if (b->logprob_out) {
            float prob = 0.0f;
            ggml_backend_tensor_get(m->graph.out_prob, &prob, sizeof(float) * (size_t)r.token, sizeof(float));
            // float softmax is exact to ~1e-7; tiny probabilities fall back to the double log-softmax
            *b->logprob_out = prob > 1e-30f ? std::log((double)prob) : ggswarm::log_softmax_at(last, m->n_vocab, r.token);
        }
    }
    if (b->compute_s_out) {
        *b->compute_s_out = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    return ok(m);
}

ggswarm_status ggswarm_session_snapshot_size(const ggswarm_model * m, int64_t sid, uint64_t * out_size) {
    if (!m || !out_size) return fail(m, GGSWARM_E_INVALID_ARG, "model or out_size is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    *out_size = sizeof(SnapHeader) + (uint64_t)s->len * m->kv_bytes_per_token();
    return ok(m);
}

ggswarm_status ggswarm_session_snapshot(const ggswarm_model * m, int64_t sid, void * buf, uint64_t capacity,
                                        uint64_t * out_written) {
    if (!m || !buf) return fail(m, GGSWARM_E_INVALID_ARG, "model or buf is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    const uint64_t payload = (uint64_t)s->len * m->kv_bytes_per_token();
    const uint64_t total = sizeof(SnapHeader) + payload;
    if (capacity < total) {
        return fail(m, GGSWARM_E_INVALID_ARG, "snapshot needs %llu bytes, buffer holds %llu",
                    (unsigned long long)total, (unsigned long long)capacity);
    }
    SnapHeader h;
    memset(&h, 0, sizeof(h));
    memcpy(h.magic, kSnapMagic, sizeof(h.magic));
    h.format_version = kSnapVersion;
    h.header_size = sizeof(SnapHeader);
    snprintf(h.model_id, sizeof(h.model_id), "%s", m->model_id.c_str());
    snprintf(h.architecture, sizeof(h.architecture), "%s", m->arch.c_str());
    h.layer_start = m->layer_start;
    h.layer_end = m->layer_end;
    h.n_layers_total = m->n_layers_total;
    h.n_head_kv = m->n_head_kv;
    h.head_dim = m->head_dim;
    h.kv_type = GGML_TYPE_F16;
    h.n_pos = s->len;
    h.payload_bytes = payload;
    uint8_t * p = static_cast<uint8_t *>(buf) + sizeof(SnapHeader);
    const size_t krow = (size_t)m->d_kv() * sizeof(ggml_fp16_t);
    const size_t vrow = (size_t)s->len * sizeof(ggml_fp16_t);
    if (s->len > 0) {
        for (size_t i = 0; i < s->k.size(); ++i) {
            ggml_backend_tensor_get(s->k[i], p, 0, (size_t)s->len * krow);
            p += (size_t)s->len * krow;
            for (int32_t r = 0; r < m->d_kv(); ++r) {
                ggml_backend_tensor_get(s->v[i], p, (size_t)r * s->v[i]->nb[1], vrow);
                p += vrow;
            }
        }
    }
    h.payload_fnv1a = fnv1a(static_cast<uint8_t *>(buf) + sizeof(SnapHeader), payload);
    memcpy(buf, &h, sizeof(h));
    if (out_written) *out_written = total;
    return ok(m);
}

ggswarm_status ggswarm_session_restore(ggswarm_model * m, int64_t sid, const void * buf, uint64_t size) {
    if (!m || !buf) return fail(m, GGSWARM_E_INVALID_ARG, "model or buf is NULL");
    Session * sp = find_session(m, sid);
    if (!sp) return no_session(m, sid);
    if (size < sizeof(SnapHeader)) {
        return fail(m, GGSWARM_E_FORMAT, "snapshot is %llu bytes, shorter than its %zu-byte header",
                    (unsigned long long)size, sizeof(SnapHeader));
    }
    SnapHeader h;
    memcpy(&h, buf, sizeof(h));
    if (memcmp(h.magic, kSnapMagic, sizeof(h.magic)) != 0) return fail(m, GGSWARM_E_FORMAT, "not a ggswarm KV snapshot (bad magic)");
    if (h.format_version != kSnapVersion || h.header_size != sizeof(SnapHeader)) {
        return fail(m, GGSWARM_E_FORMAT, "snapshot format version %u (header %u bytes) is not supported (want %u)",
                    h.format_version, h.header_size, kSnapVersion);
    }
    h.model_id[sizeof(h.model_id) - 1] = 0;
    h.architecture[sizeof(h.architecture) - 1] = 0;
    if (m->model_id != h.model_id) {
        return fail(m, GGSWARM_E_MISMATCH, "snapshot model id %s does not match this model %s", h.model_id,
                    m->model_id.c_str());
    }
    if (h.layer_start != m->layer_start || h.layer_end != m->layer_end || h.n_layers_total != m->n_layers_total) {
        return fail(m, GGSWARM_E_MISMATCH, "snapshot layer range %d:%d of %d does not match this window %d:%d of %d",
                    h.layer_start, h.layer_end, h.n_layers_total, m->layer_start, m->layer_end, m->n_layers_total);
    }
    if (h.n_head_kv != m->n_head_kv || h.head_dim != m->head_dim || h.kv_type != GGML_TYPE_F16) {
        return fail(m, GGSWARM_E_MISMATCH, "snapshot KV shape (%d heads x %d, type %d) does not match (%d x %d, f16)",
                    h.n_head_kv, h.head_dim, h.kv_type, m->n_head_kv, m->head_dim);
    }
    if (h.n_pos < 0 || h.n_pos > sp->max_tokens) {
        return fail(m, GGSWARM_E_RANGE, "snapshot holds %d positions; the session cap is %d", h.n_pos, sp->max_tokens);
    }
    const uint64_t payload = (uint64_t)h.n_pos * m->kv_bytes_per_token();
    if (h.payload_bytes != payload || size != sizeof(SnapHeader) + payload) {
        return fail(m, GGSWARM_E_FORMAT, "snapshot is truncated or padded: %llu bytes, expected %llu",
                    (unsigned long long)size, (unsigned long long)(sizeof(SnapHeader) + payload));
    }
    const uint8_t * p = static_cast<const uint8_t *>(buf) + sizeof(SnapHeader);
    if (fnv1a(p, payload) != h.payload_fnv1a) return fail(m, GGSWARM_E_FORMAT, "snapshot payload checksum mismatch (corrupt)");
    Session & s = *sp;
    const int32_t keep_len = s.len;
    ggswarm_status st = ensure_capacity(m, s, std::max(h.n_pos, 1));
    if (st) return st;
    (void)keep_len;
    const size_t krow = (size_t)m->d_kv() * sizeof(ggml_fp16_t);
    const size_t vrow = (size_t)h.n_pos * sizeof(ggml_fp16_t);
    if (h.n_pos > 0) {
        for (size_t i = 0; i < s.k.size(); ++i) {
            ggml_backend_tensor_set(s.k[i], p, 0, (size_t)h.n_pos * krow);
            p += (size_t)h.n_pos * krow;
            for (int32_t r = 0; r < m->d_kv(); ++r) {
                ggml_backend_tensor_set(s.v[i], p, (size_t)r * s.v[i]->nb[1], vrow);
                p += vrow;
            }
        }
    }
    s.len = h.n_pos;
    return ok(m);
}

ggswarm_status ggswarm_sample(const float * logits, int32_t n_vocab, const ggswarm_sampling * params,
                              int64_t position, const int32_t * history, int32_t n_history, int32_t * out_token,
                              double * out_logprob) {
    if (!logits || !params || !out_token || n_vocab <= 0 || (history == nullptr && n_history > 0) || n_history < 0) {
        return fail(nullptr, GGSWARM_E_INVALID_ARG, "invalid arguments to ggswarm_sample");
    }
    static thread_local ggswarm::SamplerScratch scratch;
    ggswarm::SampleResult r = ggswarm::sample(logits, n_vocab, *params, position, history, n_history, scratch);
    *out_token = r.token;
    if (out_logprob) *out_logprob = r.logprob;
    return GGSWARM_OK;
}

}  // extern "C"
