// libggswarm recurrent state: the Recurrent state kind (a delta-net layer's conv state and f32
// recurrent state), checkpoints of it, the truncate that rewinds to a checkpoint, and the checkpoint
// settings (docs/native.md, "Recurrent state, checkpoints and MoE").

#include "recurrent.h"

#include <algorithm>
#include <cstring>

#include "arch.h"
#include "archs/qwen35.h"

namespace ggswarm {
namespace {

// --- the state kind: per layer a conv state [(d_conv - 1) * channels] and a recurrent state
// [d_state * d_state * n_v_heads], both f32 and zero for an empty history -------------------------------

void rec_plan(const ggswarm_model * m, int32_t il, int64_t cap, ggml_context * ctx, std::vector<ggml_tensor *> & out) {
    const Hybrid & h = *hybrid_of(m);
    out.push_back(ggml_new_tensor_1d(ctx, GGML_TYPE_F32, h.conv_elems()));
    out.push_back(ggml_new_tensor_1d(ctx, GGML_TYPE_F32, h.ssm_elems()));
}

void copy_tensor(const ggml_tensor * from, ggml_tensor * to) {
    std::vector<uint8_t> tmp(ggml_nbytes(from));
    ggml_backend_tensor_get(from, tmp.data(), 0, tmp.size());
    ggml_backend_tensor_set(to, tmp.data(), 0, tmp.size());
}

void rec_carry(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & from,
               const std::vector<ggml_tensor *> & to, int32_t len) {
    copy_tensor(from[0], to[0]);
    copy_tensor(from[1], to[1]);
}

uint64_t rec_per_token(const ggswarm_model * m, int32_t il) { return 0; }

// An empty session's snapshot carries no state (it restores to zeros); otherwise the whole state.
uint64_t rec_snapshot_bytes(const ggswarm_model * m, int32_t il, int32_t len) {
    return len > 0 ? hybrid_of(m)->layer_state_bytes() : 0;
}

void rec_save(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p) {
    ggml_backend_tensor_get(t[0], p, 0, ggml_nbytes(t[0]));
    ggml_backend_tensor_get(t[1], p + ggml_nbytes(t[0]), 0, ggml_nbytes(t[1]));
}

void rec_load(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len,
              const uint8_t * p) {
    ggml_backend_tensor_set(t[0], p, 0, ggml_nbytes(t[0]));
    ggml_backend_tensor_set(t[1], p + ggml_nbytes(t[0]), 0, ggml_nbytes(t[1]));
}

uint64_t rec_ckpt_bytes(const ggswarm_model * m, int32_t il, int32_t len) { return hybrid_of(m)->layer_state_bytes(); }

void rec_ckpt_io(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p,
                 bool save) {
    if (save) rec_save(m, il, t, len, p);
    else rec_load(m, il, t, len, p);
}

// a recurrent state is the state at s.len and nowhere else
bool rec_rewinds_to(const ggswarm_model * m, int32_t il, const Session & s, int32_t target) { return target == s.len; }

const StateOps kRecurrentState = {StateKind::Recurrent, "recurrent", 2, rec_plan, rec_carry, rec_per_token,
                                  rec_snapshot_bytes, rec_save, rec_load, rec_ckpt_bytes, rec_ckpt_io,
                                  rec_rewinds_to};
StateRegistration reg_recurrent(&kRecurrentState);

// --- checkpoints ------------------------------------------------------------------------------------------

// Bytes of a checkpoint of the window's fixed-size state at len positions.
uint64_t window_state_bytes(const ggswarm_model * m, int32_t len) {
    uint64_t b = 0;
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const StateOps * ops = state_ops(m->lhp[il].state);
        if (ops->ckpt_io) b += ops->ckpt_bytes(m, il, len);
    }
    return b;
}

// Copy the window's fixed-size state at len positions to p (save) or from p (load).
void states_io(const ggswarm_model * m, Session & s, int32_t len, uint8_t * p, bool save) {
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        const StateOps * ops = state_ops(m->lhp[il].state);
        if (!ops->ckpt_io) continue;
        ops->ckpt_io(m, il, s.state[(size_t)(il - m->layer_start)], len, p, save);
        p += ops->ckpt_bytes(m, il, len);
    }
}

void drop_at(ggswarm_model * m, Checkpoints & c, size_t i) {
    const uint64_t b = c.list[i].data.size();
    budget_credit(m->budget, b);
    c.bytes -= b;
    c.list.erase(c.list.begin() + (ptrdiff_t)i);
}

// Zero the window's recurrent states (the state of an empty history).
void reset_states(const ggswarm_model * m, Session & s) {
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        if (m->lhp[il].state != StateKind::Recurrent || s.state.empty()) continue;
        for (ggml_tensor * t : s.state[(size_t)(il - m->layer_start)]) {
            std::vector<uint8_t> zero(ggml_nbytes(t), 0);
            ggml_backend_tensor_set(t, zero.data(), 0, zero.size());
        }
    }
}

}  // namespace

bool has_fixed_state(const ggswarm_model * m) {
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) {
        if (state_ops(m->lhp[il].state)->ckpt_io) return true;
    }
    return false;
}

uint64_t checkpoint_bytes(const Session & s) { return s.ckpts ? s.ckpts->bytes : 0; }

void drop_checkpoints(ggswarm_model * m, Session & s) {
    if (!s.ckpts) return;
    budget_credit(m->budget, s.ckpts->bytes);
    s.ckpts.reset();
}

void take_checkpoint(ggswarm_model * m, Session & s, bool pinned) {
    if (m->ckpt_max <= 0 || !has_fixed_state(m) || s.state.empty() || s.len <= 0) return;
    if (!s.ckpts) s.ckpts = std::make_shared<Checkpoints>();
    Checkpoints & c = *s.ckpts;
    while (!c.list.empty() && c.list.back().pos > s.len) drop_at(m, c, c.list.size() - 1);
    // the oldest of a kind, or -1; how many of a kind
    const auto oldest = [&c](bool kind) -> ptrdiff_t {
        for (size_t i = 0; i < c.list.size(); ++i) {
            if (c.list[i].pinned == kind) return (ptrdiff_t)i;
        }
        return -1;
    };
    const auto count = [&c](bool kind) {
        int32_t n = 0;
        for (const Checkpoint & k : c.list) n += k.pinned == kind ? 1 : 0;
        return n;
    };
    const int32_t most = pinned ? kPinnedMax : m->ckpt_max;
    if (!c.list.empty() && c.list.back().pos == s.len) {
        Checkpoint & here = c.list.back();
        if (here.pinned && !pinned) {  // a turn's checkpoint where a verification began: it stays, counted
            here.pinned = false;
            while (count(false) > most) drop_at(m, c, (size_t)oldest(false));
        }
        return;
    }
    const uint64_t need = window_state_bytes(m, s.len);
    while (count(pinned) >= most) drop_at(m, c, (size_t)oldest(pinned));
    while (!budget_charge(m->budget, need)) {
        const ptrdiff_t i = oldest(pinned);
        if (i < 0) return;  // no room: this position has no checkpoint
        drop_at(m, c, (size_t)i);
    }
    Checkpoint k;
    k.pos = s.len;
    k.pinned = pinned;
    k.taken = ++m->ckpt_clock;
    k.data.resize(need);
    states_io(m, s, s.len, k.data.data(), true);
    c.list.push_back(std::move(k));
    c.bytes += need;
}

int32_t checkpoint_chunk(const ggswarm_model * m, int32_t pos, int32_t nc) {
    if (m->ckpt_every <= 0 || !has_fixed_state(m)) return nc;
    const int32_t next = (pos / m->ckpt_every + 1) * m->ckpt_every;
    return std::min(nc, next - pos);
}

void checkpoint_after_chunk(ggswarm_model * m, Session & s) {
    if (m->ckpt_every > 0 && s.len % m->ckpt_every == 0) take_checkpoint(m, s);
}

uint64_t reclaimable_checkpoint_bytes(const ggswarm_model * m) {
    uint64_t b = 0;
    for (const auto & kv : m->sessions) {
        if (!kv.second.ckpts) continue;
        for (const Checkpoint & k : kv.second.ckpts->list) b += k.pinned ? 0 : k.data.size();
    }
    return b;
}

uint64_t reclaim_checkpoints(ggswarm_model * m, uint64_t want) {
    uint64_t freed = 0;
    while (freed < want) {
        Checkpoints * from = nullptr;
        size_t at = 0;
        for (auto & kv : m->sessions) {
            Checkpoints * c = kv.second.ckpts.get();
            if (!c) continue;
            for (size_t i = 0; i < c->list.size(); ++i) {
                const Checkpoint & k = c->list[i];
                if (!k.pinned && (!from || k.taken < from->list[at].taken)) {
                    from = c;
                    at = i;
                }
            }
        }
        if (!from) break;
        freed += from->list[at].data.size();
        drop_at(m, *from, at);
    }
    return freed;
}

void rewind(ggswarm_model * m, Session & s, int32_t target, int32_t * kind) {
    *kind = kTruncExact;
    bool live = true;  // the live state can go back to target by itself
    for (int32_t il = m->layer_start; il < m->layer_end && live; ++il) {
        const StateOps * ops = state_ops(m->lhp[il].state);
        live = !ops->rewinds_to || ops->rewinds_to(m, il, s, target);
    }
    if (live) {
        s.len = target;
        s.ring_lo = std::min(s.ring_lo, target);
        return;
    }
    *kind = kTruncCheckpoint;
    Checkpoints * c = s.ckpts.get();
    while (c && !c->list.empty() && c->list.back().pos > target) drop_at(m, *c, c->list.size() - 1);
    if (c && !c->list.empty()) {
        s.len = c->list.back().pos;
        states_io(m, s, s.len, c->list.back().data.data(), false);
        s.ring_lo = s.len;  // the checkpoint brought back what s.len needs; older ring slots are stale
        return;
    }
    reset_states(m, s);
    s.len = 0;
    s.ring_lo = 0;
    *kind = target > 0 ? kTruncFromZero : kTruncExact;
}

}  // namespace ggswarm

using namespace ggswarm;

extern "C" {

ggswarm_status ggswarm_session_truncate_to(ggswarm_model * m, int64_t sid, int32_t n_tokens, int32_t * out_len,
                                           int32_t * out_kind) {
    GGSWARM_LOCK(m);
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    if (n_tokens < 0 || n_tokens > s->len) {
        return fail(m, GGSWARM_E_RANGE, "cannot truncate to %d positions: the session holds %d", n_tokens, s->len);
    }
    int32_t kind = kTruncExact;
    rewind(m, *s, n_tokens, &kind);
    if (out_len) *out_len = s->len;
    if (out_kind) *out_kind = kind;
    return ok(m);
}

ggswarm_status ggswarm_session_checkpoint(ggswarm_model * m, int64_t sid, int32_t * out_taken) {
    GGSWARM_LOCK(m);
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    const bool had = s->ckpts && !s->ckpts->list.empty() && s->ckpts->list.back().pos == s->len;
    take_checkpoint(m, *s, true);
    const bool has = s->ckpts && !s->ckpts->list.empty() && s->ckpts->list.back().pos == s->len;
    if (out_taken) *out_taken = (!had && has) ? 1 : 0;
    return ok(m);
}

ggswarm_status ggswarm_session_drop_checkpoint(ggswarm_model * m, int64_t sid, int32_t pos) {
    GGSWARM_LOCK(m);
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    if (!s->ckpts) return ok(m);
    Checkpoints & c = *s->ckpts;
    for (size_t i = 0; i < c.list.size(); ++i) {
        if (c.list[i].pos == pos && c.list[i].pinned) {  // only what ggswarm_session_checkpoint took
            drop_at(m, c, i);
            break;
        }
    }
    return ok(m);
}

ggswarm_status ggswarm_set_checkpoints(ggswarm_model * m, int32_t every_n_tokens, int32_t max_per_session) {
    GGSWARM_LOCK(m);
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    if (every_n_tokens < 0 || max_per_session < 0 || max_per_session > 1024) {
        return fail(m, GGSWARM_E_INVALID_ARG, "checkpoint interval %d or count %d is out of range (>= 0; count <= 1024)",
                    every_n_tokens, max_per_session);
    }
    m->ckpt_every = every_n_tokens;
    m->ckpt_max = max_per_session;
    for (auto & kv : m->sessions) {
        Checkpoints * c = kv.second.ckpts.get();
        if (!c) continue;
        // the oldest automatic ones beyond the new maximum go; with 0, every checkpoint (pinned ones too)
        int32_t automatic = 0;
        for (const Checkpoint & k : c->list) automatic += k.pinned ? 0 : 1;
        for (size_t i = 0; i < c->list.size();) {
            const bool pinned = c->list[i].pinned;
            if (max_per_session == 0 || (!pinned && automatic > max_per_session)) {
                automatic -= pinned ? 0 : 1;
                drop_at(m, *c, i);
            } else {
                ++i;
            }
        }
    }
    return ok(m);
}

ggswarm_status ggswarm_checkpoints_reclaimable(ggswarm_model * m, uint64_t * out_bytes) {
    GGSWARM_LOCK(m);
    if (!m || !out_bytes) return fail(m, GGSWARM_E_INVALID_ARG, "model or out_bytes is NULL");
    *out_bytes = reclaimable_checkpoint_bytes(m);
    return ok(m);
}

ggswarm_status ggswarm_reclaim_checkpoints(ggswarm_model * m, uint64_t want_bytes, uint64_t * out_freed) {
    GGSWARM_LOCK(m);
    if (!m) return fail(nullptr, GGSWARM_E_INVALID_ARG, "model is NULL");
    const uint64_t freed = reclaim_checkpoints(m, want_bytes);
    if (out_freed) *out_freed = freed;
    return ok(m);
}

ggswarm_status ggswarm_session_checkpoints(const ggswarm_model * m, int64_t sid, int32_t * positions,
                                           int32_t capacity, int32_t * out_count) {
    if (!m || !out_count) return fail(m, GGSWARM_E_INVALID_ARG, "model or out_count is NULL");
    if (capacity < 0 || (capacity > 0 && !positions)) return fail(m, GGSWARM_E_INVALID_ARG, "positions buffer invalid");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    const int32_t n = s->ckpts ? (int32_t)s->ckpts->list.size() : 0;
    *out_count = n;
    for (int32_t i = 0; i < std::min(n, capacity); ++i) positions[i] = s->ckpts->list[(size_t)i].pos;
    return ok(m);
}

}  // extern "C"
