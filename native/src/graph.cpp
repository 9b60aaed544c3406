// libggswarm compute: the window's ggml graph (the architecture's layers, arch.h), built once per shape (batch size, span,
// KV capacity) and reused by every session of that shape, micro-batched forward, and sampling on the
// last window (docs/native.md, "Graph").

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

#include "attention.h"
#include "arch.h"
#include "recurrent.h"

namespace ggswarm {
namespace {

// Build the window's graph for n new positions over a session of cap positions, attending n_kv of
// them: the inputs, the embedding on the first window, the architecture's layers (arch.h), the output
// norm and head on the last. last_only: on the last window, keep only the final position after the
// last attention (sampling needs nothing else). The state leaves are the graph's own (Graph::state),
// bound by bind_state.
void build_graph(ggswarm_model * m, Graph & g, int32_t n, int32_t n_kv, int32_t cap, bool last_only, bool tile_queries) {
    ggml_tensor * x = graph_input(m, g, m->graph_size, n);
    ggml_context * c = g.ctx;
    const int64_t nh = m->n_head;

    g.inp_pos = ggml_new_tensor_1d(c, GGML_TYPE_I32, (int64_t)n * m->n_pos_per_token);
    ggml_set_input(g.inp_pos);
    // which masks the window's attention layers read (an input no layer reads is never allocated)
    bool any_kv = false, any_full = false, any_swa = false;
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        if (m->lhp[il].state != StateKind::KV) continue;
        any_kv = true;
        const bool swa = m->lhp[il].swa && m->n_swa > 0;
        any_swa = any_swa || swa;
        any_full = any_full || !swa;
    }
    if (any_kv) {
        // one mask row per softmax row: per position, or per head on a decode step (see decode_rows);
        // flash attention takes one f16 row per position. Kernel decode steps need no causal mask, but
        // sliding-window layers still take theirs.
        const ggml_type mt = m->flash() ? GGML_TYPE_F16 : GGML_TYPE_F32;
        const int64_t rows = !m->flash() && decode_rows(n) ? nh : n;
        if (any_full && !kernel_step(m, n)) {
            g.inp_mask = ggml_new_tensor_2d(c, mt, n_kv, rows);
            ggml_set_input(g.inp_mask);
        }
        if (any_swa) {
            g.inp_mask_swa = ggml_new_tensor_2d(c, mt, std::min<int64_t>(n_kv, swa_rows(m, cap)), rows);
            ggml_set_input(g.inp_mask_swa);
        }
        g.inp_kidx = ggml_new_tensor_1d(c, GGML_TYPE_I64, n);
        ggml_set_input(g.inp_kidx);
        if (!m->flash()) {
            g.inp_vidx = ggml_new_tensor_1d(c, GGML_TYPE_I64, (int64_t)n * m->d_kv());
            ggml_set_input(g.inp_vidx);
        }
        if (any_swa) {
            g.inp_kidx_swa = ggml_new_tensor_1d(c, GGML_TYPE_I64, n);
            ggml_set_input(g.inp_kidx_swa);
            if (!m->flash()) {
                g.inp_vidx_swa = ggml_new_tensor_1d(c, GGML_TYPE_I64, (int64_t)n * m->d_kv());
                ggml_set_input(g.inp_vidx_swa);
            }
        }
    }
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        g.state.emplace_back();
        state_ops(m->lhp[il].state)->plan(m, il, cap, c, g.state.back());
    }
    Build b{m, g, c, n, n_kv, cap, last_only, tile_queries};
    x = m->archp->build_window(b, x);
    if (m->is_last()) x = output_head(m, c, x);
    g.out = x;
    ggml_set_output(g.out);
    ggml_build_forward_expand(g.gf, g.out);
}

}  // namespace

ggml_tensor * graph_input(ggswarm_model * m, Graph & g, size_t size, int64_t n) {
    g.meta.resize(ggml_tensor_overhead() * size + ggml_graph_overhead_custom(size, false));
    ggml_init_params ip = {g.meta.size(), g.meta.data(), true};
    g.ctx = ggml_init(ip);
    ggml_context * c = g.ctx;
    g.gf = ggml_new_graph_custom(c, size, false);
    if (m->is_first()) {
        g.inp_tokens = ggml_new_tensor_1d(c, GGML_TYPE_I32, n);
        ggml_set_input(g.inp_tokens);
        ggml_tensor * x = ggml_get_rows(c, m->tok_embd, g.inp_tokens);
        return m->embd_scale != 0.0f ? ggml_scale(c, x, m->embd_scale) : x;
    }
    g.inp_hidden = ggml_new_tensor_2d(c, GGML_TYPE_F32, m->d_io(), n);
    ggml_set_input(g.inp_hidden);
    return g.inp_hidden;
}

ggml_tensor * output_head(ggswarm_model * m, ggml_context * c, ggml_tensor * x) {
    x = rms(c, x, m->output_norm, m->eps);
    x = ggml_mul_mat(c, m->output, x);
    if (m->logit_softcap != 0.0f) {
        x = ggml_scale(c, x, 1.0f / m->logit_softcap);
        x = ggml_tanh(c, x);
        x = ggml_scale(c, x, m->logit_softcap);
    }
    return x;
}

// Point one state leaf of the graph at a session's tensor of the same shape.
void bind_leaf(ggml_tensor * leaf, const ggml_tensor * kv) {
    leaf->buffer = nullptr;
    leaf->data = nullptr;
    ggml_backend_tensor_alloc(kv->buffer, leaf, kv->data);
}

namespace {

// Bind the graph's state to session s: its leaves, then every allocated view of them (set_rows
// results, attention's K/V views), which ggml resolved from the leaves' addresses at allocation and
// resolves again here the same way (ggml_backend_view_init).
void bind_state(Graph & g, const Session & s) {
    for (size_t i = 0; i < g.state.size(); ++i) {
        for (size_t j = 0; j < g.state[i].size(); ++j) bind_leaf(g.state[i][j], s.state[i][j]);
    }
    for (ggml_tensor * t : g.kv_views) {
        t->buffer = nullptr;
        ggml_backend_view_init(t);
    }
}

}  // namespace

// After allocation: remember the graph tensors that view the state leaves (a view's view_src is
// always the leaf itself, ggml flattens chains of views).
void collect_kv_views(Graph & g) {
    std::unordered_set<const ggml_tensor *> leaves;
    for (const auto & l : g.state) leaves.insert(l.begin(), l.end());
    for (const auto & mb : g.members) {
        for (const auto & l : mb.state) leaves.insert(l.begin(), l.end());
    }
    g.kv_views.clear();
    for (ggml_tensor * t = ggml_get_first_tensor(g.ctx); t; t = ggml_get_next_tensor(g.ctx, t)) {
        if (t->view_src && t->buffer && leaves.count(t->view_src)) g.kv_views.push_back(t);
    }
}

// Graphs kept per model, by kind. Decode-step graphs are small (one position's activations) and many
// shapes recur (one per attended span and cache size); batch graphs' compute buffers grow with the
// batch and the span, and one prompt's chunks rarely share a shape with the next prompt's.
constexpr size_t kDecodeGraphs = 8;
constexpr size_t kBatchGraphs = 1;

// Drop the graph (and its scheduler's buffers) from the cache.
void drop_graph(ggswarm_model * m, const Graph * g) {
    if (m->graph == g) m->graph = nullptr;
    for (auto it = m->graphs.begin(); it != m->graphs.end(); ++it) {
        if (it->get() == g) {
            m->graphs.erase(it);
            return;
        }
    }
}

namespace {

// The cached graph of this shape, or a new one built, allocated and cached, evicting the least
// recently used graph of its kind when the cache holds as many as it keeps. Bound to s before
// allocation, so the allocator sees the cache as already placed.
ggswarm_status graph_for(ggswarm_model * m, const GraphKey & key, const Session & s, Graph ** out) {
    for (auto & g : m->graphs) {
        if (g->key == key) {
            *out = g.get();
            return GGSWARM_OK;
        }
    }
    const bool batch = key.n > 1;
    size_t same_kind = 0;
    const Graph * oldest = nullptr;
    for (auto & g : m->graphs) {
        if (!g->key.members.empty() || (g->key.n > 1) != batch) continue;  // graphs of several sessions: batch.cpp
        ++same_kind;
        if (!oldest || g->last_use < oldest->last_use) oldest = g.get();
    }
    if (oldest && same_kind >= (batch ? kBatchGraphs : kDecodeGraphs)) drop_graph(m, oldest);
    auto g = std::make_unique<Graph>();
    build_graph(m, *g, key.n, key.n_kv, key.cap, key.last_only, key.tile_queries);
    g->key = key;
    m->graph_builds++;
    g->sched = new_sched(m);
    if (!g->sched) return fail(m, GGSWARM_E_NO_MEMORY, "cannot create a ggml scheduler");
    bind_state(*g, s);
    if (!ggml_backend_sched_alloc_graph(g->sched, g->gf)) {
        return fail(m, GGSWARM_E_COMPUTE, "ggml could not allocate the compute graph (%d tokens)", key.n);
    }
    collect_kv_views(*g);
    *out = g.get();
    m->graphs.push_back(std::move(g));
    return GGSWARM_OK;
}

}  // namespace

// Fill a mask input for new positions [pos, pos + nc) over n_kv cached ones: 0 where a position may
// attend (causal; within the last `window` positions when window > 0, as llama.cpp's standard sliding
// window: p - j < window), -inf elsewhere. Decode steps repeat the row once per head (decode_rows).
void set_mask(ggswarm_model * m, ggml_tensor * mask, int32_t pos, int32_t nc, int32_t n_kv, int32_t window,
              int64_t ring) {
    const int32_t mask_rows = (int32_t)mask->ne[1];
    const int64_t top = (int64_t)pos + nc - 1;
    m->mask_host.resize((size_t)mask_rows * n_kv);
    for (int32_t i = 0; i < (decode_rows(nc) ? 1 : mask_rows); ++i) {
        float * row = m->mask_host.data() + (size_t)i * n_kv;
        const int64_t lim = pos + i;
        for (int32_t j = 0; j < n_kv; ++j) {
            const int64_t q = ring > 0 ? top - (((top - j) % ring) + ring) % ring : j;  // the slot's position
            row[j] = q >= 0 && q <= lim && (window <= 0 || lim - q < window) ? 0.0f : -INFINITY;
        }
    }
    for (int32_t i = 1; decode_rows(nc) && i < mask_rows; ++i) {
        memcpy(m->mask_host.data() + (size_t)i * n_kv, m->mask_host.data(), sizeof(float) * n_kv);
    }
    if (mask->type == GGML_TYPE_F16) {
        m->mask_f16.resize(m->mask_host.size());
        ggml_fp32_to_fp16_row(m->mask_host.data(), m->mask_f16.data(), (int64_t)m->mask_host.size());
        ggml_backend_tensor_set(mask, m->mask_f16.data(), 0, sizeof(ggml_fp16_t) * m->mask_f16.size());
    } else {
        ggml_backend_tensor_set(mask, m->mask_host.data(), 0, sizeof(float) * m->mask_host.size());
    }
}

void set_cache_idx(ggswarm_model * m, ggml_tensor * kidx, ggml_tensor * vidx, int32_t pos, int32_t nc, int64_t rows) {
    // a window of only sliding-window layers (or none) leaves the other kind's indices unused, unallocated
    if (kidx && kidx->buffer) {
        m->kidx_host.resize(nc);
        for (int32_t t = 0; t < nc; ++t) m->kidx_host[t] = (pos + t) % rows;
        ggml_backend_tensor_set(kidx, m->kidx_host.data(), 0, sizeof(int64_t) * m->kidx_host.size());
    }
    if (vidx && vidx->buffer) {  // transposed V: one element index per (position, channel)
        m->vidx_host.resize((size_t)nc * m->d_kv());
        for (int32_t t = 0; t < nc; ++t) {
            int64_t * vi = m->vidx_host.data() + (size_t)t * m->d_kv();
            const int64_t slot = (pos + t) % rows;
            for (int32_t ch = 0; ch < m->d_kv(); ++ch) vi[ch] = (int64_t)ch * rows + slot;
        }
        ggml_backend_tensor_set(vidx, m->vidx_host.data(), 0, sizeof(int64_t) * m->vidx_host.size());
    }
}

namespace {

// Below this many weight bytes read per step (the window's weights, less a token embedding it only
// gathers rows from), a one-row step runs on one thread: on these 2-core VMs waking a sleeping worker and
// meeting it at every node's barrier costs ~0.1 ms a graph (a 1-layer tiny window: 35 us on one thread,
// 141 us on two), while reading 2 MiB takes ~0.1 ms on one core. Real windows are 100x larger.
// GGSWARM_ONE_THREAD_BYTES overrides it (0: never). Only graphs whose numbers do not depend on the
// thread count qualify (thread_free).
uint64_t one_thread_bytes() {
    static const uint64_t v = [] {
        const char * env = getenv("GGSWARM_ONE_THREAD_BYTES");
        return env && *env ? strtoull(env, nullptr, 10) : (uint64_t)2 << 20;
    }();
    return v;
}

// Whether every node of the graph computes the same values on any number of threads: ggml's CPU flash
// attention does not where a one-row step attends kFlashSplitRows or more cached positions (ops.cpp,
// use_split_kv_path: it splits them among the threads and adds the parts up), so such a graph keeps the
// thread count llama.cpp runs with. A graph's shape, and so the answer, is fixed when it is built.
constexpr int64_t kFlashSplitRows = 512;

bool thread_free(Graph & g) {
    if (g.thread_free < 0) {
        g.thread_free = 1;
        for (int i = 0; i < ggml_graph_n_nodes(g.gf); ++i) {
            const ggml_tensor * t = ggml_graph_node(g.gf, i);
            if (t->op == GGML_OP_FLASH_ATTN_EXT && t->src[1]->ne[1] >= kFlashSplitRows) g.thread_free = 0;
        }
    }
    return g.thread_free == 1;
}

}  // namespace

bool is_small_window(const ggswarm_model * m) {
    const uint64_t gathered = m->tok_embd && m->tok_embd != m->output ? ggml_nbytes(m->tok_embd) : 0;
    return m->backend == m->backend_cpu && m->weight_bytes - std::min(m->weight_bytes, gathered) < one_thread_bytes();
}

bool compute_graph(ggswarm_model * m, Graph & g, int64_t rows) {
    const bool one = rows == 1 && m->small_steps && m->n_threads > 1 && m->cpu_set_threads && thread_free(g);
    if (one) m->cpu_set_threads(m->backend_cpu, 1);
    const bool ok = ggml_backend_sched_graph_compute(g.sched, g.gf) == GGML_STATUS_SUCCESS;
    if (one) m->cpu_set_threads(m->backend_cpu, m->n_threads);
    return ok;
}

namespace {

// One micro-batch: positions [b->pos_start + off, + nc). On the last window *last points at the logits
// of the chunk's final position afterwards.
ggswarm_status forward_chunk(ggswarm_model * m, Session & s, const ggswarm_batch * b, int32_t off, int32_t nc,
                             bool final_chunk, const float ** last) {
    const int32_t pos = b->pos_start + off;
    const int64_t d = m->d_io();
    const bool last_only = m->is_last() && !b->logits_out;
    const int64_t span = kernel_step(m, nc) ? kernel_span(pos + nc) : pad_kv(pos + nc);
    const int32_t n_kv = (int32_t)std::min<int64_t>(span, s.cap);
    GraphKey key;
    key.n = nc;
    key.n_kv = n_kv;
    key.cap = s.cap;
    key.last_only = last_only;
    // the positions llama.cpp's ubatch holding this micro-batch has (ubatches of kUBatch from the call's
    // start; ours end at recurrent checkpoints too): a remainder of a long one ran tiled there
    const int32_t ubatch = std::min(kUBatch, b->n_tokens - off / kUBatch * kUBatch);
    key.tile_queries = nc > 1 && nc < kFlashTileQ && ubatch >= kFlashTileQ;
    Graph * gp = nullptr;
    if (ggswarm_status st = graph_for(m, key, s, &gp)) return st;
    Graph & g = *gp;
    g.last_use = ++m->graph_clock;
    m->graph = gp;
    bind_state(g, s);
    set_cache_idx(m, g.inp_kidx, g.inp_vidx, pos, nc, s.cap);
    set_cache_idx(m, g.inp_kidx_swa, g.inp_vidx_swa, pos, nc, swa_rows(m, s.cap));
    // multi-section RoPE: the text position in the first three sections, 0 in the fourth
    m->pos_host.assign((size_t)nc * m->n_pos_per_token, 0);
    for (int32_t sec = 0; sec < std::min(m->n_pos_per_token, 3); ++sec) {
        for (int32_t i = 0; i < nc; ++i) m->pos_host[(size_t)sec * nc + i] = pos + i;
    }
    ggml_backend_tensor_set(g.inp_pos, m->pos_host.data(), 0, sizeof(int32_t) * m->pos_host.size());
    if (g.inp_mask) set_mask(m, g.inp_mask, pos, nc, n_kv, 0);
    if (g.inp_mask_swa) {
        set_mask(m, g.inp_mask_swa, pos, nc, (int32_t)g.inp_mask_swa->ne[0], m->n_swa, swa_rows(m, s.cap));
    }
    if (m->archp->set_inputs) m->archp->set_inputs(m, g, pos, nc);
    const int64_t n_hidden = (int64_t)nc * d;
    if (g.inp_tokens) {
        ggml_backend_tensor_set(g.inp_tokens, b->token_ids + off, 0, sizeof(int32_t) * nc);
    }
    if (g.inp_hidden && b->hidden_in_type == GGSWARM_TYPE_F32) {
        const float * src = static_cast<const float *>(b->hidden_in) + (int64_t)off * d;
        ggml_backend_tensor_set(g.inp_hidden, src, 0, sizeof(float) * n_hidden);
    } else if (g.inp_hidden) {
        const ggml_fp16_t * src = static_cast<const ggml_fp16_t *>(b->hidden_in) + (int64_t)off * d;
        m->hidden_host.resize(n_hidden);
        ggml_fp16_to_fp32_row(src, m->hidden_host.data(), n_hidden);
        ggml_backend_tensor_set(g.inp_hidden, m->hidden_host.data(), 0, sizeof(float) * n_hidden);
    }
    if (!compute_graph(m, g, nc)) {
        drop_graph(m, gp);
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

// The checks ggswarm_forward makes on a step before touching the session (also ggswarm_forward_many's,
// per step): GGSWARM_OK, or the failure with its message set.
ggswarm_status validate_step(ggswarm_model * m, const Session & s, const ggswarm_batch * b) {
    const int32_t n = b->n_tokens;
    if (n <= 0 || n > GGSWARM_MAX_BATCH) {
        return fail(m, GGSWARM_E_INVALID_ARG, "n_tokens %d is outside 1..%d", n, GGSWARM_MAX_BATCH);
    }
    if (b->pos_start != s.len) {
        return fail(m, GGSWARM_E_RANGE, "pos_start %d does not follow the session's %d positions (truncate first)",
                    b->pos_start, s.len);
    }
    if ((int64_t)b->pos_start + n > s.capacity) {
        return fail(m, GGSWARM_E_RANGE, "positions up to %lld exceed the session cap of %d tokens",
                    (long long)b->pos_start + n, s.capacity);
    }
    const int64_t n_hidden = (int64_t)n * m->d_io();
    if (m->is_first() || m->needs_ids()) {
        if (!b->token_ids) {
            return fail(m, GGSWARM_E_INVALID_ARG, m->is_first() ? "the first window takes token_ids"
                                                                : "this window's layers route by token id: pass token_ids with hidden_in");
        }
        for (int32_t i = 0; i < n; ++i) {
            if (b->token_ids[i] < 0 || b->token_ids[i] >= m->n_vocab) {
                return fail(m, GGSWARM_E_INVALID_ARG, "token id %d at index %d is outside 0..%d", b->token_ids[i], i,
                            m->n_vocab - 1);
            }
        }
    }
    if (!m->is_first()) {
        if (!b->hidden_in) return fail(m, GGSWARM_E_INVALID_ARG, "a window after the first takes hidden_in");
        if (b->hidden_in_type != GGSWARM_TYPE_F32 && b->hidden_in_type != GGSWARM_TYPE_F16) {
            return fail(m, GGSWARM_E_INVALID_ARG, "hidden_in_type %d is not f32 (0) or f16 (1)", b->hidden_in_type);
        }
        if (b->hidden_in_count != n_hidden) {
            return fail(m, GGSWARM_E_INVALID_ARG,
                        "hidden size mismatch: got %lld elements, expected n_tokens %d x %lld = %lld",
                        (long long)b->hidden_in_count, n, (long long)m->d_io(), (long long)n_hidden);
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
    return GGSWARM_OK;
}

}  // namespace ggswarm

using namespace ggswarm;

extern "C" {

ggswarm_status ggswarm_forward(ggswarm_model * m, int64_t sid, const ggswarm_batch * b) {
    GGSWARM_LOCK(m);
    if (!m || !b) return fail(m, GGSWARM_E_INVALID_ARG, "model or batch is NULL");
    const auto t0 = std::chrono::steady_clock::now();
    Session * sp = find_session(m, sid);
    if (!sp) return no_session(m, sid);
    Session & s = *sp;
    const int32_t n = b->n_tokens;
    if (ggswarm_status st = validate_step(m, s, b)) return st;
    ggswarm_status st = ensure_capacity(m, s, b->pos_start + n);
    if (st) return st;

    // run in micro-batches of at most kUBatch positions (bounded compute memory, like llama.cpp's n_ubatch)
    // recurrent windows keep checkpoints (recurrent.h): where a turn starts and ends (the ends of a
    // multi-token call) and, when set, every ckpt_every positions, where micro-batches are made to end
    if (n > 1) take_checkpoint(m, s);
    const float * last = nullptr;
    for (int32_t off = 0; off < n;) {
        const int32_t nc = checkpoint_chunk(m, b->pos_start + off, std::min(kUBatch, n - off));
        const bool final_chunk = off + nc == n;
        if ((st = forward_chunk(m, s, b, off, nc, final_chunk, &last))) {
            // a failed call leaves the session at its previous length; rows written beyond it are
            // ignored. Recurrent state already moved on: back to the newest checkpoint before it.
            int32_t kind = 0;
            s.len = std::max(s.len, b->pos_start);
            rewind(m, s, b->pos_start, &kind);
            return st;
        }
        checkpoint_after_chunk(m, s);
        if (m->mtp) mtp_after_chunk(m, sid, b, off, nc);  // the attached nextn block follows (mtp.cpp)
        off += nc;
    }
    if (n > 1) take_checkpoint(m, s);
    if (m->is_last()) {
        ggswarm_sampling greedy = {0.0, 0, 64, 1.0, 0.0, 1.0, 0};
        const ggswarm_sampling & p = b->sampling ? *b->sampling : greedy;
        ggswarm::SampleResult r = ggswarm::sample(last, m->n_vocab, p, (int64_t)b->pos_start + n - 1, b->history,
                                                  b->history ? b->n_history : 0, m->scratch, b->logprob_out != nullptr);
        *b->token_out = r.token;
        if (b->logprob_out) *b->logprob_out = r.logprob;
    }
    if (b->compute_s_out) {
        *b->compute_s_out = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    return ok(m);
}

}  // extern "C"
