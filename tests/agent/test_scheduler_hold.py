"""A prefill's chunks ride in the batches of sessions decoding beside it instead of computing alone."""

from __future__ import annotations

import asyncio
import time

import pytest

import agent.node.scheduler
from agent.node.scheduler import ShardScheduler
from tests.agent.test_scheduler import RecordingBackend, sid, step

AWAY_S = 0.01  # a decoding session's step is on the other hops this long between two of its steps here


class TimedBackend(RecordingBackend):
    """Computes for `per_position_s` per position of a call (a chunk of 16: 32 ms by default)."""

    def __init__(self, per_position_s: float = 0.002) -> None:
        super().__init__()
        self.per_position_s = per_position_s

    def _start(self, steps: list) -> None:  # noqa: ANN001
        super()._start(steps)
        time.sleep(self.per_position_s * sum(n for _, _, n in steps))


def make(per_position_s: float = 0.002) -> tuple[ShardScheduler, RecordingBackend]:
    be = TimedBackend(per_position_s)
    sched = ShardScheduler(be, asyncio.Lock(), chunk_tokens=512, busy_chunk_tokens=16)
    for i in range(3):
        be.open_session(sid(i), 4096)
    return sched, be


async def decoder(
    sched: ShardScheduler, i: int, stop: asyncio.Event, steps: int | None = None, away_s: float = AWAY_S
) -> int:
    """Session `i` decoding: a step here, then `away_s` on the other hops, until `stop` (or `steps`)."""
    pos = 0
    while not stop.is_set() and (steps is None or pos < steps):
        await sched.submit(i, None, step(sid(i), pos, [1]))
        pos += 1
        await asyncio.sleep(away_s)
    return pos


def chunk_batches(be: RecordingBackend, prefill: int) -> list[set[int]]:
    """For each batch holding a chunk of session `prefill`'s prompt: the sessions in it."""
    return [{s[0] for s, _, _ in b} for b in be.batches if any(s == sid(prefill) for s, _, _ in b)]


async def prefill_beside_decoder(sched: ShardScheduler, be: RecordingBackend) -> list[set[int]]:
    stop = asyncio.Event()
    dec = asyncio.ensure_future(decoder(sched, 1, stop))
    await asyncio.sleep(5 * AWAY_S)  # it has been decoding a while: the shard knows its period
    prompt = list(range(1, 97))
    res = await sched.submit(0, None, step(sid(0), 0, prompt))
    stop.set()
    await dec
    assert res.token == sum(prompt) and be.kv[sid(0)] == prompt  # the same answer either way
    return chunk_batches(be, 0)


async def test_a_prefills_chunks_ride_with_the_decoding_sessions_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a loaded machine may keep the decoder away longer than 1.5 of its usual periods: the chunks'
    # company is under test here, not the bound (the next tests)
    monkeypatch.setattr(agent.node.scheduler, "HOLD_FACTOR", 10.0)
    sched, be = make()
    batches = await prefill_beside_decoder(sched, be)
    assert len(batches) == 96 // 16
    # the first chunk has earned no wait yet (a prefill waits at most as long as it has computed);
    # every later one rode with session 1's step instead of computing alone while it was away
    assert all(b == {0, 1} for b in batches[1:])
    assert sched.held_s > 0  # counted for /v1/health and /metrics (chunk_hold_seconds)


async def test_a_decoder_that_stops_coming_back_holds_a_prefill_only_briefly() -> None:
    sched, be = make()
    await decoder(sched, 1, asyncio.Event(), steps=6)  # then silent, its session still open
    t0 = time.perf_counter()
    await sched.submit(0, None, step(sid(0), 0, list(range(1, 97))))
    took = time.perf_counter() - t0
    # session 1 counts as stopped 1.5 of its periods (~15 ms) after its last step: nobody waits more
    assert sched.held_s < 0.05 and took < 0.192 + 0.15
    assert all(b == {0} for b in chunk_batches(be, 0))


async def test_a_session_that_finished_its_answer_does_not_hold_the_next_prompt() -> None:
    # a chat: session 1's answer ends (its session stays open for the next turn), session 2's prompt
    # comes a moment later: it computes at once, in chunks, nobody waited for
    sched, be = make()
    await decoder(sched, 1, asyncio.Event(), steps=6)
    await asyncio.sleep(0.02)  # 2 periods: session 1 is overdue
    await sched.submit(2, None, step(sid(2), 0, list(range(1, 97))))
    assert sched.held_s == 0


async def test_a_session_stepping_slowly_can_at_most_double_a_prompts_time() -> None:
    # session 1 comes back every 200 ms; a chunk of session 0's prompt computes for 32 ms: waiting for
    # session 1 each time would take 100 ms (HOLD_MAX_S) per chunk, the budget allows no more than the
    # 192 ms computed in all
    sched, be = make()
    stop = asyncio.Event()
    dec = asyncio.ensure_future(decoder(sched, 1, stop, away_s=0.2))
    await asyncio.sleep(0.5)
    t0 = time.perf_counter()
    await sched.submit(0, None, step(sid(0), 0, list(range(1, 97))))
    took = time.perf_counter() - t0
    stop.set()
    await dec
    assert took < 2 * 0.192 + 0.1  # compute, as much again held, and session 1's own steps


async def test_a_prefill_with_nobody_decoding_beside_it_never_waits() -> None:
    sched, be = make(per_position_s=0.0)
    t0 = time.perf_counter()
    await sched.submit(0, None, step(sid(0), 0, list(range(1, 1201))))
    assert time.perf_counter() - t0 < 0.05
    assert [(p, n) for b in be.batches for s, p, n in b if s == sid(0)] == [(0, 512), (512, 512), (1024, 176)]
