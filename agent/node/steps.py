"""A forward frame as one backend step: checked against its shard and session, run, and answered.

The data plane (agent/node/dataplane.py) keeps what is per frame on the wire (tokens, retries, chain
mode); this module owns what is per step: the frame's positions, kind and sizes checked against the
session, the StepInput handed to the shard's scheduler (agent/node/scheduler.py), the scheduler's
errors as HTTP answers, and the local answer's encoding.
"""

from __future__ import annotations

import numpy as np

from agent.artifacts.manifest import Manifest
from agent.backends.base import AdmissionError, BackendError, ForwardResult, ShardSpec, StepInput
from agent.node.errors import DataPlaneError
from agent.node.scheduler import SessionBusy, ShardScheduler, StepDropped
from agent.node.sessions import SessionState
from agent.wire.frames import (
    MAX_LOGITS_BYTES,
    HiddenDtype,
    Kind,
    Request,
    Response,
    encode_response,
    hidden_kind,
    numpy_dtype,
)
from agent.wire.prefix import common_prefix
from agent.wire.sampling import SamplingParams


def frame_step(req: Request, spec: ShardSpec, boundary_dim: int, s: SessionState) -> StepInput:
    """The backend step a forward frame asks of session `s`, or DataPlaneError. On the last shard the
    frame's ids are appended to the session's history, in place (a copy per step would be O(context) on
    the decode path): the caller cuts it back if the step fails."""
    cur = s.backend.session_len(s.sid)
    if req.n_tokens == 0:
        raise DataPlaneError(400, "bad_frame", "forward frame with no tokens")
    if req.pos_start != cur:
        raise DataPlaneError(
            409, "bad_position", f"position {req.pos_start} does not follow the session's {cur} positions"
        )
    end = req.pos_start + req.n_tokens
    if end > s.capacity:
        raise DataPlaneError(
            400, "context_cap", f"position {end} is beyond the session's context cap of {s.capacity}"
        )
    ids = hidden = None
    if spec.is_first:
        if req.kind != Kind.IDS:
            raise DataPlaneError(400, "bad_frame", "the first shard takes token ids")
        ids = req.ids()
    else:
        if req.kind not in (Kind.F16, Kind.F32):
            raise DataPlaneError(400, "bad_frame", "this shard takes hidden states")
        if req.dim != boundary_dim:
            raise DataPlaneError(
                400, "hidden_size", f"hidden size {req.dim} does not match this model's {boundary_dim}"
            )
        hidden = req.hidden()  # f16 or f32 as the frame carries it: backends read either
        if needs_ids(spec.manifest, spec.layer_start, spec.layer_end):
            if req.token_ids is None:
                raise DataPlaneError(
                    400,
                    "bad_frame",
                    "this shard's layers route by token id: send the ids with the hidden states",
                )
            ids = req.token_ids
    if req.want_logits and spec.is_last:
        vocab = vocab_size(spec.manifest)
        if req.n_tokens * vocab * 4 > MAX_LOGITS_BYTES:
            raise DataPlaneError(
                413,
                "logits_too_large",
                f"logits of {req.n_tokens} positions x {vocab} vocabulary exceed {MAX_LOGITS_BYTES} "
                f"bytes: ask for at most {MAX_LOGITS_BYTES // (4 * vocab)} positions per step",
            )
    history = None
    if spec.is_last:
        s.history.extend(ids.tolist() if ids is not None else (req.history or []))
        history = s.history
        if s.mtp_draft and ids is None and req.history is not None and len(req.history) == req.n_tokens:
            # the model's MTP head reads the token of every position (the frame's history is the step's ids)
            ids = np.asarray(req.history, dtype=np.int32)
    if req.sampling is not None:
        s.sampling = req.sampling
    return StepInput(
        s.sid,
        req.pos_start,
        token_ids=ids,
        hidden=hidden,
        sampling=s.sampling,
        history=history,
        # a verification samples every position: the last shard needs every position's logits
        want_logits=req.want_logits or (req.sample_all and spec.is_last),
        hidden_dtype=out_dtype(req),
    )


def sample_positions(s: SessionState, req: Request, logits: np.ndarray) -> tuple[list[int], list[float]]:
    """Speculative verification (Flag.SAMPLE_ALL): the token plain decoding would sample at every
    position of the step, each from its own logits, position and history (the history ends with that
    position's input, as it did when a plain step ran it). The draw is a pure function of (seed,
    position), so where a draft token equals the sample here, plain decoding would have produced it."""
    sampling = s.sampling or SamplingParams()
    n = req.n_tokens
    base = len(s.history) - n  # the step's inputs are the history's last n ids
    # the penalty reads the last repeat_last_n ids (all when negative): only they are sliced, not the
    # whole context once per position
    penalised = sampling.repeat_penalty != 1.0 and sampling.repeat_last_n != 0
    window = sampling.repeat_last_n if sampling.repeat_last_n > 0 else len(s.history)
    ids: list[int] = []
    lps: list[float] = []
    for i in range(n):
        end = base + i + 1
        hist = s.history[max(0, end - window) : end] if penalised else None
        tok, lp = s.backend.sample_position(logits[i], sampling, req.pos_start + i, hist)
        ids.append(tok)
        lps.append(lp)
    return ids, lps


async def run_step(
    scheduler: ShardScheduler, s: SessionState, step: StepInput, history_len: int
) -> ForwardResult:
    """Run `step` through the shard's scheduler (batched with other sessions' steps where the backend
    batches); a failure cuts the history back to `history_len` and is answered as a DataPlaneError."""
    s.busy = True  # never evicted or expired while queued or running
    try:
        return await scheduler.submit(s.key, s, step)
    except BaseException as e:
        del s.history[history_len:]
        if isinstance(e, AdmissionError):
            raise DataPlaneError(503, "kv_budget", str(e)) from None
        if isinstance(e, BackendError):
            raise DataPlaneError(400, "backend", str(e)) from None
        if isinstance(e, StepDropped):
            raise DataPlaneError(404, "unknown_session", str(e)) from None
        if isinstance(e, SessionBusy):
            raise DataPlaneError(409, "step_in_progress", str(e)) from None
        raise
    finally:
        s.busy = False


def draft_start(
    req: Request, s: SessionState, res: ForwardResult, sampled: tuple[list[int], list[float]] | None
) -> tuple[int, int]:
    """Where the last shard's MTP drafts after a step begin: (position, the token sampled there). After
    a verification, past the drafts that stood (the step's inputs are the history's last n ids)."""
    if sampled is None:
        assert res.token is not None
        return req.pos_start + req.n_tokens, int(res.token)
    inputs = s.history[len(s.history) - req.n_tokens :]
    m = common_prefix(inputs[1:], sampled[0])
    return req.pos_start + 1 + m, int(sampled[0][m])


def local_answer(
    req: Request,
    res: ForwardResult,
    end: int,
    sampled: tuple[list[int], list[float]] | None = None,
    drafts: list[int] | None = None,
) -> bytes:
    """This hop's response frame for a step that ended at position `end` (`sampled`: every position's
    token and logprob, for a verification step; `drafts`: the MTP head's drafts after the sampled token)."""
    if res.token is not None:
        kind, n, dim, payload = Kind.TOKEN, 0, 0, b""
        if sampled is not None:
            kind, n = Kind.TOKENS, len(sampled[0])
            payload = (
                np.asarray(sampled[0], dtype="<i4").tobytes() + np.asarray(sampled[1], dtype="<f4").tobytes()
            )
        logits = sampled is None and req.want_logits  # the answer carries logits, not drafts
        if drafts and not logits:
            dim = len(drafts)
            payload += np.asarray(drafts, dtype="<i4").tobytes()
        elif logits and res.logits is not None:
            kind, n, dim = Kind.LOGITS, res.logits.shape[0], res.logits.shape[1]
            payload = np.ascontiguousarray(res.logits, dtype=np.float32).tobytes()
        return encode_response(
            Response(
                step=req.step,
                kind=kind,
                session_len=end,
                n_tokens=n,
                dim=dim,
                token=res.token,
                logprob=res.logprob or 0.0,
                payload=payload,
            )
        )
    assert res.hidden is not None
    dtype = out_dtype(req)
    arr = res.hidden.astype(numpy_dtype(dtype), copy=False)  # no copy: the backend wrote it so
    return encode_response(
        Response(
            step=req.step,
            kind=hidden_kind(dtype),
            session_len=end,
            n_tokens=arr.shape[0],
            dim=arr.shape[1],
            payload=arr.tobytes(),
        )
    )


def needs_ids(manifest: Manifest, start: int, end: int) -> bool:
    """Whether layers [start, end) read the token ids (deepseek4's hash-routed experts)."""
    return any(layer.needs_token_ids for layer in manifest.layers[start:end])


def vocab_size(manifest: Manifest) -> int:
    """Logits per position; an unknown vocabulary counts as 128K, the largest a served model has."""
    v = manifest.hparams.get("vocab_size")
    return v if isinstance(v, int) and v > 0 else 1 << 17


def out_dtype(req: Request) -> HiddenDtype:
    return "f16" if req.f16_out else "f32"
