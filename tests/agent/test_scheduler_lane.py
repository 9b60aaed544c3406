"""The scheduler beside the node's lane: while sessions decode there, a prompt runs in chunks the lane's
pacer sizes (its budget share of the decoders' period), each run (in the worker thread) while the lane
holds its next step, which it then releases, and the prompt still ends exact."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from agent.backends.base import StepInput
from agent.node.prefill_budget import MIN_TOKENS, LanePacer
from agent.node.scheduler import ShardScheduler
from tests.agent.test_scheduler import RecordingBackend, sid


class PassingLane:
    """A lane whose sessions' step arrives on this hop every `period` seconds of a fake clock: each wait
    for one moves the clock to the next, from whichever thread waits (recorded), and holds it until
    released (counted)."""

    def __init__(self, period: float) -> None:
        self.period, self.now = period, 0.0
        self.threads: list[str] = []
        self.held = 0

    def wait_turn(self, timeout_s: float) -> bool:
        assert self.held == 0, "a step was held twice: the previous chunk did not release it"
        self.threads.append(threading.current_thread().name)
        self.now += self.period
        self.held += 1
        return True

    def release(self) -> None:
        self.held -= 1


def _scheduler(
    elsewhere: list[bool], lane: PassingLane, share: float = 1.0
) -> tuple[ShardScheduler, RecordingBackend, LanePacer]:
    be = RecordingBackend()
    pacer = LanePacer(lane.wait_turn, lane.release, share=share, clock=lambda: lane.now)
    sched = ShardScheduler(
        be,
        asyncio.Lock(),
        chunk_tokens=512,
        busy_chunk_tokens=16,
        decoding_elsewhere=lambda: elsewhere[0],
        pacer=pacer,
    )
    return sched, be, pacer


async def test_a_prompt_beside_lane_sessions_runs_in_paced_chunks_off_the_loop() -> None:
    lane = PassingLane(0.05)
    sched, be, _ = _scheduler([True], lane)
    be.open_session(sid(1), 4096)
    prompt = list(range(1, 21))
    res = await sched.submit(1, None, StepInput(sid(1), 0, token_ids=np.asarray(prompt, dtype=np.int64)))
    sizes = [n for b in be.batches for _, _, n in b]
    # the first chunk is the smallest (nothing measured yet); each waited for the lane's step, in a
    # worker thread, and let it go after
    assert sizes[0] == MIN_TOKENS and sum(sizes) == 20
    assert len(lane.threads) == len(sizes) and threading.main_thread().name not in lane.threads
    assert lane.held == 0
    assert res.token == sum(prompt) and be.kv[sid(1)] == prompt


async def test_chunks_grow_to_the_budget_and_the_prompt_ends_exact() -> None:
    # the recording backend computes in microseconds against a 50 ms period: the budget allows whole
    # micro-batches, reached by doubling once the first gap between passes is measured
    lane = PassingLane(0.05)
    sched, be, pacer = _scheduler([True], lane)
    be.open_session(sid(1), 8192)
    prompt = [(i % 997) + 1 for i in range(2000)]
    res = await sched.submit(1, None, StepInput(sid(1), 0, token_ids=np.asarray(prompt, dtype=np.int64)))
    sizes = [n for b in be.batches for _, _, n in b]
    assert sizes[:5] == [8, 8, 16, 32, 64] and max(sizes) == 512 and sum(sizes) == 2000
    assert res.token == sum(prompt) and be.kv[sid(1)] == prompt
    assert pacer.period_s is not None and 0.04 < pacer.period_s <= 0.05


async def test_with_no_lane_session_a_prompt_runs_whole_and_is_never_paced() -> None:
    elsewhere = [False]
    lane = PassingLane(0.05)
    sched, be, _ = _scheduler(elsewhere, lane)
    be.open_session(sid(1), 4096)
    await sched.submit(1, None, StepInput(sid(1), 0, token_ids=np.arange(1, 41, dtype=np.int64)))
    assert [n for b in be.batches for _, _, n in b] == [40] and lane.threads == []
    # a decode step (one position) is never paced either, lane or not
    elsewhere[0] = True
    await sched.submit(1, None, StepInput(sid(1), 40, token_ids=np.asarray([5], dtype=np.int64)))
    assert lane.threads == []


class QuietLane(PassingLane):
    """A lane whose sessions still count as decoding but send no step: every wait holds nothing."""

    def wait_turn(self, timeout_s: float) -> bool:
        self.threads.append(threading.current_thread().name)
        return False


async def test_a_prompt_beside_a_quiet_lane_is_not_cut_into_the_smallest_chunks() -> None:
    # the lane's decoders paused (given way to this prompt's user): after the first chunk finds no step
    # to hold, the rest goes in chunks of the quiet cost (microseconds here: whole micro-batches)
    lane = QuietLane(0.05)
    sched, be, pacer = _scheduler([True], lane)
    be.open_session(sid(1), 4096)
    prompt = [(i % 997) + 1 for i in range(700)]
    res = await sched.submit(1, None, StepInput(sid(1), 0, token_ids=np.asarray(prompt, dtype=np.int64)))
    sizes = [n for b in be.batches for _, _, n in b]
    assert sizes == [MIN_TOKENS, 512, 700 - 512 - MIN_TOKENS]
    assert pacer.quiet_chunks == 3 and pacer.mixed_chunks == 0
    assert res.token == sum(prompt) and be.kv[sid(1)] == prompt
