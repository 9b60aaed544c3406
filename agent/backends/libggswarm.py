"""The handle owners of libggswarm (native/include/ggswarm.h): models, budgets, the sampler; the library is
found and loaded by ggswarm_lib, its structs and prototypes are in ggswarm_abi."""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Any

import numpy as np

from agent.backends.ggswarm_abi import ggswarm_batch as ggswarm_batch
from agent.backends.ggswarm_abi import ggswarm_budget_p as ggswarm_budget_p
from agent.backends.ggswarm_abi import ggswarm_model_info as ggswarm_model_info
from agent.backends.ggswarm_abi import ggswarm_model_p as ggswarm_model_p
from agent.backends.ggswarm_abi import ggswarm_sampling as ggswarm_sampling
from agent.backends.ggswarm_lib import (
    GGSWARM_E_INVALID_ARG,
    GGSWARM_MAX_STEPS,
    GGSWARM_OK,
    GGSWARM_TYPE_F16,
    GGSWARM_TYPE_F32,
    GGSWARM_TYPE_Q4_0,
    GGSWARM_TYPE_Q8_0,
    TRUNCATE_KINDS,
    check_status,
    load_library,
)
from agent.backends.ggswarm_lib import KERNEL_PAD as KERNEL_PAD
from agent.backends.ggswarm_lib import KV_PAD as KV_PAD
from agent.backends.ggswarm_lib import NativeError as NativeError
from agent.backends.ggswarm_lib import check_barrier_env as check_barrier_env
from agent.backends.ggswarm_lib import check_file as check_file
from agent.backends.ggswarm_lib import is_available as is_available
from agent.backends.ggswarm_lib import library_path as library_path
from agent.backends.ggswarm_lib import padded_kv as padded_kv
from agent.wire.frames import HiddenDtype, numpy_dtype


def sampling_struct(
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repeat_penalty: float = 1.0,
    repeat_last_n: int = 64,
    seed: int = 0,
) -> ggswarm_sampling:
    return ggswarm_sampling(
        temperature=float(temperature),
        top_k=int(top_k),
        repeat_last_n=int(repeat_last_n),
        top_p=float(top_p),
        min_p=float(min_p),
        repeat_penalty=float(repeat_penalty),
        seed=int(seed) & ((1 << 64) - 1),
    )


_I32 = np.dtype(np.int32)


def _i32(values: Any) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == _I32 and values.ndim == 1 and values.flags.c_contiguous:
        return values  # what the route's steps already are: no conversion on every call
    return np.ascontiguousarray(np.asarray(values, dtype=np.int32).reshape(-1))


def _address(a: np.ndarray) -> int:
    """Where a C-contiguous array's data starts. Through ctypes' buffer protocol where the array is
    writable (0.5 us), else numpy's `.ctypes.data` (1.7-2 us: it builds a helper object each time); a
    tiny window's step passes three arrays, and these lookups were half of filling its batch."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))  # type: ignore[arg-type]  # ndarray exports a buffer; numpy's stubs do not say so
    except (TypeError, ValueError, BufferError):  # read-only (np.frombuffer of bytes), or empty
        return int(a.ctypes.data)


def _i32_array(values: Any) -> tuple[np.ndarray, Any]:
    arr = _i32(values)
    return arr, arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))


def sample(
    logits: np.ndarray, params: ggswarm_sampling, position: int, history: list[int] | None = None
) -> tuple[int, float]:
    """The C sampler on one position's logits (tests compare it with agent.backends.sampling)."""
    lib = load_library()
    x = np.ascontiguousarray(np.asarray(logits, dtype=np.float32).reshape(-1))
    hist, hist_p = _i32_array(history or [])
    tok = ctypes.c_int32()
    lp = ctypes.c_double()
    st = lib.ggswarm_sample(
        x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
        x.shape[0],
        ctypes.byref(params),
        position,
        hist_p if hist.size else None,
        hist.size,
        ctypes.byref(tok),
        ctypes.byref(lp),
    )
    check_status(st, lib.ggswarm_last_error())
    return tok.value, lp.value


class NativeBudget:
    """Owns a reference to one ggswarm_budget: a node's KV bytes, shared by the models opened with it."""

    def __init__(self, total_bytes: int) -> None:
        self._lib = load_library()
        self._h = ggswarm_budget_p()
        check_status(
            self._lib.ggswarm_budget_new(int(total_bytes), ctypes.byref(self._h)),
            self._lib.ggswarm_last_error(),
        )

    @property
    def handle(self) -> int | None:
        return self._h.value

    def usage(self) -> tuple[int, int]:
        """(total, used) bytes, as the library holds them now."""
        if not self._h:
            raise NativeError(GGSWARM_E_INVALID_ARG, "budget is freed")
        total, used = ctypes.c_uint64(), ctypes.c_uint64()
        st = self._lib.ggswarm_budget_get(self._h, ctypes.byref(total), ctypes.byref(used))
        check_status(st, self._lib.ggswarm_last_error())
        return total.value, used.value

    @property
    def total(self) -> int:
        return self.usage()[0]

    @property
    def used(self) -> int:
        return self.usage()[1]

    def remaining(self) -> int:
        total, used = self.usage()
        return max(0, total - used)

    def close(self) -> None:
        """Drop this reference (models opened with the budget keep theirs). Idempotent."""
        if self._h:
            self._lib.ggswarm_budget_free(self._h)
            self._h = ggswarm_budget_p()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


class NativeModel:
    """Owns one ggswarm_model handle (a loaded layer window) and the sessions opened on it."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        layer_start: int,
        layer_end: int,
        n_threads: int = 2,
        budget: NativeBudget | None = None,
        model_id: str | None = None,
    ) -> None:
        """budget: the node's KV budget, charged for this model's sessions (None: no limit)."""
        self._lib = load_library()
        self._h = ggswarm_model_p()
        st = self._lib.ggswarm_model_open(
            os.fsencode(path),
            int(layer_start),
            int(layer_end),
            int(n_threads),
            budget.handle if budget is not None else None,
            model_id.encode() if model_id else None,
            ctypes.byref(self._h),
        )
        check_status(st, self._lib.ggswarm_last_error())
        info = ggswarm_model_info()
        self._call(self._lib.ggswarm_model_info_get, ctypes.byref(info))
        self.info = info
        self.architecture = info.architecture.decode()
        self.device = info.device.decode()
        self.model_id = info.model_id.decode()
        self.d_model = info.d_model
        self.n_vocab = info.n_vocab
        self.is_first = bool(info.is_first)
        self.is_last = bool(info.is_last)
        self.decode_kernels = info.decode_kernels == 1
        self.n_ctx_max = info.n_ctx_max
        self.kv_bytes_per_token = info.kv_bytes_per_token
        # forward_many runs several sessions' steps in one graph (else one after another, in the library)
        self.batches_sessions = bool(info.batches_sessions)
        # reusable per-call buffers (a decode step allocates nothing on the C side)
        self._batch = ggswarm_batch()
        self._tok = ctypes.c_int32()
        self._lp = ctypes.c_double()
        self._secs = ctypes.c_double()
        self._tok_at = ctypes.addressof(self._tok)
        self._lp_at = ctypes.addressof(self._lp)
        self._secs_at = ctypes.addressof(self._secs)
        self.has_mtp = False  # a nextn block attached (mtp_open)

    def _call(self, fn: Any, *args: Any) -> None:
        if not self._h:
            raise NativeError(GGSWARM_E_INVALID_ARG, "model is closed")
        st = fn(self._h, *args)
        if st != GGSWARM_OK:
            # this thread's message: the handle's own may already hold a lane thread's (API v7)
            check_status(st, self._lib.ggswarm_last_error())

    def close(self) -> None:
        """Free the handle, its sessions and their KV. Idempotent."""
        if self._h:
            self._lib.ggswarm_model_free(self._h)
            self._h = ggswarm_model_p()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    def __enter__(self) -> NativeModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_threads(self, n: int) -> None:
        self._call(self._lib.ggswarm_set_threads, int(n))

    def open_session(self, capacity: int) -> int:
        sid = ctypes.c_int64()
        self._call(self._lib.ggswarm_session_open, int(capacity), ctypes.byref(sid))
        return sid.value

    def close_session(self, sid: int) -> None:
        self._call(self._lib.ggswarm_session_close, sid)

    def session_len(self, sid: int) -> int:
        n = ctypes.c_int32()
        self._call(self._lib.ggswarm_session_len, sid, ctypes.byref(n))
        return n.value

    def truncate(self, sid: int, n_tokens: int) -> None:
        self._call(self._lib.ggswarm_session_truncate, sid, int(n_tokens))

    def truncate_to(self, sid: int, n_tokens: int) -> tuple[int, str]:
        """Go back to at most `n_tokens` positions; (length now held, how): "exact" (it holds
        n_tokens: no recurrent layer, or nothing to undo), "checkpoint" (recurrent state restored at the length returned) or "from_zero" (no
        checkpoint: re-prefill everything). The caller re-prefills [length, n_tokens)."""
        n, kind = ctypes.c_int32(), ctypes.c_int32()
        self._call(
            self._lib.ggswarm_session_truncate_to, sid, int(n_tokens), ctypes.byref(n), ctypes.byref(kind)
        )
        return n.value, TRUNCATE_KINDS.get(kind.value, f"kind {kind.value}")

    def checkpoint(self, sid: int) -> bool:
        """A checkpoint of the session's fixed-size state at its length now (no-op without such state),
        held apart from the automatic ones (outside their maximum, one at a time, pushing none out);
        True when this call added it."""
        taken = ctypes.c_int32(0)
        self._call(self._lib.ggswarm_session_checkpoint, sid, ctypes.byref(taken))
        return bool(taken.value)

    def drop_checkpoint(self, sid: int, pos: int) -> None:
        """Drop the checkpoint `checkpoint` took at `pos`, if the session holds it."""
        self._call(self._lib.ggswarm_session_drop_checkpoint, sid, int(pos))

    def set_checkpoints(self, every_n_tokens: int, max_per_session: int) -> None:
        """Recurrent windows and rings: checkpoints at the start and end of every multi-token forward
        call and, when `every_n_tokens` > 0, every that many positions; at most `max_per_session` per
        session (library default 0 / 2; 0: none)."""
        self._call(self._lib.ggswarm_set_checkpoints, int(every_n_tokens), int(max_per_session))

    def checkpoints(self, sid: int) -> list[int]:
        """Positions of the session's recurrent-state checkpoints, ascending."""
        count = ctypes.c_int32()
        self._call(self._lib.ggswarm_session_checkpoints, sid, None, 0, ctypes.byref(count))
        buf = (ctypes.c_int32 * max(1, count.value))()
        self._call(self._lib.ggswarm_session_checkpoints, sid, buf, count.value, ctypes.byref(count))
        return list(buf[: count.value])

    def checkpoints_reclaimable(self) -> int:
        """Bytes the handle's automatic checkpoints hold: budget room reclaim_checkpoints can give back."""
        out = ctypes.c_uint64()
        self._call(self._lib.ggswarm_checkpoints_reclaimable, ctypes.byref(out))
        return int(out.value)

    def reclaim_checkpoints(self, want_bytes: int) -> int:
        """Drop automatic checkpoints, least recently taken first, until `want_bytes` are credited to
        the budget or none is left; returns the bytes credited."""
        out = ctypes.c_uint64()
        self._call(
            self._lib.ggswarm_reclaim_checkpoints, ctypes.c_uint64(max(0, int(want_bytes))), ctypes.byref(out)
        )
        return int(out.value)

    def set_cache_type(self, cache_type: str) -> None:
        """The attention caches' type for sessions opened from now on: "f16" (the default, as
        llama.cpp's), "f32" where the architecture keeps it (deepseek4), "q8_0" or "q4_0" where it
        keeps them (K and V alike, with flash attention, as llama.cpp's --cache-type-k/-v); refused
        while a session is open."""
        types = {
            "f32": GGSWARM_TYPE_F32,
            "f16": GGSWARM_TYPE_F16,
            "q8_0": GGSWARM_TYPE_Q8_0,
            "q4_0": GGSWARM_TYPE_Q4_0,
        }
        if cache_type not in types:
            raise NativeError(
                GGSWARM_E_INVALID_ARG, f"cache type {cache_type!r} is not one of {sorted(types)}"
            )
        self._call(self._lib.ggswarm_set_cache_type, types[cache_type])
        # the attention mode follows a quantized cache (flash attention), the bytes per token the type
        self._refresh_info()

    def set_flash_attention(self, on: bool) -> None:
        """Flash attention on or off for the steps run from now on, like llama.cpp's -fa on|off (never
        calling it keeps the open-time "auto": on for a GPU, off for a CPU); refused while a session is
        open, and off with a quantized cache."""
        self._call(self._lib.ggswarm_set_flash_attention, 1 if on else 0)
        self._refresh_info()

    def _refresh_info(self) -> None:
        info = ggswarm_model_info()
        self._call(self._lib.ggswarm_model_info_get, ctypes.byref(info))
        self.info = info
        self.decode_kernels = info.decode_kernels == 1
        self.kv_bytes_per_token = info.kv_bytes_per_token

    def kv_bytes(self, sid: int = -1) -> int:
        n = ctypes.c_uint64()
        self._call(self._lib.ggswarm_kv_bytes, sid, ctypes.byref(n))
        return n.value

    def growth_bytes(self, sid: int, n_positions: int) -> int:
        """Extra KV bytes the budget must have free for the session to hold `n_positions`."""
        n = ctypes.c_uint64()
        self._call(self._lib.ggswarm_session_growth_bytes, sid, int(n_positions), ctypes.byref(n))
        return n.value

    @property
    def graph_builds(self) -> int:
        """Window graphs built so far (one per new shape; sessions of one shape share a graph)."""
        info = ggswarm_model_info()
        self._call(self._lib.ggswarm_model_info_get, ctypes.byref(info))
        return int(info.graph_builds)

    def snapshot(self, sid: int) -> bytes:
        size = ctypes.c_uint64()
        self._call(self._lib.ggswarm_session_snapshot_size, sid, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        written = ctypes.c_uint64()
        self._call(self._lib.ggswarm_session_snapshot, sid, buf, size.value, ctypes.byref(written))
        return buf.raw[: written.value]

    def restore(self, sid: int, data: bytes) -> None:
        self._call(self._lib.ggswarm_session_restore, sid, data, len(data))

    def mtp_open(self, path: str | os.PathLike[str]) -> None:
        """Attach the file's nextn block to this last window (API v15; before any session): its forward
        calls then need the token ids of their positions, and mtp_draft drafts."""
        self._call(self._lib.ggswarm_mtp_open, os.fsencode(path))
        self.has_mtp = True

    def mtp_draft(
        self, sid: int, token: int, n_draft: int, want_logits: bool = False, pos: int | None = None
    ) -> dict[str, Any]:
        """The nextn block's greedy drafts of the n_draft positions after position `pos` of session sid
        (default: its length), the first from `token` (the token at `pos`, sampled, not in the session
        there): {"drafts", "logits"}."""
        drafts = (ctypes.c_int32 * max(n_draft, 1))()
        n_out = ctypes.c_int32()
        logits = np.empty((max(n_draft, 0), self.n_vocab), dtype=np.float32) if want_logits else None
        self._call(
            self._lib.ggswarm_mtp_draft,
            int(sid),
            self.session_len(sid) if pos is None else int(pos),
            int(token),
            int(n_draft),
            drafts,
            logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if logits is not None else None,
            logits.size if logits is not None else 0,
            ctypes.byref(n_out),
        )
        return {"drafts": list(drafts[: n_out.value]), "logits": logits}

    def forward(
        self,
        sid: int,
        pos_start: int,
        token_ids: np.ndarray | None = None,
        hidden: np.ndarray | None = None,
        sampling: ggswarm_sampling | None = None,
        history: np.ndarray | None = None,
        want_logits: bool = False,
        hidden_dtype: HiddenDtype = "f32",
    ) -> dict[str, Any]:
        """One forward call; returns {"hidden"} or {"token", "logprob", "logits"} plus "compute_s".

        `hidden` goes in as it is when f16 or f32 (the library reads either); the returned hidden rows
        are written by the library in `hidden_dtype`.
        """
        keep: list[Any] = []  # arrays that must outlive the call
        out = self._fill(
            self._batch, keep, pos_start, token_ids, hidden, sampling, history, want_logits, hidden_dtype
        )
        b = self._batch
        b.compute_s_out = self._secs_at
        if self.is_last:
            b.token_out = self._tok_at
            b.logprob_out = self._lp_at
        self._call(self._lib.ggswarm_forward, sid, ctypes.byref(b))
        if self.is_last:
            out["token"] = self._tok.value
            out["logprob"] = self._lp.value
        out["compute_s"] = self._secs.value
        del keep
        return out

    def forward_many(self, steps: list[dict[str, Any]]) -> list[dict[str, Any] | NativeError]:
        """One step of each of several distinct sessions in one call (ggswarm_forward_many): each step
        a dict of forward()'s arguments ("sid", "pos_start", optional "token_ids", "hidden", "sampling",
        "history", "want_logits", "hidden_dtype"). Returns, in order, forward()'s dict for each step
        that ran, or the NativeError of a step that failed (the others are unaffected)."""
        n = len(steps)
        if not 1 <= n <= GGSWARM_MAX_STEPS:
            raise NativeError(GGSWARM_E_INVALID_ARG, f"{n} steps: forward_many takes 1..{GGSWARM_MAX_STEPS}")
        if not self._h:
            raise NativeError(GGSWARM_E_INVALID_ARG, "model is closed")
        batches = (ggswarm_batch * n)()
        sids = (ctypes.c_int64 * n)(*[int(st["sid"]) for st in steps])
        statuses = (ctypes.c_int32 * n)()
        toks = (ctypes.c_int32 * n)()
        lps = (ctypes.c_double * n)()
        secs = (ctypes.c_double * n)()
        keep: list[Any] = []
        outs: list[dict[str, Any]] = []
        for i, st in enumerate(steps):
            outs.append(
                self._fill(
                    batches[i],
                    keep,
                    int(st["pos_start"]),
                    st.get("token_ids"),
                    st.get("hidden"),
                    st.get("sampling"),
                    st.get("history"),
                    bool(st.get("want_logits", False)),
                    st.get("hidden_dtype", "f32"),
                )
            )
            batches[i].compute_s_out = ctypes.addressof(secs) + 8 * i
            if self.is_last:
                batches[i].token_out = ctypes.addressof(toks) + 4 * i
                batches[i].logprob_out = ctypes.addressof(lps) + 8 * i
        self._lib.ggswarm_forward_many(self._h, n, sids, batches, statuses)
        res: list[dict[str, Any] | NativeError] = []
        for i, out in enumerate(outs):
            if statuses[i] != GGSWARM_OK:
                msg = (self._lib.ggswarm_forward_many_error(self._h, i) or b"").decode("utf-8", "replace")
                res.append(NativeError(statuses[i], msg or f"libggswarm status {statuses[i]}"))
                continue
            if self.is_last:
                out["token"] = toks[i]
                out["logprob"] = lps[i]
            out["compute_s"] = secs[i]
            res.append(out)
        del keep
        return res

    def _fill(
        self,
        b: ggswarm_batch,
        keep: list[Any],
        pos_start: int,
        token_ids: np.ndarray | None,
        hidden: np.ndarray | None,
        sampling: ggswarm_sampling | None,
        history: np.ndarray | None,
        want_logits: bool,
        hidden_dtype: HiddenDtype,
    ) -> dict[str, Any]:
        """Fill one ggswarm_batch (not its token/logprob/seconds outputs); arrays it points at go in
        `keep`; returns the step's output dict holding the arrays the library writes."""
        ids: np.ndarray | None = None
        if token_ids is not None:
            ids = _i32(token_ids)
            keep.append(ids)
            n = int(ids.shape[0])
            b.token_ids = _address(ids)
        else:
            b.token_ids = None
        if hidden is not None:
            h = np.asarray(hidden)
            if h.dtype not in (np.float32, np.float16):
                h = h.astype(np.float32)
            h = np.ascontiguousarray(h)
            keep.append(h)
            n = int(h.shape[0]) if h.ndim == 2 else (h.size // max(self.d_model, 1))
            b.hidden_in = _address(h)
            b.hidden_in_count = h.size
            b.hidden_in_type = GGSWARM_TYPE_F16 if h.dtype == np.float16 else GGSWARM_TYPE_F32
            if ids is not None and ids.size != n:
                raise ValueError(f"{ids.size} token ids for {n} hidden rows")
        else:
            b.hidden_in = None
            b.hidden_in_count = 0
        if token_ids is None and hidden is None:
            n = 0
        b.n_tokens = n
        b.pos_start = int(pos_start)
        out: dict[str, Any] = {}
        b.hidden_out = None
        b.hidden_out_count = 0
        b.logits_out = None
        b.logits_out_count = 0
        b.sampling = None
        b.history = None
        b.n_history = 0
        b.token_out = None
        b.logprob_out = None
        b.compute_s_out = None
        if not self.is_last:
            hout = np.empty((max(n, 0), self.d_model), dtype=numpy_dtype(hidden_dtype))
            b.hidden_out = _address(hout)
            b.hidden_out_count = hout.size
            b.hidden_out_type = GGSWARM_TYPE_F16 if hidden_dtype == "f16" else GGSWARM_TYPE_F32
            out["hidden"] = hout
        else:
            if want_logits:
                logits = np.empty((max(n, 0), self.n_vocab), dtype=np.float32)
                b.logits_out = _address(logits)
                b.logits_out_count = logits.size
                out["logits"] = logits
            if sampling is not None:
                keep.append(sampling)
                b.sampling = ctypes.addressof(sampling)
            if history is not None and len(history):
                hist = _i32(history)
                keep.append(hist)
                b.history = _address(hist)
                b.n_history = hist.size
        return out
