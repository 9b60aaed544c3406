"""Helpers that drive chains of backends in-process like a route client would (tests and bench)."""

from __future__ import annotations

import numpy as np

from agent.backends.base import Backend
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams


def route_forward(
    hops: list[Backend],
    sid: SessionId,
    pos: int,
    ids: list[int],
    sampling: SamplingParams | None = None,
    history: list[int] | None = None,
    want_logits: bool = False,
):  # noqa: ANN201 - ForwardResult of the last hop
    """Push `ids` at position `pos` through every hop; returns the last hop's ForwardResult."""
    res = hops[0].forward(
        sid,
        pos,
        token_ids=np.asarray(ids, dtype=np.int32),
        sampling=sampling,
        history=history,
        want_logits=want_logits and len(hops) == 1,
    )
    for hop in hops[1:]:
        res = hop.forward(
            sid, pos, hidden=res.hidden, sampling=sampling, history=history, want_logits=want_logits
        )
    return res


def generate(
    hops: list[Backend],
    sid: SessionId,
    prompt: list[int],
    n_new: int,
    sampling: SamplingParams | None = None,
    pos: int = 0,
) -> list[int]:
    """Prefill `prompt` at `pos` then decode `n_new` tokens one step at a time."""
    history = list(prompt)
    res = route_forward(hops, sid, pos, prompt, sampling, history)
    out = [int(res.token)]
    pos += len(prompt)
    while len(out) < n_new:
        history.append(out[-1])
        res = route_forward(hops, sid, pos, [out[-1]], sampling, history)
        pos += 1
        out.append(int(res.token))
    return out
