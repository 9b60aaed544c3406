"""The backend contract every layer-range executor implements (torch, llama.cpp, native ggml)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from agent.artifacts.manifest import Manifest
from agent.backends.sampling import sample
from agent.wire.frames import HiddenDtype
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams


class BackendError(Exception):
    """A request the backend cannot serve; the message is safe to show to the caller."""


class AdmissionError(BackendError):
    """The KV budget cannot take this session/step right now (maps to HTTP 503)."""


@dataclass(frozen=True)
class ShardSpec:
    """What a node hosts: layers [layer_start, layer_end) of the GGUF at `path`."""

    path: str
    layer_start: int
    layer_end: int
    manifest: Manifest
    n_threads: int = 2

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_end == self.manifest.n_layers

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass
class ForwardResult:
    """Output of one forward call.

    Non-last shards return `hidden` (n_tokens x boundary_dim, in the dtype forward was asked for).
    The last shard returns the sampled `token` and its `logprob` (log-softmax of the raw logits) for
    the final position; when `want_logits` was asked (tests, teacher forcing) it also fills `logits`
    for every position.
    """

    hidden: np.ndarray | None = None
    token: int | None = None
    logprob: float | None = None
    logits: np.ndarray | None = None
    compute_s: float = 0.0


@dataclass
class StepInput:
    """One session's step (Backend.forward, one of a batch in forward_batch): new positions
    [pos_start, pos_start + n) appended to the session's KV.

    The first shard takes `token_ids`; the others take `hidden` (f16 or f32 rows, as the frame
    carried them, with the positions' `token_ids` where the window routes experts by token id).
    `history` is the token ids the session has seen (for the repetition penalty on the last shard).
    A non-last shard returns its hidden rows in `hidden_dtype` (f32: unrounded).
    """

    sid: SessionId
    pos_start: int
    token_ids: np.ndarray | None = None
    hidden: np.ndarray | None = None
    sampling: SamplingParams | None = None
    history: list[int] | None = None
    want_logits: bool = False
    hidden_dtype: HiddenDtype = "f32"


class Backend(ABC):
    """A loaded layer range. Thread-compatible, not thread-safe: the data plane serialises calls."""

    spec: ShardSpec
    # True when the backend's KV is charged to the node budget it was given, in the backend itself
    # (native: in libggswarm); the session table then reads that budget instead of adding sessions up.
    kv_in_node_budget: bool = False
    # True on a last shard that drafts with the model's own MTP head (mtp_draft; docs/speculative.md)
    mtp: bool = False

    @property
    def boundary_dim(self) -> int:
        """Elements per token of the state crossing a seam (from the manifest, not hard-coded)."""
        return self.spec.manifest.boundary_dim

    @abstractmethod
    def open_session(self, sid: SessionId, capacity: int) -> None:
        """Reserve per-session state able to grow to `capacity` positions."""

    @abstractmethod
    def close_session(self, sid: SessionId) -> None:
        """Free every byte held for `sid`. Unknown ids are ignored."""

    @abstractmethod
    def session_len(self, sid: SessionId) -> int:
        """Number of positions currently in the session's KV."""

    @abstractmethod
    def truncate(self, sid: SessionId, n_tokens: int) -> None:
        """Drop KV positions >= n_tokens (a backend keeping recurrent state goes back to its newest
        checkpoint at or before n_tokens: session_len says where; truncate_to reports it)."""

    def truncate_to(self, sid: SessionId, n_tokens: int) -> tuple[int, str]:
        """Go back to at most `n_tokens` positions; returns (length now held, how). KV-only backends
        go back exactly ("exact"); one holding recurrent state goes back to its newest checkpoint at or
        before `n_tokens` ("checkpoint") or to 0 ("from_zero"), and the caller re-prefills the rest."""
        self.truncate(sid, n_tokens)
        return n_tokens, "exact"

    def sample_position(
        self, logits: np.ndarray, sampling: SamplingParams, position: int, history: list[int] | None
    ) -> tuple[int, float]:
        """The token this backend's forward would sample from one position's logits (a speculative
        verification samples every position of a step as plain decoding samples each one)."""
        return sample(logits, sampling, position, history)

    def checkpoint(self, sid: SessionId) -> bool:
        """Keep the session's fixed-size state at its length now, so a truncate_to into the positions
        after it comes back here exactly (a speculative verification's rows are cut back so); True
        when this call took one. KV-only backends truncate exactly anyway: nothing to keep."""
        return False

    def drop_checkpoint(self, sid: SessionId, pos: int) -> None:  # noqa: B027 - nothing kept by default
        """Drop the checkpoint `checkpoint` took at `pos`."""

    def mtp_draft(self, sid: SessionId, pos: int, token: int, n: int) -> list[int]:
        """Up to `n` tokens the model's MTP head drafts after position `pos` of the session, the first
        from `token` (sampled at `pos`); [] where there is no head or it cannot draft for the session."""
        return []

    @abstractmethod
    def forward(self, step: StepInput) -> ForwardResult:
        """Run the range on the step's new positions, appended to its session's KV (StepInput)."""

    # True when forward_batch runs the steps of several sessions as one computation (continuous
    # batching); False: it runs them one after another, and the data plane gains nothing by batching.
    batches_sessions: bool = False

    def forward_batch(self, steps: list[StepInput]) -> list[ForwardResult | BackendError]:
        """Run one step of each of several distinct sessions; results in order. A step that fails
        gets its BackendError in its slot and leaves the others' results (and KV) as if run alone.
        This default runs them one after another; a batching backend overrides it."""
        out: list[ForwardResult | BackendError] = []
        for st in steps:
            try:
                out.append(self.forward(st))
            except AdmissionError:
                raise
            except BackendError as e:
                out.append(e)
        return out

    @abstractmethod
    def kv_bytes(self, sid: SessionId | None = None) -> int:
        """Bytes of KV held for one session, or for all sessions when `sid` is None."""

    def kv_open_bytes(self, capacity: int) -> int:
        """KV bytes reserved up front when a session opens (backends that preallocate)."""
        return 0

    def kv_growth_bytes(self, sid: SessionId, new_len: int) -> int:
        """Extra KV bytes the node budget must have free for the session to grow to `new_len`."""
        return 0

    def reclaimable_bytes(self) -> int:
        """Bytes of the node budget held by caches the backend gives back on demand (checkpoints)."""
        return 0

    def reclaim(self, want_bytes: int) -> int:
        """Give back up to `want_bytes` of reclaimable_bytes to the node budget; returns the bytes freed."""
        return 0

    def snapshot(self, sid: SessionId) -> bytes:
        """The session's KV as bytes (prefix snapshots, migration); backends that cannot, refuse."""
        raise BackendError(f"{type(self).__name__} cannot snapshot sessions")

    def restore(self, sid: SessionId, data: bytes) -> None:
        """Open `sid` from a snapshot taken by the same backend on the same shard."""
        raise BackendError(f"{type(self).__name__} cannot restore sessions")

    def close(self) -> None:  # noqa: B027 - optional hook, most backends free on garbage collection
        """Release the model. Idempotent."""
