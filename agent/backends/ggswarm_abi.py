"""libggswarm's C ABI for ctypes: the structs and one prototype per declaration of native/include/ggswarm.h."""

from __future__ import annotations

import ctypes


# typedef struct ggswarm_model_info { ... } ggswarm_model_info;
class ggswarm_model_info(ctypes.Structure):  # noqa: N801 - mirrors the C name
    _fields_ = [
        ("architecture", ctypes.c_char * 32),
        ("device", ctypes.c_char * 64),
        ("n_layers_total", ctypes.c_int32),
        ("layer_start", ctypes.c_int32),
        ("layer_end", ctypes.c_int32),
        ("is_first", ctypes.c_int32),
        ("is_last", ctypes.c_int32),
        ("d_model", ctypes.c_int32),
        ("n_vocab", ctypes.c_int32),
        ("n_head", ctypes.c_int32),
        ("n_head_kv", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("n_ff", ctypes.c_int32),
        ("n_ctx_train", ctypes.c_int32),
        ("n_ctx_max", ctypes.c_int32),
        ("n_threads", ctypes.c_int32),
        ("weight_bytes", ctypes.c_uint64),
        ("kv_bytes_per_token", ctypes.c_uint64),
        ("model_id", ctypes.c_char * 72),
        ("decode_kernels", ctypes.c_int32),
        ("graph_builds", ctypes.c_uint64),
        ("batches_sessions", ctypes.c_int32),
    ]


# typedef struct ggswarm_sampling { double temperature; int32_t top_k; int32_t repeat_last_n;
#     double top_p; double min_p; double repeat_penalty; uint64_t seed; } ggswarm_sampling;
class ggswarm_sampling(ctypes.Structure):  # noqa: N801
    _fields_ = [
        ("temperature", ctypes.c_double),
        ("top_k", ctypes.c_int32),
        ("repeat_last_n", ctypes.c_int32),
        ("top_p", ctypes.c_double),
        ("min_p", ctypes.c_double),
        ("repeat_penalty", ctypes.c_double),
        ("seed", ctypes.c_uint64),
    ]


# typedef struct ggswarm_batch { ... } ggswarm_batch;
# Its pointers are declared void *: the caller sets them to addresses (ints) of arrays it keeps alive for
# the call. A ctypes pointer object stored in a field would be kept by the struct under a key ctypes
# formats with sprintf, on every assignment of every decode step.
class ggswarm_batch(ctypes.Structure):  # noqa: N801
    _fields_ = [
        ("n_tokens", ctypes.c_int32),
        ("pos_start", ctypes.c_int32),
        ("token_ids", ctypes.c_void_p),  # const int32_t *
        ("hidden_in", ctypes.c_void_p),
        ("hidden_in_count", ctypes.c_int64),
        ("hidden_in_type", ctypes.c_int32),
        ("hidden_out_type", ctypes.c_int32),
        ("hidden_out", ctypes.c_void_p),
        ("hidden_out_count", ctypes.c_int64),
        ("logits_out", ctypes.c_void_p),  # float *
        ("logits_out_count", ctypes.c_int64),
        ("sampling", ctypes.c_void_p),  # const ggswarm_sampling *
        ("history", ctypes.c_void_p),  # const int32_t *
        ("n_history", ctypes.c_int32),
        ("token_out", ctypes.c_void_p),  # int32_t *
        ("logprob_out", ctypes.c_void_p),  # double *
        ("compute_s_out", ctypes.c_void_p),  # double *
    ]


# typedef struct ggswarm_lane_session { ... } ggswarm_lane_session;  (v7)
class ggswarm_lane_session(ctypes.Structure):  # noqa: N801
    _fields_ = [
        ("lane_id", ctypes.c_uint64),
        ("model", ctypes.c_void_p),
        ("sid", ctypes.c_int64),
        ("key_in", ctypes.c_uint8 * 32),
        ("next_host", ctypes.c_char_p),
        ("next_port", ctypes.c_int32),
        ("next_lane_id", ctypes.c_uint64),
        ("key_out", ctypes.c_uint8 * 32),
        ("hidden_out_type", ctypes.c_int32),
        ("sampling", ctypes.POINTER(ggswarm_sampling)),
        ("history", ctypes.POINTER(ctypes.c_int32)),
        ("n_history", ctypes.c_int32),
        ("first_step", ctypes.c_uint64),
        ("answer_direct", ctypes.c_int32),
    ]


# typedef struct ggswarm_lane_stats { ... } ggswarm_lane_stats;  (v7)
class ggswarm_lane_stats(ctypes.Structure):  # noqa: N801
    _fields_ = [
        ("steps", ctypes.c_uint64),
        ("next_step", ctypes.c_uint64),
        ("idle_s", ctypes.c_double),
        ("busy", ctypes.c_int32),
        ("n_appended", ctypes.c_int32),
    ]


class ggswarm_lane_batch(ctypes.Structure):  # noqa: N801
    _fields_ = [
        ("t_done", ctypes.c_double),
        ("wait_s", ctypes.c_double),
        ("compute_s", ctypes.c_double),
        ("steps", ctypes.c_int32),
        ("positions", ctypes.c_int32),
        ("sampled", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


ggswarm_model_p = ctypes.c_void_p
ggswarm_budget_p = ctypes.c_void_p
ggswarm_lane_p = ctypes.c_void_p


def bind(lib: ctypes.CDLL) -> None:
    """Declare every function's argument and return types on the loaded library."""
    c_status = ctypes.c_int32
    i32p = ctypes.POINTER(ctypes.c_int32)
    u64p = ctypes.POINTER(ctypes.c_uint64)

    # int32_t ggswarm_api_version(void);
    lib.ggswarm_api_version.argtypes = []
    lib.ggswarm_api_version.restype = ctypes.c_int32

    # const char * ggswarm_last_error(void);
    lib.ggswarm_last_error.argtypes = []
    lib.ggswarm_last_error.restype = ctypes.c_char_p

    # ggswarm_status ggswarm_budget_new(uint64_t total_bytes, ggswarm_budget ** out);
    lib.ggswarm_budget_new.argtypes = [ctypes.c_uint64, ctypes.POINTER(ggswarm_budget_p)]
    lib.ggswarm_budget_new.restype = c_status

    # void ggswarm_budget_free(ggswarm_budget * budget);
    lib.ggswarm_budget_free.argtypes = [ggswarm_budget_p]
    lib.ggswarm_budget_free.restype = None

    # ggswarm_status ggswarm_budget_get(const ggswarm_budget * budget, uint64_t * out_total,
    #     uint64_t * out_used);
    lib.ggswarm_budget_get.argtypes = [ggswarm_budget_p, u64p, u64p]
    lib.ggswarm_budget_get.restype = c_status

    # ggswarm_status ggswarm_model_open(const char * path, int32_t layer_start, int32_t layer_end,
    #     int32_t n_threads, ggswarm_budget * budget, const char * model_id, ggswarm_model ** out);
    lib.ggswarm_model_open.argtypes = [
        ctypes.c_char_p,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int32,
        ggswarm_budget_p,
        ctypes.c_char_p,
        ctypes.POINTER(ggswarm_model_p),
    ]
    lib.ggswarm_model_open.restype = c_status

    # void ggswarm_model_free(ggswarm_model * model);
    lib.ggswarm_model_free.argtypes = [ggswarm_model_p]
    lib.ggswarm_model_free.restype = None

    # ggswarm_status ggswarm_check_file(const char * path);  (v10)
    lib.ggswarm_check_file.argtypes = [ctypes.c_char_p]
    lib.ggswarm_check_file.restype = c_status

    # const char * ggswarm_model_last_error(const ggswarm_model * model);
    lib.ggswarm_model_last_error.argtypes = [ggswarm_model_p]
    lib.ggswarm_model_last_error.restype = ctypes.c_char_p

    # ggswarm_status ggswarm_model_info_get(const ggswarm_model * model, ggswarm_model_info * out);
    lib.ggswarm_model_info_get.argtypes = [ggswarm_model_p, ctypes.POINTER(ggswarm_model_info)]
    lib.ggswarm_model_info_get.restype = c_status

    # ggswarm_status ggswarm_set_threads(ggswarm_model * model, int32_t n_threads);
    lib.ggswarm_set_threads.argtypes = [ggswarm_model_p, ctypes.c_int32]
    lib.ggswarm_set_threads.restype = c_status

    # ggswarm_status ggswarm_session_open(ggswarm_model * model, int32_t capacity, int64_t * out_sid);
    lib.ggswarm_session_open.argtypes = [ggswarm_model_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64)]
    lib.ggswarm_session_open.restype = c_status

    # ggswarm_status ggswarm_session_close(ggswarm_model * model, int64_t sid);
    lib.ggswarm_session_close.argtypes = [ggswarm_model_p, ctypes.c_int64]
    lib.ggswarm_session_close.restype = c_status

    # ggswarm_status ggswarm_session_len(const ggswarm_model * model, int64_t sid, int32_t * out_len);
    lib.ggswarm_session_len.argtypes = [ggswarm_model_p, ctypes.c_int64, i32p]
    lib.ggswarm_session_len.restype = c_status

    # ggswarm_status ggswarm_session_truncate(ggswarm_model * model, int64_t sid, int32_t n_tokens);
    lib.ggswarm_session_truncate.argtypes = [ggswarm_model_p, ctypes.c_int64, ctypes.c_int32]
    lib.ggswarm_session_truncate.restype = c_status

    # ggswarm_status ggswarm_session_truncate_to(ggswarm_model * model, int64_t sid, int32_t n_tokens,
    #     int32_t * out_len, int32_t * out_kind);
    lib.ggswarm_session_truncate_to.argtypes = [
        ggswarm_model_p,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(ctypes.c_int32),
    ]
    lib.ggswarm_session_truncate_to.restype = c_status

    # ggswarm_status ggswarm_set_checkpoints(ggswarm_model * model, int32_t every_n_tokens,
    #     int32_t max_per_session);
    lib.ggswarm_session_checkpoint.argtypes = [
        ggswarm_model_p,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int32),
    ]
    lib.ggswarm_session_checkpoint.restype = c_status
    lib.ggswarm_session_drop_checkpoint.argtypes = [ggswarm_model_p, ctypes.c_int64, ctypes.c_int32]
    lib.ggswarm_session_drop_checkpoint.restype = c_status
    lib.ggswarm_set_checkpoints.argtypes = [ggswarm_model_p, ctypes.c_int32, ctypes.c_int32]
    lib.ggswarm_set_checkpoints.restype = c_status

    # ggswarm_status ggswarm_session_checkpoints(const ggswarm_model * model, int64_t sid,
    #     int32_t * positions, int32_t capacity, int32_t * out_count);
    lib.ggswarm_session_checkpoints.argtypes = [
        ggswarm_model_p,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int32),
        ctypes.c_int32,
        ctypes.POINTER(ctypes.c_int32),
    ]
    lib.ggswarm_session_checkpoints.restype = c_status
    # ggswarm_status ggswarm_checkpoints_reclaimable(ggswarm_model * model, uint64_t * out_bytes);  (v17)
    lib.ggswarm_checkpoints_reclaimable.argtypes = [ggswarm_model_p, u64p]
    lib.ggswarm_checkpoints_reclaimable.restype = c_status
    # ggswarm_status ggswarm_reclaim_checkpoints(ggswarm_model * model, uint64_t want_bytes,
    #     uint64_t * out_freed);  (v17)
    lib.ggswarm_reclaim_checkpoints.argtypes = [ggswarm_model_p, ctypes.c_uint64, u64p]
    lib.ggswarm_reclaim_checkpoints.restype = c_status

    # ggswarm_status ggswarm_set_cache_type(ggswarm_model * model, int32_t type);  (v10)
    lib.ggswarm_set_cache_type.argtypes = [ggswarm_model_p, ctypes.c_int32]
    lib.ggswarm_set_cache_type.restype = c_status
    # ggswarm_status ggswarm_set_flash_attention(ggswarm_model * model, int32_t on);  (v11)
    lib.ggswarm_set_flash_attention.argtypes = [ggswarm_model_p, ctypes.c_int32]
    lib.ggswarm_set_flash_attention.restype = c_status

    # ggswarm_status ggswarm_kv_bytes(const ggswarm_model * model, int64_t sid, uint64_t * out_bytes);
    lib.ggswarm_kv_bytes.argtypes = [ggswarm_model_p, ctypes.c_int64, u64p]
    lib.ggswarm_kv_bytes.restype = c_status

    # ggswarm_status ggswarm_session_growth_bytes(const ggswarm_model * model, int64_t sid,
    #     int32_t n_positions, uint64_t * out_bytes);
    lib.ggswarm_session_growth_bytes.argtypes = [ggswarm_model_p, ctypes.c_int64, ctypes.c_int32, u64p]
    lib.ggswarm_session_growth_bytes.restype = c_status

    # ggswarm_status ggswarm_forward(ggswarm_model * model, int64_t sid, const ggswarm_batch * batch);
    lib.ggswarm_forward.argtypes = [ggswarm_model_p, ctypes.c_int64, ctypes.POINTER(ggswarm_batch)]
    lib.ggswarm_forward.restype = c_status

    # ggswarm_status ggswarm_forward_many(ggswarm_model * model, int32_t n, const int64_t * sids,
    #     const ggswarm_batch * batches, ggswarm_status * statuses);
    lib.ggswarm_forward_many.argtypes = [
        ggswarm_model_p,
        ctypes.c_int32,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ggswarm_batch),
        ctypes.POINTER(c_status),
    ]
    lib.ggswarm_forward_many.restype = c_status

    # const char * ggswarm_forward_many_error(const ggswarm_model * model, int32_t i);
    lib.ggswarm_forward_many_error.argtypes = [ggswarm_model_p, ctypes.c_int32]
    lib.ggswarm_forward_many_error.restype = ctypes.c_char_p

    # ggswarm_status ggswarm_session_snapshot_size(const ggswarm_model * model, int64_t sid,
    #     uint64_t * out_size);
    lib.ggswarm_session_snapshot_size.argtypes = [ggswarm_model_p, ctypes.c_int64, u64p]
    lib.ggswarm_session_snapshot_size.restype = c_status

    # ggswarm_status ggswarm_session_snapshot(const ggswarm_model * model, int64_t sid, void * buf,
    #     uint64_t capacity, uint64_t * out_written);
    lib.ggswarm_session_snapshot.argtypes = [
        ggswarm_model_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_uint64,
        u64p,
    ]
    lib.ggswarm_session_snapshot.restype = c_status

    # ggswarm_status ggswarm_session_restore(ggswarm_model * model, int64_t sid, const void * buf,
    #     uint64_t size);
    lib.ggswarm_session_restore.argtypes = [ggswarm_model_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint64]
    lib.ggswarm_session_restore.restype = c_status

    # ggswarm_status ggswarm_sample(const float * logits, int32_t n_vocab, const ggswarm_sampling * params,
    #     int64_t position, const int32_t * history, int32_t n_history, int32_t * out_token,
    #     double * out_logprob);
    lib.ggswarm_sample.argtypes = [
        ctypes.POINTER(ctypes.c_float),
        ctypes.c_int32,
        ctypes.POINTER(ggswarm_sampling),
        ctypes.c_int64,
        i32p,
        ctypes.c_int32,
        i32p,
        ctypes.POINTER(ctypes.c_double),
    ]
    lib.ggswarm_sample.restype = c_status

    # ggswarm_status ggswarm_lane_open(const char * bind_host, int32_t port, ggswarm_lane ** out);
    lib.ggswarm_lane_open.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(ggswarm_lane_p)]
    lib.ggswarm_lane_open.restype = c_status

    # int32_t ggswarm_lane_port(const ggswarm_lane * lane);
    lib.ggswarm_lane_port.argtypes = [ggswarm_lane_p]
    lib.ggswarm_lane_port.restype = ctypes.c_int32

    # ggswarm_status ggswarm_lane_add(ggswarm_lane * lane, const ggswarm_lane_session * session);
    lib.ggswarm_lane_add.argtypes = [ggswarm_lane_p, ctypes.POINTER(ggswarm_lane_session)]
    lib.ggswarm_lane_add.restype = c_status

    # ggswarm_status ggswarm_lane_remove(ggswarm_lane * lane, uint64_t lane_id, ggswarm_lane_stats * stats,
    #     int32_t * appended, int32_t capacity);
    lib.ggswarm_lane_remove.argtypes = [
        ggswarm_lane_p,
        ctypes.c_uint64,
        ctypes.POINTER(ggswarm_lane_stats),
        i32p,
        ctypes.c_int32,
    ]
    lib.ggswarm_lane_remove.restype = c_status

    # ggswarm_status ggswarm_lane_stats_get(ggswarm_lane * lane, uint64_t lane_id, ggswarm_lane_stats * out);
    lib.ggswarm_lane_stats_get.argtypes = [
        ggswarm_lane_p,
        ctypes.c_uint64,
        ctypes.POINTER(ggswarm_lane_stats),
    ]
    lib.ggswarm_lane_stats_get.restype = c_status

    # ggswarm_status ggswarm_lane_activity(ggswarm_lane * lane, uint64_t lane_id, double * idle_s,
    #     int32_t * busy);  (v18)
    lib.ggswarm_lane_activity.argtypes = [
        ggswarm_lane_p,
        ctypes.c_uint64,
        ctypes.POINTER(ctypes.c_double),
        ctypes.POINTER(ctypes.c_int32),
    ]
    lib.ggswarm_lane_activity.restype = c_status

    # int32_t ggswarm_lane_drop_model(ggswarm_lane * lane, const ggswarm_model * model);
    lib.ggswarm_lane_drop_model.argtypes = [ggswarm_lane_p, ggswarm_model_p]
    lib.ggswarm_lane_drop_model.restype = ctypes.c_int32

    # int32_t ggswarm_lane_wait_step(ggswarm_lane * lane, int32_t timeout_ms);
    lib.ggswarm_lane_wait_step.argtypes = [ggswarm_lane_p, ctypes.c_int32]
    lib.ggswarm_lane_wait_step.restype = ctypes.c_int32
    # int32_t ggswarm_lane_gate(ggswarm_lane * lane, int32_t timeout_ms);  void ..._gate_release(lane)
    lib.ggswarm_lane_gate.argtypes = [ggswarm_lane_p, ctypes.c_int32]
    lib.ggswarm_lane_gate.restype = ctypes.c_int32
    lib.ggswarm_lane_gate_release.argtypes = [ggswarm_lane_p]
    lib.ggswarm_lane_gate_release.restype = None

    # int32_t ggswarm_lane_take_batches(ggswarm_lane * lane, ggswarm_lane_batch * out, int32_t max,
    #     uint64_t * dropped);
    lib.ggswarm_lane_take_batches.argtypes = [
        ggswarm_lane_p,
        ctypes.POINTER(ggswarm_lane_batch),
        ctypes.c_int32,
        ctypes.POINTER(ctypes.c_uint64),
    ]
    lib.ggswarm_lane_take_batches.restype = ctypes.c_int32

    # void ggswarm_lane_free(ggswarm_lane * lane);
    lib.ggswarm_lane_free.argtypes = [ggswarm_lane_p]
    lib.ggswarm_lane_free.restype = None

    # (v15) ggswarm_status ggswarm_mtp_open(ggswarm_model * model, const char * path);
    lib.ggswarm_mtp_open.argtypes = [ggswarm_model_p, ctypes.c_char_p]
    lib.ggswarm_mtp_open.restype = c_status
    # ggswarm_status ggswarm_mtp_draft(ggswarm_model * model, int64_t sid, int32_t pos, int32_t token,
    #     int32_t n_draft, int32_t * drafts_out, float * logits_out, int64_t logits_out_count,
    #     int32_t * n_out);
    lib.ggswarm_mtp_draft.argtypes = [
        ggswarm_model_p,
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(ctypes.c_float),
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int32),
    ]
    lib.ggswarm_mtp_draft.restype = c_status
