"""A route's hops in one process: each hop's hidden rows handed to the next, as the route client would send
them (the native tests and bench/native.py, bench/archs.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agent.backends.base import Backend, ForwardResult, StepInput
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams


def route_forward(
    hops: Sequence[Backend],
    sid: SessionId,
    pos: int,
    ids: Sequence[int],
    sampling: SamplingParams | None = None,
    history: list[int] | None = None,
    want_logits: bool = False,
) -> ForwardResult:
    """Push `ids` at position `pos` through every hop; returns the last hop's ForwardResult."""
    res = hops[0].forward(
        StepInput(
            sid,
            pos,
            token_ids=np.asarray(ids, dtype=np.int32),
            sampling=sampling,
            history=history,
            want_logits=want_logits and len(hops) == 1,
        )
    )
    for hop in hops[1:]:
        res = hop.forward(
            StepInput(
                sid, pos, hidden=res.hidden, sampling=sampling, history=history, want_logits=want_logits
            )
        )
    return res
