// Internal types of libggswarm shared by its translation units: the node's KV budget, the model handle
// (weights, device, sessions, cached graphs), sessions' state, and the functions one unit offers the
// others. arch.h adds the architecture table and the pieces window graphs are built from.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "ggswarm.h"
#include "gguf.h"
#include "sampler.h"

namespace ggswarm {

struct Arch;
struct Checkpoints;  // recurrent.h: a session's checkpoints of its recurrent states
struct MtpBlock;     // mtp.cpp: a last window's nextn block (ggswarm_mtp_open) and its sessions' state

// What an architecture keeps beyond the common fields of ggswarm_model (archs/qwen35.h: Hybrid).
struct ArchData {
    virtual ~ArchData() = default;
};

// One transformer layer's weights in the backend buffer; an architecture loads the ones it uses
// (biases only where the GGUF has them: qwen2). Tensors only one architecture has go in `extra`,
// by their GGUF name without the "blk.N." prefix.
struct Layer {
    ggml_tensor * attn_norm = nullptr;
    ggml_tensor * wq = nullptr;
    ggml_tensor * wk = nullptr;
    ggml_tensor * wv = nullptr;
    ggml_tensor * bq = nullptr;
    ggml_tensor * bk = nullptr;
    ggml_tensor * bv = nullptr;
    ggml_tensor * wo = nullptr;
    ggml_tensor * bo = nullptr;
    ggml_tensor * ffn_norm = nullptr;
    ggml_tensor * w_gate = nullptr;
    ggml_tensor * w_up = nullptr;
    ggml_tensor * w_down = nullptr;
    ggml_tensor * q_norm = nullptr;          // per-head RMS norms of q and k (qwen3, gemma3)
    ggml_tensor * k_norm = nullptr;
    ggml_tensor * attn_post_norm = nullptr;  // norms of the attention and FFN outputs (gemma3)
    ggml_tensor * ffn_post_norm = nullptr;
    ggml_tensor * attn_sinks = nullptr;      // per-head softmax sinks, f32 [n_head]: attention() adds them (gpt-oss)
    ggml_tensor * ffn_gate_inp = nullptr;    // mixture of experts: router, stacked experts, shared expert
    ggml_tensor * ffn_gate_exps = nullptr;
    ggml_tensor * ffn_up_exps = nullptr;
    ggml_tensor * ffn_down_exps = nullptr;
    ggml_tensor * ffn_gate_inp_shexp = nullptr;
    ggml_tensor * ffn_gate_shexp = nullptr;
    ggml_tensor * ffn_up_shexp = nullptr;
    ggml_tensor * ffn_down_shexp = nullptr;
    std::map<std::string, ggml_tensor *> extra;
};

// What one layer keeps per session (arch.h's StateOps says how each kind is stored).
enum class StateKind : int32_t {
    KV = 0,         // K and V rows of every position (attention)
    Recurrent = 1,  // a fixed-size state updated by every position (gated delta-net: conv + f32 state)
    Dsv4 = 3,       // deepseek4: raw K window, compressed K (+ indexer K) and per-position compressor rows
};

// Per-layer hyper-parameters, for every layer of the model (not only the window's).
struct LayerHp {
    StateKind state = StateKind::KV;
    bool swa = false;  // attends only the last n_swa positions (ggswarm_model::n_swa)
    float rope_base = 10000.0f;
    float rope_scale = 1.0f;   // freq_scale: 1 / rope.scaling.factor (1: none)
    float rope_ext = 0.0f;     // YaRN's ext_factor: 1 where YaRN applies to this layer, else 0
    float rope_attn = 1.0f;    // ggml's attn_factor for this layer's RoPE (YaRN's magnitude, net of ggml's)
};

// RoPE scaling as llama.cpp's context sets it up from the file (llama_context's cparams): the scaling
// type (absent: linear), 1 / factor, YaRN's ext_factor, attn_factor, betas and original context.
struct RopeScaling {
    std::string type = "linear";
    float freq_scale = 1.0f;
    float ext_factor = 0.0f;
    float attn_factor = 1.0f;  // llama.cpp's cparams.yarn_attn_factor (times rope.scaling.attn_factor)
    float beta_fast = 32.0f, beta_slow = 1.0f;
    int32_t n_ctx_orig = 0;  // rope.scaling.original_context_length, else context_length
};

// One session's state on the model's device: per layer of the window, the tensors of its state kind
// (KV: K [d_kv, cap] and V^T [cap, d_kv], f16, or V rows [d_kv, cap] in flash mode).
struct Session {
    int32_t capacity = 0;  // positions the session may grow to (ggswarm_session_open)
    int32_t len = 0;
    int32_t cap = 0;  // positions its state tensors are allocated for now (grows by doubling, up to capacity)
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    std::vector<std::vector<ggml_tensor *>> state;
    uint64_t bytes = 0;
    std::shared_ptr<Checkpoints> ckpts;  // windows with fixed-size state (recurrent.h); kept across growth
    // rings (deepseek4's raw window and compressor rows, sliding-window caches) hold the rows position
    // ring_lo reads and those written after (up to their size): a rewind to a checkpoint, or a restored
    // snapshot, loads only what its position reads, so older slots are stale
    int32_t ring_lo = 0;

    void release() {
        if (buf) ggml_backend_buffer_free(buf);
        if (ctx) ggml_free(ctx);
        buf = nullptr;
        ctx = nullptr;
        state.clear();
        bytes = 0;
        cap = 0;
    }
};

// The shape a built graph depends on; see Graph. No session in it: the KV is bound per call.
struct GraphKey {
    int32_t n = 0;       // new positions
    int32_t n_kv = 0;    // attended span
    int32_t cap = 0;     // KV capacity of the bound session (the cache tensors' shape)
    bool last_only = false;
    // a micro-batch of 2..63 positions cut (at a recurrent checkpoint) from what is one ubatch of 64 or
    // more in llama.cpp: ggml's CPU flash kernel ran that ubatch tiled, so flash attention pads to its
    // tile (attention.cpp flash_attention, deepseek4_graph.cpp)
    bool tile_queries = false;
    std::vector<int32_t> members;  // a graph of several sessions (batch.cpp): (n, n_kv, cap) per member; else empty
    bool operator==(const GraphKey & o) const {
        return n == o.n && n_kv == o.n_kv && cap == o.cap && last_only == o.last_only &&
               tile_queries == o.tile_queries && members == o.members;
    }
};

// One session's rows in a graph of several sessions (batch.cpp): rows [off, off + n) of the concatenated
// inputs, its own attention inputs (null where the graph's mode reads none) and its own state leaves.
struct GraphMember {
    int32_t off = 0, n = 0, n_kv = 0, cap = 0;
    ggml_tensor * mask = nullptr;
    ggml_tensor * mask_swa = nullptr;
    ggml_tensor * kidx = nullptr;
    ggml_tensor * vidx = nullptr;
    ggml_tensor * kidx_swa = nullptr;  // the sliding-window layers' rings
    ggml_tensor * vidx_swa = nullptr;
    ggml_tensor * pos = nullptr;  // a view of the graph's inp_pos at its first row (the decode kernels read it)
    std::vector<std::vector<ggml_tensor *>> state;
};

// A built and allocated window graph, cached by its key and reused by whichever session calls with
// that shape (a decode loop, or sessions taking turns, rebuild nothing: only the inputs and the KV
// binding change). It owns its metadata arena and its scheduler (so its allocation survives while
// other graphs run). The graph reads and writes the session state through its own leaf tensors of
// the session's shapes (per layer, as its state kind plans them); bind_state points them, and every
// view of them, at the calling session's tensors before each compute.
struct Graph {
    std::vector<uint8_t> meta;
    ggml_backend_sched_t sched = nullptr;
    ggml_context * ctx = nullptr;
    ggml_cgraph * gf = nullptr;
    ggml_tensor * inp_tokens = nullptr;
    ggml_tensor * inp_hidden = nullptr;
    ggml_tensor * inp_pos = nullptr;
    ggml_tensor * inp_mask = nullptr;
    ggml_tensor * inp_mask_swa = nullptr;  // sliding-window layers' mask (also on kernel decode steps)
    ggml_tensor * inp_kidx = nullptr;  // row of each new position in K
    ggml_tensor * inp_vidx = nullptr;  // element index of each new (channel, position) in transposed V
    ggml_tensor * inp_kidx_swa = nullptr;  // the same in the sliding-window layers' rings
    ggml_tensor * inp_vidx_swa = nullptr;
    ggml_tensor * out = nullptr;
    // a window with a nextn block attached (and the block's own graphs): every position's last hidden row
    // (the hyper-connection streams before the output head), which the block reads (mtp.cpp)
    ggml_tensor * out_hidden = nullptr;
    std::vector<std::vector<ggml_tensor *>> state;  // per layer: leaves bound to a session's s.state
    std::vector<ggml_tensor *> kv_views;             // graph tensors viewing a state leaf (rebound with it)
    std::vector<ggml_tensor *> arch_in;              // the architecture's own inputs (Arch::set_inputs fills them)
    std::vector<GraphMember> members;                // a graph of several sessions (batch.cpp); else empty
    ggml_tensor * inp_last = nullptr;                // several sessions, last window: each member's final row
    GraphKey key;
    uint64_t last_use = 0;
    int8_t thread_free = -1;  // 1: no node's result depends on the thread count (compute_graph); -1: not yet looked

    Graph() = default;
    Graph(const Graph &) = delete;
    Graph & operator=(const Graph &) = delete;
    ~Graph() {
        if (sched) ggml_backend_sched_free(sched);
        if (ctx) ggml_free(ctx);
    }
};

// A parsed GGUF header: key/values and tensor metadata, no tensor data.
struct Meta {
    gguf_context * g = nullptr;
    ggml_context * ctx = nullptr;  // tensor metadata only (no_alloc)
    ~Meta() {
        if (g) gguf_free(g);
        if (ctx) ggml_free(ctx);
    }
};

}  // namespace ggswarm

// The handle behind ggswarm.h's opaque ggswarm_budget: the node's KV bytes, charged and credited by
// every model handle opened with it (from any thread), freed with its last reference.
struct ggswarm_budget {
    mutable std::mutex mu;
    uint64_t total = 0;
    uint64_t used = 0;
    int refs = 1;  // the creator's, plus one per model handle
};

// The handle behind ggswarm.h's opaque ggswarm_model: one layer window on one device.
// Serialises a public entry point on model handle m (which may be NULL: the call then fails unlocked).
#define GGSWARM_LOCK(m)                                                                                   \
    std::unique_lock<std::recursive_mutex> ggswarm_model_lock_ =                                          \
        (m) ? std::unique_lock<std::recursive_mutex>((m)->mu) : std::unique_lock<std::recursive_mutex>()

struct ggswarm_model {
    mutable std::string error;
    // v7: every public call on the handle holds it (GGSWARM_LOCK), so a lane thread (lane.cpp) and the
    // caller's own thread can both use one handle; recursive because entry points call each other
    mutable std::recursive_mutex mu;

    std::string arch;
    const ggswarm::Arch * archp = nullptr;  // its entry in the architecture table (arch.h)
    std::string model_id;
    std::string device_name;
    int32_t n_layers_total = 0, layer_start = 0, layer_end = 0;
    int32_t d_model = 0, n_vocab = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_ff = 0, n_rot = 0;
    int32_t n_ctx_train = 0, n_ctx_max = 0, n_threads = 1;
    float eps = 1e-5f, rope_base = 10000.0f;
    int rope_mode = GGML_ROPE_TYPE_NORMAL;
    ggswarm::RopeScaling rope;  // read once by the loader (read_rope_scaling); layers copy what applies to them
    int32_t n_swa = 0;           // sliding window of the layers whose LayerHp::swa is set
    float embd_scale = 0.0f;     // first window: token embeddings times this (0: not scaled; gemma3)
    float logit_softcap = 0.0f;  // last window: logits = c * tanh(logits / c) (0: none)
    std::vector<ggswarm::LayerHp> lhp;  // one per layer of the whole model
    std::shared_ptr<ggswarm::ArchData> arch_data;  // the architecture's own parameters, if any
    int32_t n_pos_per_token = 1;  // 4 for multi-section RoPE (positions of the t, h, w sections, then 0)
    int32_t n_streams = 1;   // boundary rows per token are d_model x n_streams (deepseek4's hyper-connections: 4)
    int32_t ids_layers = 0;  // layers [0, ids_layers) read the token ids (deepseek4's hash-routed experts)
    int32_t nodes_per_layer = 128;
    // v15 multi-token prediction: this handle IS a nextn block (opened by ggswarm_mtp_open: its one layer
    // follows the trunk), or has one attached (the trunk's last window); mtp.cpp
    bool mtp_block = false;
    ggswarm::MtpBlock * mtp = nullptr;
    // checkpoints of the state that cannot be cut back (recurrent states, rings; recurrent.cpp): at the
    // start and end of every multi-token forward call (turn boundaries: where a failed call, a
    // regenerate, an edited last message and the next turn go back to) and, when `ckpt_every` > 0
    // (default 0: off), every that many positions; at most `ckpt_max` per session (the oldest dropped
    // first): 2 keep the latest call's start and end (docs/native.md, "Checkpoints")
    int32_t ckpt_every = 0;
    int32_t ckpt_max = 2;
    uint64_t ckpt_clock = 0;  // orders automatic checkpoints by when they were taken (reclaim_checkpoints)
    // the attention caches' type (ggswarm_set_cache_type; the architecture says which it keeps)
    ggml_type cache_type = GGML_TYPE_F16;
    // llama.cpp's Hadamard rotations of quantized KV caches (llama-kv-cache.cpp attn_rot_k/attn_rot_v):
    // queries and keys by rot_k, values by rot_v and the attention output back by it; null when the
    // caches are not quantized or the head size is no multiple of 64. Made by ggswarm_set_cache_type.
    ggml_tensor * rot_k = nullptr;
    ggml_tensor * rot_v = nullptr;
    ggml_context * rot_ctx = nullptr;
    ggml_backend_buffer_t rot_buf = nullptr;
    int64_t d_io() const { return (int64_t)d_model * n_streams; }
    bool needs_ids() const { return layer_start < ids_layers; }
    // How attention runs (ggswarm_model_info.decode_kernels, chosen at open): 1: CPU decode steps use
    // attention.cpp's kernels (see kernel_step); 0: ggml's ops; -1: ggml's ops, the kernels failed the
    // self-check at open; -2: ggml_flash_attn_ext on every step, with the V cache not transposed
    int32_t decode_kernels = 0;
    // decode_kernels for caches that are not quantized: chosen at open, or by ggswarm_set_flash_attention
    int32_t chosen_attention = 0;
    ggswarm_budget * budget = nullptr;  // the node's KV budget (a reference), or none
    uint64_t weight_bytes = 0;
    uint64_t graph_builds = 0;
    // one-row steps may run on one thread (compute_graph): a CPU window with few weights (open_model)
    bool small_steps = false;
    ggml_backend_set_n_threads_t cpu_set_threads = nullptr;  // the CPU backend's, found by apply_threads

    ggml_backend_dev_t dev = nullptr;
    ggml_backend_t backend = nullptr;      // device the weights and KV live on
    ggml_backend_t backend_cpu = nullptr;  // CPU fallback for the scheduler (== backend on CPU hosts)
    ggml_backend_buffer_type_t buft = nullptr;
    ggml_context * wctx = nullptr;
    ggml_backend_buffer_t wbuf = nullptr;
    ggml_context * wctx_extra = nullptr;          // weights in the CPU's repacked layout (loader.cpp)
    ggml_backend_buffer_t wbuf_extra = nullptr;
#ifdef GGSWARM_OWN_THREADPOOL
    // The CPU backends' workers (loader.cpp's apply_threads), owned here, freed after the backends. Only in
    // the build against our own OpenMP-free ggml (native/build.sh with GGSWARM_GGML=own).
    ggml_threadpool * threadpool = nullptr;
    int32_t threadpool_n = 0;  // its thread count (ggml declares ggml_threadpool_get_n_threads, defines none)
#endif

    ggml_tensor * tok_embd = nullptr;
    ggml_tensor * output_norm = nullptr;
    ggml_tensor * output = nullptr;
    ggml_tensor * rope_freqs = nullptr;
    std::vector<ggswarm::Layer> layers;

    std::map<int64_t, ggswarm::Session> sessions;
    int64_t next_sid = 1;

    size_t graph_size = 0;                                 // node capacity of a window graph
    std::vector<std::unique_ptr<ggswarm::Graph>> graphs;  // built graphs, one per shape (see GraphKey)
    ggswarm::Graph * graph = nullptr;                      // the one the last forward call ran
    uint64_t graph_clock = 0;                              // orders graphs by last use (eviction)
    std::vector<float> mask_host;
    std::vector<ggml_fp16_t> mask_f16;  // the mask as flash attention takes it
    std::vector<int64_t> kidx_host;
    std::vector<int64_t> vidx_host;
    std::vector<int32_t> pos_host;
    std::vector<float> hidden_host;
    std::vector<float> logits_host;
    std::vector<uint8_t> staging;
    std::vector<std::string> step_errors;  // ggswarm_forward_many: each step's message ("" when it ran)
    ggswarm::SamplerScratch scratch;

    bool is_first() const { return layer_start == 0; }
    bool is_last() const { return layer_end == n_layers_total; }
    int32_t d_kv() const { return head_dim * n_head_kv; }
    bool flash() const { return decode_kernels == -2; }  // V rows per position; f16 mask
    uint64_t kv_bytes_per_token() const;  // kv.cpp: over the window's layers, every state kind
    uint64_t kv_total() const {
        uint64_t t = 0;
        for (const auto & kv : sessions) t += kv.second.bytes;
        return t;
    }

    ~ggswarm_model();  // ggswarm.cpp: also returns the sessions' KV bytes and the budget reference
};

namespace ggswarm {

// 64-bit FNV-1a, for snapshot checksums and model fingerprints
inline uint64_t fnv1a(const uint8_t * p, size_t n, uint64_t h = 1469598103934665603ULL) {
    for (size_t i = 0; i < n; ++i) {
        h ^= p[i];
        h *= 1099511628211ULL;
    }
    return h;
}

// errors (ggswarm.cpp): set the thread's and the handle's last error, return code
ggswarm_status fail(const ggswarm_model * m, ggswarm_status code, const char * fmt, ...)
    __attribute__((format(printf, 3, 4)));
ggswarm_status ok(const ggswarm_model * m);

// loading (loader.cpp; read_hparams: hparams.cpp)
// Every tensor the window [m->layer_start, m->layer_end) needs is in the file's table with the expected
// shape and type; nothing is allocated (ggswarm_check_file).
ggswarm_status check_window(ggswarm_model * m, const Meta & meta);
// ggswarm_model_open; mtp_block: open the file's nextn block as the window [trunk, trunk + 1) (mtp.cpp)
ggswarm_status open_model(const char * path, int32_t layer_start, int32_t layer_end, int32_t n_threads,
                          ggswarm_budget * budget, const char * model_id, bool mtp_block, ggswarm_model ** out);
ggswarm_status read_hparams(ggswarm_model * m, const Meta & meta);
ggswarm_status load_weights(ggswarm_model * m, const Meta & meta, const char * path, uint64_t file_size);
std::string fingerprint(const char * path, uint64_t data_off, uint64_t file_size);
ggswarm_status apply_threads(ggswarm_model * m, int32_t n);
ggswarm_status init_backends(ggswarm_model * m);
ggswarm_status init_sched(ggswarm_model * m);
ggml_backend_sched_t new_sched(const ggswarm_model * m, size_t graph_size = 0);

// multi-token prediction (mtp.cpp): after a micro-batch of positions [pos, pos + nc) of session sid ran
// on a window with a block attached, feed them to the block; forget a closed session; free the block
void mtp_after_chunk(ggswarm_model * m, int64_t sid, const ggswarm_batch * b, int32_t off, int32_t nc);
void mtp_session_closed(ggswarm_model * m, int64_t sid);
void mtp_set_threads(ggswarm_model * m, int32_t n);
void mtp_free(ggswarm_model * m);
// a session's nextn state as the snapshot's trailer (snapshot.cpp): its bytes at the trunk's length len (0:
// none: no block, or one that does not follow), written, checked (before a restore touches the session)
// and restored (n == 0: the block starts over)
uint64_t mtp_snapshot_bytes(const ggswarm_model * m, int64_t sid, int32_t len);
bool mtp_snapshot_write(const ggswarm_model * m, int64_t sid, int32_t len, uint8_t * p, uint64_t n);
ggswarm_status mtp_check_trailer(const ggswarm_model * m, int32_t len, const uint8_t * p, uint64_t n);
ggswarm_status mtp_restore(ggswarm_model * m, int64_t sid, int32_t len, int32_t capacity, const uint8_t * p, uint64_t n);

// session state (kv.cpp)
void budget_release(ggswarm_budget * b);
bool budget_charge(ggswarm_budget * b, uint64_t bytes);  // false (nothing taken) when it cannot hold them
void budget_credit(ggswarm_budget * b, uint64_t bytes);
void free_kv(ggswarm_model * m, Session & s);  // release the session's KV and credit the budget
Session * find_session(const ggswarm_model * m, int64_t sid);
ggswarm_status no_session(const ggswarm_model * m, int64_t sid);
int64_t pad_kv(int64_t n);
bool kernel_step(const ggswarm_model * m, int32_t n);
// ggswarm.cpp: set m->decode_kernels to the non-flash mode this device and head size take (the decode
// kernels where the open-time self-check proves them identical to ggml's ops, else the ops); `what`
// names the model in a failed self-check's message
void choose_non_flash(ggswarm_model * m, const char * what);
int64_t kernel_span(int64_t n);
ggswarm_status ensure_capacity(ggswarm_model * m, Session & s, int32_t need);

// compute (graph.cpp), shared with batch.cpp
constexpr int32_t kUBatch = 512;  // positions per micro-batch (bounded compute memory, like llama.cpp's n_ubatch)
// Sliding-window attention layers keep K and V in a ring, as llama.cpp's SWA cache: GGML_PAD(min(n_ctx,
// n_swa + n_ubatch), 256) slots (at most the session's capacity); position p in slot p % slots.
// window_ring is that size at full capacity (deepseek4's raw window is sized the same way).
bool swa_ring(const ggswarm_model * m, int32_t il);
int64_t window_ring(const ggswarm_model * m);
int64_t swa_rows(const ggswarm_model * m, int64_t cap);
ggswarm_status validate_step(ggswarm_model * m, const Session & s, const ggswarm_batch * b);
// The attention mask for positions [pos, pos + nc) over n_kv cache slots: causal, within `window` when
// > 0; `ring` > 0: slot j holds the newest position q <= pos + nc - 1 with q = j (mod ring)
void set_mask(ggswarm_model * m, ggml_tensor * mask, int32_t pos, int32_t nc, int32_t n_kv, int32_t window,
              int64_t ring = 0);
// The K row and transposed-V element indices of positions [pos, pos + nc) in a cache of `rows` slots
void set_cache_idx(ggswarm_model * m, ggml_tensor * kidx, ggml_tensor * vidx, int32_t pos, int32_t nc, int64_t rows);
// a new graph of `size` nodes in g (its context and metadata) and its input rows for n positions: the
// token ids' embeddings on the first window, else the incoming hidden rows
ggml_tensor * graph_input(ggswarm_model * m, Graph & g, size_t size, int64_t n);
ggml_tensor * output_head(ggswarm_model * m, ggml_context * c, ggml_tensor * x);  // last window: norm, head, softcap
void bind_leaf(ggml_tensor * leaf, const ggml_tensor * kv);
void collect_kv_views(Graph & g);
void drop_graph(ggswarm_model * m, const Graph * g);
// Compute a window graph of `rows` positions (graph.cpp): a one-row step of a window whose weights are
// small runs on the calling thread alone, since waking the pool's workers costs more than they save.
bool compute_graph(ggswarm_model * m, Graph & g, int64_t rows);
// Whether the window's one-row steps are small enough for one thread (its weights, once loaded).
bool is_small_window(const ggswarm_model * m);

}  // namespace ggswarm
