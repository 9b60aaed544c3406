// libggswarm continuous batching (docs/native.md, "Continuous batching"): ggswarm_forward_many runs one
// step of each of several sessions in one window graph. The row-wise work (embedding or hidden input,
// norms, projections, FFN or experts, output head) runs once over every step's rows concatenated; per
// session, attention appends its rows of K and V to its own cache and attends them with its own mask,
// positions and span (attention_many). Graphs are cached by the members' shapes like the single-session
// ones (graph.cpp), and bound to the calling sessions' caches before each compute.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "arch.h"
#include "attention.h"

namespace ggswarm {

ggml_tensor * attention_many(Build & b, int32_t il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale) {
    ggswarm_model * m = b.m;
    Graph & g = b.g;
    ggml_context * c = b.c;
    const int64_t hd = m->head_dim, dkv = m->d_kv();
    const bool swa = swa_ring(m, il);  // its cache a ring: the member's ring indices, span and mask
    ggml_tensor * out = nullptr;
    for (GraphMember & mb : g.members) {
        const int32_t n = mb.n;
        // this member's rows: q [hd, nh, n], k [d_kv, n], v [d_kv, n] (contiguous slices of the batch)
        ggml_tensor * qj = ggml_view_3d(c, q, hd, q->ne[1], n, q->nb[1], q->nb[2], (size_t)mb.off * q->nb[2]);
        ggml_tensor * kj = ggml_view_2d(c, k, dkv, n, k->nb[2], (size_t)mb.off * k->nb[2]);
        ggml_tensor * kc = mb.state[b.local(il)][0];
        ggml_tensor * vc = mb.state[b.local(il)][1];
        ggml_tensor * kidx = swa ? mb.kidx_swa : mb.kidx;
        const int32_t n_kv = swa ? (int32_t)std::min<int64_t>(mb.n_kv, swa_rows(m, mb.cap)) : mb.n_kv;
        ggml_tensor * k_put = ggml_set_rows(c, kc, kj, kidx);
        ggml_build_forward_expand(g.gf, k_put);
        ggml_tensor * v_put;
        if (m->flash()) {
            ggml_tensor * vj = ggml_view_2d(c, v, dkv, n, v->nb[1], (size_t)mb.off * v->nb[1]);
            v_put = ggml_set_rows(c, vc, vj, kidx);
        } else {
            ggml_tensor * vj = ggml_view_2d(c, v, 1, (int64_t)n * dkv, ggml_element_size(v), (size_t)mb.off * v->nb[1]);
            v_put = ggml_set_rows(c, ggml_reshape_2d(c, vc, 1, ggml_nelements(vc)), vj, swa ? mb.vidx_swa : mb.vidx);
        }
        ggml_build_forward_expand(g.gf, v_put);
        ggml_tensor * mask = swa ? mb.mask_swa : mb.mask;
        ggml_tensor * sinks = b.layer(il).attn_sinks;
        ggml_tensor * o;
        if (m->flash()) {
            o = flash_attention(c, qj, kc, vc, mask, n, n_kv, kq_scale, sinks);
        } else if (kernel_step(m, n) && !swa && !sinks) {
            o = kernel_attention(c, qj, kc, vc, mb.pos, mb.n_kv, k_put, v_put, kq_scale);
        } else {
            o = ops_attention(c, qj, kc, vc, mask, n, n_kv, kq_scale, nullptr, sinks);
        }
        out = out ? ggml_concat(c, out, o, 1) : o;
    }
    return out;
}

namespace {

// Graphs of several sessions kept per model, by kind, as graph.cpp keeps single-session ones: those
// of one-position steps only (small; their shapes change as sessions come and go) and those with a
// longer step among them (compute buffers sized for up to 512 rows)
constexpr size_t kManyDecodeGraphs = 4;
constexpr size_t kManyBatchGraphs = 1;

bool has_batch(const GraphKey & k) { return k.n > (int32_t)(k.members.size() / 3); }

// The graph for members of shape (n, n_kv, cap) each (key.members): inputs of all rows, each member's
// attention inputs and state leaves, the architecture's layers, and on the last window the head over
// each member's final row (all rows when a member asks for logits) and their softmax.
void build_many(ggswarm_model * m, Graph & g, const GraphKey & key, size_t size) {
    const int32_t nm = (int32_t)key.members.size() / 3;
    const int32_t total = key.n;
    ggml_tensor * x = graph_input(m, g, size, total);
    ggml_context * c = g.ctx;
    g.inp_pos = ggml_new_tensor_1d(c, GGML_TYPE_I32, total);
    ggml_set_input(g.inp_pos);
    bool any_full = false, any_swa = false;
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const bool swa = m->lhp[il].swa && m->n_swa > 0;
        any_swa = any_swa || swa;
        any_full = any_full || !swa;
    }
    const ggml_type mt = m->flash() ? GGML_TYPE_F16 : GGML_TYPE_F32;
    auto input = [&](ggml_type t, int64_t ne0, int64_t ne1) {
        ggml_tensor * r = ggml_new_tensor_2d(c, t, ne0, ne1);
        ggml_set_input(r);
        return r;
    };
    g.members.resize(nm);
    for (int32_t j = 0, off = 0; j < nm; ++j) {
        GraphMember & mb = g.members[j];
        mb.off = off;
        mb.n = key.members[3 * j];
        mb.n_kv = key.members[3 * j + 1];
        mb.cap = key.members[3 * j + 2];
        // masks as graph.cpp makes them: one row per head on a decode step with ggml's ops
        const int64_t rows = !m->flash() && decode_rows(mb.n) ? m->n_head : mb.n;
        if (any_full && !kernel_step(m, mb.n)) mb.mask = input(mt, mb.n_kv, rows);
        if (any_swa) mb.mask_swa = input(mt, std::min<int64_t>(mb.n_kv, swa_rows(m, mb.cap)), rows);
        mb.kidx = input(GGML_TYPE_I64, mb.n, 1);
        if (!m->flash()) mb.vidx = input(GGML_TYPE_I64, (int64_t)mb.n * m->d_kv(), 1);
        if (any_swa) {
            mb.kidx_swa = input(GGML_TYPE_I64, mb.n, 1);
            if (!m->flash()) mb.vidx_swa = input(GGML_TYPE_I64, (int64_t)mb.n * m->d_kv(), 1);
        }
        mb.pos = ggml_view_1d(c, g.inp_pos, 1, (size_t)off * sizeof(int32_t));
        for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
            mb.state.emplace_back();
            state_ops(m->lhp[il].state)->plan(m, il, mb.cap, c, mb.state.back());
        }
        off += mb.n;
    }
    // each member's final row, picked after the last attention (archs/common.cpp) when no member wants logits
    if (m->is_last() && total > nm) g.inp_last = input(GGML_TYPE_I32, nm, 1);
    Build b{m, g, c, total, 0, 0, key.last_only};
    x = m->archp->build_window(b, x);
    if (x->ne[1] == total) g.inp_last = nullptr;  // every row kept (a member wants logits): not in the graph
    if (m->is_last()) x = output_head(m, c, x);
    g.out = x;
    ggml_set_output(g.out);
    ggml_build_forward_expand(g.gf, g.out);
}

// Point every member's state leaves (and the graph's views of them) at its session's tensors.
void bind_members(Graph & g, const std::vector<Session *> & ss) {
    for (size_t j = 0; j < g.members.size(); ++j) {
        const auto & st = g.members[j].state;
        for (size_t i = 0; i < st.size(); ++i) {
            for (size_t l = 0; l < st[i].size(); ++l) bind_leaf(st[i][l], ss[j]->state[i][l]);
        }
    }
    for (ggml_tensor * t : g.kv_views) {
        t->buffer = nullptr;
        ggml_backend_view_init(t);
    }
}

// The cached graph of these members' shapes, or a new one (evicting the least recently used graph of
// several sessions of its kind when as many as that kind keeps are cached).
ggswarm_status graph_for_many(ggswarm_model * m, const GraphKey & key, const std::vector<Session *> & ss, Graph ** out) {
    for (auto & g : m->graphs) {
        if (g->key == key) {
            *out = g.get();
            return GGSWARM_OK;
        }
    }
    size_t kept = 0;
    const Graph * oldest = nullptr;
    for (auto & g : m->graphs) {
        if (g->key.members.empty() || has_batch(g->key) != has_batch(key)) continue;
        ++kept;
        if (!oldest || g->last_use < oldest->last_use) oldest = g.get();
    }
    if (oldest && kept >= (has_batch(key) ? kManyBatchGraphs : kManyDecodeGraphs)) drop_graph(m, oldest);
    // the window graph's nodes, plus each member's attention nodes per layer
    const size_t nm = key.members.size() / 3;
    const size_t size = m->graph_size + nm * (size_t)((m->layer_end - m->layer_start) * 48 + 64);
    auto g = std::make_unique<Graph>();
    build_many(m, *g, key, size);
    g->key = key;
    m->graph_builds++;
    g->sched = new_sched(m, size);
    if (!g->sched) return fail(m, GGSWARM_E_NO_MEMORY, "cannot create a ggml scheduler");
    bind_members(*g, ss);
    if (!ggml_backend_sched_alloc_graph(g->sched, g->gf)) {
        return fail(m, GGSWARM_E_COMPUTE, "ggml could not allocate the compute graph (%zu sessions, %d rows)", nm, key.n);
    }
    collect_kv_views(*g);
    *out = g.get();
    m->graphs.push_back(std::move(g));
    return GGSWARM_OK;
}

// Run steps idx (validated, capacity ensured, >= 2 of them) through one graph and fill their outputs.
ggswarm_status run_group(ggswarm_model * m, const std::vector<int32_t> & idx, const ggswarm_batch * batches,
                         const std::vector<Session *> & all) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t d = m->d_io();
    std::vector<Session *> ss;
    GraphKey key;
    key.last_only = m->is_last();
    for (int32_t i : idx) {
        const ggswarm_batch & b = batches[i];
        Session & s = *all[i];
        ss.push_back(&s);
        // every member attends ggml's padded span: the decode kernels read only up to their position, and
        // the padding adds exact zeros, so the numbers are those of the kernels' shorter span, and the
        // shape (hence the graph) changes 4x less often
        key.members.push_back(b.n_tokens);
        key.members.push_back((int32_t)std::min<int64_t>(pad_kv(b.pos_start + b.n_tokens), s.cap));
        key.members.push_back(s.cap);
        key.n += b.n_tokens;
        if (b.logits_out) key.last_only = false;
    }
    Graph * gp = nullptr;
    if (ggswarm_status st = graph_for_many(m, key, ss, &gp)) return st;
    Graph & g = *gp;
    g.last_use = ++m->graph_clock;
    m->graph = gp;
    bind_members(g, ss);
    std::vector<int32_t> last_rows;
    for (size_t j = 0; j < idx.size(); ++j) {
        const ggswarm_batch & b = batches[idx[j]];
        const GraphMember & mb = g.members[j];
        const int32_t n = mb.n, pos = b.pos_start, cap = ss[j]->cap;
        last_rows.push_back(mb.off + n - 1);
        set_cache_idx(m, mb.kidx, mb.vidx, pos, n, cap);
        set_cache_idx(m, mb.kidx_swa, mb.vidx_swa, pos, n, swa_rows(m, cap));
        m->pos_host.resize(n);
        for (int32_t t = 0; t < n; ++t) m->pos_host[t] = pos + t;
        ggml_backend_tensor_set(g.inp_pos, m->pos_host.data(), sizeof(int32_t) * mb.off, sizeof(int32_t) * n);
        if (mb.mask) set_mask(m, mb.mask, pos, n, mb.n_kv, 0);
        if (mb.mask_swa) set_mask(m, mb.mask_swa, pos, n, (int32_t)mb.mask_swa->ne[0], m->n_swa, swa_rows(m, cap));
        const int64_t nh = (int64_t)n * d;
        if (g.inp_tokens) {
            ggml_backend_tensor_set(g.inp_tokens, b.token_ids, sizeof(int32_t) * mb.off, sizeof(int32_t) * n);
        } else if (b.hidden_in_type == GGSWARM_TYPE_F32) {
            ggml_backend_tensor_set(g.inp_hidden, b.hidden_in, sizeof(float) * mb.off * d, sizeof(float) * nh);
        } else {
            m->hidden_host.resize(nh);
            ggml_fp16_to_fp32_row(static_cast<const ggml_fp16_t *>(b.hidden_in), m->hidden_host.data(), nh);
            ggml_backend_tensor_set(g.inp_hidden, m->hidden_host.data(), sizeof(float) * mb.off * d, sizeof(float) * nh);
        }
    }
    if (g.inp_last) ggml_backend_tensor_set(g.inp_last, last_rows.data(), 0, sizeof(int32_t) * last_rows.size());
    if (!compute_graph(m, g, key.n)) {
        drop_graph(m, gp);
        return fail(m, GGSWARM_E_COMPUTE, "ggml graph compute failed (%zu sessions in one graph)", idx.size());
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const bool all_rows = g.out->ne[1] == key.n;  // else one row per member
    for (size_t j = 0; j < idx.size(); ++j) {
        const ggswarm_batch & b = batches[idx[j]];
        const GraphMember & mb = g.members[j];
        ss[j]->len = b.pos_start + mb.n;
        const int64_t nh = (int64_t)mb.n * d;
        if (!m->is_last()) {
            if (b.hidden_out_type == GGSWARM_TYPE_F32) {
                ggml_backend_tensor_get(g.out, b.hidden_out, sizeof(float) * mb.off * d, sizeof(float) * nh);
            } else {
                m->hidden_host.resize(nh);
                ggml_backend_tensor_get(g.out, m->hidden_host.data(), sizeof(float) * mb.off * d, sizeof(float) * nh);
                ggml_fp32_to_fp16_row(m->hidden_host.data(), static_cast<ggml_fp16_t *>(b.hidden_out), nh);
            }
        } else {
            const int64_t row = all_rows ? mb.off + mb.n - 1 : (int64_t)j;
            const float * last;
            if (b.logits_out) {
                ggml_backend_tensor_get(g.out, b.logits_out, (size_t)mb.off * g.out->nb[1],
                                        sizeof(float) * (size_t)mb.n * m->n_vocab);
                last = b.logits_out + (int64_t)(mb.n - 1) * m->n_vocab;
            } else {
                m->logits_host.resize((size_t)m->n_vocab);
                ggml_backend_tensor_get(g.out, m->logits_host.data(), (size_t)row * g.out->nb[1], sizeof(float) * m->n_vocab);
                last = m->logits_host.data();
            }
            ggswarm_sampling greedy = {0.0, 0, 64, 1.0, 0.0, 1.0, 0};
            const ggswarm_sampling & p = b.sampling ? *b.sampling : greedy;
            SampleResult r = sample(last, m->n_vocab, p, (int64_t)b.pos_start + mb.n - 1, b.history,
                                    b.history ? b.n_history : 0, m->scratch, b.logprob_out != nullptr);
            *b.token_out = r.token;
            if (b.logprob_out) *b.logprob_out = r.logprob;
        }
        if (b.compute_s_out) *b.compute_s_out = secs;
    }
    return GGSWARM_OK;
}

}  // namespace
}  // namespace ggswarm

using namespace ggswarm;

extern "C" {

ggswarm_status ggswarm_forward_many(ggswarm_model * m, int32_t n, const int64_t * sids, const ggswarm_batch * batches,
                                    ggswarm_status * statuses) {
    GGSWARM_LOCK(m);
    if (!m || !sids || !batches || !statuses) return fail(m, GGSWARM_E_INVALID_ARG, "model, sids, batches or statuses is NULL");
    if (n <= 0 || n > GGSWARM_MAX_STEPS) return fail(m, GGSWARM_E_INVALID_ARG, "n %d is outside 1..%d", n, GGSWARM_MAX_STEPS);
    m->step_errors.assign(n, std::string());
    std::vector<Session *> ss(n, nullptr);
    auto settle = [&](int32_t i, ggswarm_status st) {
        statuses[i] = st;
        if (st) m->step_errors[i] = m->error;
    };
    const bool together = m->archp->batches;
    for (int32_t i = 0; i < n; ++i) {
        statuses[i] = GGSWARM_OK;
        ggswarm_status st = GGSWARM_OK;
        for (int32_t j = 0; j < i && !st; ++j) {
            if (sids[j] == sids[i]) {
                st = fail(m, GGSWARM_E_INVALID_ARG, "session %lld is already step %d of this batch", (long long)sids[i], j);
            }
        }
        Session * s = st ? nullptr : find_session(m, sids[i]);
        if (!st && !s) st = no_session(m, sids[i]);
        if (!st) st = validate_step(m, *s, &batches[i]);
        if (!st && together) st = ensure_capacity(m, *s, batches[i].pos_start + batches[i].n_tokens);
        if (st) {
            settle(i, st);
        } else {
            ss[i] = s;
        }
    }
    // groups of at most kUBatch rows, in step order; a longer step, or one left alone, runs on its own
    std::vector<std::vector<int32_t>> groups;
    int32_t rows = 0;
    for (int32_t i = 0; i < n; ++i) {
        if (!ss[i]) continue;
        const int32_t nt = batches[i].n_tokens;
        if (!together || nt > kUBatch) {
            groups.push_back({i});
            rows = kUBatch + 1;  // nothing joins it
            continue;
        }
        if (groups.empty() || rows + nt > kUBatch) {
            groups.emplace_back();
            rows = 0;
        }
        groups.back().push_back(i);
        rows += nt;
    }
    for (const auto & grp : groups) {
        if (grp.size() == 1) {
            settle(grp[0], ggswarm_forward(m, sids[grp[0]], &batches[grp[0]]));
            continue;
        }
        const ggswarm_status st = run_group(m, grp, batches, ss);
        for (int32_t i : grp) settle(i, st);
    }
    for (int32_t i = 0; i < n; ++i) {
        if (statuses[i]) {
            const std::string msg = m->step_errors[i];
            return fail(m, statuses[i], "step %d: %s", i, msg.c_str());
        }
    }
    return ok(m);
}

const char * ggswarm_forward_many_error(const ggswarm_model * m, int32_t i) {
    if (!m || i < 0 || (size_t)i >= m->step_errors.size()) return "";
    return m->step_errors[i].c_str();
}

}  // extern "C"
