"""Per-shard step scheduler: runs the steps of different sessions that arrive together as one batch.

Owns the order in which a shard's backend runs forward steps (docs/protocol.md, "Batching"). The data
plane validates a frame, then hands its step here and awaits the result; the KV bytes stay the
session table's, reached through the `admit` callback, and retries stay the data plane's.

A backend that really batches (`Backend.batches_sessions`) gets one worker task per shard. Each round
it takes at most one pending step per session, in line order (when the step arrived, or when its
latest chunk ended), while they fit in `max_batch_tokens` positions. A prefill longer than
`chunk_tokens` runs one chunk per round and then goes to the back of the line: a long prompt holds the
decodes of other sessions for one chunk, never for the whole prompt, and two long prompts take turns.
No step is ever passed by a newer one.

Before it takes a batch the worker may wait a little for steps still on their way (`_gather`): while
fewer steps are queued than sessions that stepped here lately, up to a millisecond after each arrival
and at most a quarter of the latest batch's compute, so steps a client relays one after another join
one batch. A lone session never waits: its small steps do not even go through the worker
(`_run_inline`), and a batch of a few positions computes on the event loop, not in a thread.

`chunk_tokens` defaults to the native executor's micro-batch (native/src/graph.cpp kUBatch = 512): an
unchunked call is computed in pieces of exactly that size from its first position, so a chunked
prefill runs the very same pieces and leaves the same KV position for position.

Sessions on the node's native lane decode outside this queue (lanes.py): while they do, a prompt runs
in chunks the node's `LanePacer` sizes from measured costs (prefill_budget.py: a set share of the
decoders' period), each run in the worker thread just before their next step here, which waits for it.

A backend that does not batch runs one step at a time under the shard lock, as it always has: small
steps inline on the event loop, bigger ones in a worker thread, nothing added to their latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from agent.backends.base import Backend, BackendError, ForwardResult, StepInput
from agent.defaults import env_int

# A lone decoding session's step this short runs on the event loop at once (ShardScheduler._run_inline),
# and a batch this short in the worker without a thread hand-off: a few ms of compute cost less than
# the hand-off and the wake-up after it (docs/benchmarks-log.md, "Small steps in place")
INLINE_TOKENS = 16
MAX_BATCH_TOKENS = 512  # positions per batch (one step alone may have up to CHUNK_TOKENS)
CHUNK_TOKENS = 512  # = native kUBatch: chunk boundaries are the micro-batch boundaries of one call
# While other sessions are decoding on the shard, a prefill runs in chunks this small: a decode step
# that arrives during a chunk waits for at most this many positions (tens of ms on a CPU), not 512
# (about a second on two cores). 16 rather than 32: p95 inter-token latency of 4 decoding sessions while
# a 2,000-token prompt arrived fell from 451 to 275 ms, the prompt took 36 s instead of 29 (bench/served.py
# --itl-only A/B, docs/benchmarks-log.md). Exact for the native executor at any cut in ggml-ops attention
# mode; in flash-attention mode a cut changes the rounding as llama.cpp's ubatch does (docs/protocol.md).
BUSY_CHUNK_TOKENS = 16
BUSY_CHUNK_ENV = "GGSWARM_BUSY_CHUNK_TOKENS"  # an operator's override, 1..CHUNK_TOKENS
BUSY_WINDOW_S = 1.0  # another session stepped on this shard this recently: it is decoding
# Gathering a batch (ShardScheduler._gather). 8 sessions over 3 hops on 2 cores: batches of 3.4 steps
# instead of 1.8, 99 instead of 88 tok/s in all; one session and the ITL under a long prompt unchanged
# (docs/benchmarks-log.md, "Gathering a batch").
GATHER_GAP_US = 1000  # wait at most this long after each arrival
GATHER_GAP_ENV = "GGSWARM_BATCH_GATHER_US"  # an operator's override, 0 (off)..100000
GATHER_SHARE = 0.25  # and in all at most this share of the latest batch's compute
ACTIVE_S = 0.25  # a session stepped here this recently (or 4 batches' compute, if longer): it comes back
# A prefill's chunk waits for the steps of sessions decoding beside it (ShardScheduler._hold_chunks):
# until they are HOLD_FACTOR x their own period overdue (they stopped), never more than HOLD_MAX_S
HOLD_FACTOR = 1.5
HOLD_MAX_S = 0.1

Admit = Callable[[Any, int], None]  # (the step's owner, KV bytes the batch adds so far) -> or raises


def busy_chunk_from_env(env: Mapping[str, str] | None = None) -> int:
    """BUSY_CHUNK_TOKENS, or the operator's GGSWARM_BUSY_CHUNK_TOKENS (ValueError when out of range)."""
    n = env_int(BUSY_CHUNK_ENV, 1, CHUNK_TOKENS, env)
    return BUSY_CHUNK_TOKENS if n is None else n


def gather_gap_from_env(env: Mapping[str, str] | None = None) -> int:
    """GATHER_GAP_US, or the operator's GGSWARM_BATCH_GATHER_US (ValueError when out of range)."""
    n = env_int(GATHER_GAP_ENV, 0, 100_000, env)
    return GATHER_GAP_US if n is None else n


class Pacer(Protocol):
    """How prompts share a hop with the lane's decoders (agent/node/prefill_budget.py LanePacer)."""

    def chunk_tokens(self, prompts: int = 1) -> int: ...

    def before_chunk(self) -> bool: ...

    def after_chunk(self, tokens: int, seconds: float, held: bool) -> None: ...


class BatchObserver(Protocol):
    """Where the scheduler reports its figures (agent/node/metrics.py NodeMetrics)."""

    def queue_wait(self, seconds: float) -> None: ...

    def batch(self, steps: int, tokens: int, seconds: float) -> None: ...


class StepDropped(Exception):
    """The step was taken off the queue before it completed (its session closed, its shard unloaded)."""


class SessionBusy(Exception):
    """The session already has a step queued or running here (one step per session at a time)."""


@dataclass(eq=False)
class _Pending:
    """A submitted step, maybe part-run (chunked prefill): what is done so far and who waits on it."""

    key: Hashable
    owner: Any
    step: StepInput
    n_tokens: int
    future: asyncio.Future[ForwardResult]
    enqueued: float
    ready: float  # place in line: when it arrived, or when its latest chunk finished
    done: int = 0
    parts: list[ForwardResult] = field(default_factory=list)
    closed: bool = False  # its session is closed: drop it, the session's KV is gone anyway
    computed: float = 0.0  # seconds its chunks have computed (in their batches)
    held: float = 0.0  # seconds it waited for decoding sessions to ride with (_hold_chunks)

    @property
    def cancelled(self) -> bool:
        """Its handler is gone: drop it, and give back the chunks it ran."""
        return self.future.cancelled()

    @property
    def remaining(self) -> int:
        return self.n_tokens - self.done


def step_tokens(step: StepInput) -> int:
    """Positions a step adds: its ids, or its hidden rows."""
    if step.hidden is not None:
        return int(step.hidden.shape[0])
    return 0 if step.token_ids is None else int(len(step.token_ids))


class ShardScheduler:
    """The queue and worker of one shard: batches steps of distinct sessions, chunks long prefills."""

    def __init__(
        self,
        backend: Backend,
        lock: asyncio.Lock,
        admit: Admit | None = None,
        observer: BatchObserver | None = None,
        batching: bool | None = None,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        chunk_tokens: int = CHUNK_TOKENS,
        busy_chunk_tokens: int | None = None,
        gather_gap_us: int | None = None,
        decoding_elsewhere: Callable[[], bool] | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.backend = backend
        # held around every call into the backend (and by OPEN, CLOSE, TRUNCATE, hand-offs): a backend
        # handle must not be used from two threads at once
        self.lock = lock
        self._admit = admit
        self._observer = observer
        self.batching = backend.batches_sessions if batching is None else batching
        self.max_batch_tokens = max(1, max_batch_tokens)
        self.chunk_tokens = max(1, chunk_tokens)
        busy = busy_chunk_tokens if busy_chunk_tokens is not None else busy_chunk_from_env()
        self.busy_chunk_tokens = max(1, min(busy, self.chunk_tokens))
        self._queue: dict[Hashable, _Pending] = {}  # by session, in arrival order
        self._last_step: dict[Hashable, float] = {}  # session -> when its latest step arrived
        self._worker: asyncio.Task[None] | None = None
        gap_us = gather_gap_from_env() if gather_gap_us is None else gather_gap_us
        self.gather_gap_s = max(0, gap_us) / 1e6
        self._arrived = asyncio.Event()  # set by every submit: _gather waits on it
        self._last_compute_s = 0.0  # the latest batch's compute: bounds how long _gather may wait
        # session -> how often its small steps come back here (an average of the intervals): a session
        # decoding now is one whose next step is due (_decoders)
        self._period: dict[Hashable, float] = {}
        self.held_s = 0.0  # seconds prefills have waited for decoders in all (telemetry)
        # whether sessions decode on this shard outside the queue (the node's native lane)
        self._decoding_elsewhere = decoding_elsewhere
        # sizes a prompt's chunks while the lane's sessions decode, and (blocking, in the worker thread)
        # runs each just before their next step here, which the lane holds meanwhile: a mixed step
        self._pacer = pacer

    def pending(self) -> int:
        return len(self._queue)

    def prefills(self) -> list[tuple[Hashable, int, int, int]]:
        """Per queued step: (session key, first position, positions done, positions); hop_telemetry.py."""
        return [(p.key, p.step.pos_start, p.done, p.n_tokens) for p in self._queue.values()]

    async def submit(self, key: Hashable, owner: Any, step: StepInput) -> ForwardResult:
        """Run `step` of session `key` and return its result. Raises the step's BackendError
        (AdmissionError when the KV budget refused it), StepDropped or SessionBusy."""
        if not self.batching:
            return await self._run_alone(owner, step)
        now = time.perf_counter()
        n = step_tokens(step)
        if n == 0:
            raise BackendError("a step with no positions")
        prev = self._last_step.get(key)
        if prev is not None and n <= INLINE_TOKENS:
            # how often a decoding session comes back here: how long a chunk may wait for it
            gap, was = now - prev, self._period.get(key)
            self._period[key] = gap if was is None else 0.8 * was + 0.2 * gap
        elif n > INLINE_TOKENS:
            self._period.pop(key, None)  # a prompt: it is not decoding (yet)
        # (asked before this step is recorded: "alone" means this session stepped here before)
        alone = n <= INLINE_TOKENS and self._alone(key, now)
        self._last_step[key] = now
        if key in self._queue:
            # steps of one session are sequential; a second one now (a retry racing its original)
            # could only fail on its position, and its rollback would undo the first
            raise SessionBusy("this session already has a step in progress on this shard")
        if alone:
            return self._run_inline(owner, step, n)
        loop = asyncio.get_running_loop()
        p = _Pending(key, owner, step, n, loop.create_future(), now, now)
        self._queue[key] = p
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work())
        # a handler cancelled meanwhile cancels the future: the worker drops the step (and gives back
        # the chunks it ran) instead of resolving it
        return await p.future

    def drop_session(self, key: Hashable, reason: str) -> int:
        """Fail every queued step of `key` (its session is being closed); call with the lock held, so
        none of them is running. Returns how many were dropped."""
        self._last_step.pop(key, None)
        self._period.pop(key, None)
        p = self._queue.pop(key, None)
        if p is None:
            return 0
        p.closed = True
        _fail(p, StepDropped(reason))
        return 1

    def drop_all(self, reason: str) -> None:
        """Fail every queued step (the shard is being unloaded)."""
        for key in list(self._queue):
            self.drop_session(key, reason)

    # -- a lone session's small step ----------------------------------------------------------------
    def _alone(self, key: Hashable, now: float) -> bool:
        """This session is decoding here (it stepped lately) and no other one is: nothing queued or
        running, nobody else coming back, so a batch could hold only this step and it need not wait for
        one. A session's first step here never counts as alone: steps of sessions that start together
        arrive in one loop turn, and the first must not run before the others have joined its batch."""
        if self._queue or self.lock.locked():
            return False
        self._forget_idle(now)  # a lone session's steps never reach _chunk_for, which does it otherwise
        window = max(ACTIVE_S, 4 * self._last_compute_s)
        mine = self._last_step.get(key)
        if mine is None or now - mine > window:
            return False
        return all(k == key or now - t > window for k, t in self._last_step.items())

    def _run_inline(self, owner: Any, step: StepInput, n: int) -> ForwardResult:
        """Run a lone small step on the event loop, at once: what the worker would do with a batch of
        one, without the task, the future and the loop turns between them (~0.1 ms a step, paid on
        every hop of a decoding session's route). Nothing can start on the shard meanwhile: the loop
        does not yield, and the lock was free (no step or hand-off in a thread)."""
        if self._observer is not None:
            self._observer.queue_wait(0.0)
        grow = self.backend.kv_growth_bytes(step.sid, step.pos_start + n)
        if self._admit is not None:
            self._admit(owner, grow)
        t1 = time.perf_counter()
        try:
            res = self.backend.forward(step)
        except BackendError:
            self._truncate_back(step)  # as a failed batch: the session stays where the step began
            raise
        self._last_compute_s = time.perf_counter() - t1
        if self._observer is not None:
            self._observer.batch(1, n, self._last_compute_s)
        return res

    # -- the serial path (a backend that does not batch) ----------------------------------------------
    async def _run_alone(self, owner: Any, step: StepInput) -> ForwardResult:
        n = step_tokens(step)
        t_queued = time.perf_counter()
        async with self.lock:
            t_start = time.perf_counter()
            if self._observer is not None:
                self._observer.queue_wait(t_start - t_queued)
            # exact bytes from the backend (native: libggswarm), asked while no step runs on it
            grow = self.backend.kv_growth_bytes(step.sid, step.pos_start + n)
            if self._admit is not None:
                self._admit(owner, grow)
            if n <= INLINE_TOKENS:
                res = self.backend.forward(step)
            else:
                res = await asyncio.to_thread(self.backend.forward, step)
            if self._observer is not None:
                self._observer.batch(1, n, time.perf_counter() - t_start)
        return res

    # -- the batching worker ----------------------------------------------------------------------
    async def _work(self) -> None:
        while self._queue:
            await self._hold_chunks()
            await self._gather()
            async with self.lock:
                batch = self._take()
                if batch:
                    try:
                        await self._run(batch)
                    except Exception as e:  # noqa: BLE001 - the worker must outlive any one batch
                        # (an AdmissionError stays one: the steps are answered 503 kv_budget)
                        err = e if isinstance(e, BackendError) else BackendError(f"batch failed: {e!r}")
                        for p, _ in batch:
                            self._rollback(p)
                            self._finish(p, err)
            # let the handlers just answered run first: a session's next step (or a CLOSE) that is
            # ready now joins the next batch instead of missing it
            await asyncio.sleep(0)

    async def _gather(self) -> None:
        """Before a batch is taken: while fewer steps are queued than sessions active on this shard,
        wait for more, each time up to `gather_gap_s` after the latest arrival and in all at most
        GATHER_SHARE of the latest batch's compute. Steps a client is still relaying one after another
        (star mode answers a batch's sessions at once, and their next frames follow within a
        millisecond or two) then join this batch instead of the next; a lone session never waits."""
        if self.gather_gap_s <= 0 or self._last_compute_s <= 0:
            return
        deadline = time.perf_counter() + GATHER_SHARE * self._last_compute_s
        # a session that stepped within a few batches' time is coming back
        window = max(ACTIVE_S, 4 * self._last_compute_s)
        while True:
            now = time.perf_counter()
            live = sum(1 for p in self._queue.values() if not p.cancelled)
            active = sum(1 for t in self._last_step.values() if now - t <= window)
            if live == 0 or live >= active or now >= deadline:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), min(self.gather_gap_s, deadline - now))
            except TimeoutError:
                return

    async def _hold_chunks(self) -> None:
        """While only prefills are queued and other sessions are decoding here (they stepped lately and
        are on other hops now), wait for their next steps: the next chunk then rides in their batch
        instead of computing alone meanwhile, when it would take the cores from the hops computing
        their steps (one box) and hold their next step here until it is done. A wait ends when a
        decoder is back, or when the last of them is overdue (HOLD_FACTOR x its own period after its
        latest step: it stopped), and lasts at most HOLD_MAX_S; a prefill never waits longer in all
        than its chunks have computed, so sessions that decode slowly (or a client stepping slowly on
        purpose) can at most double another's prompt. A prefill with nobody decoding beside it, or
        whose neighbours have stopped, never waits; its first chunk never waits."""
        t0 = time.perf_counter()
        live = [p for p in self._queue.values() if not p.cancelled]
        if not live or any(p.n_tokens <= INLINE_TOKENS for p in live):
            return
        budget = t0 + min(HOLD_MAX_S, min(p.computed - p.held for p in live))
        while True:
            now = time.perf_counter()
            if any(p.n_tokens <= INLINE_TOKENS for p in self._queue.values()):
                return  # a decoder is back: the chunk rides with it
            due = self._decoders(now)
            deadline = min(budget, max(due, default=now))
            if now >= deadline:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - now)
            except TimeoutError:
                pass
            finally:
                waited = time.perf_counter() - now
                self.held_s += waited
                for p in live:
                    p.held += waited

    def _decoders(self, now: float) -> list[float]:
        """When the sessions decoding here, and away now, are due back at the latest: HOLD_FACTOR x
        their own period after their latest step. A session that has not come back by then stopped
        (its answer ended, its user reads it), whatever its state: nobody waits for it."""
        due = []
        for k, period in self._period.items():
            if k in self._queue:
                continue
            last = self._last_step.get(k)
            if last is not None and now - last <= HOLD_FACTOR * period:
                due.append(last + HOLD_FACTOR * period)
        return due

    def _take(self) -> list[tuple[_Pending, int]]:
        """The next batch: (step, positions to run now) for at most one step per session."""
        for p in [p for p in self._queue.values() if p.cancelled]:
            self._rollback(p)  # its handler is gone: give back what it ran, drop it
            self._remove(p)
        batch: list[tuple[_Pending, int]] = []
        tokens = 0
        # strictly in line order (arrival, or the end of a step's latest chunk), while the budget
        # lasts: nobody is passed by a newer step, and a prefill's chunk too big to join the decodes
        # before it runs in the next batch, alone or with what fits after it
        for p in sorted(self._queue.values(), key=lambda p: p.ready):
            n = min(p.remaining, self._chunk_for(p.key))
            if batch and tokens + n > self.max_batch_tokens:
                break
            batch.append((p, n))
            tokens += n
        return batch

    def _chunk_for(self, key: Hashable) -> int:
        """Positions a prefill of session `key` runs this round: small chunks while another session
        has stepped on this shard within BUSY_WINDOW_S (it is decoding: in star mode its next step is
        often on another hop when this batch is taken) or sessions decode on the node's lane, else
        whole micro-batches."""
        self._forget_idle(time.perf_counter())
        if self._elsewhere() and self._pacer is not None:
            prompts = sum(1 for p in self._queue.values() if p.n_tokens > INLINE_TOKENS)
            return min(self.chunk_tokens, self._pacer.chunk_tokens(prompts))
        busy = any(k != key for k in self._last_step)
        return self.busy_chunk_tokens if busy else self.chunk_tokens

    def _elsewhere(self) -> bool:
        return self._decoding_elsewhere is not None and self._decoding_elsewhere()

    def _forget_idle(self, now: float) -> None:
        """Drop what is kept of sessions that have not stepped here for BUSY_WINDOW_S: the tables stay
        bounded by the sessions active in the last second (a session that expired instead of closing
        is never dropped by name)."""
        for k, t in list(self._last_step.items()):
            if now - t > BUSY_WINDOW_S:
                del self._last_step[k]
                self._period.pop(k, None)

    async def _run(self, batch: list[tuple[_Pending, int]]) -> None:
        t0 = time.perf_counter()
        runs: list[tuple[_Pending, int]] = []
        inputs: list[StepInput] = []
        extra = 0
        for p, n in batch:
            if p.done == 0 and self._observer is not None:
                self._observer.queue_wait(t0 - p.enqueued)
            start = p.step.pos_start + p.done
            try:
                # the KV this batch adds, counted together: every step's growth must fit at once
                grow = self.backend.kv_growth_bytes(p.step.sid, start + n)
                if self._admit is not None:
                    self._admit(p.owner, extra + grow)
            except BackendError as e:
                self._rollback(p)
                self._finish(p, e)
                continue
            extra += grow
            runs.append((p, n))
            inputs.append(_piece(p, n))
        if not runs:
            return
        tokens = sum(n for _, n in runs)
        t1 = time.perf_counter()
        pacer = self._pacer if any(n > 1 for _, n in runs) and self._elsewhere() else None
        if pacer is not None:
            started: list[float] = []

            def paced() -> list[ForwardResult | BackendError]:
                held = pacer.before_chunk()
                started.append(time.perf_counter())  # compute is timed from here, not the wait
                ran = 0
                try:
                    out = _forward_batch(self.backend, inputs)
                    ran = tokens
                    return out
                finally:  # the lane's held step goes on, whatever happened to the chunk
                    pacer.after_chunk(ran, time.perf_counter() - started[0], held)

            results = await asyncio.to_thread(paced)
            t1 = started[0]
        elif tokens <= INLINE_TOKENS:
            # a few positions compute in a few ms: a thread hand-off (and the loop's wake-up after
            # it) would cost more than the loop gains by staying free meanwhile, since in star mode
            # the next steps for this shard come only after these answers went round the route
            results = _forward_batch(self.backend, inputs)
        else:
            results = await asyncio.to_thread(_forward_batch, self.backend, inputs)
        self._last_compute_s = time.perf_counter() - t1
        if self._observer is not None:
            self._observer.batch(len(runs), tokens, self._last_compute_s)
        if len(results) != len(runs):
            raise BackendError(f"forward_batch answered {len(results)} results for {len(runs)} steps")
        now = time.perf_counter()
        for (p, n), r in zip(runs, results, strict=True):
            if p.closed:
                continue  # dropped while it ran; its session's KV is freed with the session
            if isinstance(r, BaseException):
                self._rollback(p)
                self._finish(p, r)
                continue
            p.parts.append(r)
            p.done += n
            p.computed += self._last_compute_s
            if p.cancelled:
                self._rollback(p)
                self._remove(p)
            elif p.done >= p.n_tokens:
                self._finish(p, _assemble(p.parts))
            else:
                p.ready = now  # to the back of the line: the others' steps go before its next chunk

    def _rollback(self, p: _Pending) -> None:
        """Give back the positions a failed or abandoned step ran (its earlier chunks, or all of a
        batch that raised): an unchunked step that fails leaves the session where it was, and so does
        a chunked one. (Only this step of its session can be in flight: nothing else is undone.)"""
        if p.closed:
            return
        self._truncate_back(p.step)
        p.done, p.parts = 0, []

    def _truncate_back(self, st: StepInput) -> None:
        """The session back where step `st` began, if it ran any positions (a backend that fails to
        go back has lost the session anyway: its next step fails on its position)."""
        with contextlib.suppress(BackendError):
            if self.backend.session_len(st.sid) > st.pos_start:
                self.backend.truncate_to(st.sid, st.pos_start)

    def _finish(self, p: _Pending, outcome: ForwardResult | BaseException) -> None:
        self._remove(p)
        if isinstance(outcome, BaseException):
            _fail(p, outcome)
        elif not p.future.done():
            p.future.set_result(outcome)

    def _remove(self, p: _Pending) -> None:
        if self._queue.get(p.key) is p:
            del self._queue[p.key]


def _fail(p: _Pending, e: BaseException) -> None:
    if not p.future.done():
        p.future.set_exception(e)
        # nobody may be awaiting any more (a cancelled handler): do not log "never retrieved"
        p.future.exception()


def _piece(p: _Pending, n: int) -> StepInput:
    """The next `n` positions of a step, as a step of their own."""
    if p.done == 0 and n == p.n_tokens:
        return p.step
    a, b = p.done, p.done + n
    st = p.step
    return replace(
        st,
        pos_start=st.pos_start + a,
        token_ids=None if st.token_ids is None else st.token_ids[a:b],
        hidden=None if st.hidden is None else st.hidden[a:b],
    )


def _assemble(parts: list[ForwardResult]) -> ForwardResult:
    """One step's result from its chunks: rows in order, the token of the last position."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    hidden = logits = None
    if last.hidden is not None:
        hidden = np.concatenate([r.hidden for r in parts if r.hidden is not None])
    if last.logits is not None:
        logits = np.concatenate([r.logits for r in parts if r.logits is not None])
    return ForwardResult(
        hidden=hidden,
        token=last.token,
        logprob=last.logprob,
        logits=logits,
        compute_s=sum(r.compute_s for r in parts),
    )


def _forward_batch(backend: Backend, steps: list[StepInput]) -> list[ForwardResult | BackendError]:
    """A batch of one is the backend's plain forward (its single-step path, nothing to batch); its
    BackendError goes in its slot, as forward_batch would put it."""
    if len(steps) > 1:
        return backend.forward_batch(steps)
    try:
        return [backend.forward(steps[0])]
    except BackendError as e:
        return [e]
