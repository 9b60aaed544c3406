// libggswarm: runs layers [a, b) of a llama-family GGUF with ggml, hidden state in/out at the seam.
//
// Weights stay in their GGUF (quantized) types in one backend buffer of the chosen ggml device; only
// the window's tensors and its role tensors are read from the file. Every session owns a KV buffer
// (f16; K as [head_dim * n_head_kv, capacity], V transposed as [capacity, head_dim * n_head_kv] per
// layer) that grows by doubling inside the node's byte budget (shared by every handle of the node).
// A forward call builds the window's graph in a preallocated metadata arena (once per shape) and runs
// it through ggml_backend_sched, so the same code drives a CPU or a GPU build of ggml. See include/ggswarm.h and docs/native.md.
//
// This unit: errors, the model handle's lifecycle and info; loader.cpp, kv.cpp, graph.cpp and
// attention.cpp do the rest (model.h holds what they share).

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>

#include "arch.h"
#include "attention.h"
#include "model.h"
#ifdef GGSWARM_OWN_THREADPOOL
#include "ggml-cpu.h"
#endif

namespace ggswarm {
namespace {

thread_local std::string g_last_error;

}  // namespace

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

namespace {

bool env_set(const char * name) {
    const char * v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

}  // namespace

// The non-flash mode of this handle (docs/native.md, "Attention modes"): on a CPU whose ggml build and
// hardware have AVX-512, decode steps run attention.cpp's kernels if, checked now on random data of this
// model's head shape, they give ggml's bits; every other step (and every step elsewhere) runs ggml's
// mul_mat/soft_max ops, which reproduce llama.cpp's default (flash attention off) path. Environment:
// GGSWARM_GGML_ATTENTION=1 forces ggml's ops; GGSWARM_KERNEL_SELFCHECK=corrupt (tests only) makes the
// self-check fail.
void choose_non_flash(ggswarm_model * m, const char * path) {
    const bool cpu = ggml_backend_dev_type(m->dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    // the kernels' softmax has no attention sinks (gpt-oss): a window with them takes ggml's ops
    const bool sinks =
        std::any_of(m->layers.begin(), m->layers.end(), [](const Layer & L) { return L.attn_sinks != nullptr; });
    if (env_set("GGSWARM_GGML_ATTENTION") || !cpu || sinks || !decode_attention_supported(m->head_dim)) {
        m->decode_kernels = 0;  // ggml's ops: no AVX-512, a GPU, sinks, or a head size the kernels do not take
    } else {
        const char * hook = getenv("GGSWARM_KERNEL_SELFCHECK");
        const bool corrupt = hook && strcmp(hook, "corrupt") == 0;
        std::string why;
        if (decode_attention_self_check(m->backend_cpu, m->head_dim, m->n_head, m->n_head_kv, corrupt, &why)) {
            m->decode_kernels = 1;
        } else {
            m->decode_kernels = -1;
            fprintf(stderr, "libggswarm: %s: decode attention kernels off, ggml's ops used instead: self-check: %s\n",
                    path, why.c_str());
        }
    }
}

namespace {

// The mode at open ("auto", like llama.cpp's -fa auto on the devices it resolves for): flash attention
// on a GPU, as llama.cpp turns it on there; the non-flash mode on a CPU, llama.cpp's default path there
// (llama-cpp-python's flash_attn=False). ggswarm_set_flash_attention (the node's --flash-attn) overrides it.
void choose_attention(ggswarm_model * m, const char * path) {
    const bool cpu = ggml_backend_dev_type(m->dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    if (!cpu) {
        m->decode_kernels = -2;
    } else {
        choose_non_flash(m, path);
    }
}

}  // namespace
}  // namespace ggswarm

using namespace ggswarm;

ggswarm_model::~ggswarm_model() {
    mtp_free(this);  // the attached nextn block: its own handle and sessions
    graphs.clear();  // their schedulers, before the backends
    for (auto & kv : sessions) free_kv(this, kv.second);
    sessions.clear();
    budget_release(budget);
    if (wbuf) ggml_backend_buffer_free(wbuf);
    if (wctx) ggml_free(wctx);
    if (wbuf_extra) ggml_backend_buffer_free(wbuf_extra);
    if (wctx_extra) ggml_free(wctx_extra);
    if (rot_buf) ggml_backend_buffer_free(rot_buf);
    if (rot_ctx) ggml_free(rot_ctx);
    if (backend_cpu && backend_cpu != backend) ggml_backend_free(backend_cpu);
    if (backend) ggml_backend_free(backend);
#ifdef GGSWARM_OWN_THREADPOOL
    if (threadpool) ggml_threadpool_free(threadpool);
#endif
}

#ifdef GGSWARM_OWN_THREADPOOL
// Our own static ggml logs to stderr at every level (llama_cpp's log callback never reaches this copy):
// keep its warnings and errors, drop the per-tensor info lines ("repack: repack tensor ...").
namespace {
ggml_log_level g_ggml_log_level = GGML_LOG_LEVEL_NONE;

void ggml_warnings_only(ggml_log_level level, const char * text, void * /*user*/) {
    if (level != GGML_LOG_LEVEL_CONT) g_ggml_log_level = level;  // CONT continues the previous message
    if (g_ggml_log_level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
}
}  // namespace
#endif

extern "C" {

int32_t ggswarm_api_version(void) { return GGSWARM_API_VERSION; }

const char * ggswarm_last_error(void) { return g_last_error.c_str(); }

const char * ggswarm_model_last_error(const ggswarm_model * model) {
    return model ? model->error.c_str() : "model handle is NULL";
}

}  // extern "C"

namespace {

// The file's header, hyper-parameters and window range into a new handle (*out), before anything is
// allocated for weights: what ggswarm_model_open and ggswarm_check_file share. layer_end -1: the whole model.
ggswarm_status open_header(const char * path, int32_t layer_start, int32_t layer_end, ggswarm::Meta & meta,
                           ggswarm_model ** out, uint64_t * file_size, bool mtp_block = false) {
    if (!path) return fail(nullptr, GGSWARM_E_INVALID_ARG, "path is NULL");
    struct stat st;
    if (stat(path, &st) != 0) return fail(nullptr, GGSWARM_E_IO, "cannot open %s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return fail(nullptr, GGSWARM_E_IO, "%s is not a regular file", path);
    *file_size = (uint64_t)st.st_size;
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
    m->mtp_block = mtp_block;  // the architecture's reader keeps the nextn block in the layer count
    ggswarm_status s = read_hparams(m, meta);
    if (s) return bail(s);
    if (layer_end == -1) layer_end = m->n_layers_total;
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
    *out = m;
    return GGSWARM_OK;
}

}  // namespace

namespace ggswarm {

ggswarm_status open_model(const char * path, int32_t layer_start, int32_t layer_end, int32_t n_threads,
                          ggswarm_budget * budget, const char * model_id, bool mtp_block, ggswarm_model ** out) {
#ifdef GGSWARM_OWN_THREADPOOL
    static std::once_flag log_once;
    std::call_once(log_once, [] { ggml_log_set(ggml_warnings_only, nullptr); });
#endif
    if (!out) return fail(nullptr, GGSWARM_E_INVALID_ARG, "out is NULL");
    *out = nullptr;
    if (n_threads <= 0 || n_threads > 1024) {
        return fail(nullptr, GGSWARM_E_INVALID_ARG, "n_threads must be in 1..1024, got %d", n_threads);
    }
    if (layer_end < 0) return fail(nullptr, GGSWARM_E_RANGE, "layer range %d:%d is invalid", layer_start, layer_end);
    Meta meta;
    ggswarm_model * m = nullptr;
    uint64_t file_size = 0;
    if (ggswarm_status s = open_header(path, layer_start, layer_end, meta, &m, &file_size, mtp_block)) return s;
    auto bail = [&](ggswarm_status s) {
        g_last_error = m->error;
        delete m;
        return s;
    };
    ggswarm_status s;
    if (budget) {
        std::lock_guard<std::mutex> lock(budget->mu);
        ++budget->refs;
        m->budget = budget;  // from here on the destructor releases the reference
    }
    if ((s = init_backends(m))) return bail(s);
    if ((s = load_weights(m, meta, path, file_size))) return bail(s);
    if ((s = init_sched(m))) return bail(s);
    m->small_steps = is_small_window(m);
    apply_threads(m, n_threads);
    choose_attention(m, path);
    m->chosen_attention = m->decode_kernels;
    m->model_id = (model_id && *model_id) ? std::string(model_id) : fingerprint(path, gguf_get_data_offset(meta.g), file_size);
    if (m->model_id.size() > 71) m->model_id.resize(71);
    *out = m;
    return GGSWARM_OK;
}

}  // namespace ggswarm

extern "C" {

ggswarm_status ggswarm_model_open(const char * path, int32_t layer_start, int32_t layer_end, int32_t n_threads,
                                  ggswarm_budget * budget, const char * model_id, ggswarm_model ** out) {
    g_last_error.clear();
    return open_model(path, layer_start, layer_end, n_threads, budget, model_id, false, out);
}

ggswarm_status ggswarm_check_file(const char * path) {
    g_last_error.clear();
    Meta meta;
    ggswarm_model * m = nullptr;
    uint64_t file_size = 0;
    if (ggswarm_status s = open_header(path, 0, -1, meta, &m, &file_size)) return s;
    const ggswarm_status s = check_window(m, meta);
    if (s) g_last_error = m->error;
    delete m;
    return s;
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
    out->d_model = (int32_t)m->d_io();  // the boundary row: d_model x streams
    out->n_vocab = m->n_vocab;
    out->n_head = m->n_head;
    out->n_head_kv = m->n_head_kv;
    out->head_dim = m->head_dim;
    out->n_ff = m->n_ff;
    out->n_ctx_train = m->n_ctx_train;
    out->n_ctx_max = m->n_ctx_max;
    out->n_threads = m->n_threads;
    out->decode_kernels = m->decode_kernels;
    out->weight_bytes = m->weight_bytes;
    out->kv_bytes_per_token = m->kv_bytes_per_token();
    out->graph_builds = m->graph_builds;
    out->batches_sessions = m->archp && m->archp->batches ? 1 : 0;
    return ok(m);
}

ggswarm_status ggswarm_set_threads(ggswarm_model * m, int32_t n_threads) {
    GGSWARM_LOCK(m);
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    if (n_threads <= 0 || n_threads > 1024) {
        return fail(m, GGSWARM_E_INVALID_ARG, "n_threads must be in 1..1024, got %d", n_threads);
    }
    mtp_set_threads(m, n_threads);  // the attached nextn block's, too
    return apply_threads(m, n_threads);
}

ggswarm_status ggswarm_sample(const float * logits, int32_t n_vocab, const ggswarm_sampling * params,
                              int64_t position, const int32_t * history, int32_t n_history, int32_t * out_token,
                              double * out_logprob) {
    if (!logits || !params || !out_token || n_vocab <= 0 || (history == nullptr && n_history > 0) || n_history < 0) {
        return fail(nullptr, GGSWARM_E_INVALID_ARG, "invalid arguments to ggswarm_sample");
    }
    static thread_local ggswarm::SamplerScratch scratch;
    ggswarm::SampleResult r =
        ggswarm::sample(logits, n_vocab, *params, position, history, n_history, scratch, out_logprob != nullptr);
    *out_token = r.token;
    if (out_logprob) *out_logprob = r.logprob;
    return GGSWARM_OK;
}

}  // extern "C"
