"""A lane step against hop 0's deadline for a client with a replacement provider (agent/client/failover.py
wait_lane): on time it is the step's answer; late, it is a timeout naming hop 0, and the step is cancelled
(its waiting frame leaves the lane's queue). The step runs in the caller's task, not one of its own (one
task less per decode step on the web's event loop)."""

from __future__ import annotations

import asyncio
import time

import pytest

from agent.client.recovery import Hop, RecoveryPolicy, Replacement
from agent.client.route import RouteClient, RouteError

FLOOR_S = 0.2


async def _no_replacement(_i: int, _hops: list[Hop], _why: str) -> Replacement | None:
    return None


def _client() -> RouteClient:
    # never contacted: the steps below are local coroutines standing for the lane's round trip
    hops = [Hop("http://127.0.0.1:9", 0, 15, b"t0"), Hop("http://127.0.0.1:9", 15, 30, b"t1")]
    policy = RecoveryPolicy(deadline_floor_s=FLOOR_S, deadline_samples=4)
    c = RouteClient(hops, mode="chain", replacements=_no_replacement, recovery=policy, lane=False)
    c.link.rtt[0].extend([0.001] * 4)  # hop 0's recent steps: the deadline is the floor
    return c


async def test_a_lane_step_within_hop_0s_deadline_gives_its_answer_in_the_callers_task() -> None:
    c = _client()
    caller = asyncio.current_task()

    async def step() -> asyncio.Task[object] | None:
        await asyncio.sleep(0.01)
        return asyncio.current_task()

    try:
        assert await c.failover.wait_lane(step(), 1) is caller
    finally:
        await c.close()


async def test_a_lane_step_past_hop_0s_deadline_is_a_timeout_naming_hop_0_and_is_cancelled() -> None:
    c = _client()
    cancelled = asyncio.Event()

    async def hung_step() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    t0 = time.monotonic()
    try:
        with pytest.raises(RouteError) as err:
            await c.failover.wait_lane(hung_step(), 1)
    finally:
        await c.close()
    assert err.value.code == "timeout" and err.value.hop == 0
    assert "did not answer a lane step" in str(err.value)
    assert FLOOR_S <= time.monotonic() - t0 < 5.0
    assert cancelled.is_set()
