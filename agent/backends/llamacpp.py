"""Whole-model backend on llama-cpp-python: a 1-hop route, and the speed/parity reference."""

from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING

import numpy as np

from agent import defaults
from agent.backends.base import (
    AdmissionError,
    Backend,
    BackendError,
    ForwardResult,
    ShardSpec,
    StepInput,
)
from agent.backends.sampling import sample
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams

if TYPE_CHECKING:  # llama-cpp-python is an optional extra: imported when the backend is built
    from llama_cpp._internals import LlamaContext


class _Session:
    def __init__(self, ctx: LlamaContext, n_ctx: int) -> None:
        self.ctx = ctx
        self.n_ctx = n_ctx
        self.length = 0


class LlamaCppBackend(Backend):
    """All layers in one llama.cpp model; one llama_context per session (its own KV)."""

    def __init__(
        self, spec: ShardSpec, kv_budget_bytes: int = defaults.KV_BUDGET_BYTES, n_batch: int = 512
    ) -> None:
        if not (spec.is_first and spec.is_last):
            raise BackendError("the llamacpp backend runs whole models only (layers 0:n)")
        import llama_cpp
        from llama_cpp._internals import LlamaBatch, LlamaModel

        self._lc = llama_cpp
        self._Batch = LlamaBatch
        self.spec = spec
        self.kv_budget_bytes = kv_budget_bytes
        self.n_batch = n_batch
        params = llama_cpp.llama_model_default_params()
        try:
            self._model = LlamaModel(path_model=spec.path, params=params, verbose=False)
        except ValueError as e:
            raise BackendError(str(e)) from None
        self.n_vocab = self._model.n_vocab()
        self.max_ctx = spec.manifest.context_length or 4096
        self.sessions: dict[SessionId, _Session] = {}
        self._batch = LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1, verbose=False)

    def open_session(self, sid: SessionId, capacity: int) -> None:
        from llama_cpp._internals import LlamaContext

        if sid in self.sessions:
            raise BackendError("session already open")
        n_ctx = min(capacity, self.max_ctx)
        if self.kv_bytes() + self._state_bytes(n_ctx) > self.kv_budget_bytes:
            raise AdmissionError("KV budget exhausted on this node")
        cp = self._lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = self.n_batch
        cp.n_ubatch = self.n_batch
        cp.n_threads = self.spec.n_threads
        cp.n_threads_batch = self.spec.n_threads
        cp.n_seq_max = 1
        try:
            ctx = LlamaContext(model=self._model, params=cp, verbose=False)
        except ValueError as e:
            raise BackendError(str(e)) from None
        self.sessions[sid] = _Session(ctx, n_ctx)

    def close_session(self, sid: SessionId) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            s.ctx.close()  # type: ignore[no-untyped-call]  # llama-cpp-python leaves close() unannotated

    def _s(self, sid: SessionId) -> _Session:
        try:
            return self.sessions[sid]
        except KeyError:
            raise BackendError("unknown session") from None

    def session_len(self, sid: SessionId) -> int:
        return self._s(sid).length

    def truncate(self, sid: SessionId, n_tokens: int) -> None:
        s = self._s(sid)
        if not 0 <= n_tokens <= s.length:
            raise BackendError(f"cannot truncate to {n_tokens}: session holds {s.length} positions")
        s.ctx.kv_cache_seq_rm(0, n_tokens, -1)
        s.length = n_tokens

    def _state_bytes(self, n_ctx: int) -> int:
        """A session's state at `n_ctx` tokens as the manifest describes each layer's (f16 caches, as
        llama.cpp's default): read from the per-layer description rather than from attention keys, since
        this backend also runs architectures without layer windows, whose head counts may be per-layer
        arrays or absent (recurrent layers)."""
        return sum(layer.state_bytes(n_ctx) for layer in self.spec.manifest.layers)

    def kv_bytes(self, sid: SessionId | None = None) -> int:
        if sid is not None:
            return self._state_bytes(self._s(sid).n_ctx)
        return sum(self._state_bytes(s.n_ctx) for s in self.sessions.values())

    def kv_open_bytes(self, capacity: int) -> int:
        return self._state_bytes(min(capacity, self.max_ctx))

    def forward(self, step: StepInput) -> ForwardResult:
        t0 = time.perf_counter()
        s = self._s(step.sid)
        if step.token_ids is None:
            raise BackendError("the llamacpp backend takes token ids")
        if step.pos_start != s.length:
            raise BackendError(
                f"position {step.pos_start} does not follow the session's {s.length} positions"
            )
        ids = [int(x) for x in np.asarray(step.token_ids).reshape(-1)]
        if not ids or min(ids) < 0 or max(ids) >= self.n_vocab:
            raise BackendError("token id out of vocabulary range")
        if step.pos_start + len(ids) > s.n_ctx:
            raise BackendError(
                f"position {step.pos_start + len(ids)} exceeds the session's limit of {s.n_ctx}"
            )
        all_logits: list[np.ndarray] = []
        for off in range(0, len(ids), self.n_batch):
            chunk = ids[off : off + self.n_batch]
            self._batch.set_batch(chunk, n_past=step.pos_start + off, logits_all=step.want_logits)
            try:
                s.ctx.decode(self._batch)
            except RuntimeError as e:
                raise BackendError(f"llama_decode failed: {e}") from None
            if step.want_logits:
                ptr = self._lc.llama_get_logits(s.ctx.ctx)
                all_logits.append(np.ctypeslib.as_array(ptr, shape=(len(chunk), self.n_vocab)).copy())
        s.length = step.pos_start + len(ids)
        ptr = self._lc.llama_get_logits_ith(s.ctx.ctx, -1)
        last = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        tok, lp = sample(last, step.sampling or SamplingParams(), s.length - 1, step.history)
        res = ForwardResult(token=tok, logprob=lp)
        if step.want_logits:
            res.logits = np.concatenate(all_logits)
        res.compute_s = time.perf_counter() - t0
        return res

    def close(self) -> None:
        for sid in list(self.sessions):
            self.close_session(sid)
