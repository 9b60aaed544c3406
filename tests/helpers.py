"""Test helpers shared across suites: a fixed chat prompt and greedy decoding through backends."""

from __future__ import annotations

import numpy as np

from agent.backends.base import Backend, StepInput
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams

# "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, ... The capital of France is" in
# SmolLM2's vocabulary: a real continuation, not one token repeated.
CHAT_PROMPT = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    504,
    3575,
    282,
    4649,
    314,
]


def greedy_through(parts: list[Backend], prompt: list[int], n: int, sid: bytes = b"g" * 16) -> list[int]:
    """`n` greedy tokens with the hidden state handed from each backend to the next (one process)."""
    session = SessionId(sid)
    for p in parts:
        p.open_session(session, len(prompt) + n + 1)
    out: list[int] = []
    ids, pos = prompt, 0
    try:
        for _ in range(n):
            h = None
            for p in parts:
                r = p.forward(
                    StepInput(
                        session,
                        pos,
                        token_ids=np.array(ids) if h is None else None,
                        hidden=h,
                        sampling=SamplingParams(),
                    ),
                )
                h = r.hidden
            pos += len(ids)
            assert r.token is not None
            out.append(int(r.token))
            ids = [int(r.token)]
    finally:
        for p in parts:
            p.close_session(session)
    return out
