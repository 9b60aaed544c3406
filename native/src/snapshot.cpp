// libggswarm's session snapshots: the format (SnapHeader, the window's state kinds, a checksummed payload per
// layer as its state kind writes it; docs/native.md, "Snapshot format"), taking one and restoring one.

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "arch.h"
#include "recurrent.h"

namespace ggswarm {
namespace {

constexpr char kSnapMagic[8] = {'G', 'G', 'S', 'W', 'K', 'V', 'S', 'N'};
constexpr uint32_t kSnapVersion = 3;  // 2: the window's state kinds (recurrent layers' state in the payload);
                                      // 3: an attached nextn block's state after the payload
constexpr uint32_t kSnapV2HeaderSize = 184;  // version 2's header: restored still (no nextn trailer)

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
    uint64_t mtp_bytes;          // the nextn trailer after the payload (v3; 0: none)
    uint64_t mtp_fnv1a;          // FNV-1a 64 of the trailer
};
static_assert(sizeof(SnapHeader) == 200, "snapshot header layout changed: bump kSnapVersion");

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

// Snapshot payload bytes of the window's state at len positions.
uint64_t payload_bytes(const ggswarm_model * m, int32_t len) {
    uint64_t b = 0;
    for (int32_t il = m->layer_start; il < m->layer_end; ++il) b += state_ops(m->lhp[il].state)->snapshot_bytes(m, il, len);
    return b;
}

}  // namespace
}  // namespace ggswarm

using namespace ggswarm;

extern "C" {

ggswarm_status ggswarm_session_snapshot_size(const ggswarm_model * m, int64_t sid, uint64_t * out_size) {
    if (!m || !out_size) return fail(m, GGSWARM_E_INVALID_ARG, "model or out_size is NULL");
    // lock-free like the other reads, unless a nextn block's trailer is counted (its block is cut to
    // the trunk's length first, as the snapshot then finds it)
    std::unique_lock<std::recursive_mutex> lk;
    if (m->mtp) lk = std::unique_lock<std::recursive_mutex>(m->mu);
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    *out_size = sizeof(SnapHeader) + payload_bytes(m, s->len) + mtp_snapshot_bytes(m, sid, s->len);
    return ok(m);
}

ggswarm_status ggswarm_session_snapshot(const ggswarm_model * m, int64_t sid, void * buf, uint64_t buf_size,
                                        uint64_t * out_written) {
    GGSWARM_LOCK(m);
    if (!m || !buf) return fail(m, GGSWARM_E_INVALID_ARG, "model or buf is NULL");
    Session * s = find_session(m, sid);
    if (!s) return no_session(m, sid);
    const uint64_t payload = payload_bytes(m, s->len);
    const uint64_t trailer = mtp_snapshot_bytes(m, sid, s->len);
    const uint64_t total = sizeof(SnapHeader) + payload + trailer;
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
    if (trailer > 0) {
        if (!mtp_snapshot_write(m, sid, s->len, p, trailer)) {
            return fail(m, GGSWARM_E_COMPUTE, "cannot write the nextn block's state: %s", ggswarm_last_error());
        }
        h.mtp_bytes = trailer;
        h.mtp_fnv1a = fnv1a(p, trailer);
    }
    memcpy(buf, &h, sizeof(h));
    if (out_written) *out_written = total;
    return ok(m);
}

ggswarm_status ggswarm_session_restore(ggswarm_model * m, int64_t sid, const void * buf, uint64_t size) {
    GGSWARM_LOCK(m);
    if (!m || !buf) return fail(m, GGSWARM_E_INVALID_ARG, "model or buf is NULL");
    Session * sp = find_session(m, sid);
    if (!sp) return no_session(m, sid);
    if (size < kSnapV2HeaderSize) {
        return fail(m, GGSWARM_E_FORMAT, "snapshot is %llu bytes, shorter than its header",
                    (unsigned long long)size);
    }
    SnapHeader h;
    memset(&h, 0, sizeof(h));
    memcpy(&h, buf, kSnapV2HeaderSize);
    if (memcmp(h.magic, kSnapMagic, sizeof(h.magic)) != 0) return fail(m, GGSWARM_E_FORMAT, "not a ggswarm KV snapshot (bad magic)");
    const bool v2 = h.format_version == 2 && h.header_size == kSnapV2HeaderSize;
    if (!v2 && (h.format_version != kSnapVersion || h.header_size != sizeof(SnapHeader))) {
        return fail(m, GGSWARM_E_FORMAT, "snapshot format version %u (header %u bytes) is not supported (want 2 or %u)",
                    h.format_version, h.header_size, kSnapVersion);
    }
    if (!v2) {
        if (size < sizeof(SnapHeader)) return fail(m, GGSWARM_E_FORMAT, "snapshot is %llu bytes, shorter than its header", (unsigned long long)size);
        memcpy(&h, buf, sizeof(h));
    }
    const uint64_t head = h.header_size;
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
    if (h.payload_bytes != payload || h.mtp_bytes > size || size != head + payload + h.mtp_bytes) {
        return fail(m, GGSWARM_E_FORMAT, "snapshot is truncated or padded: %llu bytes, expected %llu",
                    (unsigned long long)size, (unsigned long long)(head + payload + h.mtp_bytes));
    }
    const uint8_t * p = static_cast<const uint8_t *>(buf) + head;
    if (fnv1a(p, payload) != h.payload_fnv1a) return fail(m, GGSWARM_E_FORMAT, "snapshot payload checksum mismatch (corrupt)");
    const uint8_t * trailer = p + payload;
    if (h.mtp_bytes > 0 && fnv1a(trailer, h.mtp_bytes) != h.mtp_fnv1a) {
        return fail(m, GGSWARM_E_FORMAT, "snapshot nextn trailer checksum mismatch (corrupt)");
    }
    if (ggswarm_status st = mtp_check_trailer(m, h.n_pos, trailer, h.mtp_bytes)) return st;
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
    s.ring_lo = h.n_pos;  // rings hold what n_pos reads (the snapshot's rows), older slots nothing
    // an attached nextn block takes the trailer's state (drafting goes on), or starts over without one;
    // one whose own restore fails (its trailer was checked above) only stops drafting: the trunk's stands
    if (mtp_restore(m, sid, h.n_pos, s.capacity, trailer, h.mtp_bytes)) mtp_session_closed(m, sid);
    return ok(m);
}

}  // extern "C"
