"""The native executor's numbers do not depend on how many threads compute them: a replacement hop
with another --threads (failover) continues a session with the very numbers the first one gave."""

from __future__ import annotations

import numpy as np

from agent.backends import load_backend
from agent.backends.base import ShardSpec, StepInput
from tests.helpers import CHAT_PROMPT


def run(be, threads: list[int], tag: int) -> list[np.ndarray]:  # noqa: ANN001 - a NativeBackend
    """Two sessions: a prefill each, then decode steps of both in one batch, each call on the next
    thread count of `threads` (cycled); every call's logits."""
    sids = [bytes([tag, i]) * 8 for i in range(2)]
    out: list[np.ndarray] = []
    toks, pos = [], []
    for k, s in enumerate(sids):
        be.model.set_threads(threads[k % len(threads)])
        be.open_session(s, 256)
        prompt = CHAT_PROMPT[: 20 + 7 * k]
        r = be.forward(StepInput(s, 0, token_ids=np.array(prompt, dtype=np.int32), want_logits=True))
        out.append(r.logits)
        toks.append(int(np.argmax(r.logits[-1])))
        pos.append(len(prompt))
    for step in range(6):
        be.model.set_threads(threads[step % len(threads)])
        steps = [
            StepInput(s, pos[i], token_ids=np.array([toks[i]], dtype=np.int32), want_logits=True)
            for i, s in enumerate(sids)
        ]
        for i, r in enumerate(be.forward_batch(steps)):
            assert not isinstance(r, Exception), r
            out.append(r.logits)
            toks[i] = int(np.argmax(r.logits[-1]))
            pos[i] += 1
    for s in sids:
        be.close_session(s)
    return out


def test_one_thread_two_threads_and_a_count_changing_every_call_give_identical_logits(
    native_lib: None, model_path: str, manifest
) -> None:  # noqa: ANN001
    be = load_backend("native", ShardSpec(model_path, 0, 30, manifest, n_threads=2))
    try:
        two = run(be, [2], 1)
        one = run(be, [1], 2)
        mixed = run(be, [1, 2], 3)
    finally:
        be.close()
    assert len(two) == 2 + 2 * 6
    for a, b, c in zip(two, one, mixed, strict=True):
        assert np.array_equal(a, b) and np.array_equal(a, c)
