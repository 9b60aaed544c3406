// DeepSeek-V4's graph inputs (Graph::arch_in): made with the window graph, filled per call with the raw
// ring's slots and mask, the compressors' plans and masks, and the Hadamard rotations.

#include <algorithm>
#include <cmath>
#include <vector>

#include "archs/deepseek4.h"

namespace ggswarm {
namespace deepseek4 {
namespace {

ggml_tensor * input(ggml_context * c, ggml_type t, int64_t a, int64_t b = 1, int64_t e = 1) {
    ggml_tensor * x = ggml_new_tensor_3d(c, t, a, b, e);
    ggml_set_input(x);
    return x;
}

}  // namespace

void make_inputs(Build & b) {
    ggml_context * c = b.c;
    const int64_t n = b.n;
    std::vector<ggml_tensor *> & in = b.g.arch_in;
    in.assign(kInputs, nullptr);
    in[kKidx] = input(c, GGML_TYPE_I64, n);
    in[kMaskRaw] = input(c, GGML_TYPE_F32, raw_span(b.m, b.n_kv), n);
    in[kApe4] = input(c, GGML_TYPE_I32, n);
    in[kApe128] = input(c, GGML_TYPE_I32, n);
    const int64_t nb4 = n_blocks(n, kCsa), nb128 = n_blocks(n, kHca);
    in[kRead4] = input(c, GGML_TYPE_I32, 2 * kCsa * nb4);
    in[kBias4] = input(c, GGML_TYPE_F32, 1, 2 * kCsa, nb4);
    in[kWrite4] = input(c, GGML_TYPE_I64, nb4);
    in[kCpos4] = input(c, GGML_TYPE_I32, nb4);
    in[kMask4] = input(c, GGML_TYPE_F32, n_comp_span(b.n_kv, kCsa), n);
    in[kRead128] = input(c, GGML_TYPE_I32, kHca * nb128);
    in[kWrite128] = input(c, GGML_TYPE_I64, nb128);
    in[kCpos128] = input(c, GGML_TYPE_I32, nb128);
    in[kMask128] = input(c, GGML_TYPE_F32, n_comp_span(b.n_kv, kHca), n);
    in[kRows4] = input(c, GGML_TYPE_I64, std::min<int64_t>(n, ring_rows(kCsa)));
    in[kRows128] = input(c, GGML_TYPE_I64, std::min<int64_t>(n, ring_rows(kHca)));
    const int64_t ri = rot_size(dsv4(b.m).idx_len), rh = rot_size(b.m->head_dim);
    in[kRotIdx] = input(c, GGML_TYPE_F32, ri, ri);
    in[kRotHead] = input(c, GGML_TYPE_F32, rh, rh);
}

namespace {

template <typename T>
void put(ggml_tensor * t, const std::vector<T> & v) {
    if (t && t->buffer) ggml_backend_tensor_set(t, v.data(), 0, sizeof(T) * v.size());
}

// The compression plan of ratio r for positions [pos, pos + nc): per block slot its entry, first
// position and source rows (overlapping: the previous block's rows first, then the block's own).
void set_comp(const Graph & g, int32_t r, int32_t pos, int32_t nc, In read, In write, In cpos, In bias) {
    const int64_t nb = n_blocks(nc, r), scratch = n_comp(g.key.cap, r) - 1, ring = ring_rows(r);
    const bool overlap = bias != kInputs;
    // a row of position q in compress()'s concatenation: its ring slot if older than the graph, else new
    auto row = [&](int32_t q) { return (int32_t)(q < pos ? q % ring : ring + (q - pos)); };
    std::vector<int64_t> wr(nb, scratch);
    std::vector<int32_t> cp(nb, 0), rd((overlap ? 2 : 1) * r * nb, 0);
    std::vector<float> bi(overlap ? 2 * r * nb : 0, 0.0f);
    int64_t i = 0;
    for (int32_t p = pos; p < pos + nc; ++p) {
        if ((p + 1) % r != 0) continue;
        const int32_t j = p / r, start = j * r;
        wr[i] = j;
        cp[i] = start;
        for (int32_t k = 0; k < r; ++k) {
            if (overlap) {
                rd[i * r + k] = j > 0 ? row(start - r + k) : 0;
                if (j == 0) bi[i * 2 * r + k] = -INFINITY;
                rd[nb * r + i * r + k] = row(start + k);
            } else {
                rd[i * r + k] = row(start + k);
            }
        }
        ++i;
    }
    put(g.arch_in[read], rd);
    put(g.arch_in[write], wr);
    put(g.arch_in[cpos], cp);
    if (overlap) put(g.arch_in[bias], bi);
}

void set_comp_mask(ggswarm_model * m, ggml_tensor * t, int32_t r, int32_t pos, int32_t nc) {
    if (!t || !t->buffer) return;
    const int64_t w = t->ne[0];
    m->mask_host.assign((size_t)w * nc, -INFINITY);
    for (int32_t i = 0; i < nc; ++i) {
        const int64_t vis = (int64_t)(pos + i + 1) / r;
        for (int64_t j = 0; j < std::min(vis, w); ++j) m->mask_host[(size_t)i * w + j] = 0.0f;
    }
    put(t, m->mask_host);
}

// The ring slots of the last min(nc, ring) new positions (their rows are what the ring keeps).
void set_ring_writes(ggml_tensor * t, int32_t pos, int32_t nc, int64_t ring) {
    const int64_t k = std::min<int64_t>(nc, ring);
    std::vector<int64_t> slots(k);
    for (int64_t i = 0; i < k; ++i) slots[i] = (pos + nc - k + i) % ring;
    put(t, slots);
}

}  // namespace

void set_inputs(ggswarm_model * m, Graph & g, int32_t pos, int32_t nc) {
    std::vector<ggml_tensor *> & in = g.arch_in;
    const int64_t rr = raw_rows(m);
    std::vector<int64_t> kidx(nc);
    std::vector<int32_t> a4(nc), a128(nc);
    for (int32_t t = 0; t < nc; ++t) {
        kidx[t] = (pos + t) % rr;
        a4[t] = (pos + t) % kCsa;
        a128[t] = (pos + t) % kHca;
    }
    put(in[kKidx], kidx);
    put(in[kApe4], a4);
    put(in[kApe128], a128);
    if (in[kMaskRaw]->buffer) {
        // slot j holds the newest position q <= top with q = j (mod ring), after this graph's writes
        const int64_t w = in[kMaskRaw]->ne[0], top = pos + nc - 1;
        m->mask_host.assign((size_t)w * nc, -INFINITY);
        for (int64_t j = 0; j < w; ++j) {
            const int64_t q = top - (((top - j) % rr) + rr) % rr;
            if (q < 0) continue;
            for (int32_t i = 0; i < nc; ++i) {
                const int64_t p = pos + i;
                if (q <= p && q > p - m->n_swa) m->mask_host[(size_t)i * w + j] = 0.0f;
            }
        }
        put(in[kMaskRaw], m->mask_host);
    }
    set_comp(g, kCsa, pos, nc, kRead4, kWrite4, kCpos4, kBias4);
    set_comp(g, kHca, pos, nc, kRead128, kWrite128, kCpos128, kInputs);
    set_comp_mask(m, in[kMask4], kCsa, pos, nc);
    set_comp_mask(m, in[kMask128], kHca, pos, nc);
    set_ring_writes(in[kRows4], pos, nc, ring_rows(kCsa));
    set_ring_writes(in[kRows128], pos, nc, ring_rows(kHca));
    const Dsv4 & h = dsv4(m);
    put(in[kRotIdx], h.rot_idx);
    put(in[kRotHead], h.rot_head);
}

}  // namespace deepseek4
}  // namespace ggswarm
