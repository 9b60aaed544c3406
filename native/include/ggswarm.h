/*
 * ggswarm.h - the whole interface of libggswarm, a ggml layer-window executor.
 *
 * libggswarm runs transformer layers [layer_start, layer_end) of a GGUF model with ggml's quantized
 * kernels. The boundary hidden state goes in and out as f16/f32 rows; the first window embeds token
 * ids; the last one applies the output norm and head and samples on the node (logits never leave it).
 * Every session keeps its own KV cache in ggml tensors, grown on demand inside a byte budget that all
 * model handles of a node share (ggswarm_budget), and can be truncated, snapshotted to bytes and
 * restored in another process.
 *
 * Conventions
 *   - Every function that can fail returns a ggswarm_status (0 = GGSWARM_OK, < 0 = error). The message
 *     of the last failure is available from ggswarm_last_error() (thread-local) and from
 *     ggswarm_model_last_error() (per model handle). The library never aborts on bad input.
 *   - A model handle is not thread-safe: serialise calls on one handle. Distinct handles may be used
 *     from distinct threads, even when they share one budget (the budget is thread-safe).
 *   - Sessions are identified by int64 ids owned by the model handle; unknown ids are an error
 *     (GGSWARM_E_NO_SESSION), so a stale id can never touch freed memory.
 *
 * API versions (GGSWARM_API_VERSION; bump on every change of a declaration or struct below)
 *   1 - first version: model open/free/info, threads, sessions (open/close/len/truncate/kv bytes),
 *       forward (token ids or f16/f32 hidden in; hidden, or sampled token + logprob + optional
 *       logits out), KV snapshot/restore (snapshot format version 1), standalone sampler.
 *   2 - ggswarm_model_info.decode_kernels.
 *   3 - one KV budget per node: ggswarm_budget_new/free/get, shared by the handles opened with it
 *       (ggswarm_model_open takes a budget instead of kv_budget_bytes; ggswarm_model_info loses
 *       kv_budget_bytes); ggswarm_session_growth_bytes; ggswarm_model_info.graph_builds.
 *   4 - recurrent state (qwen35, qwen35moe): checkpoints; ggswarm_session_truncate_to (rewind to the
 *       nearest checkpoint, report where and how), ggswarm_set_checkpoints, ggswarm_session_checkpoints;
 *       on a window with recurrent layers ggswarm_session_truncate goes back to that checkpoint too.
 *   5 - deepseek4: ggswarm_batch.token_ids also with hidden_in, required on a window whose layers route
 *       experts by token id (hash layers); ggswarm_model_info.d_model is the boundary row (d_model x
 *       the hyper-connection streams: 4 x d_model for deepseek4).
 *   6 - continuous batching: ggswarm_forward_many (one step of each of several sessions in one graph),
 *       ggswarm_forward_many_error, GGSWARM_MAX_STEPS; ggswarm_model_info.batches_sessions.
 *   7 - the decode lane (ggswarm_lane_*): a session's small steps relayed hop to hop by libggswarm's own
 *       threads on blocking sockets, AES-256-GCM sealed frames (docs/lane.md); every call that changes
 *       a model handle (forward, forward_many, session open/close/truncate/restore, snapshot, threads,
 *       checkpoint policy) now holds the handle's lock, so a lane thread and the caller may share a
 *       handle; calls that only read (session_len, kv_bytes, growth_bytes, snapshot_size, checkpoints,
 *       info, forward_many_error) take no lock and may run beside a step on another thread, as before
 *       (the per-handle ggswarm_model_last_error may hold a lane step's message: read the thread's own
 *       ggswarm_last_error after a failed call).
 *   8 - lane bundles: one lane frame may carry the steps of up to GGSWARM_LANE_MAX_BUNDLE sessions on
 *       one window, run as one ggswarm_forward_many batch and sent on as one bundle (docs/lane.md);
 *       ggswarm_lane_wait_step, for an owner pacing its own long work between the lane's steps.
 *   9 - ggswarm_lane_take_batches: the batches the lane computed (steps, positions, tokens sampled, lock
 *       wait, compute), so the owner's telemetry counts lane work beside its own.
 *  10 - ggswarm_check_file: whether the executor opens a file (its metadata, RoPE scaling and every
 *       layer's tensor table), without loading weights; what "servable" means for inspect and placement.
 *       RoPE scaling as llama.cpp reads it (YaRN included); deepseek4's per-layer clamps.
 *       ggswarm_set_cache_type: the attention caches' type, like llama.cpp's --cache-type-k (f16 by
 *       default; deepseek4 also f32); deepseek4's state held as llama.cpp holds it (rings: the raw
 *       window and the compressor rows; a truncate past them goes to a checkpoint or to 0).
 *  11 - quantized attention caches: GGSWARM_TYPE_Q8_0 and GGSWARM_TYPE_Q4_0 for ggswarm_set_cache_type,
 *       as llama.cpp's --cache-type-k/-v q8_0|q4_0 (flash attention, and llama.cpp's Hadamard
 *       rotations of the cached rows, follow: ggswarm_model_info.decode_kernels -2); snapshots of such
 *       caches hold their quantized rows (V per position). ggswarm_set_flash_attention: llama.cpp's
 *       flash-attention switch per handle; a CPU without AVX-512 now runs ggml's non-flash ops by default
 *       (llama.cpp's default path), not flash attention.
 *  12 - capacity named capacity: ggswarm_session_open(model, capacity, ...) takes the positions a session
 *       may grow to (was max_tokens, which the webapp uses for a completion's length); same ABI.
 *  13 - ggswarm_lane_gate / ggswarm_lane_gate_release: the owner's own work (a prompt's chunk) goes just
 *       before the lane's next step on this hop, which waits for it (at most GGSWARM_LANE_GATE_MAX_MS):
 *       a mixed step, where wait_step's pacing ran the chunk beside the lane's steps at other hops.
 *  14 - ggswarm_session_checkpoint / ggswarm_session_drop_checkpoint: a checkpoint at the session's
 *       length now, so a speculative verification's rows, run one position at a time, can be cut back
 *       exactly on a window that keeps recurrent state, and dropped once the verification is settled.
 *  15 - multi-token prediction (deepseek4, glm-dsa): ggswarm_mtp_open attaches the file's nextn block to the last
 *       window; ggswarm_forward on it then feeds the block's per-session state; ggswarm_mtp_draft.
 *       Checkpoints: by default at the start and end of multi-token calls only, at most 2 (every_n_tokens
 *       0, max_per_session 2; were 256 and 8); the one ggswarm_session_checkpoint takes is held apart
 *       (not counted against max_per_session) and is the only kind ggswarm_session_drop_checkpoint drops.
 *  16 - snapshot format 3: a session's nextn-block state (the block's own snapshot and the trunk rows its
 *       drafts read) travels after the payload, so a session handed off or restored from a prefix keeps
 *       drafting; format 2 snapshots still restore (their block starts over). Same declarations;
 *       snapshot_size takes the lock on a window with a block attached (it brings the block back to the
 *       trunk's length, as the snapshot then finds it).
 *  17 - automatic checkpoints are a cache of the budget's free room: a session growing (or restored)
 *       where the budget is short takes back the handle's automatic checkpoints, least recently taken
 *       first, before it fails; ggswarm_checkpoints_reclaimable, ggswarm_reclaim_checkpoints (for an
 *       owner that admits work on several handles sharing one budget).
 *  18 - ggswarm_lane_activity: a lane session's busy flag and idle time without waiting for its step in
 *       flight (ggswarm_lane_stats_get waits: in relay mode until the later hops answered), for an
 *       owner's event loop and its KV admission; ggswarm_lane_gate's quiet check counts a release.
 */
#ifndef GGSWARM_H
#define GGSWARM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GGSWARM_API_VERSION 18

#if defined(_WIN32)
#define GGSWARM_API __declspec(dllexport)
#else
#define GGSWARM_API __attribute__((visibility("default")))
#endif

typedef int32_t ggswarm_status;

#define GGSWARM_OK 0
#define GGSWARM_E_INVALID_ARG -1   /* a parameter is out of range (threads <= 0, n_tokens 0, ...) */
#define GGSWARM_E_IO -2            /* the file cannot be opened or read */
#define GGSWARM_E_FORMAT -3        /* malformed GGUF, missing/misshapen tensor, corrupt or truncated data */
#define GGSWARM_E_UNSUPPORTED -4   /* architecture or feature this library does not implement */
#define GGSWARM_E_RANGE -5         /* layer range, position or context beyond what is allowed */
#define GGSWARM_E_BUDGET -6        /* the KV byte budget cannot hold the request */
#define GGSWARM_E_NO_SESSION -7    /* unknown session id */
#define GGSWARM_E_COMPUTE -8       /* ggml failed to allocate or compute a graph */
#define GGSWARM_E_MISMATCH -9      /* a snapshot belongs to another model / range / shape */
#define GGSWARM_E_NO_MEMORY -10    /* a host or device allocation failed */

/* element types of hidden-state buffers (f32, f16) and of attention caches (all four) */
#define GGSWARM_TYPE_F32 0
#define GGSWARM_TYPE_F16 1
#define GGSWARM_TYPE_Q8_0 2
#define GGSWARM_TYPE_Q4_0 3

/* hard product cap on positions per session, whatever the model allows */
#define GGSWARM_MAX_CONTEXT 131072
/* largest batch accepted by one forward call */
#define GGSWARM_MAX_BATCH 4096
/* most steps (sessions) accepted by one ggswarm_forward_many call */
#define GGSWARM_MAX_STEPS 256

typedef struct ggswarm_model ggswarm_model;
typedef struct ggswarm_budget ggswarm_budget;

typedef struct ggswarm_model_info {
    char architecture[32];      /* general.architecture, NUL-terminated */
    char device[64];            /* ggml backend device the weights live on */
    int32_t n_layers_total;     /* block_count of the whole model */
    int32_t layer_start;        /* first layer held */
    int32_t layer_end;          /* one past the last layer held */
    int32_t is_first;           /* 1 when layer_start == 0: forward takes token ids */
    int32_t is_last;            /* 1 when layer_end == n_layers_total: forward samples */
    int32_t d_model;            /* elements per token of the boundary state */
    int32_t n_vocab;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_ff;
    int32_t n_ctx_train;        /* context_length of the model */
    int32_t n_ctx_max;          /* min(n_ctx_train, GGSWARM_MAX_CONTEXT) */
    int32_t n_threads;
    uint64_t weight_bytes;      /* bytes of tensor data read for this window */
    uint64_t kv_bytes_per_token;/* KV bytes one position costs over the window's layers */
    char model_id[72];          /* identity written into snapshots (caller's sha256 or a fingerprint) */
    int32_t decode_kernels;     /* 1: decode steps run libggswarm's own CPU attention kernels, which
                                   give the same numbers as ggml's ops (AVX-512 CPU and ggml build,
                                   head_dim % 64 == 0, GGSWARM_GGML_ATTENTION unset when opened, and
                                   checked against ggml's ops at open); 0: ggml's ops; -1: ggml's ops
                                   because that check found a bit differ (logged to stderr); -2:
                                   ggml_flash_attn_ext on every step (GPU devices at auto, flash
                                   attention set on, a quantized cache; V cache not transposed) */
    uint64_t graph_builds;      /* window graphs built so far: one per new shape (batch size, attended
                                   span, KV capacity, last-only); sessions of one shape share it */
    int32_t batches_sessions;   /* v6: 1 when ggswarm_forward_many runs several sessions' steps in one
                                   graph (llama, mistral, qwen2, qwen3, gemma3); 0: it runs them one
                                   after another (recurrent or token-routed architectures) */
} ggswarm_model_info;

typedef struct ggswarm_sampling {
    double temperature;     /* <= 0: greedy */
    int32_t top_k;          /* 0 = disabled */
    int32_t repeat_last_n;  /* < 0: whole history; 0: disabled */
    double top_p;           /* 1.0 = disabled */
    double min_p;           /* 0.0 = disabled */
    double repeat_penalty;  /* 1.0 = disabled */
    uint64_t seed;
} ggswarm_sampling;

typedef struct ggswarm_batch {
    int32_t n_tokens;             /* 1 .. GGSWARM_MAX_BATCH */
    int32_t pos_start;            /* must equal the session length (append only; truncate first) */
    const int32_t * token_ids;    /* first window, or a window with token-routed layers: n_tokens ids; else NULL */
    const void * hidden_in;       /* other windows: n_tokens x d_model of hidden_in_type; else NULL */
    int64_t hidden_in_count;      /* elements in hidden_in; must equal n_tokens * d_model */
    int32_t hidden_in_type;       /* GGSWARM_TYPE_F32 or GGSWARM_TYPE_F16 */
    int32_t hidden_out_type;      /* GGSWARM_TYPE_F32 or GGSWARM_TYPE_F16 */
    void * hidden_out;            /* non-last windows: n_tokens x d_model of hidden_out_type */
    int64_t hidden_out_count;     /* capacity of hidden_out in elements; >= n_tokens * d_model */
    float * logits_out;           /* last window, optional: n_tokens x n_vocab logits (teacher forcing) */
    int64_t logits_out_count;     /* capacity of logits_out in elements; >= n_tokens * n_vocab */
    const ggswarm_sampling * sampling; /* last window: NULL means greedy */
    const int32_t * history;      /* last window: token ids seen so far (repetition penalty); may be NULL */
    int32_t n_history;
    int32_t * token_out;          /* last window: sampled token of the final position */
    double * logprob_out;         /* last window: log-softmax of the raw logits at token_out */
    double * compute_s_out;       /* optional: seconds spent in graph build + compute */
} ggswarm_batch;

/* API version the library was built with (compare with GGSWARM_API_VERSION). */
GGSWARM_API int32_t ggswarm_api_version(void);

/* Message of the last failed call on this thread ("" when none). Valid until the next call. */
GGSWARM_API const char * ggswarm_last_error(void);

/* A node's KV byte budget: the KV of every session of every model handle opened with it stays within
 * total_bytes together (0 holds nothing). Thread-safe. */
GGSWARM_API ggswarm_status ggswarm_budget_new(uint64_t total_bytes, ggswarm_budget ** out);

/* Drop the caller's reference. The budget lives on until the last model handle opened with it is
 * freed, so the order of frees does not matter. NULL is ignored. */
GGSWARM_API void ggswarm_budget_free(ggswarm_budget * budget);

/* The budget's total and the KV bytes its sessions hold now (either out pointer may be NULL). */
GGSWARM_API ggswarm_status ggswarm_budget_get(const ggswarm_budget * budget, uint64_t * out_total,
                                              uint64_t * out_used);

/* Open layers [layer_start, layer_end) of the GGUF at path. Reads only those layers' tensors plus the
 * role tensors (first window: token_embd.weight; last: output_norm.weight and output.weight, or
 * token_embd.weight when tied). budget (may be NULL: no limit) is charged for every session's KV; the
 * handle keeps a reference to it. model_id (may be NULL) is the identity recorded in snapshots, e.g.
 * the file's sha256 hex; when NULL a metadata fingerprint is used. */
GGSWARM_API ggswarm_status ggswarm_model_open(const char * path, int32_t layer_start, int32_t layer_end,
                                              int32_t n_threads, ggswarm_budget * budget,
                                              const char * model_id, ggswarm_model ** out);

/* Free the model, its sessions and their KV. NULL is ignored. */
GGSWARM_API void ggswarm_model_free(ggswarm_model * model);

/* Whether ggswarm_model_open would accept `path` for any window: the header, the architecture's
 * hyper-parameters (with llama.cpp's types and fallbacks) and every layer's tensors (names, shapes,
 * types) are checked from the metadata alone; no weight is read, so a partly downloaded file works.
 * GGSWARM_OK, or the error open would give (message in ggswarm_last_error). */
GGSWARM_API ggswarm_status ggswarm_check_file(const char * path);

/* Message of the last failed call on this handle ("" when none). */
GGSWARM_API const char * ggswarm_model_last_error(const ggswarm_model * model);

GGSWARM_API ggswarm_status ggswarm_model_info_get(const ggswarm_model * model, ggswarm_model_info * out);

/* Threads used by CPU compute; must be >= 1. Cheap when n_threads is at most the largest count set so
   far on this handle (its threadpool is kept). Results do not depend on the count. */
GGSWARM_API ggswarm_status ggswarm_set_threads(ggswarm_model * model, int32_t n_threads);

/* Open a session able to grow to capacity positions (1 .. n_ctx_max); KV is allocated on demand. */
GGSWARM_API ggswarm_status ggswarm_session_open(ggswarm_model * model, int32_t capacity, int64_t * out_sid);

/* Close a session and free its KV. Unknown ids return GGSWARM_E_NO_SESSION. */
GGSWARM_API ggswarm_status ggswarm_session_close(ggswarm_model * model, int64_t sid);

GGSWARM_API ggswarm_status ggswarm_session_len(const ggswarm_model * model, int64_t sid, int32_t * out_len);

/* Drop positions >= n_tokens (n_tokens <= length). A window with recurrent layers (v4) goes back to its
 * newest checkpoint at or before n_tokens, so the session may hold fewer (see ggswarm_session_len, or
 * ggswarm_session_truncate_to which reports it). */
GGSWARM_API ggswarm_status ggswarm_session_truncate(ggswarm_model * model, int64_t sid, int32_t n_tokens);

/* ggswarm_session_truncate_to's *out_kind */
#define GGSWARM_TRUNCATE_EXACT 0       /* the session holds exactly n_tokens (KV-only window, or nothing to undo) */
#define GGSWARM_TRUNCATE_CHECKPOINT 1  /* recurrent state restored from a checkpoint at *out_len <= n_tokens */
#define GGSWARM_TRUNCATE_FROM_ZERO 2   /* no checkpoint at or before n_tokens: state reset, *out_len = 0 */

/* Truncate a session that may keep recurrent state (v4). A recurrent state cannot be cut back to an
 * arbitrary position, so the session goes back to the newest checkpoint at or before n_tokens (exact
 * when one is there; KV-only windows: exactly n_tokens). *out_len gets the length it now holds: the
 * caller re-prefills positions [*out_len, n_tokens). *out_kind gets a GGSWARM_TRUNCATE_* value.
 * Checkpoints are taken at the start and end of every forward call of more than one position (and
 * every ggswarm_set_checkpoints interval, default 0: none), at most 2 per session by default (the
 * latest call's start and end); they count against the budget. */
GGSWARM_API ggswarm_status ggswarm_session_truncate_to(ggswarm_model * model, int64_t sid, int32_t n_tokens,
                                                       int32_t * out_len, int32_t * out_kind);

/* A checkpoint of the session's fixed-size state at its length now (v14), unless one is there: a later
 * ggswarm_session_truncate_to into the positions after it goes back exactly here. A no-op on windows
 * without such state or with a checkpoint maximum of 0. It is held apart from the automatic ones: it
 * does not count against ggswarm_set_checkpoints' maximum and pushes none of them out (nor do they push
 * it out, nor does a short budget make room for it); a session holds one such checkpoint at a time (a
 * newer one replaces it). *out_taken (may be NULL): 1 when this call added the checkpoint, 0 when one
 * was there or none could be taken (its caller drops only what it took). */
GGSWARM_API ggswarm_status ggswarm_session_checkpoint(ggswarm_model * model, int64_t sid, int32_t * out_taken);

/* Drop the checkpoint ggswarm_session_checkpoint took at position pos, if the session holds it (v14),
 * crediting its bytes (an automatic checkpoint there, e.g. a later call's start, stays). */
GGSWARM_API ggswarm_status ggswarm_session_drop_checkpoint(ggswarm_model * model, int64_t sid, int32_t pos);

/* Checkpoint policy of this handle's sessions (v4): checkpoints at the start and end of every forward
 * call of more than one position and, with every_n_tokens > 0, one every every_n_tokens positions
 * (default 0: none); at most max_per_session per session (default 2; 0: none at all; the oldest dropped
 * first). A no-op for windows without recurrent layers. */
GGSWARM_API ggswarm_status ggswarm_set_checkpoints(ggswarm_model * model, int32_t every_n_tokens,
                                                   int32_t max_per_session);

/* (v17) Bytes the handle's automatic checkpoints hold: room ggswarm_reclaim_checkpoints can give back
 * (a checkpoint ggswarm_session_checkpoint took is not counted: a verification in flight needs it). */
GGSWARM_API ggswarm_status ggswarm_checkpoints_reclaimable(ggswarm_model * model, uint64_t * out_bytes);

/* (v17) Drop the handle's automatic checkpoints, the least recently taken first, until want_bytes are
 * credited to the budget or none is left; *out_freed (may be NULL) gets the bytes credited. A truncate
 * that needed a dropped one goes to an older checkpoint or to 0 (GGSWARM_TRUNCATE_FROM_ZERO). A session's
 * growth does this by itself where the budget is short. */
GGSWARM_API ggswarm_status ggswarm_reclaim_checkpoints(ggswarm_model * model, uint64_t want_bytes,
                                                       uint64_t * out_freed);

/* The positions of the session's checkpoints, ascending: up to capacity of them into positions (may be
 * NULL when capacity is 0); *out_count gets how many there are. */
GGSWARM_API ggswarm_status ggswarm_session_checkpoints(const ggswarm_model * model, int64_t sid,
                                                       int32_t * positions, int32_t capacity,
                                                       int32_t * out_count);

/* (v10) The type of the window's attention caches for the sessions opened after it: GGSWARM_TYPE_F16
 * (the default, as llama.cpp's), GGSWARM_TYPE_F32 where the architecture keeps it (deepseek4), (v11)
 * GGSWARM_TYPE_Q8_0 or GGSWARM_TYPE_Q4_0 where it keeps them (K and V alike: llama.cpp's
 * --cache-type-k/-v with flash attention on, which a quantized V requires there); GGSWARM_E_UNSUPPORTED
 * otherwise, GGSWARM_E_INVALID_ARG while a session is open. Recurrent states and compressor rows stay
 * f32, as in llama.cpp. */
GGSWARM_API ggswarm_status ggswarm_set_cache_type(ggswarm_model * model, int32_t type);

/* (v11) Flash attention on (1) or off (0) for the steps run from now on, like llama.cpp's -fa on|off: on
 * runs ggml_flash_attn_ext as llama.cpp builds it (ggswarm_model_info.decode_kernels -2), off llama.cpp's
 * non-flash ops (or, on an AVX-512 CPU, the decode kernels that the open-time check proved identical to
 * them). Not calling it keeps the choice made at open ("auto": flash on a GPU, off on a CPU). Refused
 * while a session is open, and off with a quantized cache (llama.cpp requires flash attention for a
 * quantized V). */
GGSWARM_API ggswarm_status ggswarm_set_flash_attention(ggswarm_model * model, int32_t on);

/* KV bytes held by one session, or by all sessions of this handle when sid < 0 (v4: recurrent state
 * and checkpoints included). */

GGSWARM_API ggswarm_status ggswarm_kv_bytes(const ggswarm_model * model, int64_t sid, uint64_t * out_bytes);

/* Extra KV bytes the budget must have free for the session to hold n_positions (1 .. its capacity):
 * 0 when its capacity already suffices. A forward call that grows the session needs no more than this
 * (it takes more, doubling the capacity, only when the budget has room). */
GGSWARM_API ggswarm_status ggswarm_session_growth_bytes(const ggswarm_model * model, int64_t sid,
                                                        int32_t n_positions, uint64_t * out_bytes);

/* Run the window on positions [pos_start, pos_start + n_tokens) of session sid, appending to its KV. */
GGSWARM_API ggswarm_status ggswarm_forward(ggswarm_model * model, int64_t sid, const ggswarm_batch * batch);

/* v6: run one step of each of n DISTINCT sessions (sids[i] with batches[i], each as ggswarm_forward
 * would take it) together. On an architecture that batches (ggswarm_model_info.batches_sessions) the
 * steps' rows run through one graph: embedding, norms, projections, FFN and output head over all rows
 * at once, attention and KV writes per session over its own cache, in groups of at most 512 rows (the
 * micro-batch); a longer step, or one left alone in its group, runs as ggswarm_forward runs it. Elsewhere
 * the steps run one after another inside the call. Each step gets its outputs (hidden rows, or sampled
 * token, logprob and optional logits) as ggswarm_forward gives them, and its own status in
 * statuses[i]: a step that fails validation (or a duplicate sid, or the budget) fails alone and leaves
 * its session untouched; a compute failure fails the steps computed with it. *compute_s_out, when
 * set, is the time of the graph the step ran in. Returns GGSWARM_OK when every step ran, else the
 * first failing step's status (its message, prefixed with the step index, as the last error); each
 * step's own message: ggswarm_forward_many_error. 1 <= n <= GGSWARM_MAX_STEPS. */
GGSWARM_API ggswarm_status ggswarm_forward_many(ggswarm_model * model, int32_t n, const int64_t * sids,
                                                const ggswarm_batch * batches, ggswarm_status * statuses);

/* Message of step i of the last ggswarm_forward_many call on this handle ("" when it ran, or i is out
 * of range). Valid until the next call on the handle. */
GGSWARM_API const char * ggswarm_forward_many_error(const ggswarm_model * model, int32_t i);

/* Bytes ggswarm_session_snapshot will write for the session's current length. */
GGSWARM_API ggswarm_status ggswarm_session_snapshot_size(const ggswarm_model * model, int64_t sid,
                                                         uint64_t * out_size);

/* Serialise the session's KV (header + payload, see docs/native.md) into buf (buf_size bytes). */
GGSWARM_API ggswarm_status ggswarm_session_snapshot(const ggswarm_model * model, int64_t sid, void * buf,
                                                    uint64_t buf_size, uint64_t * out_written);

/* Replace the session's KV with a snapshot. Fails with GGSWARM_E_MISMATCH naming the field when the
 * snapshot was taken from another model id, layer range or KV shape, and with GGSWARM_E_FORMAT when
 * it is truncated or corrupt. On failure the session is left unchanged. */
GGSWARM_API ggswarm_status ggswarm_session_restore(ggswarm_model * model, int64_t sid, const void * buf,
                                                   uint64_t size);

/* The sampler the last window uses, on caller-supplied logits (exposed for tests and tools).
 * position: absolute position of the input whose logits these are (selects the random draw).
 * out_logprob may be NULL: the log-softmax (a pass over the vocabulary in double) is then skipped. */
GGSWARM_API ggswarm_status ggswarm_sample(const float * logits, int32_t n_vocab, const ggswarm_sampling * params,
                                          int64_t position, const int32_t * history, int32_t n_history,
                                          int32_t * out_token, double * out_logprob);

/* ---- v15: multi-token prediction (docs/native.md, "Multi-token prediction") -------------------------------
 * The last window of a model whose file carries a nextn block (DeepSeek-V4, GLM-5.x's glm-dsa:
 * nextn_predict_layers = 1) can attach it. Each position p of a session then also runs through the block,
 * as llama.cpp's MTP context runs it: the token at p with the trunk's last hidden row of position p - 1
 * (deepseek4: the hyper-connection streams before the output head; glm-dsa: after the output norm;
 * zeros at 0), into the block's own per-session state (deepseek4: its raw sliding-window K cache;
 * glm-dsa: its latent cache; charged to the handle's budget, freed with the session). A forward call
 * therefore needs token_ids on an MTP window (the tokens of its positions); a call without them leaves the
 * session's MTP state behind, and drafts for it are refused (GGSWARM_E_RANGE) until the session starts over
 * at position 0. A snapshot carries the block's state (v16), so a restored session drafts on; one taken
 * without it (format 2, or a window without the block) restores with the block starting over.
 * ggswarm_mtp_draft drafts. */

/* most tokens one ggswarm_mtp_draft call drafts */
#define GGSWARM_MTP_MAX_DRAFT 15

/* Attach the nextn block of the GGUF at path (the file this window was opened from) to `model`, the last
 * window (layer_end == the trunk's layer count). Reads only the block's tensors and the roles it uses
 * (token embedding, output head); shares the model's budget, threads and cache type (set the cache
 * type before: ggswarm_set_cache_type also applies to the block). GGSWARM_E_UNSUPPORTED when the
 * architecture or the file has no such block; GGSWARM_E_INVALID_ARG while a session is open. */
GGSWARM_API ggswarm_status ggswarm_mtp_open(ggswarm_model * model, const char * path);

/* Draft n_draft (1 .. GGSWARM_MTP_MAX_DRAFT) tokens after position pos of session sid (pos <= its
 * length: the session's length, or, after a speculative verification, where the drafts that stood
 * end): `token` is the token at position pos (sampled, not in the session at pos yet); the block's
 * greedy token for pos + 1 from it and the trunk's row of pos - 1, then each next from the previous
 * draft and the block's own output row (llama.cpp's single-head chain). drafts_out gets *n_out tokens;
 * logits_out (optional, >= n_draft x n_vocab) each draft's logits. The block's state is left at pos
 * (the trunk's positions after it are cut back by the session's next call, as usual). GGSWARM_E_RANGE
 * when the block does not follow the session (see above) or the trunk's row of pos - 1 is no longer
 * kept (the last 64 positions' are). */
GGSWARM_API ggswarm_status ggswarm_mtp_draft(ggswarm_model * model, int64_t sid, int32_t pos, int32_t token,
                                             int32_t n_draft, int32_t * drafts_out, float * logits_out,
                                             int64_t logits_out_count, int32_t * n_out);

/* ---- v7: the decode lane (docs/lane.md) --------------------------------------------------------------
 * A lane is a TCP listener whose connections libggswarm serves on its own threads, with blocking
 * sockets and no interpreter: a frame names a lane session, is opened with that session's key
 * (AES-256-GCM, the header as associated data, the step number as nonce), runs as one ggswarm_forward
 * step of the session, and goes on to the next hop's lane sealed with the next hop's key; the next hop's
 * answer (sampled token, log-probability, every hop's timings) comes back the same way. The caller
 * admits a session to the lane (ggswarm_lane_add) after checking it by its own rules, and takes it off
 * (ggswarm_lane_remove) to run it itself again. A frame that fails any check changes nothing. */

/* most positions one lane step may carry (decode steps and short drafts; prompts stay off the lane) */
#define GGSWARM_LANE_MAX_TOKENS 64
/* most hops whose timings an answer carries */
#define GGSWARM_LANE_MAX_HOPS 64
/* most sessions and most open connections one lane holds */
#define GGSWARM_LANE_MAX_SESSIONS 4096
#define GGSWARM_LANE_MAX_CONNECTIONS 256
#define GGSWARM_LANE_KEY_BYTES 32
/* v8: most sessions whose steps one bundle frame carries */
#define GGSWARM_LANE_MAX_BUNDLE 32

typedef struct ggswarm_lane ggswarm_lane;

typedef struct ggswarm_lane_session {
    uint64_t lane_id;               /* the id frames for it carry (the caller's choice: unpredictable, unique) */
    ggswarm_model * model;          /* the window it runs on; must outlive its stay on the lane */
    int64_t sid;                    /* the model's session */
    uint8_t key_in[GGSWARM_LANE_KEY_BYTES];   /* opens frames from upstream and seals answers to it */
    const char * next_host;         /* next hop's lane (numeric IPv4 address); NULL on the last window */
    int32_t next_port;
    uint64_t next_lane_id;
    uint8_t key_out[GGSWARM_LANE_KEY_BYTES];  /* seals frames to the next hop and opens its answers */
    int32_t hidden_out_type;        /* GGSWARM_TYPE_F16 or _F32: the boundary rows sent on */
    const ggswarm_sampling * sampling; /* last window: NULL means greedy (copied) */
    const int32_t * history;        /* last window: token ids so far (copied; only what the penalty reads) */
    int32_t n_history;
    uint64_t first_step;            /* the lowest step number accepted from upstream */
    int32_t answer_direct;          /* 1: direct mode: a window before the last sends its rows on without
                                       waiting; the last window answers the connection that subscribed
                                       for the session (kind 4), and every window sends its errors
                                       there; 0: relay mode, each answer goes back the way it came */
} ggswarm_lane_session;

typedef struct ggswarm_lane_stats {
    uint64_t steps;                 /* steps the lane ran for the session */
    uint64_t next_step;             /* the lowest step number it accepts now */
    double idle_s;                  /* seconds since it was added or last ran a step */
    int32_t busy;                   /* 1 while a step of it is running */
    int32_t n_appended;             /* last window: token ids its steps appended to the history */
} ggswarm_lane_stats;

/* Listen on bind_host:port (numeric IPv4; port 0: any free port, see ggswarm_lane_port). */
GGSWARM_API ggswarm_status ggswarm_lane_open(const char * bind_host, int32_t port, ggswarm_lane ** out);

GGSWARM_API int32_t ggswarm_lane_port(const ggswarm_lane * lane);

/* Admit a session (its lane_id not on the lane yet). Copies everything it points to. */
GGSWARM_API ggswarm_status ggswarm_lane_add(ggswarm_lane * lane, const ggswarm_lane_session * session);

/* Take a session off the lane, after the step of it in flight, if any; stats (may be NULL) get its last
 * figures and appended (may be NULL; capacity ids) the ids its steps appended to the history. */
GGSWARM_API ggswarm_status ggswarm_lane_remove(ggswarm_lane * lane, uint64_t lane_id, ggswarm_lane_stats * stats,
                                               int32_t * appended, int32_t capacity);

GGSWARM_API ggswarm_status ggswarm_lane_stats_get(ggswarm_lane * lane, uint64_t lane_id, ggswarm_lane_stats * out);

/* v18: whether a step of the session runs now (busy 1) and seconds since it was added or last ran one,
 * read at once: unlike ggswarm_lane_stats_get, it does not wait for the session's step in flight. */
GGSWARM_API ggswarm_status ggswarm_lane_activity(ggswarm_lane * lane, uint64_t lane_id, double * idle_s, int32_t * busy);

/* Take every session of a model off the lane (call before ggswarm_model_free); returns how many. */
GGSWARM_API int32_t ggswarm_lane_drop_model(ggswarm_lane * lane, const ggswarm_model * model);

/* v8: block until a lane step (or bundle) finishes computing on this hop, or timeout_ms passes.
 * Returns 1 when one finished; 0 on timeout, or at once when none finished within the last timeout_ms
 * (the lane is quiet: nothing to make room for). The owner calls it before a prompt's chunk, so that
 * the chunk computes while the lane's sessions are at other hops instead of holding them here. */
GGSWARM_API int32_t ggswarm_lane_wait_step(ggswarm_lane * lane, int32_t timeout_ms);

/* v13: block until the lane's next step (or bundle) arrives on this hop, and hold it there before its
 * compute until ggswarm_lane_gate_release (or GGSWARM_LANE_GATE_MAX_MS, whichever comes first).
 * Returns 1 when a step is held: the owner runs its own work on the window now (a prompt's chunk) and
 * then releases it, so the two compute one after the other while the route's other hops wait, never
 * beside each other on shared cores. Returns 0 on timeout, or at once when no step finished, and none
 * was released by ggswarm_lane_gate_release, within the last timeout_ms (a quiet lane: an owner asking
 * right after its chunk must wait for the step it let go to come round, though that chunk held it for
 * longer than timeout_ms); then nothing is held and no release is due. */
#define GGSWARM_LANE_GATE_MAX_MS 1000
GGSWARM_API int32_t ggswarm_lane_gate(ggswarm_lane * lane, int32_t timeout_ms);
GGSWARM_API void ggswarm_lane_gate_release(ggswarm_lane * lane);

/* v9: one batch the lane computed on this hop (a lone step or a bundle), as ggswarm_lane_take_batches
 * hands it over. */
typedef struct ggswarm_lane_batch {
    double t_done;                  /* when it finished computing: CLOCK_MONOTONIC seconds (Linux) */
    double wait_s;                  /* waiting for the model handle (the owner's own call running on it) */
    double compute_s;               /* the forward call, under the handle's lock */
    int32_t steps;                  /* sessions' steps that ran (1 for a lone step) */
    int32_t positions;              /* token positions they computed */
    int32_t sampled;                /* tokens sampled (the last window: one per step that ran; else 0) */
    int32_t reserved;
} ggswarm_lane_batch;

/* batches kept for ggswarm_lane_take_batches; when full, the oldest is overwritten (and counted) */
#define GGSWARM_LANE_BATCH_LOG 16384

/* v9: move the oldest of the batches computed since the last call (at most max) into out; returns how
 * many, or -1 on bad arguments. dropped (may be NULL) gets how many were overwritten unread since the last
 * call that asked for it. The owner takes them now and then (a few times a minute is plenty). */
GGSWARM_API int32_t ggswarm_lane_take_batches(ggswarm_lane * lane, ggswarm_lane_batch * out, int32_t max,
                                              uint64_t * dropped);

/* Stop listening, close every connection, wait for the lane's threads and free it. NULL is ignored. */
GGSWARM_API void ggswarm_lane_free(ggswarm_lane * lane);

#ifdef __cplusplus
}
#endif

#endif /* GGSWARM_H */
