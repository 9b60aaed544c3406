// libggswarm sessions: the node's KV budget, per-session state buffers (planned per layer as its state kind
// says, arch.h StateOps; grown within the budget; truncated), the caches' type and the attention mode
// (docs/native.md, "KV cache"). The KV state kind is kv_state.cpp's, the snapshot format snapshot.cpp's.

#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include "arch.h"
#include "recurrent.h"

namespace ggswarm {

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

namespace {
int64_t round_up(int64_t n, int64_t pad) { return (n + pad - 1) / pad * pad; }
}  // namespace

int64_t pad_kv(int64_t n) { return round_up(n, kKvPad); }

bool swa_ring(const ggswarm_model * m, int32_t il) {
    const LayerHp & h = m->lhp[il];
    return h.state == StateKind::KV && h.swa && m->n_swa > 0;
}

int64_t window_ring(const ggswarm_model * m) {
    return pad_kv(std::min<int64_t>(m->n_ctx_max, (int64_t)m->n_swa + kUBatch));
}

int64_t swa_rows(const ggswarm_model * m, int64_t cap) { return std::min<int64_t>(cap, window_ring(m)); }

// A CPU decode step runs attention.cpp's kernels: no mask input (they write -inf past the new
// position themselves), and a span padded only to their 64-position step, since padding adds exact
// zeros to softmax's and the values' sums and so changes nothing but the work done (kernel_step).
constexpr int64_t kKernelPad = 64;

bool kernel_step(const ggswarm_model * m, int32_t n) { return n == 1 && m->decode_kernels == 1; }

int64_t kernel_span(int64_t n) { return round_up(n, kKernelPad); }

// The node's budget. Charges and credits come from any handle's thread, so under the budget's lock.

namespace {

}  // namespace

// Take `bytes` from the budget; false (nothing taken) when it cannot hold them. No budget: always.
bool budget_charge(ggswarm_budget * b, uint64_t bytes) {
    if (!b || bytes == 0) return true;
    std::lock_guard<std::mutex> lock(b->mu);
    if (b->used + bytes > b->total) return false;
    b->used += bytes;
    return true;
}

void budget_credit(ggswarm_budget * b, uint64_t bytes) {
    if (!b || bytes == 0) return;
    std::lock_guard<std::mutex> lock(b->mu);
    b->used -= std::min(bytes, b->used);
}

namespace {

void budget_usage(const ggswarm_budget * b, uint64_t * total, uint64_t * used) {
    std::lock_guard<std::mutex> lock(b->mu);
    *total = b->total;
    *used = b->used;
}

// The state tensors (not yet allocated) of a session of `cap` positions, per layer as its kind plans
// them; n.bytes: exactly what ggml_backend_alloc_ctx_tensors_from_buft will allocate (alignment
// included).
ggswarm_status plan_state(const ggswarm_model * m, int64_t cap, Session & n) {
    size_t tensors = 2;
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const StateOps * ops = state_ops(m->lhp[il].state);
        if (!ops) return fail(m, GGSWARM_E_UNSUPPORTED, "layer %d: no state kind %d in this build", il, (int)m->lhp[il].state);
        tensors += ops->max_tensors;
    }
    ggml_init_params ip = {ggml_tensor_overhead() * tensors, nullptr, true};
    n.ctx = ggml_init(ip);
    if (!n.ctx) return fail(m, GGSWARM_E_NO_MEMORY, "cannot create a session state context");
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        n.state.emplace_back();
        state_ops(m->lhp[il].state)->plan(m, il, cap, n.ctx, n.state.back());
    }
    n.cap = (int32_t)cap;
    n.bytes = ggml_backend_alloc_ctx_tensors_from_buft_size(n.ctx, m->buft);
    return GGSWARM_OK;
}

// Capacity that holds `need` positions: a multiple of kKvPad, so the attention always spans whole
// padded blocks, and no more than the session's capacity need.
int64_t min_capacity(const Session & s, int32_t need) {
    return std::min<int64_t>(pad_kv(need), pad_kv(s.capacity));
}

}  // namespace

void budget_release(ggswarm_budget * b) {
    if (!b) return;
    bool last;
    {
        std::lock_guard<std::mutex> lock(b->mu);
        last = --b->refs == 0;
    }
    if (last) delete b;
}

void free_kv(ggswarm_model * m, Session & s) {
    drop_checkpoints(m, s);
    budget_credit(m->budget, s.bytes);
    s.release();
}

// Make room for `need` positions, keeping the first s.len positions. The allocation doubles while the
// budget has room (fewer copies over a long generation), else grows to exactly what `need` takes,
// which is what ggswarm_session_growth_bytes reports.
ggswarm_status ensure_capacity(ggswarm_model * m, Session & s, int32_t need) {
    if (need <= s.cap) return GGSWARM_OK;
    const int64_t exact_cap = min_capacity(s, need);
    const int64_t doubled_cap = std::max<int64_t>(exact_cap, std::min<int64_t>(2LL * s.cap, pad_kv(s.capacity)));
    Session n;
    ggswarm_status st = plan_state(m, doubled_cap, n);
    if (st) return st;
    if (!budget_charge(m->budget, n.bytes - s.bytes)) {
        n.release();
        if ((st = plan_state(m, exact_cap, n))) return st;
        if (!budget_charge(m->budget, n.bytes - s.bytes)) {
            // the handle's checkpoints only borrow free room: a session's state comes before them (all
            // of them not being enough, none goes for nothing)
            uint64_t total = 0, used = 0;
            budget_usage(m->budget, &total, &used);
            const uint64_t more = n.bytes - s.bytes, room = total > used ? total - used : 0;
            if (more > room && more - room <= reclaimable_checkpoint_bytes(m)) reclaim_checkpoints(m, more - room);
            if (!budget_charge(m->budget, more)) {
                budget_usage(m->budget, &total, &used);
                n.release();
                return fail(m, GGSWARM_E_BUDGET,
                            "KV budget exhausted: %d positions need %llu more bytes; %llu of the node's %llu bytes are in use",
                            need, (unsigned long long)more, (unsigned long long)used, (unsigned long long)total);
            }
        }
    }
    const uint64_t charged = n.bytes - s.bytes;
    n.buf = ggml_backend_alloc_ctx_tensors_from_buft(n.ctx, m->buft);
    if (!n.buf) {
        budget_credit(m->budget, charged);
        const uint64_t bytes = n.bytes;
        n.release();
        return fail(m, GGSWARM_E_NO_MEMORY, "cannot allocate %llu KV bytes on %s", (unsigned long long)bytes,
                    m->device_name.c_str());
    }
    ggml_backend_buffer_set_usage(n.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_clear(n.buf, 0);  // padded positions are read (times a zero weight): keep them finite
    n.capacity = s.capacity;
    n.len = s.len;
    if (s.len > 0) {
        for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
            const size_t i = (size_t)(il - m->layer_start);
            state_ops(m->lhp[il].state)->carry(m, il, s.state[i], n.state[i], s.len);
        }
    }
    n.ckpts = s.ckpts;
    n.ring_lo = s.ring_lo;
    s.release();  // its bytes now belong to n: the charge above was the difference
    s = n;
    return GGSWARM_OK;
}

}  // namespace ggswarm

using namespace ggswarm;

uint64_t ggswarm_model::kv_bytes_per_token() const {
    uint64_t b = 0;
    for (int32_t il = layer_start; il < layer_end; ++il) {
        const StateOps * ops = state_ops(lhp[il].state);
        if (ops) b += ops->bytes_per_token(this, il);
    }
    return b;
}

extern "C" {

ggswarm_status ggswarm_session_open(ggswarm_model * m, int32_t capacity, int64_t * out_sid) {
    GGSWARM_LOCK(m);
    if (!m || !out_sid) return fail(m, GGSWARM_E_INVALID_ARG, "model or out_sid is NULL");
    if (capacity <= 0 || capacity > m->n_ctx_max) {
        return fail(m, GGSWARM_E_RANGE, "capacity %d is outside 1..%d (model context, capped at %d)", capacity,
                    m->n_ctx_max, GGSWARM_MAX_CONTEXT);
    }
    Session s;
    s.capacity = capacity;
    const int64_t sid = m->next_sid++;
    m->sessions.emplace(sid, s);
    *out_sid = sid;
    return ok(m);
}

ggswarm_status ggswarm_session_close(ggswarm_model * m, int64_t sid) {
    GGSWARM_LOCK(m);
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    auto it = m->sessions.find(sid);
    if (it == m->sessions.end()) return no_session(m, sid);
    free_kv(m, it->second);
    m->sessions.erase(it);
    mtp_session_closed(m, sid);  // and its nextn block's state (mtp.cpp)
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
    GGSWARM_LOCK(m);
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    if (n_tokens < 0 || n_tokens > s->len) {
        return fail(m, GGSWARM_E_RANGE, "cannot truncate to %d positions: the session holds %d", n_tokens, s->len);
    }
    // recurrent state goes back only to a checkpoint: the session may end shorter (ggswarm_session_len)
    int32_t kind = 0;
    rewind(m, *s, n_tokens, &kind);
    return ok(m);
}

namespace {

// llama.cpp's rotations of a quantized cache's rows (llama-kv-cache.cpp attn_rot_k, attn_rot_v): K (and
// the queries) by the largest Hadamard order dividing the head, V by order 64, where the head is a
// multiple of 64; kept on the model's device as constants the graphs read.
ggswarm_status make_rotations(ggswarm_model * m) {
    if (m->rot_buf) ggml_backend_buffer_free(m->rot_buf);
    if (m->rot_ctx) ggml_free(m->rot_ctx);
    m->rot_buf = nullptr;
    m->rot_ctx = nullptr;
    m->rot_k = m->rot_v = nullptr;
    if (!ggml_is_quantized(m->cache_type) || m->head_dim % 64 != 0) return GGSWARM_OK;
    ggml_init_params ip = {2 * ggml_tensor_overhead(), nullptr, true};
    m->rot_ctx = ggml_init(ip);
    if (!m->rot_ctx) return fail(m, GGSWARM_E_NO_MEMORY, "cannot create the rotation context");
    const int64_t rk = rot_size(m->head_dim), rv = 64;
    m->rot_k = ggml_new_tensor_2d(m->rot_ctx, GGML_TYPE_F32, rk, rk);
    m->rot_v = ggml_new_tensor_2d(m->rot_ctx, GGML_TYPE_F32, rv, rv);
    m->rot_buf = ggml_backend_alloc_ctx_tensors_from_buft(m->rot_ctx, m->buft);
    if (!m->rot_buf) return fail(m, GGSWARM_E_NO_MEMORY, "cannot allocate the rotation matrices");
    const std::vector<float> hk = hadamard(rk), hv = hadamard(rv);
    ggml_backend_tensor_set(m->rot_k, hk.data(), 0, hk.size() * sizeof(float));
    ggml_backend_tensor_set(m->rot_v, hv.data(), 0, hv.size() * sizeof(float));
    return GGSWARM_OK;
}

ggml_type cache_ggml_type(int32_t type) {
    switch (type) {
        case GGSWARM_TYPE_F32: return GGML_TYPE_F32;
        case GGSWARM_TYPE_F16: return GGML_TYPE_F16;
        case GGSWARM_TYPE_Q8_0: return GGML_TYPE_Q8_0;
        case GGSWARM_TYPE_Q4_0: return GGML_TYPE_Q4_0;
        default: return GGML_TYPE_COUNT;
    }
}

}  // namespace

ggswarm_status ggswarm_set_cache_type(ggswarm_model * m, int32_t type) {
    GGSWARM_LOCK(m);
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    const ggml_type t = cache_ggml_type(type);
    if (t == GGML_TYPE_COUNT) return fail(m, GGSWARM_E_INVALID_ARG, "cache type %d is not a GGSWARM_TYPE_*", type);
    if (!(m->archp->cache_types & (1u << t))) {
        std::string kept;
        for (ggml_type k : {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0}) {
            if (m->archp->cache_types & (1u << k)) kept += std::string(kept.empty() ? "" : ", ") + ggml_type_name(k);
        }
        return fail(m, GGSWARM_E_UNSUPPORTED, "%s keeps its caches in %s in this build, not %s", m->arch.c_str(),
                    kept.c_str(), ggml_type_name(t));
    }
    if (!m->sessions.empty()) {
        return fail(m, GGSWARM_E_INVALID_ARG, "the cache type changes only while no session is open (%zu are)",
                    m->sessions.size());
    }
    // llama.cpp's checks for a quantized cache: whole blocks per head (K and V)
    if (ggml_is_quantized(t) && m->head_dim % ggml_blck_size(t) != 0) {
        return fail(m, GGSWARM_E_UNSUPPORTED, "cache type %s with block size %lld does not divide the head size %d",
                    ggml_type_name(t), (long long)ggml_blck_size(t), m->head_dim);
    }
    if (ggml_is_quantized(t) && m->archp->check_cache_type) {
        if (ggswarm_status st = m->archp->check_cache_type(m, t)) return st;
    }
    const ggml_type before = m->cache_type;
    m->cache_type = t;
    if (ggml_is_quantized(t)) {  // and whole blocks per row of every state tensor in that type
        Session probe;
        ggswarm_status st = plan_state(m, kKvPad, probe);
        for (size_t i = 0; !st && i < probe.state.size(); ++i) {
            for (const ggml_tensor * x : probe.state[i]) {
                if (x->type == t && x->ne[0] % ggml_blck_size(t) != 0) {
                    st = fail(m, GGSWARM_E_UNSUPPORTED, "cache type %s with block size %lld does not divide the %lld-wide rows of layer %d",
                              ggml_type_name(t), (long long)ggml_blck_size(t), (long long)x->ne[0], m->layer_start + (int32_t)i);
                    break;
                }
            }
        }
        probe.release();
        if (st) {
            m->cache_type = before;
            return st;
        }
    }
    if (ggswarm_status st = make_rotations(m)) {
        m->cache_type = before;
        make_rotations(m);
        return st;
    }
    // a quantized V needs flash attention in llama.cpp (llama_init_from_model turns it on, or refuses)
    m->decode_kernels = ggml_is_quantized(t) ? -2 : m->chosen_attention;
    m->graphs.clear();  // built for the former state types and attention mode
    m->graph = nullptr;
    return ok(m);
}

ggswarm_status ggswarm_set_flash_attention(ggswarm_model * m, int32_t on) {
    GGSWARM_LOCK(m);
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    if (on != 0 && on != 1) return fail(m, GGSWARM_E_INVALID_ARG, "flash attention is 1 (on) or 0 (off), not %d", on);
    if (!m->sessions.empty()) {
        return fail(m, GGSWARM_E_INVALID_ARG, "the attention mode changes only while no session is open (%zu are)",
                    m->sessions.size());
    }
    if (!on && ggml_is_quantized(m->cache_type)) {
        return fail(m, GGSWARM_E_INVALID_ARG, "a quantized V cache (%s) requires flash attention, as in llama.cpp",
                    ggml_type_name(m->cache_type));
    }
    if (on) m->decode_kernels = -2;
    else choose_non_flash(m, m->model_id.c_str());
    m->chosen_attention = m->decode_kernels;
    m->graphs.clear();  // built for the former attention mode (mask type, V layout)
    m->graph = nullptr;
    return ok(m);
}

ggswarm_status ggswarm_kv_bytes(const ggswarm_model * m, int64_t sid, uint64_t * out_bytes) {
    if (!m || !out_bytes) return fail(m, GGSWARM_E_INVALID_ARG, "model or out_bytes is NULL");
    if (sid < 0) {
        uint64_t t = 0;
        for (const auto & kv : m->sessions) t += kv.second.bytes + checkpoint_bytes(kv.second);
        *out_bytes = t;
        return ok(m);
    }
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    *out_bytes = s->bytes + checkpoint_bytes(*s);
    return ok(m);
}

ggswarm_status ggswarm_session_growth_bytes(const ggswarm_model * m, int64_t sid, int32_t n_positions,
                                            uint64_t * out_bytes) {
    if (!m || !out_bytes) return fail(m, GGSWARM_E_INVALID_ARG, "model or out_bytes is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    if (n_positions <= 0 || n_positions > s->capacity) {
        return fail(m, GGSWARM_E_RANGE, "n_positions %d is outside 1..%d (the session cap)", n_positions,
                    s->capacity);
    }
    if (n_positions <= s->cap) {
        *out_bytes = 0;
        return ok(m);
    }
    Session n;
    ggswarm_status st = plan_state(m, min_capacity(*s, n_positions), n);
    if (st) return st;
    *out_bytes = n.bytes - s->bytes;
    n.release();
    return ok(m);
}

ggswarm_status ggswarm_budget_new(uint64_t total_bytes, ggswarm_budget ** out) {
    if (!out) return fail(nullptr, GGSWARM_E_INVALID_ARG, "out is NULL");
    *out = new (std::nothrow) ggswarm_budget();
    if (!*out) return fail(nullptr, GGSWARM_E_NO_MEMORY, "out of memory");
    (*out)->total = total_bytes;
    return GGSWARM_OK;
}

void ggswarm_budget_free(ggswarm_budget * budget) { budget_release(budget); }

ggswarm_status ggswarm_budget_get(const ggswarm_budget * budget, uint64_t * out_total, uint64_t * out_used) {
    if (!budget) return fail(nullptr, GGSWARM_E_INVALID_ARG, "budget is NULL");
    uint64_t total = 0, used = 0;
    budget_usage(budget, &total, &used);
    if (out_total) *out_total = total;
    if (out_used) *out_used = used;
    return GGSWARM_OK;
}

}  // extern "C"
