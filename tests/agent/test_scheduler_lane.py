"""The scheduler beside the node's lane: while sessions decode there, a prompt runs in the lane's small
chunks, each one paced (in the worker thread) to the lane's passes, and the prompt still ends exact."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from agent.backends.base import StepInput
from agent.node.scheduler import LANE_CHUNK_TOKENS, ShardScheduler
from tests.agent.test_scheduler import RecordingBackend, sid


def _scheduler(elsewhere: list[bool], paced: list[str]) -> tuple[ShardScheduler, RecordingBackend]:
    be = RecordingBackend()

    def pace() -> None:
        # a blocking call: it must not run on the event loop's thread
        paced.append(threading.current_thread().name)

    sched = ShardScheduler(
        be,
        asyncio.Lock(),
        chunk_tokens=512,
        busy_chunk_tokens=16,
        decoding_elsewhere=lambda: elsewhere[0],
        pace=pace,
    )
    return sched, be


async def test_a_prompt_beside_lane_sessions_runs_in_small_paced_chunks_off_the_loop() -> None:
    elsewhere, paced = [True], []
    sched, be = _scheduler(elsewhere, paced)
    be.open_session(sid(1), 4096)
    prompt = list(range(1, 21))
    res = await sched.submit(1, None, StepInput(sid(1), 0, token_ids=np.asarray(prompt, dtype=np.int64)))
    sizes = [n for b in be.batches for _, _, n in b]
    assert sizes == [LANE_CHUNK_TOKENS, LANE_CHUNK_TOKENS, 20 - 2 * LANE_CHUNK_TOKENS]
    assert len(paced) == 3 and threading.main_thread().name not in paced
    assert res.token == sum(prompt) and be.kv[sid(1)] == prompt


async def test_with_no_lane_session_a_prompt_runs_whole_and_is_never_paced() -> None:
    elsewhere, paced = [False], []
    sched, be = _scheduler(elsewhere, paced)
    be.open_session(sid(1), 4096)
    await sched.submit(1, None, StepInput(sid(1), 0, token_ids=np.arange(1, 41, dtype=np.int64)))
    assert [n for b in be.batches for _, _, n in b] == [40] and paced == []
    # a decode step (one position) is never paced either, lane or not
    elsewhere[0] = True
    await sched.submit(1, None, StepInput(sid(1), 40, token_ids=np.asarray([5], dtype=np.int64)))
    assert paced == []
