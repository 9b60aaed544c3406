"""The per-shard step scheduler against a fake backend that records every batch it is given."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest

from agent.backends.base import AdmissionError, Backend, BackendError, ForwardResult, StepInput
from agent.node.scheduler import (
    BUSY_CHUNK_TOKENS,
    SessionBusy,
    ShardScheduler,
    StepDropped,
    busy_chunk_from_env,
)
from agent.wire.ids import SessionId

POISON = -1  # a step holding this token id fails in the fake backend


class RecordingBackend(Backend):
    """A last shard whose KV is the list of token ids it was given. The "token" it samples is the sum
    of the session's KV, so a wrong, repeated or missing position shows in every later answer."""

    batches_sessions = True

    def __init__(self) -> None:
        self.kv: dict[SessionId, list[int]] = {}
        self.batches: list[list[tuple[SessionId, int, int]]] = []  # (session, pos_start, n) per step
        self.gate: threading.Event | None = None  # when set up, the next batch waits for it
        self.budget_after: int | None = None  # when set, forward_batch raises after that many steps

    def open_session(self, sid: SessionId, capacity: int) -> None:
        self.kv[sid] = []

    def close_session(self, sid: SessionId) -> None:
        self.kv.pop(sid, None)

    def session_len(self, sid: SessionId) -> int:
        if sid not in self.kv:
            raise BackendError("unknown session")
        return len(self.kv[sid])

    def truncate(self, sid: SessionId, n_tokens: int) -> None:
        del self.kv[sid][n_tokens:]

    def kv_bytes(self, sid: SessionId | None = None) -> int:
        return 8 * (len(self.kv[sid]) if sid is not None else sum(map(len, self.kv.values())))

    def _start(self, steps: list[tuple[SessionId, int, int]]) -> None:
        """Record a backend call (forward_batch, or forward for a batch of one) and hold it at the gate."""
        self.batches.append(steps)
        if self.gate is not None:
            gate, self.gate = self.gate, None
            assert gate.wait(10)

    def forward(self, step: StepInput) -> ForwardResult:
        assert step.token_ids is not None
        self._start([(step.sid, step.pos_start, len(step.token_ids))])
        return self._run(step)

    def _run(self, step: StepInput) -> ForwardResult:
        """One step's work, alone or inside a batch."""
        sid, pos_start, token_ids = step.sid, step.pos_start, step.token_ids
        assert token_ids is not None
        kv = self.kv.get(sid)
        if kv is None or pos_start != len(kv):
            raise BackendError(f"position {pos_start} does not follow")
        if POISON in token_ids:
            raise BackendError("poisoned step")
        kv.extend(int(t) for t in token_ids)
        return ForwardResult(
            hidden=np.asarray(token_ids, dtype=np.float32)[:, None],
            token=sum(kv),
            logprob=0.0,
            compute_s=1e-4,
        )

    def forward_batch(self, steps: list[StepInput]) -> list[ForwardResult | BackendError]:
        assert len(steps) > 1  # the scheduler runs a batch of one as a plain forward
        self._start(
            [(st.sid, st.pos_start, 0 if st.token_ids is None else len(st.token_ids)) for st in steps]
        )
        out: list[ForwardResult | BackendError] = []
        for k, st in enumerate(steps):
            if self.budget_after is not None and k == self.budget_after:
                raise AdmissionError("KV budget exhausted inside the backend")
            try:
                out.append(self._run(st))
            except BackendError as e:
                out.append(e)
        return out


class Recorder:
    """A BatchObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.batch_sizes: list[tuple[int, int]] = []

    def queue_wait(self, seconds: float) -> None:
        self.waits.append(seconds)

    def batch(self, steps: int, tokens: int, seconds: float) -> None:
        self.batch_sizes.append((steps, tokens))


def sid(i: int) -> SessionId:
    return SessionId(bytes([i]) * 16)


def make(
    max_batch_tokens: int = 512, chunk_tokens: int = 512, busy_chunk_tokens: int | None = None
) -> tuple[ShardScheduler, RecordingBackend, Recorder]:
    be, rec = RecordingBackend(), Recorder()
    sched = ShardScheduler(
        be,
        asyncio.Lock(),
        observer=rec,
        max_batch_tokens=max_batch_tokens,
        chunk_tokens=chunk_tokens,
        # unless a test is about it, one chunk size whether or not others decode
        busy_chunk_tokens=chunk_tokens if busy_chunk_tokens is None else busy_chunk_tokens,
    )
    return sched, be, rec


def step(s: SessionId, pos: int, ids: list[int]) -> StepInput:
    return StepInput(s, pos, token_ids=np.array(ids, dtype=np.int64))


async def test_concurrent_steps_of_eight_sessions_run_as_one_batch() -> None:
    sched, be, rec = make()
    for i in range(8):
        be.open_session(sid(i), 64)
    got = await asyncio.gather(*(sched.submit(i, None, step(sid(i), 0, [i + 1, 10])) for i in range(8)))
    assert [len(b) for b in be.batches] == [8]
    assert [r.token for r in got] == [i + 11 for i in range(8)]
    assert rec.batch_sizes == [(8, 16)] and len(rec.waits) == 8


async def test_a_backend_that_does_not_batch_runs_each_step_alone_in_arrival_order() -> None:
    be, rec = RecordingBackend(), Recorder()
    sched = ShardScheduler(be, asyncio.Lock(), observer=rec, batching=False)
    for i in range(3):
        be.open_session(sid(i), 64)
    got = await asyncio.gather(*(sched.submit(i, None, step(sid(i), 0, [i + 1])) for i in range(3)))
    assert be.batches == [[(sid(i), 0, 1)] for i in range(3)]  # forward, one step at a time
    assert [r.token for r in got] == [1, 2, 3] and rec.batch_sizes == [(1, 1)] * 3


async def test_a_2000_token_prefill_is_chunked_and_the_decodes_of_others_interleave() -> None:
    sched, be, _ = make(max_batch_tokens=512, chunk_tokens=512)
    prompt = [random.Random(0).randrange(1, 1000) for _ in range(2000)]
    be.open_session(sid(0), 4096)
    done = asyncio.Event()
    waited: list[int] = []  # batches each decode step waited for, past the one it could first join

    async def decoder(i: int) -> int:
        be.open_session(sid(i), 4096)
        pos = 0
        while not done.is_set():
            before = len(be.batches)
            await sched.submit(i, None, step(sid(i), pos, [i]))
            ran_in = next(
                k for k in range(before, len(be.batches)) if any(s == sid(i) for s, _, _ in be.batches[k])
            )
            waited.append(ran_in - before)
            pos += 1
        return pos

    async def prefill() -> ForwardResult:
        await asyncio.sleep(0)  # the decoders are queued first
        try:
            return await sched.submit(0, None, step(sid(0), 0, prompt))
        finally:
            done.set()

    res, *steps = await asyncio.gather(prefill(), *(decoder(i) for i in range(1, 8)))
    chunks = [(pos, n) for b in be.batches for s, pos, n in b if s == sid(0)]
    assert chunks == [(0, 512), (512, 512), (1024, 512), (1536, 464)]
    # the answer is assembled from the chunks: every row in order, the token after the last position
    assert res.hidden is not None and res.hidden[:, 0].astype(int).tolist() == prompt
    assert res.token == sum(prompt) and be.kv[sid(0)] == prompt
    # between two chunks, every other session decoded: none waits for more than one chunk
    at = [k for k, b in enumerate(be.batches) if any(s == sid(0) for s, _, _ in b)]
    for k0, k1 in zip(at, at[1:], strict=False):
        assert {s for b in be.batches[k0 + 1 : k1 + 1] for s, _, _ in b} >= {sid(i) for i in range(1, 8)}
    assert all(n >= 4 for n in steps)  # decoding went on during the prefill
    assert max(waited) <= 1  # a decode step waits at most for the batch running (or taken) before it


async def test_a_session_never_waits_more_than_one_batch_behind_a_newer_one() -> None:
    # a budget of 4 decodes per batch and 12 sessions: most rounds somebody has to wait
    sched, be, _ = make(max_batch_tokens=4, chunk_tokens=4)
    rng = random.Random(7)
    before: list[int] = []  # by submission: batches recorded when it was submitted
    who: list[tuple[int, int, int]] = []  # (session, pos_start, n_tokens) by submission
    ran: dict[int, int] = {}  # n-th submission -> the batch it ran in (its first chunk)

    async def session(i: int) -> None:
        be.open_session(sid(i), 4096)
        pos = 0
        for _ in range(15):
            for _ in range(rng.randrange(3)):
                await asyncio.sleep(0)
            n_tokens = 20 if i in (0, 1) and rng.random() < 0.3 else 1  # now and then a chunked prefill
            nth = len(who)
            who.append((i, pos, n_tokens))
            before.append(len(be.batches))
            await sched.submit(i, None, step(sid(i), pos, [i + 1] * n_tokens))
            first_piece = (sid(i), pos, min(n_tokens, 4))
            ran[nth] = next(k for k in range(before[nth], len(be.batches)) if first_piece in be.batches[k])
            pos += n_tokens

    await asyncio.gather(*(session(i) for i in range(12)))
    assert len(be.batches) > 15 * 12 // 4  # the budget really held sessions back
    assert sum(n > 1 for _, _, n in who) >= 3  # some steps were prefills, run in chunks of 4
    for a in range(len(who)):
        for b in range(a + 1, len(who)):
            # no step is passed by a newer one: it runs in the same batch or before
            assert ran[a] <= ran[b], f"step {a} ran in batch {ran[a]}, after {b} (newer) ran in {ran[b]}"


async def test_an_error_in_one_step_leaves_the_others_of_its_batch() -> None:
    sched, be, _ = make()
    for i in range(4):
        be.open_session(sid(i), 64)
        be.kv[sid(i)].extend([5, 6])
    outcome = await asyncio.gather(
        *(sched.submit(i, None, step(sid(i), 2, [POISON if i == 2 else 7])) for i in range(4)),
        return_exceptions=True,
    )
    assert len(be.batches) == 1
    assert isinstance(outcome[2], BackendError) and "poisoned" in str(outcome[2])
    assert [o.token for k, o in enumerate(outcome) if k != 2] == [18, 18, 18]  # type: ignore[union-attr]
    assert be.kv[sid(2)] == [5, 6]


async def test_a_chunked_prefill_that_fails_midway_leaves_the_session_where_it_began() -> None:
    sched, be, _ = make(chunk_tokens=8)
    be.open_session(sid(1), 64)
    be.kv[sid(1)].extend([3, 3])
    with pytest.raises(BackendError, match="poisoned"):
        await sched.submit(1, None, step(sid(1), 2, [1] * 20 + [POISON]))
    assert [b[0][1:] for b in be.batches] == [(2, 8), (10, 8), (18, 5)]
    assert be.kv[sid(1)] == [3, 3]


async def test_closing_a_session_while_its_step_is_queued_fails_that_step_only() -> None:
    sched, be, _ = make()
    for i in range(3):
        be.open_session(sid(i), 64)
    gate = threading.Event()
    be.gate = gate  # the first batch (session 0 alone) holds the shard until the gate opens
    first = asyncio.ensure_future(sched.submit(0, None, step(sid(0), 0, [1] * 20)))
    while not be.batches:
        await asyncio.sleep(0.001)
    queued = [asyncio.ensure_future(sched.submit(i, None, step(sid(i), 0, [i]))) for i in (1, 2)]
    await asyncio.sleep(0)
    assert sched.pending() == 3

    async def close(i: int) -> int:
        async with sched.lock:  # as the data plane's CLOSE does: between batches
            n = sched.drop_session(i, "closed while queued")
            be.close_session(sid(i))
            return n

    closing = asyncio.ensure_future(close(1))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not closing.done()  # a batch is running: the close waits for it
    gate.set()
    assert (await first).token == 20
    assert await closing == 1  # before the next batch: session 1's step never runs
    with pytest.raises(StepDropped, match="closed while queued"):
        await queued[0]
    assert (await queued[1]).token == 2
    assert [[s for s, _, _ in b] for b in be.batches] == [[sid(0)], [sid(2)]]
    assert sid(1) not in be.kv and sched.pending() == 0


async def test_a_second_step_of_a_session_while_its_first_is_queued_is_refused() -> None:
    sched, be, _ = make()
    be.open_session(sid(0), 64)
    first = asyncio.ensure_future(sched.submit(0, None, step(sid(0), 0, [1])))
    await asyncio.sleep(0)  # queued
    with pytest.raises(SessionBusy):
        await sched.submit(0, None, step(sid(0), 1, [2]))
    assert (await first).token == 1


async def test_a_batch_the_backend_gives_up_on_fails_each_step_and_gives_back_what_ran() -> None:
    sched, be, _ = make()
    for i in range(3):
        be.open_session(sid(i), 64)
    be.budget_after = 2  # two steps ran, then the backend refused the batch
    outcome = await asyncio.gather(
        *(sched.submit(i, None, step(sid(i), 0, [i + 1])) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(o, AdmissionError) for o in outcome)  # 503 kv_budget, not a 400
    assert all(be.kv[sid(i)] == [] for i in range(3))
    be.budget_after = None
    assert (await sched.submit(0, None, step(sid(0), 0, [4]))).token == 4  # the shard goes on


async def test_a_step_whose_handler_is_gone_is_dropped_before_it_runs() -> None:
    sched, be, _ = make()
    for i in range(2):
        be.open_session(sid(i), 64)
    gate = threading.Event()
    be.gate = gate
    first = asyncio.ensure_future(sched.submit(0, None, step(sid(0), 0, [1] * 20)))
    while not be.batches:
        await asyncio.sleep(0.001)
    gone = asyncio.ensure_future(sched.submit(1, None, step(sid(1), 0, [2])))
    await asyncio.sleep(0)
    gone.cancel()
    gate.set()
    assert (await first).token == 20
    with pytest.raises(asyncio.CancelledError):
        await gone
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(be.batches) == 1 and be.kv[sid(1)] == [] and sched.pending() == 0


async def test_a_prefill_runs_whole_micro_batches_alone_and_small_chunks_while_another_session_decodes() -> (
    None
):
    sched, be, _ = make(max_batch_tokens=512, chunk_tokens=512, busy_chunk_tokens=32)
    for i in range(3):
        be.open_session(sid(i), 4096)
    alone = await sched.submit(0, None, step(sid(0), 0, list(range(1, 601))))
    assert [(p, n) for b in be.batches for s, p, n in b if s == sid(0)] == [(0, 512), (512, 88)]
    assert alone.token == sum(range(1, 601))
    # session 1 decodes (a step a moment ago): session 2's prompt goes 32 positions at a time, so a
    # decode arriving meanwhile waits for 32 positions, not 512
    await sched.submit(1, None, step(sid(1), 0, [7]))
    res = await sched.submit(2, None, step(sid(2), 0, list(range(1, 101))))
    assert [(p, n) for b in be.batches for s, p, n in b if s == sid(2)] == [
        (0, 32),
        (32, 32),
        (64, 32),
        (96, 4),
    ]
    assert res.token == sum(range(1, 101)) and be.kv[sid(2)] == list(range(1, 101))


def test_the_operator_can_set_the_busy_chunk_and_a_bad_value_is_a_clear_error() -> None:
    assert busy_chunk_from_env({}) == BUSY_CHUNK_TOKENS
    assert busy_chunk_from_env({"GGSWARM_BUSY_CHUNK_TOKENS": "16"}) == 16
    for bad in ("0", "513", "lots"):
        with pytest.raises(ValueError, match="GGSWARM_BUSY_CHUNK_TOKENS"):
            busy_chunk_from_env({"GGSWARM_BUSY_CHUNK_TOKENS": bad})
