"""The scheduler gathering a batch: steps relayed one after another join it; nobody waits for long."""

from __future__ import annotations

import asyncio
import time

import pytest

from agent.node.scheduler import GATHER_GAP_US, ShardScheduler, gather_gap_from_env
from tests.agent.test_scheduler import RecordingBackend, sid, step


class SlowFirstBackend(RecordingBackend):
    """Its first call computes for `first_s` (so the scheduler has a compute time to bound its wait
    by); later calls are instant."""

    def __init__(self, first_s: float) -> None:
        super().__init__()
        self.first_s = first_s

    def _start(self, steps: list) -> None:  # noqa: ANN001
        super()._start(steps)
        if len(self.batches) == 1:
            time.sleep(self.first_s)


class CountingEvent(asyncio.Event):
    """The scheduler's arrival event, counting how often the worker waited on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    async def wait(self) -> bool:  # type: ignore[override]
        self.waits += 1
        return await super().wait()


def make(n: int, gap_us: int, first_s: float = 0.4) -> tuple[ShardScheduler, SlowFirstBackend]:
    be = SlowFirstBackend(first_s)
    sched = ShardScheduler(be, asyncio.Lock(), busy_chunk_tokens=512, gather_gap_us=gap_us)
    sched._arrived = CountingEvent()
    for i in range(n):
        be.open_session(sid(i), 64)
    return sched, be


async def first_round(sched: ShardScheduler, n: int) -> None:
    """Every session steps once, together: one batch, which computes for `first_s`."""
    await asyncio.gather(*(sched.submit(i, None, step(sid(i), 0, [1])) for i in range(n)))


async def staggered(sched: ShardScheduler, n: int, pos: int, every_s: float) -> None:
    """The sessions' next steps arriving one after another, as a client relays them."""
    tasks = []
    for i in range(n):
        tasks.append(asyncio.ensure_future(sched.submit(i, None, step(sid(i), pos, [1]))))
        await asyncio.sleep(every_s)
    await asyncio.gather(*tasks)


async def test_steps_relayed_one_after_another_join_one_batch() -> None:
    sched, be = make(4, gap_us=50_000)  # 50 ms after each arrival, at most 0.25 x 0.4 s in all
    await first_round(sched, 4)
    await staggered(sched, 4, 1, every_s=0.005)
    assert [len(b) for b in be.batches] == [4, 4]
    assert all(be.kv[sid(i)] == [1, 1] for i in range(4))


async def test_without_gathering_the_first_relayed_step_runs_alone() -> None:
    sched, be = make(4, gap_us=0)
    await first_round(sched, 4)
    await staggered(sched, 4, 1, every_s=0.005)
    assert len(be.batches[1]) == 1  # what gathering changes
    assert sched._arrived.waits == 0


async def test_a_lone_session_never_waits() -> None:
    sched, be = make(1, gap_us=100_000)
    await first_round(sched, 1)
    for pos in range(1, 6):
        await sched.submit(0, None, step(sid(0), pos, [1]))
    assert sched._arrived.waits == 0 and len(be.batches) == 6


async def test_a_session_that_stopped_stepping_holds_the_others_at_most_a_share_of_a_compute() -> None:
    sched, be = make(2, gap_us=100_000, first_s=0.2)  # gap 100 ms, but at most 0.25 x 0.2 s = 50 ms
    await first_round(sched, 2)
    t0 = time.perf_counter()
    res = await sched.submit(0, None, step(sid(0), 1, [1]))
    waited = time.perf_counter() - t0
    assert res.token == 2 and len(be.batches[1]) == 1
    assert sched._arrived.waits >= 1  # it did wait for session 1 ...
    assert waited < 1.0  # ... boundedly (50 ms plus this machine's scheduling)


async def test_a_closed_session_is_not_waited_for() -> None:
    sched, be = make(2, gap_us=100_000, first_s=0.2)
    await first_round(sched, 2)
    async with sched.lock:
        sched.drop_session(1, "closed")
    await sched.submit(0, None, step(sid(0), 1, [1]))
    assert sched._arrived.waits == 0


def test_the_operator_can_set_the_gap_and_a_bad_value_is_a_clear_error() -> None:
    assert gather_gap_from_env({}) == GATHER_GAP_US
    assert gather_gap_from_env({"GGSWARM_BATCH_GATHER_US": "0"}) == 0  # off
    for bad in ("-1", "100001", "soon"):
        with pytest.raises(ValueError, match="GGSWARM_BATCH_GATHER_US"):
            gather_gap_from_env({"GGSWARM_BATCH_GATHER_US": bad})


def test_serving_with_a_bad_gap_fails_at_once_with_its_name(monkeypatch, capsys) -> None:  # noqa: ANN001
    from agent.cli import main

    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.setenv("GGSWARM_BATCH_GATHER_US", "soon")
    argv = ["serve", "--model", "pkg:smollm2", "--port", "1", "--public-key", "unused"]
    assert main(argv) == 2
    assert "GGSWARM_BATCH_GATHER_US='soon' is not an integer" in capsys.readouterr().err
