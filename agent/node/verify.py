"""Speculative verification on a hop: a step's rows run one position at a time, as plain decode steps
run them, and are later cut back to the drafts that stood (docs/speculative.md).

One position at a time because ggml multiplies a row alone and rows together with different kernels
(tinyBLAS takes two rows or more): SmolLM2's logits differ by up to 0.92 between the two, enough to
change a greedy token at a near tie, and a route that speculates must answer the plain route's tokens.
The round trip, not the compute, is what speculation saves on a route.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from agent.backends.base import ForwardResult, StepInput
from agent.node.scheduler import ShardScheduler, step_tokens
from agent.node.sessions import SessionState, Verification
from agent.node.steps import run_step


def row(step: StepInput, i: int) -> StepInput:
    """Position i of `step` as a step of its own."""
    return dataclasses.replace(
        step,
        pos_start=step.pos_start + i,
        token_ids=None if step.token_ids is None else step.token_ids[i : i + 1],
        hidden=None if step.hidden is None else step.hidden[i : i + 1],
    )


def joined(results: list[ForwardResult]) -> ForwardResult:
    """The rows' results as one step's: hidden rows or logits rows in order, the last row's token."""
    first, last = results[0], results[-1]
    return ForwardResult(
        hidden=None
        if first.hidden is None
        else np.concatenate([r.hidden for r in results if r.hidden is not None]),
        token=last.token,
        logprob=last.logprob,
        logits=None
        if first.logits is None
        else np.concatenate([r.logits for r in results if r.logits is not None]),
        compute_s=sum(r.compute_s for r in results),
    )


async def run_rows(
    scheduler: ShardScheduler, s: SessionState, step: StepInput, history_len: int
) -> ForwardResult:
    """Run a verification step one position at a time; the session keeps it (s.verify) for a cut back.
    A failure part way leaves the session where the step began."""
    async with scheduler.lock:
        _forget(s)  # the previous verification is settled: this step follows what stood of it
        # recurrent state: where a cut back into this step starts from
        took = s.backend.checkpoint(s.sid)
    n = step_tokens(step)
    results: list[ForwardResult] = []
    try:
        for i in range(n):
            results.append(await run_step(scheduler, s, row(step, i), history_len))
    except BaseException:
        async with scheduler.lock:
            if results:  # back to the checkpoint just taken, where the window keeps fixed state
                s.backend.truncate_to(s.sid, step.pos_start)
            if took:
                s.backend.drop_checkpoint(s.sid, step.pos_start)
        raise
    s.verify = Verification(step.pos_start, step.pos_start + n, step, took)
    return joined(results)


def _forget(s: SessionState) -> None:
    """The session's latest verification is settled (call with the shard's lock held): its checkpoint,
    if the hop took one for it, goes, so verifications never push out the checkpoints a session keeps
    at its turns."""
    v, s.verify = s.verify, None
    if v is not None and v.checkpoint:
        s.backend.drop_checkpoint(s.sid, v.pos)


async def settle(s: SessionState, lock: asyncio.Lock) -> None:
    """A step that is not a verification ran after it: no frame can cut back into it any more."""
    if s.verify is not None:
        async with lock:
            _forget(s)


def can_cut_into(s: SessionState, pos: int) -> bool:
    """A frame at `pos` behind the session's length goes back there first: only into the latest
    verification step, past its first position (the token it was sent for always stands)."""
    v = s.verify
    return v is not None and v.pos < pos <= v.end


async def rewind(s: SessionState, target: int, lock: asyncio.Lock) -> tuple[int, str]:
    """Bring the session back to at most `target` positions; (positions held, how). Inside the latest
    verification step a recurrent window goes back to the step's checkpoint and runs its rows again up
    to `target`, so the state is exactly a plain route's that never saw the rejected drafts."""
    async with lock:
        held, how = s.backend.truncate_to(s.sid, target)
        v = s.verify
        if held < target and v is not None and v.pos <= held and target <= v.end:
            for i in range(held - v.pos, target - v.pos):
                again = dataclasses.replace(row(v.step, i), want_logits=False)
                await asyncio.to_thread(s.backend.forward, again)
            held, how = target, "replayed"
        if v is not None and held <= v.pos:
            _forget(s)
    del s.history[held:]
    return held, how
