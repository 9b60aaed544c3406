// libggswarm sessions: the node's KV budget, per-session state buffers (growth within the budget,
// truncate; per layer as its state kind says, arch.h StateOps), the KV state kind, and the snapshot
// format (docs/native.md, "KV cache" and "Snapshot format").

#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include "arch.h"
#include "recurrent.h"

namespace ggswarm {
namespace {

constexpr char kSnapMagic[8] = {'G', 'G', 'S', 'W', 'K', 'V', 'S', 'N'};
constexpr uint32_t kSnapVersion = 2;  // 2: the window's state kinds (recurrent layers' state in the payload)

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
    int32_t kv_type;  // ggml_type of the attention caches (ggswarm_model::cache_type)
    int32_t n_pos;
    int32_t reserved;
    uint64_t payload_bytes;
    uint64_t payload_fnv1a;
    int32_t n_kv_layers;         // layers of the window per state kind (v2)
    int32_t n_recurrent_layers;
    uint64_t state_kinds_fnv1a;  // FNV-1a 64 of the window's per-layer StateKind values (int32 each)
};
static_assert(sizeof(SnapHeader) == 184, "snapshot header layout changed: bump kSnapVersion");

// The window's state kinds as a snapshot records them: a count per kind and a hash of the sequence.
void state_kinds(const ggswarm_model * m, int32_t * n_kv, int32_t * n_rec, uint64_t * hash) {
    *n_kv = *n_rec = 0;
    std::vector<int32_t> kinds;
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        kinds.push_back((int32_t)m->lhp[il].state);
        if (m->lhp[il].state == StateKind::KV) ++*n_kv;
        if (m->lhp[il].state == StateKind::Recurrent) ++*n_rec;
    }
    *hash = fnv1a(reinterpret_cast<const uint8_t *>(kinds.data()), kinds.size() * sizeof(int32_t));
}

}  // namespace

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

// Snapshot payload bytes of the window's state at len positions.
uint64_t payload_bytes(const ggswarm_model * m, int32_t len) {
    uint64_t b = 0;
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) b += state_ops(m->lhp[il].state)->snapshot_bytes(m, il, len);
    return b;
}

// --- the KV state kind: K [d_kv, rows] and V^T [rows, d_kv] in the cache type (V [d_kv, rows] in flash mode,
// always so for a quantized cache), rows the allocation (Session::cap), or a sliding-window layer's ring (swa_rows: position
// p in slot p % rows) -------------------------------------------------------------------------------------

int64_t kv_rows(const ggswarm_model * m, int32_t il, int64_t cap) { return swa_ring(m, il) ? swa_rows(m, cap) : cap; }

void kv_plan(const ggswarm_model * m, int32_t il, int64_t cap, ggml_context * ctx, std::vector<ggml_tensor *> & out) {
    const int64_t rows = kv_rows(m, il, cap);
    out.push_back(ggml_new_tensor_2d(ctx, m->cache_type, m->d_kv(), rows));
    out.push_back(m->flash() ? ggml_new_tensor_2d(ctx, m->cache_type, m->d_kv(), rows)
                             : ggml_new_tensor_2d(ctx, m->cache_type, rows, m->d_kv()));
}

uint64_t kv_per_token(const ggswarm_model * m, int32_t il) { return 2ULL * ggml_row_size(m->cache_type, m->d_kv()); }

// The positions [from, len) a layer's cache holds for its next position: all, or a ring's window.
int64_t kv_from(const ggswarm_model * m, int32_t il, int32_t len) {
    return swa_ring(m, il) ? std::max<int64_t>(0, (int64_t)len - m->n_swa) : 0;
}

// Copy positions [from, len) of a cache of `rows` slots between K/V tensors t and a host buffer p, K rows
// then V, in position order; up to 2 runs per slot wrap. V is transposed in the payload (per channel, the
// positions in order) whatever the attention mode, so f16 snapshots move between modes; a quantized V
// stays in rows (its blocks run along the channels).
void kv_io(const ggswarm_model * m, const std::vector<ggml_tensor *> & t, int64_t from, int64_t len, uint8_t * p,
           bool save) {
    const int64_t rows = t[0]->ne[1], dkv = m->d_kv();
    const size_t krow = ggml_row_size(t[0]->type, dkv), h = ggml_type_size(t[1]->type);
    auto runs = [&](auto && fn) {
        for (int64_t q = from; q < len;) {
            const int64_t slot = q % rows, run = std::min<int64_t>(len - q, rows - slot);
            fn(slot, run);
            q += run;
        }
    };
    auto io = [&](ggml_tensor * x, size_t off, size_t n) {
        if (save) ggml_backend_tensor_get(x, p, off, n);
        else ggml_backend_tensor_set(x, p, off, n);
        p += n;
    };
    runs([&](int64_t slot, int64_t run) { io(t[0], (size_t)slot * krow, (size_t)run * krow); });
    if (ggml_is_quantized(t[1]->type)) {
        runs([&](int64_t slot, int64_t run) { io(t[1], (size_t)slot * krow, (size_t)run * krow); });
        return;
    }
    if (m->flash()) {
        std::vector<uint8_t> rowsv((size_t)(len - from) * krow);
        auto transpose = [&](const uint8_t * in, uint8_t * out, bool to_channels) {
            for (int64_t r = 0; r < dkv; ++r) {
                for (int64_t j = 0; j < len - from; ++j) {
                    const size_t pos_major = (size_t)(j * dkv + r) * h, ch_major = (size_t)(r * (len - from) + j) * h;
                    memcpy(out + (to_channels ? ch_major : pos_major), in + (to_channels ? pos_major : ch_major), h);
                }
            }
        };
        size_t o = 0;
        if (save) {
            runs([&](int64_t slot, int64_t run) {
                ggml_backend_tensor_get(t[1], rowsv.data() + o, (size_t)slot * krow, (size_t)run * krow);
                o += (size_t)run * krow;
            });
            transpose(rowsv.data(), p, true);
        } else {
            transpose(p, rowsv.data(), false);
            runs([&](int64_t slot, int64_t run) {
                ggml_backend_tensor_set(t[1], rowsv.data() + o, (size_t)slot * krow, (size_t)run * krow);
                o += (size_t)run * krow;
            });
        }
        p += (size_t)(len - from) * krow;
        return;
    }
    for (int64_t r = 0; r < dkv; ++r) {
        runs([&](int64_t slot, int64_t run) { io(t[1], (size_t)r * t[1]->nb[1] + (size_t)slot * h, (size_t)run * h); });
    }
}

void kv_carry(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & from,
              const std::vector<ggml_tensor *> & to, int32_t len) {
    if (from[0]->ne[1] == to[0]->ne[1]) {  // a ring that keeps its size: whole
        for (size_t i = 0; i < 2; ++i) {
            std::vector<uint8_t> tmp(ggml_nbytes(from[i]));
            ggml_backend_tensor_get(from[i], tmp.data(), 0, tmp.size());
            ggml_backend_tensor_set(to[i], tmp.data(), 0, tmp.size());
        }
        return;
    }
    // growth: the first len positions (a ring smaller than its full size never wrapped)
    std::vector<uint8_t> tmp((size_t)len * kv_per_token(m, il));
    kv_io(m, from, 0, len, tmp.data(), true);
    kv_io(m, to, 0, len, tmp.data(), false);
}

// A snapshot holds what the next position reads: every position, or a ring's window.
uint64_t kv_snapshot_bytes(const ggswarm_model * m, int32_t il, int32_t len) {
    return (uint64_t)(len - kv_from(m, il, len)) * kv_per_token(m, il);
}

void kv_save(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p) {
    kv_io(m, t, kv_from(m, il, len), len, p, true);
}

void kv_load(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len,
             const uint8_t * p) {
    kv_io(m, t, kv_from(m, il, len), len, const_cast<uint8_t *>(p), false);
}

// A ring goes back by itself while it still holds the target's window; further back the session goes
// to 0 (these windows keep no checkpoints: llama.cpp's SWA cache cannot go back either).
bool kv_rewinds_to(const ggswarm_model * m, int32_t il, const Session & s, int32_t target) {
    if (!swa_ring(m, il) || target == s.len) return true;
    return kv_from(m, il, target) >= std::max<int64_t>(s.ring_lo, (int64_t)s.len - kv_rows(m, il, s.cap));
}

const StateOps kKvState = {StateKind::KV, "kv",     2,       kv_plan, kv_carry, kv_per_token, kv_snapshot_bytes,
                           kv_save,        kv_load, nullptr, nullptr, kv_rewinds_to};
StateRegistration reg_kv(&kKvState);

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
            uint64_t total = 0, used = 0;
            budget_usage(m->budget, &total, &used);
            const uint64_t more = n.bytes - s.bytes;
            n.release();
            return fail(m, GGSWARM_E_BUDGET,
                        "KV budget exhausted: %d positions need %llu more bytes; %llu of the node's %llu bytes are in use",
                        need, (unsigned long long)more, (unsigned long long)used, (unsigned long long)total);
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

ggswarm_status ggswarm_session_snapshot_size(const ggswarm_model * m, int64_t sid, uint64_t * out_size) {
    if (!m || !out_size) return fail(m, GGSWARM_E_INVALID_ARG, "model or out_size is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    *out_size = sizeof(SnapHeader) + payload_bytes(m, s->len);
    return ok(m);
}

ggswarm_status ggswarm_session_snapshot(const ggswarm_model * m, int64_t sid, void * buf, uint64_t buf_size,
                                        uint64_t * out_written) {
    GGSWARM_LOCK(m);
    if (!m || !buf) return fail(m, GGSWARM_E_INVALID_ARG, "model or buf is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    const uint64_t payload = payload_bytes(m, s->len);
    const uint64_t total = sizeof(SnapHeader) + payload;
    if (buf_size < total) {
        return fail(m, GGSWARM_E_INVALID_ARG, "snapshot needs %llu bytes, buffer holds %llu",
                    (unsigned long long)total, (unsigned long long)buf_size);
    }
    SnapHeader h;
    memset(&h, 0, sizeof(h));
    memcpy(h.magic, kSnapMagic, sizeof(h.magic));
    h.format_version = kSnapVersion;
    h.header_size = sizeof(SnapHeader);
    state_kinds(m, &h.n_kv_layers, &h.n_recurrent_layers, &h.state_kinds_fnv1a);
    snprintf(h.model_id, sizeof(h.model_id), "%s", m->model_id.c_str());
    snprintf(h.architecture, sizeof(h.architecture), "%s", m->arch.c_str());
    h.layer_start = m->layer_start;
    h.layer_end = m->layer_end;
    h.n_layers_total = m->n_layers_total;
    h.n_head_kv = m->n_head_kv;
    h.head_dim = m->head_dim;
    h.kv_type = m->cache_type;
    h.n_pos = s->len;
    h.payload_bytes = payload;
    uint8_t * p = static_cast<uint8_t *>(buf) + sizeof(SnapHeader);
    if (s->len > 0) {
        for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
            const StateOps * ops = state_ops(m->lhp[il].state);
            ops->save(m, il, s->state[(size_t)(il - m->layer_start)], s->len, p);
            p += ops->snapshot_bytes(m, il, s->len);
        }
    }
    h.payload_fnv1a = fnv1a(static_cast<uint8_t *>(buf) + sizeof(SnapHeader), payload);
    memcpy(buf, &h, sizeof(h));
    if (out_written) *out_written = total;
    return ok(m);
}

ggswarm_status ggswarm_session_restore(ggswarm_model * m, int64_t sid, const void * buf, uint64_t size) {
    GGSWARM_LOCK(m);
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
    {
        int32_t n_kv = 0, n_rec = 0;
        uint64_t kinds = 0;
        state_kinds(m, &n_kv, &n_rec, &kinds);
        if (h.n_kv_layers != n_kv || h.n_recurrent_layers != n_rec || h.state_kinds_fnv1a != kinds) {
            return fail(m, GGSWARM_E_MISMATCH,
                        "snapshot state kinds (%d KV, %d recurrent layers) do not match this window's (%d KV, %d "
                        "recurrent)",
                        h.n_kv_layers, h.n_recurrent_layers, n_kv, n_rec);
        }
    }
    if (h.n_head_kv != m->n_head_kv || h.head_dim != m->head_dim || h.kv_type != m->cache_type) {
        return fail(m, GGSWARM_E_MISMATCH, "snapshot KV shape (%d heads x %d, type %d) does not match (%d x %d, %s)",
                    h.n_head_kv, h.head_dim, h.kv_type, m->n_head_kv, m->head_dim, ggml_type_name(m->cache_type));
    }
    if (h.n_pos < 0 || h.n_pos > sp->capacity) {
        return fail(m, GGSWARM_E_RANGE, "snapshot holds %d positions; the session cap is %d", h.n_pos, sp->capacity);
    }
    const uint64_t payload = payload_bytes(m, h.n_pos);
    if (h.payload_bytes != payload || size != sizeof(SnapHeader) + payload) {
        return fail(m, GGSWARM_E_FORMAT, "snapshot is truncated or padded: %llu bytes, expected %llu",
                    (unsigned long long)size, (unsigned long long)(sizeof(SnapHeader) + payload));
    }
    const uint8_t * p = static_cast<const uint8_t *>(buf) + sizeof(SnapHeader);
    if (fnv1a(p, payload) != h.payload_fnv1a) return fail(m, GGSWARM_E_FORMAT, "snapshot payload checksum mismatch (corrupt)");
    Session & s = *sp;
    ggswarm_status st = ensure_capacity(m, s, std::max(h.n_pos, 1));
    if (st) return st;
    if (h.n_pos > 0) {
        for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
            const StateOps * ops = state_ops(m->lhp[il].state);
            ops->load(m, il, s.state[(size_t)(il - m->layer_start)], h.n_pos, p);
            p += ops->snapshot_bytes(m, il, h.n_pos);
        }
    }
    drop_checkpoints(m, s);
    s.len = h.n_pos;
    s.ring_lo = h.n_pos;  // rings hold what n_pos needs (the snapshot's), older slots nothing
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
