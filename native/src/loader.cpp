// libggswarm loading: the window's tensors checked and read into one backend buffer (the CPU's
// repacked layout where it multiplies them), the ggml device, scheduler and threads.

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "arch.h"
#ifdef GGSWARM_OWN_THREADPOOL
#include "ggml-cpu.h"
#endif

namespace ggswarm {

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
// product, the weight in a dummy buffer of that type; for stacked experts, ffn_*_exps, the product by
// expert ids it runs them in: CPU_REPACK takes those in 3 dimensions, e.g. gpt-oss's MXFP4 on AVX2).
bool matmul_ok(const ggswarm_model * m, const ggml_tensor * src, ggml_backend_buffer_type_t buft, bool experts) {
    ggml_init_params ip = {ggml_tensor_overhead() * 8, nullptr, true};
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) return false;
    ggml_tensor * w = ggml_new_tensor(ctx, src->type, GGML_MAX_DIMS, src->ne);
    ggml_tensor * op;
    if (experts) {
        ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w->ne[0], 1, 512);
        op = ggml_mul_mat_id(ctx, w, x, ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, 512));
    } else {
        op = ggml_mul_mat(ctx, w, ggml_new_tensor_4d(ctx, GGML_TYPE_F32, w->ne[0], 512, w->ne[2], w->ne[3]));
    }
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
        const bool experts = w.shape.size() == 3 && w.name.find("_exps.weight") != std::string::npos;
        const bool repack = extra && !w.plain && w.shape.size() >= 2 && w.name != "token_embd.weight" &&
                            matmul_ok(m, src, extra, experts);
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
        if (b == m->backend_cpu) m->cpu_set_threads = fn;  // compute_graph's one-thread steps
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
