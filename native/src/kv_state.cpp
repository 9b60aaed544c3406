// libggswarm's KV state kind (StateKind::KV, arch.h StateOps): attention layers' K and V caches, whole or a
// sliding-window ring, as sessions plan, grow, snapshot and rewind them.

#include <algorithm>
#include <cstring>
#include <vector>

#include "arch.h"

namespace ggswarm {
namespace {

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
    return kv_from(m, il, target) >= std::max<int64_t>(kv_from(m, il, s.ring_lo), (int64_t)s.len - kv_rows(m, il, s.cap));
}

const StateOps kKvState = {StateKind::KV, "kv",     2,       kv_plan, kv_carry, kv_per_token, kv_snapshot_bytes,
                           kv_save,        kv_load, nullptr, nullptr, kv_rewinds_to};
StateRegistration reg_kv(&kKvState);

}  // namespace
}  // namespace ggswarm
