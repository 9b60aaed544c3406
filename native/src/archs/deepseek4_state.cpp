// DeepSeek-V4's session state kind (StateKind::Dsv4): the raw K window, the compressed caches and the
// compressors' rows, as sessions plan, grow, snapshot, checkpoint and rewind them.

#include <algorithm>
#include <vector>

#include "archs/deepseek4.h"

namespace ggswarm {
namespace deepseek4 {
namespace {

// --- the state kind --------------------------------------------------------------------------------------
// Per layer, as llama.cpp keeps it (src/llama-kv-cache-dsv4.cpp): the raw K (K = V) in a ring of
// raw_rows() slots, the last positions only (the window attends n_swa of them; the ring also holds a
// micro-batch's new rows); ratio 4 adds compressed K and indexer K, one entry per block of 4 positions,
// and the compressor's and the indexer's kv and score rows ([2 width] each, f32) in rings of 8 slots
// (the block being filled and the one before, which the overlapping windows read); ratio 128 adds
// compressed K per block of 128 and its compressor rows ([width] each, f32) in rings of 128 slots. A
// position's row sits in slot position % slots. Entries are a prefix (a truncate keeps len / ratio of
// them); the rings are not, so going back further than they still hold takes a checkpoint (recurrent.h).

enum class Lay { Raw, Rows, Entries };

struct Part {
    int64_t width;
    ggml_type type;
    int32_t ratio;  // the layer's compression ratio (1 for the raw window)
    Lay lay;
};

// the first position whose compressor row a session of len positions still needs
int64_t rows_from(int32_t r, int64_t len) {
    return r == kCsa ? std::max<int64_t>(0, len / kCsa * kCsa - kCsa) : len / kHca * kHca;
}

std::vector<Part> parts(const ggswarm_model * m, int32_t il) {
    const Dsv4 & h = dsv4(m);
    const int64_t hd = m->head_dim, ix = h.idx_len;
    const ggml_type kCacheType = m->cache_type;  // the node's, like llama.cpp's --cache-type-k (f16 default)
    std::vector<Part> p = {{hd, kCacheType, 1, Lay::Raw}};
    if (h.ratio[il] == kCsa) {
        p.push_back({hd, kCacheType, kCsa, Lay::Entries});
        p.push_back({2 * hd, GGML_TYPE_F32, kCsa, Lay::Rows});
        p.push_back({2 * hd, GGML_TYPE_F32, kCsa, Lay::Rows});
        p.push_back({ix, kCacheType, kCsa, Lay::Entries});
        p.push_back({2 * ix, GGML_TYPE_F32, kCsa, Lay::Rows});
        p.push_back({2 * ix, GGML_TYPE_F32, kCsa, Lay::Rows});
    } else if (h.ratio[il] == kHca) {
        p.push_back({hd, kCacheType, kHca, Lay::Entries});
        p.push_back({hd, GGML_TYPE_F32, kHca, Lay::Rows});
        p.push_back({hd, GGML_TYPE_F32, kHca, Lay::Rows});
    }
    return p;
}

int64_t part_rows(const ggswarm_model * m, const Part & p, int64_t cap) {
    switch (p.lay) {
        case Lay::Raw: return raw_rows(m);
        case Lay::Rows: return ring_rows(p.ratio);
        default: return n_comp(cap, p.ratio);
    }
}

// The positions [from, len) whose rows a ring part holds for a session of len positions.
int64_t ring_from(const ggswarm_model * m, const Part & p, int64_t len) {
    return p.lay == Lay::Raw ? std::max<int64_t>(0, len - m->n_swa) : rows_from(p.ratio, len);
}

size_t row_bytes(const Part & p) { return ggml_row_size(p.type, p.width); }

// Bytes of a part at len positions as a snapshot (and, for rings, a checkpoint) holds it.
size_t part_bytes(const ggswarm_model * m, const Part & p, int32_t len) {
    const int64_t rows = p.lay == Lay::Entries ? len / p.ratio : len - ring_from(m, p, len);
    return (size_t)rows * row_bytes(p);
}

// Copy a ring part's rows of positions [from(len), len), in position order, out to p or in from p.
void ring_io(const ggswarm_model * m, const Part & p, ggml_tensor * t, int32_t len, uint8_t * buf, bool save) {
    const int64_t rows = t->ne[1], rb = (int64_t)row_bytes(p);
    for (int64_t q = ring_from(m, p, len); q < len;) {
        const int64_t slot = q % rows, run = std::min<int64_t>(len - q, rows - slot);  // up to the ring's end
        if (save) ggml_backend_tensor_get(t, buf, (size_t)(slot * rb), (size_t)(run * rb));
        else ggml_backend_tensor_set(t, buf, (size_t)(slot * rb), (size_t)(run * rb));
        buf += run * rb;
        q += run;
    }
}

void st_plan(const ggswarm_model * m, int32_t il, int64_t cap, ggml_context * ctx, std::vector<ggml_tensor *> & out) {
    for (const Part & p : parts(m, il)) out.push_back(ggml_new_tensor_2d(ctx, p.type, p.width, part_rows(m, p, cap)));
}

void st_carry(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & from,
              const std::vector<ggml_tensor *> & to, int32_t len) {
    const std::vector<Part> ps = parts(m, il);
    std::vector<uint8_t> tmp;
    for (size_t i = 0; i < ps.size(); ++i) {  // rings keep their shape: copied whole; entries: the prefix
        tmp.resize(ps[i].lay == Lay::Entries ? part_bytes(m, ps[i], len) : ggml_nbytes(from[i]));
        if (tmp.empty()) continue;
        ggml_backend_tensor_get(from[i], tmp.data(), 0, tmp.size());
        ggml_backend_tensor_set(to[i], tmp.data(), 0, tmp.size());
    }
}

// Only the entries grow with the context; the rings are fixed (ggswarm_model_info.kv_bytes_per_token).
uint64_t st_per_token(const ggswarm_model * m, int32_t il) {
    uint64_t b = 0;
    for (const Part & p : parts(m, il)) {
        if (p.lay == Lay::Entries) b += (row_bytes(p) + p.ratio - 1) / p.ratio;
    }
    return b;
}

uint64_t st_snapshot_bytes(const ggswarm_model * m, int32_t il, int32_t len) {
    uint64_t b = 0;
    for (const Part & p : parts(m, il)) b += part_bytes(m, p, len);
    return b;
}

// A snapshot: per part, the entries' prefix or the rings' rows that position len onwards reads.
void st_io(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p,
           bool save, bool rings_only) {
    const std::vector<Part> ps = parts(m, il);
    for (size_t i = 0; i < ps.size(); ++i) {
        const size_t n = part_bytes(m, ps[i], len);
        if (ps[i].lay != Lay::Entries) ring_io(m, ps[i], t[i], len, p, save);
        else if (rings_only) continue;
        else if (n && save) ggml_backend_tensor_get(t[i], p, 0, n);
        else if (n) ggml_backend_tensor_set(t[i], p, 0, n);
        p += n;
    }
}

void st_save(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p) {
    st_io(m, il, t, len, p, true, false);
}

void st_load(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, const uint8_t * p) {
    st_io(m, il, t, len, const_cast<uint8_t *>(p), false, false);
}

// A checkpoint holds the rings' rows only: the entries are a prefix the live state keeps.
uint64_t st_ckpt_bytes(const ggswarm_model * m, int32_t il, int32_t len) {
    uint64_t b = 0;
    for (const Part & p : parts(m, il)) {
        if (p.lay != Lay::Entries) b += part_bytes(m, p, len);
    }
    return b;
}

void st_ckpt_io(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p,
                bool save) {
    st_io(m, il, t, len, p, save, true);
}

// The rings still hold what target needs when no slot it reads was written over since, nor lost to a
// rewind (s.ring_lo): a retried decode step or a few positions back, not a long edit.
bool st_rewinds_to(const ggswarm_model * m, int32_t il, const Session & s, int32_t target) {
    if (target == s.len) return true;
    for (const Part & p : parts(m, il)) {
        if (p.lay == Lay::Entries) continue;
        const int64_t rows = part_rows(m, p, s.cap);
        if (ring_from(m, p, target) < std::max<int64_t>(ring_from(m, p, s.ring_lo), (int64_t)s.len - rows)) return false;
    }
    return true;
}

const StateOps kDsv4State = {StateKind::Dsv4, "dsv4",          7,           st_plan,         st_carry,
                             st_per_token,    st_snapshot_bytes, st_save,   st_load,         st_ckpt_bytes,
                             st_ckpt_io,      st_rewinds_to};
StateRegistration reg_state(&kDsv4State);

}  // namespace
}  // namespace deepseek4
}  // namespace ggswarm
