// DeepSeek-V4's internals shared by its units: deepseek4.cpp (hyper-parameters, tensors, the table entry),
// deepseek4_state.cpp (the state kind), deepseek4_inputs.cpp (the graph's inputs), deepseek4_graph.cpp (the graph).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "arch.h"

namespace ggswarm {
namespace deepseek4 {

struct Dsv4 : ArchData {
    int32_t n_rot = 0, q_lora = 0, o_groups = 0, o_lora = 0;
    int32_t n_expert = 0, n_used = 0, n_ff_exp = 0, n_shexp = 1;
    int32_t idx_heads = 0, idx_len = 0, top_k = 0;
    int32_t hc = 4, sinkhorn = 1, hash_layers = 0;
    float hc_eps = 1e-6f, w_scale = 1.0f, comp_base = 10000.0f;
    std::vector<float> clamp_exp, clamp_shexp;  // per layer of the file (0: no clamp)
    bool norm_w = true;
    std::vector<int32_t> ratio;  // per layer: 0, 4 or 128
    // llama.cpp's Hadamard rotations of indexer-key-wide and head-wide rows (see rotates()), made once
    std::vector<float> rot_idx, rot_head;
};

inline const Dsv4 & dsv4(const ggswarm_model * m) { return *static_cast<const Dsv4 *>(m->arch_data.get()); }

constexpr int32_t kCsa = 4;
constexpr int32_t kHca = 128;

inline int64_t pad256(int64_t n) { return std::max<int64_t>(256, (n + 255) / 256 * 256); }
// compressed entries a session of cap positions holds: every block, and a scratch entry for the blocks
// a graph computes but that do not complete (never visible)
inline int64_t n_comp(int64_t cap, int32_t r) { return cap / r + 1; }
// compressed entries a graph attending n_kv positions attends: llama.cpp's mask width, the visible
// entries padded to 256 (at least 256), beyond what a session holds where it holds fewer (the rows past
// them are masked; attention reads them as padding, comp_pad). The width decides how ggml multiplies
// the weights by the values (tinyBLAS needs a multiple of its block: 256 + 129 rows took another sum order).
inline int64_t n_comp_span(int64_t n_kv, int32_t r) { return pad256(n_kv / r); }
// of them the entries the session's cache holds
inline int64_t n_comp_held(int64_t n_kv, int64_t cap, int32_t r) { return std::min(n_comp_span(n_kv, r), n_comp(cap, r)); }
// blocks that can complete among nc new positions
inline int64_t n_blocks(int64_t nc, int32_t r) { return nc / r + 1; }

// llama.cpp's raw window: GGML_PAD(min(n_ctx, n_swa + n_ubatch), 256) slots, whatever the capacity
inline int64_t raw_rows(const ggswarm_model * m) { return window_ring(m); }
// compressor rows a ratio keeps: the block being filled, and the one before where windows overlap
inline int64_t ring_rows(int32_t r) { return r == kCsa ? 2 * kCsa : kHca; }

// --- inputs (Graph::arch_in) -----------------------------------------------------------------------------

enum In {
    kKidx,      // i64 [n]: raw ring slot of each new position
    kMaskRaw,   // f32 [raw span, n]: the sliding window over the ring's slots
    kApe4,      // i32 [n]: position % 4
    kApe128,    // i32 [n]: position % 128
    kRead4,     // i32 [2 * 4 * nb4]: rows of the previous blocks, then of the completing blocks (rows of
                //   the ring, then the graph's new rows, as compress() concatenates them)
    kBias4,     // f32 [1, 8, nb4]: -inf for the first block's missing previous rows
    kWrite4,    // i64 [nb4]: the completing blocks' entries (or the scratch entry)
    kCpos4,     // i32 [nb4]: their first position (their RoPE position)
    kMask4,     // f32 [nc4, n]: visible compressed entries
    kRead128,   // i32 [128 * nb128]
    kWrite128,  // i64 [nb128]
    kCpos128,   // i32 [nb128]
    kMask128,   // f32 [nc128, n]
    kRows4,     // i64 [min(n, 8)]: ring slots of the last new positions, whose rows the ring keeps
    kRows128,   // i64 [min(n, 128)]
    kRotIdx,    // f32 [r, r]: the Hadamard rotation of indexer-key-wide rows (rot_size(idx_len))
    kRotHead,   // f32 [r, r]: of head-wide rows, where rotates(head_dim) (else unused)
    kInputs
};

// The raw ring's slots a graph of span n_kv attends: the whole ring once positions wrap around it.
inline int64_t raw_span(const ggswarm_model * m, int64_t n_kv) { return std::min(n_kv, raw_rows(m)); }

void make_inputs(Build & b);  // deepseek4_inputs.cpp: the inputs build_window adds to g.arch_in
void set_inputs(ggswarm_model * m, Graph & g, int32_t pos, int32_t nc);  // Arch::set_inputs
ggml_tensor * build(Build & b, ggml_tensor * x);  // deepseek4_graph.cpp: Arch::build_window

}  // namespace deepseek4
}  // namespace ggswarm
