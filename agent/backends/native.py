"""Native ggml backend: a layer window run by libggswarm, weights quantized, KV per session in ggml."""

from __future__ import annotations

import os
import time
from typing import Any

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
from agent.backends.ggswarm_lib import (
    GGSWARM_E_BUDGET,
    GGSWARM_E_UNSUPPORTED,
    GGSWARM_MAX_STEPS,
    NativeError,
    load_library,
)
from agent.backends.libggswarm import NativeBudget, NativeModel, ggswarm_sampling, sampling_struct
from agent.backends.libggswarm import sample as native_sample
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams

# The library's checkpoint policy (native/src/model.h ckpt_every / ckpt_max; docs/native.md "Checkpoints"):
# checkpoints at the start and end of every multi-token call, none periodic, at most 2 per session (the
# latest call's start and end: where a regenerate, an edit of the last message, the next turn and a
# failed call go back to). Filled in for the one a node leaves unset when it sets the other.
CHECKPOINT_EVERY = 0
CHECKPOINTS_MAX = 2


def _error(e: NativeError) -> BackendError:
    return AdmissionError(str(e)) if e.status == GGSWARM_E_BUDGET else BackendError(str(e))


class NativeBackend(Backend):
    """Layers [layer_start, layer_end) of the GGUF in one libggswarm handle; one native session per sid."""

    def __init__(self, spec: ShardSpec, **options: object) -> None:
        """Options: kv_budget (a NativeBudget: the node's, shared by all its native shards; default
        none, no limit), model_id (identity written into KV snapshots; default the manifest's sha256),
        checkpoint_every / checkpoints_max (windows with recurrent layers or rings: checkpoints at the
        start and end of every multi-token call, plus one every N positions when N > 0, at most M per
        session; default GGSWARM_CHECKPOINT_EVERY / GGSWARM_CHECKPOINTS_MAX, else the library's 0 / 2:
        CHECKPOINT_EVERY / CHECKPOINTS_MAX; integers, N >= 0, 0 <= M <= 1024, else BackendError),
        cache_type ("f16", the default, "f32"
        where the architecture keeps it, "q8_0" / "q4_0": defaults.CACHE_TYPES), flash_attn ("auto",
        the default: the library's choice at open, flash on a GPU and off on a CPU; "on"; "off": like
        llama.cpp's -fa; a quantized cache needs flash attention, so "auto" turns it on there and "off"
        is refused), mtp (a last shard attaches the file's MTP head, where it has one, for drafts:
        mtp_draft). Options other backends take (kv_budget_bytes, n_batch, ...) are ignored."""
        budget = options.get("kv_budget")
        if budget is not None and not isinstance(budget, NativeBudget):
            raise BackendError(f"kv_budget must be a NativeBudget, not {type(budget).__name__}")
        model_id = options.get("model_id")
        try:
            load_library()
        except OSError as e:
            raise BackendError(f"native backend unavailable: {e}") from None
        self.spec = spec
        self.kv_budget = budget
        # the library charges every session's KV to the node budget itself (SessionTable reads it there)
        self.kv_in_node_budget = budget is not None
        try:
            self.model = NativeModel(
                spec.path,
                spec.layer_start,
                spec.layer_end,
                n_threads=spec.n_threads,
                budget=budget,
                model_id=str(model_id) if model_id else (spec.manifest.sha256 or None),
            )
        except NativeError as e:
            raise _error(e) from None
        if self.model.d_model != spec.manifest.boundary_dim:
            self.model.close()
            raise BackendError(
                f"model d_model {self.model.d_model} != manifest boundary_dim {spec.manifest.boundary_dim}"
            )
        self.sessions: dict[SessionId, int] = {}
        # the C struct of the sampling parameters last seen: a route's steps repeat theirs every token
        self._sampling: tuple[SamplingParams, ggswarm_sampling] = (_GREEDY, _struct(_GREEDY))
        # plain-attention architectures run a batch of sessions' steps as one graph (forward_batch)
        self.batches_sessions = self.model.batches_sessions
        cache_type = str(options.get("cache_type") or defaults.CACHE_TYPE)
        try:
            self.model.set_cache_type(cache_type)
        except NativeError as e:
            self.model.close()
            raise BackendError(f"cache type {cache_type!r}: {e}") from None
        flash = str(options.get("flash_attn") or defaults.FLASH_ATTN)
        if flash not in defaults.FLASH_ATTN_MODES:
            self.model.close()
            raise BackendError(f"flash_attn {flash!r} is not one of {', '.join(defaults.FLASH_ATTN_MODES)}")
        if flash != "auto":
            try:
                self.model.set_flash_attention(flash == "on")
            except NativeError as e:
                self.model.close()
                raise BackendError(f"flash attention {flash!r} with cache type {cache_type!r}: {e}") from None
        every = options.get("checkpoint_every", os.environ.get("GGSWARM_CHECKPOINT_EVERY"))
        most = options.get("checkpoints_max", os.environ.get("GGSWARM_CHECKPOINTS_MAX"))
        if every is not None or most is not None:
            try:
                self.model.set_checkpoints(
                    CHECKPOINT_EVERY if every is None else int(str(every)),
                    CHECKPOINTS_MAX if most is None else int(str(most)),
                )
            except (NativeError, ValueError) as e:
                self.model.close()
                raise BackendError(f"bad checkpoint settings {every!r} / {most!r}: {e}") from None
        if options.get("mtp") and spec.is_last:
            # the model's MTP head (a nextn block after the trunk), where the file has one: drafts for
            # the sessions that ask at OPEN (docs/speculative.md); a file without one serves without
            try:
                self.model.mtp_open(spec.path)
                self.mtp = True
            except NativeError as e:
                if e.status != GGSWARM_E_UNSUPPORTED:
                    self.model.close()
                    raise BackendError(f"MTP head: {e}") from None

    def mtp_draft(self, sid: SessionId, pos: int, token: int, n: int) -> list[int]:
        """The MTP head's greedy drafts after `pos` (ggswarm_mtp_draft); [] when it cannot draft for the
        session (its head missed positions: a step without token ids, a snapshot restored)."""
        if not self.mtp or n <= 0:
            return []
        try:
            return list(self.model.mtp_draft(self._sid(sid), int(token), int(n), pos=int(pos))["drafts"])
        except NativeError:
            return []

    def _sid(self, sid: SessionId) -> int:
        try:
            return self.sessions[sid]
        except KeyError:
            raise BackendError("unknown session") from None

    def open_session(self, sid: SessionId, capacity: int) -> None:
        if sid in self.sessions:
            raise BackendError("session already open")
        try:
            self.sessions[sid] = self.model.open_session(int(capacity))
        except NativeError as e:
            raise _error(e) from None

    def close_session(self, sid: SessionId) -> None:
        native_sid = self.sessions.pop(sid, None)
        if native_sid is not None and self.model is not None:
            self.model.close_session(native_sid)

    def session_len(self, sid: SessionId) -> int:
        return self.model.session_len(self._sid(sid))

    def truncate(self, sid: SessionId, n_tokens: int) -> None:
        try:
            self.model.truncate(self._sid(sid), int(n_tokens))
        except NativeError as e:
            raise _error(e) from None

    def truncate_to(self, sid: SessionId, n_tokens: int) -> tuple[int, str]:
        try:
            return self.model.truncate_to(self._sid(sid), int(n_tokens))
        except NativeError as e:
            raise _error(e) from None

    def checkpoint(self, sid: SessionId) -> bool:
        try:
            return self.model.checkpoint(self._sid(sid))
        except NativeError as e:
            raise _error(e) from None

    def drop_checkpoint(self, sid: SessionId, pos: int) -> None:
        try:
            self.model.drop_checkpoint(self._sid(sid), pos)
        except NativeError as e:
            raise _error(e) from None

    def kv_bytes(self, sid: SessionId | None = None) -> int:
        return self.model.kv_bytes(-1 if sid is None else self._sid(sid))

    def kv_growth_bytes(self, sid: SessionId, new_len: int) -> int:
        """Exactly the extra KV bytes the library needs free to hold `new_len` positions."""
        try:
            return self.model.growth_bytes(self._sid(sid), int(new_len))
        except NativeError as e:
            raise _error(e) from None

    def reclaimable_bytes(self) -> int:
        """The handle's automatic checkpoints: a cache of free budget room (docs/native.md, "Checkpoints")."""
        return self.model.checkpoints_reclaimable() if self.kv_in_node_budget else 0

    def reclaim(self, want_bytes: int) -> int:
        return self.model.reclaim_checkpoints(want_bytes) if self.kv_in_node_budget else 0

    @property
    def graph_builds(self) -> int:
        """Window graphs the library has built (one per new shape; sessions of one shape share it)."""
        return self.model.graph_builds

    def snapshot(self, sid: SessionId) -> bytes:
        """The session's KV as bytes (header with model id, layer range and positions; docs/native.md)."""
        try:
            return self.model.snapshot(self._sid(sid))
        except NativeError as e:
            raise _error(e) from None

    def restore(self, sid: SessionId, data: bytes) -> None:
        """Replace the session's KV with a snapshot taken by the same model window (any process)."""
        try:
            self.model.restore(self._sid(sid), data)
        except NativeError as e:
            raise _error(e) from None

    def _step(self, st: StepInput) -> dict[str, Any]:
        """A step checked and converted to NativeModel.forward / forward_many's arguments."""
        native_sid = self._sid(st.sid)
        token_ids, hidden, history = st.token_ids, st.hidden, st.history
        if self.spec.is_first:
            if token_ids is None:
                raise BackendError("the first shard takes token ids")
            hidden = None
        elif hidden is None:
            raise BackendError("this shard takes hidden states")
        else:
            hidden = np.asarray(hidden)
            if hidden.ndim != 2 or hidden.shape[1] != self.boundary_dim:
                raise BackendError(
                    f"hidden size mismatch: got shape {tuple(hidden.shape)}, expected (n, {self.boundary_dim})"
                )
            # token ids travel with the hidden rows to windows with token-routed layers (deepseek4's
            # hash layers); the library reads them only there
            if token_ids is not None and len(token_ids) != hidden.shape[0]:
                raise BackendError(f"{len(token_ids)} token ids for {hidden.shape[0]} hidden rows")
        params = None
        if self.spec.is_last:
            p = st.sampling or _GREEDY
            seen, params = self._sampling
            if p is not seen and p != seen:
                params = _struct(p)
                self._sampling = (p, params)
            history = _penalised(history, p)
        return {
            "sid": native_sid,
            "pos_start": st.pos_start,
            "token_ids": token_ids,
            "hidden": hidden,
            "sampling": params,
            "history": np.asarray(history, dtype=np.int32) if history else None,
            "want_logits": st.want_logits,
            "hidden_dtype": st.hidden_dtype,
        }

    def sample_position(
        self, logits: np.ndarray, sampling: SamplingParams, position: int, history: list[int] | None
    ) -> tuple[int, float]:
        """The library's own sampler (its forward samples with it), not the Python reference."""
        return native_sample(logits, _struct(sampling), position, _penalised(history, sampling))

    @staticmethod
    def _result(out: dict[str, Any], want_logits: bool) -> ForwardResult:
        return ForwardResult(
            hidden=out.get("hidden"),
            token=out.get("token"),
            logprob=out.get("logprob"),
            logits=out.get("logits") if want_logits else None,
        )

    def forward(self, step: StepInput) -> ForwardResult:
        t0 = time.perf_counter()
        args = self._step(step)
        try:
            out = self.model.forward(**args)
        except NativeError as e:
            raise _error(e) from None
        res = self._result(out, step.want_logits)
        res.compute_s = time.perf_counter() - t0
        return res

    def forward_batch(self, steps: list[StepInput]) -> list[ForwardResult | BackendError]:
        """One step of each of several distinct sessions through ggswarm_forward_many: one graph for
        all their rows where the architecture batches (batches_sessions), else one after another in
        the library. A failing step (bad input, unknown or repeated session, KV budget: AdmissionError)
        gets its error in its slot; the others run as if alone. compute_s: the whole call's time."""
        t0 = time.perf_counter()
        results: list[ForwardResult | BackendError | None] = [None] * len(steps)
        calls: list[dict[str, Any]] = []
        where: list[int] = []
        for i, st in enumerate(steps):
            try:
                calls.append(self._step(st))
                where.append(i)
            except BackendError as e:
                results[i] = e
        for lo in range(0, len(calls), GGSWARM_MAX_STEPS):
            chunk = calls[lo : lo + GGSWARM_MAX_STEPS]
            try:
                outs = self.model.forward_many(chunk)
            except (NativeError, ValueError) as e:
                err = _error(e) if isinstance(e, NativeError) else BackendError(str(e))
                outs = [NativeError(-1, str(err))] * len(chunk)
            for i, out in zip(where[lo : lo + GGSWARM_MAX_STEPS], outs, strict=True):
                if isinstance(out, NativeError):
                    results[i] = _error(out)
                else:
                    results[i] = self._result(out, steps[i].want_logits)
        secs = time.perf_counter() - t0
        final: list[ForwardResult | BackendError] = []
        for r in results:
            assert r is not None  # every slot is filled above
            if isinstance(r, ForwardResult):
                r.compute_s = secs
            final.append(r)
        return final

    def close(self) -> None:
        if getattr(self, "model", None) is not None:
            self.model.close()
        self.sessions.clear()


_GREEDY = SamplingParams()


def _struct(p: SamplingParams) -> ggswarm_sampling:
    return sampling_struct(
        p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n, p.seed
    )


def _penalised(history: list[int] | None, p: SamplingParams) -> list[int] | None:
    """The part of a session's history the library's sampler reads (native/src/sampler.cpp): none
    without a repetition penalty, else the last repeat_last_n ids (all of them when it is negative).
    Converting the whole history on every decode step would cost O(context) per token."""
    if not history or p.repeat_penalty == 1.0 or p.repeat_last_n == 0:
        return None
    return history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history
