// The architecture layer of libggswarm: a table from GGUF general.architecture to what differs per
// architecture (hyper-parameters, each layer's tensors and session state, the graph of a window of
// layers), and the pieces every architecture builds from (norms, RoPE, attention over the session's
// cache, gated FFNs, a mixture of experts). docs/native.md, "Architectures", says how to add one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model.h"

namespace ggswarm {

// --- GGUF hyper-parameters ------------------------------------------------------------------------------

// Typed reads of "<arch>.<key>" from a GGUF header, each failing with a message that names the key.
struct Hp {
    const ggswarm_model * m;
    const gguf_context * g;
    std::string prefix;  // "<arch>."

    bool has(const char * key) const;
    bool is_array(const char * key) const;
    // an integer in [lo, hi]; E_FORMAT when missing or out of range, E_UNSUPPORTED when per-layer
    ggswarm_status need_int(const char * key, int64_t lo, int64_t hi, int32_t * dst) const;
    bool opt_int(const char * key, int64_t * out) const;      // false when absent (or not an integer)
    bool opt_float(const char * key, double * out) const;     // false when absent
    bool opt_str(const char * key, std::string * out) const;  // false when absent
    // a bool (GGUF BOOL, or an integer as 0 / not 0): 1 read, 0 absent, -1 present in another form
    int opt_bool(const char * key, bool * out) const;
    // llama.cpp's get_key_or_arr for floats: one number for every layer, or an f32 array of exactly n;
    // 1 read, 0 absent, -1 present in another form (a wrong length included)
    int per_layer_float(const char * key, int32_t n, std::vector<float> * out) const;
    // a per-layer array of integers or bools (n values) or one value for every layer; false when absent
    bool per_layer(const char * key, int32_t n, std::vector<int64_t> * out) const;
    // an integer array (i32/u32 elements) of any length; false when missing or of another type
    bool int_array(const char * key, std::vector<int64_t> * out) const;
};

// What read_attention_hparams lets through beyond the llama layer: routed experts (the architecture
// reads them, read_moe_hparams) and RoPE on the first rope.dimension_count channels of a head only.
struct AttnOpts {
    bool experts = false;
    bool partial_rope = false;
};

// The attention hyper-parameters most decoder architectures share: feed_forward_length, head counts,
// head_dim (key_length = value_length), rope dimension (whole head unless opts.partial_rope), rms
// epsilon, rope base and linear scaling, context length. Fills m and every m->lhp[il] with KV state and
// the model's rope base; refuses experts unless opts.experts.
ggswarm_status read_attention_hparams(ggswarm_model * m, const Hp & hp, AttnOpts opts = {});

// Multi-token-prediction blocks (nextn_predict_layers) follow the trunk in block_count; the trunk never
// runs them: drops them from m->n_layers_total and m->lhp.
ggswarm_status drop_mtp_layers(ggswarm_model * m, const Hp & hp);

// rope.freq_base and RoPE scaling as llama.cpp reads them (m->rope_base, m->rope); read_hparams calls it
// before the architecture's reader and gives every layer the model's values, which readers may override.
ggswarm_status read_rope_scaling(ggswarm_model * m, const Hp & hp);

// --- tensors ----------------------------------------------------------------------------------------------

// The tensors a window reads from the file, with their expected shapes.
struct Wants {
    struct Item {
        std::string name;
        std::vector<int64_t> shape;
        bool optional;
        ggml_tensor ** dst;
        bool plain = false;  // never in the CPU's repacked layout (the graph views it in another shape)
    };
    std::vector<Item> items;
    const gguf_context * g = nullptr;

    void need(const std::string & name, std::vector<int64_t> shape, ggml_tensor ** dst) {
        items.push_back({name, std::move(shape), false, dst});
    }
    void opt(const std::string & name, std::vector<int64_t> shape, ggml_tensor ** dst) {
        items.push_back({name, std::move(shape), true, dst});
    }
    // A matrix the graph reshapes (llama.cpp loads it in that shape, which is never repacked).
    void need_plain(const std::string & name, std::vector<int64_t> shape, ggml_tensor ** dst) {
        items.push_back({name, std::move(shape), false, dst, true});
    }
    bool in_file(const std::string & name) const { return gguf_find_tensor(g, name.c_str()) >= 0; }
};

inline std::string blk(int32_t il, const char * name) { return "blk." + std::to_string(il) + "." + name; }

// The attention tensors of layer il (attn_norm, q/k/v with optional biases, output): llama's set.
void want_attention(const ggswarm_model * m, int32_t il, Layer & L, Wants & w);
// ffn_norm, ffn_gate, ffn_up, ffn_down of layer il at m->n_ff.
void want_ffn(const ggswarm_model * m, int32_t il, Layer & L, Wants & w);

// --- graph building ---------------------------------------------------------------------------------------

// Everything a window builder needs: the model, the graph under construction and its shape.
struct Build {
    ggswarm_model * m;
    Graph & g;
    ggml_context * c;
    int32_t n;       // new positions
    int32_t n_kv;    // attended span
    int32_t cap;     // cache capacity of the bound session
    bool last_only;  // last window: keep only the final position after the last layer's attention
    bool tile_queries = false;  // GraphKey::tile_queries

    int32_t local(int32_t il) const { return il - m->layer_start; }
    const Layer & layer(int32_t il) const { return m->layers[local(il)]; }
    const LayerHp & hp(int32_t il) const { return m->lhp[il]; }
    std::vector<ggml_tensor *> & state(int32_t il) { return g.state[local(il)]; }
};

ggml_tensor * rms(ggml_context * c, ggml_tensor * x, ggml_tensor * w, float eps);
ggml_tensor * linear(ggml_context * c, ggml_tensor * w, ggml_tensor * b, ggml_tensor * x);

// RoPE of x [hd, heads, n] at the graph's positions with layer il's base and scale (m->rope_mode).
ggml_tensor * rope(Build & b, int32_t il, ggml_tensor * x);

// llama.cpp's Hadamard rotations (llama-kv-cache.cpp, llama_mul_mat_hadamard): the orthonormal
// Walsh-Hadamard matrix of order n (a power of two; H H = I), the order it takes for rows of width n
// (the largest power of two >= 64 dividing n), and x rotated by rot in chunks of rot's order along
// dimension 0 (with ggml's hint that src0 is a Hadamard matrix, so the same kernel runs).
std::vector<float> hadamard(int64_t n);
int64_t rot_size(int64_t n);
ggml_tensor * rotate(ggml_context * c, ggml_tensor * x, ggml_tensor * rot);

// q, k, v of layer il from the normed input: q [hd, n_head, n], k [hd, n_head_kv, n], v [hd * n_head_kv, n].
struct Qkv {
    ggml_tensor * q, * k, * v;
};
Qkv qkv(Build & b, int32_t il, ggml_tensor * cur);

// Attention of the window's new positions for layer il (KV state): appends k [hd, nkv, n] and v
// [hd * nkv, n] to the session's cache and attends q [hd, nh, n] over the first n_kv positions
// (the layer's sliding window when hp.swa), softmax(kq_scale * K.q + mask). Runs in the model's
// attention mode (ggml's ops, the decode kernels, or flash attention). Returns [hd * nh, n], before
// the output projection.
ggml_tensor * attention(Build & b, int32_t il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale);

// attention() on a graph of several sessions (batch.cpp): per member, its rows of q, k and v appended to
// its own cache and attended with its own inputs, the results concatenated in member order.
ggml_tensor * attention_many(Build & b, int32_t il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale);

// The attention block of qwen3 and qwen3moe for layer il on the normed input: q, k and v, per-head RMS
// norms of q and k before RoPE, attention and the output projection (before the residual); and the
// tensors it takes (llama's set and the two norms).
ggml_tensor * qk_norm_attention(Build & b, int32_t il, ggml_tensor * cur);
void want_qk_norm_attention(const ggswarm_model * m, int32_t il, Layer & L, Wants & w);

// On the last window's last layer, keep only the final position of cur and of the residual x (the
// sampler reads nothing else; on a graph of several sessions, each member's final position); otherwise
// unchanged.
void keep_last(Build & b, int32_t il, ggml_tensor ** cur, ggml_tensor ** x);

// SwigluOai: gpt-oss's clamped SwiGLU (ggml_swiglu_oai, alpha 1.702, limit 7 as llama.cpp fixes them),
// for experts only (moe_ffn)
enum class Act { Silu, Gelu, SwigluOai };

// down(act(gate(x)) * up(x)): SwiGLU or GeGLU.
ggml_tensor * glu_ffn(ggml_context * c, ggml_tensor * x, ggml_tensor * gate, ggml_tensor * up, ggml_tensor * down,
                      Act act);

// SoftmaxWeight (gpt-oss): the top experts chosen by the raw router logits, their weights a softmax
// over the chosen ones' logits
enum class Gating { Softmax, Sigmoid, SoftmaxWeight };

// The routed-expert hyper-parameters as llama.cpp reads them (llama_hparams): expert_count,
// expert_used_count, expert_feed_forward_length (else feed_forward_length / used), expert_shared_count,
// leading_dense_block_count, expert_weights_scale / _norm, expert_gating_func (0 or absent: `gating`
// as given, the architecture's default), expert_group_count / _used_count (DeepSeek-V3's group-limited
// routing). Refuses gating functions other than softmax (1) and sigmoid (2).
struct MoeHp {
    int32_t n_expert = 0, n_used = 0, n_ff_exp = 0, n_shexp = 0, dense_lead = 0;
    int32_t n_groups = 0, n_group_used = 0;
    float w_scale = 0.0f;  // 0 or 1: none
    bool norm_w = false;
    Gating gating = Gating::Softmax;

    bool dense(int32_t il) const { return il < dense_lead; }
};
ggswarm_status read_moe_hparams(ggswarm_model * m, const Hp & hp, MoeHp * e);

// The per-model data of an architecture whose only extra hyper-parameters are its experts' (qwen3moe,
// glm4moe, gpt-oss, minimax-m2): read() stores one, the builders read it back with moe_hp().
struct MoeData : ArchData {
    MoeHp e;
};
inline const MoeHp & moe_hp(const ggswarm_model * m) { return static_cast<const MoeData *>(m->arch_data.get())->e; }

// The routing llama.cpp's graph hard-codes for qwen3moe and gpt-oss, whatever the file's keys say: the
// given gating and weight normalisation, no weight scale, no shared expert, no leading dense layers.
inline void fixed_routing(MoeHp * e, Gating gating, bool norm_w) {
    e->gating = gating;
    e->norm_w = norm_w;
    e->w_scale = 0.0f;
    e->n_shexp = 0;
    e->dense_lead = 0;
}
// Layer il's router and stacked experts (gate, up, down), exp_probs_b.bias when `bias` (optional unless
// `need_bias`), and the shared expert (n_shexp x n_ff_exp wide) when e.n_shexp > 0.
void want_experts(const ggswarm_model * m, const MoeHp & e, int32_t il, Layer & L, Wants & w, bool bias,
                  bool need_bias = false);

// A mixture of experts on x [d, n] (llama.cpp's build_moe_ffn): router logits gate_inp.x, probabilities
// by `gating`; the top n_used experts per position chosen by the probabilities plus exp_probs_b (when
// set), among the n_group_used groups with the best two-expert sums when n_groups > 1; their weights
// from the unbiased probabilities (renormalised to sum 1 when norm_w, then times w_scale unless 0 or
// 1), each a gated FFN from the stacked expert tensors ([d, ff, n_expert], down [ff, d, n_expert]);
// with a shared expert (sh_gate/sh_up/sh_down, may be null) added, scaled by sigmoid(sh_gate_inp.x)
// when sh_gate_inp is set. Optional biases (gpt-oss): the router's gate_inp_b [n_expert], and per
// expert up_b / gate_b [ff, n_expert], down_b [d, n_expert] (ggml_add_id). Returns [d, n].
struct Moe {
    ggml_tensor * gate_inp = nullptr;
    ggml_tensor * gate_inp_b = nullptr;
    ggml_tensor * exp_probs_b = nullptr;
    ggml_tensor * gate_exps = nullptr;
    ggml_tensor * up_exps = nullptr;
    ggml_tensor * down_exps = nullptr;
    ggml_tensor * gate_b = nullptr;
    ggml_tensor * up_b = nullptr;
    ggml_tensor * down_b = nullptr;
    ggml_tensor * sh_gate_inp = nullptr;
    ggml_tensor * sh_gate = nullptr;
    ggml_tensor * sh_up = nullptr;
    ggml_tensor * sh_down = nullptr;
    int32_t n_expert = 0;
    int32_t n_used = 0;
    int32_t n_groups = 0, n_group_used = 0;
    Gating gating = Gating::Softmax;
    bool norm_w = true;
    float w_scale = 1.0f;
    Act act = Act::Silu;
};
ggml_tensor * moe_ffn(ggml_context * c, ggml_tensor * x, const Moe & p);
// The Moe of layer il from its tensors (want_experts') and e; the shared expert left to the caller.
Moe routed_experts(const MoeHp & e, const Layer & L);

// --- the table ----------------------------------------------------------------------------------------------

// One architecture. read_hparams fills m (and m->lhp, one entry per layer of the whole model: state
// kind, sliding window, rope base); want_layer lists layer il's tensors; build_window builds layers
// [m->layer_start, m->layer_end) on x [d_model, n] (already embedded and scaled on the first window)
// and returns the hidden state after the last of them.
struct Arch {
    const char * name;
    ggswarm_status (*read_hparams)(ggswarm_model * m, const Hp & hp);
    void (*want_layer)(const ggswarm_model * m, int32_t il, Layer & L, Wants & w);
    ggml_tensor * (*build_window)(Build & b, ggml_tensor * x);
    // optional: fill the inputs build_window added to g.arch_in for positions [pos, pos + nc)
    void (*set_inputs)(ggswarm_model * m, Graph & g, int32_t pos, int32_t nc) = nullptr;
    // true when build_window uses only row-wise ops and attention()/keep_last() per layer (no set_inputs,
    // one position per token), so ggswarm_forward_many may run several sessions' rows in one graph
    bool batches = false;
    // the cache types (bits 1 << ggml_type) its state kinds keep, ggswarm_set_cache_type; f16 for all
    uint32_t cache_types = 1u << GGML_TYPE_F16;
    // optional: refuse a quantized cache type llama.cpp refuses beyond the head size (MLA: the value head)
    ggswarm_status (*check_cache_type)(ggswarm_model * m, ggml_type t) = nullptr;
};

// What the KV state kind keeps (kv_state.cpp): f16, and q8_0 / q4_0 as llama.cpp's quantized caches.
constexpr uint32_t kKvCacheTypes = (1u << GGML_TYPE_F16) | (1u << GGML_TYPE_Q8_0) | (1u << GGML_TYPE_Q4_0);

// Architectures register themselves from their own unit: `static ArchRegistration reg(&kMyArch);`.
void register_arch(const Arch * a);
struct ArchRegistration {
    explicit ArchRegistration(const Arch * a) { register_arch(a); }
};
const Arch * find_arch(const std::string & name);
std::string arch_names();  // "gemma3, llama, ..." for messages

// --- state kinds -----------------------------------------------------------------------------------------

// How one kind of per-layer session state is laid out, grown, measured and serialised. The session
// holds, per layer of the window, the tensors `plan` creates; a graph holds leaves of the same shapes,
// bound to the calling session's tensors before each compute. Registered like architectures.
struct StateOps {
    StateKind kind;
    const char * name;
    size_t max_tensors;  // tensors plan creates per layer
    // layer il's state tensors for a session of cap positions, created in ctx (no data)
    void (*plan)(const ggswarm_model * m, int32_t il, int64_t cap, ggml_context * ctx,
                 std::vector<ggml_tensor *> & out);
    // after growth: copy the state of the first len positions from the old tensors into the new ones
    void (*carry)(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & from,
                  const std::vector<ggml_tensor *> & to, int32_t len);
    // bytes a position costs (caches that grow), and the bytes of the fixed part (recurrent states)
    uint64_t (*bytes_per_token)(const ggswarm_model * m, int32_t il);
    // snapshot payload of this layer at len positions, and writing / reading it
    uint64_t (*snapshot_bytes)(const ggswarm_model * m, int32_t il, int32_t len);
    void (*save)(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len, uint8_t * p);
    void (*load)(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len,
                 const uint8_t * p);
    // The part of the state that cannot be cut back to an earlier position (a recurrent state, a ring),
    // as a checkpoint at len positions keeps it: its bytes and copying it out (save) or back (null: none).
    uint64_t (*ckpt_bytes)(const ggswarm_model * m, int32_t il, int32_t len) = nullptr;
    void (*ckpt_io)(const ggswarm_model * m, int32_t il, const std::vector<ggml_tensor *> & t, int32_t len,
                    uint8_t * p, bool save) = nullptr;
    // Whether the live state can go back to `target` positions without a checkpoint (null: always).
    bool (*rewinds_to)(const ggswarm_model * m, int32_t il, const Session & s, int32_t target) = nullptr;
};
void register_state_kind(const StateOps * ops);
struct StateRegistration {
    explicit StateRegistration(const StateOps * ops) { register_state_kind(ops); }
};
const StateOps * state_ops(StateKind k);  // nullptr when no unit implements the kind

}  // namespace ggswarm
