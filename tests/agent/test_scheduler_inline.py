"""A lone decoding session's small step runs at once on the event loop: no worker, no loop turn."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import agent.node.scheduler
from agent.backends.base import AdmissionError, BackendError, ForwardResult, StepInput
from agent.node.scheduler import INLINE_TOKENS, ShardScheduler
from tests.agent.test_scheduler import POISON, Recorder, RecordingBackend, make, sid, step


async def in_place(coro: Any) -> tuple[bool, Any]:
    """(whether `coro` finished without the event loop running anything else, its result)."""
    turned = False

    def mark() -> None:
        nonlocal turned
        turned = True

    asyncio.get_running_loop().call_soon(mark)
    res = await coro
    return not turned, res


class HalfWritingBackend(RecordingBackend):
    """Appends a failing step's positions before it raises, as a backend that fails midway through
    a graph would leave its KV."""

    def _run(self, step: StepInput) -> ForwardResult:
        if step.token_ids is not None and POISON in step.token_ids:
            self.kv[step.sid].extend(int(t) for t in step.token_ids if t != POISON)
            raise BackendError("poisoned after writing")
        return super()._run(step)


class ThreadRecordingBackend(RecordingBackend):
    """Records the thread each backend call ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def _start(self, steps: list) -> None:  # noqa: ANN001
        self.threads.append(threading.get_ident())
        super()._start(steps)


async def decoding(sched: ShardScheduler, be: RecordingBackend, i: int = 0) -> None:
    """Session `i` opened and stepped once (its first step takes the usual path)."""
    be.open_session(sid(i), 64)
    await sched.submit(i, None, step(sid(i), 0, [1]))


async def test_a_lone_decoding_sessions_small_step_is_answered_without_a_loop_turn() -> None:
    sched, be, rec = make()
    await decoding(sched, be)
    inline, res = await in_place(sched.submit(0, None, step(sid(0), 1, [2, 3])))
    assert inline and res.token == 6 and be.kv[sid(0)] == [1, 2, 3]
    assert be.batches[-1] == [(sid(0), 1, 2)]
    assert rec.batch_sizes[-1] == (1, 2) and rec.waits[-1] == 0.0  # telemetry as for a batch of one


async def test_a_sessions_first_step_waits_for_the_others_arriving_in_the_same_turn() -> None:
    sched, be, _ = make()
    for i in range(4):
        be.open_session(sid(i), 64)
    await asyncio.gather(*(sched.submit(i, None, step(sid(i), 0, [1])) for i in range(4)))
    assert [len(b) for b in be.batches] == [4]


async def test_with_another_session_decoding_steps_are_batched_not_run_inline() -> None:
    sched, be, _ = make()
    await asyncio.gather(decoding(sched, be, 0), decoding(sched, be, 1))
    # session 0's step waits for a batch (session 1 is coming back), and session 1's joins it
    got = await asyncio.gather(
        in_place(sched.submit(0, None, step(sid(0), 1, [5]))), sched.submit(1, None, step(sid(1), 1, [5]))
    )
    assert got[0][0] is False
    assert [got[0][1].token, got[1].token] == [6, 6] and [len(b) for b in be.batches] == [2, 2]


async def test_a_prefill_or_a_step_while_the_shard_is_busy_is_not_run_inline() -> None:
    sched, be, _ = make()
    await decoding(sched, be)
    inline, _ = await in_place(sched.submit(0, None, step(sid(0), 1, [1] * (INLINE_TOKENS + 1))))
    assert not inline
    pos = 1 + INLINE_TOKENS + 1
    await sched.lock.acquire()  # a hand-off or a big step in a thread holds the shard
    waiting = asyncio.ensure_future(in_place(sched.submit(0, None, step(sid(0), pos, [1]))))
    await asyncio.sleep(0.01)
    assert not waiting.done() and len(be.kv[sid(0)]) == pos  # it waits for the shard
    sched.lock.release()
    inline, _ = await waiting
    assert not inline and len(be.kv[sid(0)]) == pos + 1


async def test_an_inline_step_that_fails_leaves_the_session_where_it_began() -> None:
    be, rec = HalfWritingBackend(), Recorder()
    sched = ShardScheduler(be, asyncio.Lock(), observer=rec)
    await decoding(sched, be)
    with pytest.raises(BackendError, match="poisoned"):
        await sched.submit(0, None, step(sid(0), 1, [7, POISON]))
    assert be.kv[sid(0)] == [1]
    inline, res = await in_place(sched.submit(0, None, step(sid(0), 1, [7])))
    assert inline and res.token == 8


async def test_an_inline_step_the_kv_budget_refuses_runs_nothing() -> None:
    refused: list[int] = []

    def admit(owner: object, grow: int) -> None:
        if owner == "full":
            refused.append(grow)
            raise AdmissionError("KV budget exhausted")

    be = RecordingBackend()
    sched = ShardScheduler(be, asyncio.Lock(), admit=admit)
    await decoding(sched, be)
    calls = len(be.batches)
    with pytest.raises(AdmissionError):
        await sched.submit(0, "full", step(sid(0), 1, [3]))
    assert refused and len(be.batches) == calls and be.kv[sid(0)] == [1]


async def test_a_batch_of_a_few_positions_computes_on_the_loop_and_a_bigger_one_in_a_thread() -> None:
    be = ThreadRecordingBackend()
    sched = ShardScheduler(be, asyncio.Lock())
    for i in range(4):
        be.open_session(sid(i), 64)
    await asyncio.gather(*(sched.submit(i, None, step(sid(i), 0, [1] * 4)) for i in range(4)))  # 16
    await asyncio.gather(*(sched.submit(i, None, step(sid(i), 4, [1] * 5)) for i in range(4)))  # 20
    loop_thread = threading.get_ident()
    assert [len(b) for b in be.batches] == [4, 4]
    assert be.threads[0] == loop_thread
    assert be.threads[1] != loop_thread
    assert [be.kv[sid(i)] for i in range(4)] == [[1] * 9] * 4


async def test_sessions_that_expire_without_closing_are_forgotten_by_a_lone_sessions_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent.node.scheduler, "BUSY_WINDOW_S", 0.05)
    sched, be, _ = make()
    for i in range(1, 6):  # each steps once and is never closed (the node's sweeper expires it)
        be.open_session(sid(i), 64)
        await sched.submit(i, None, step(sid(i), 0, [1]))
    await asyncio.sleep(0.1)
    await decoding(sched, be)
    inline, _ = await in_place(sched.submit(0, None, step(sid(0), 1, [1])))
    assert inline and set(sched._last_step) == {0}  # the table holds the sessions of the last window
