"""A route client without a replacement provider past a hop's deadline (agent/client/failover.py, watch).

A scripted hop on 127.0.0.1 answers frames (a token per step) and its health check; one step is slow.
A hop that still answers its health check is waited for (slow is no failure without a replacement:
a decoder behind another session's long prompt); one that does not is reported at once, by name.
"""

from __future__ import annotations

import asyncio
import os
import time

from aiohttp import web

from agent.client.recovery import Hop, RecoveryPolicy
from agent.client.route import RouteClient, RouteError
from agent.wire.frames import Kind, Op, Response, decode_request, encode_response
from agent.wire.sampling import SamplingParams
from tests.conftest import free_port

FLOOR_S = 0.5
SLOW_STEP = 8  # the step (frame number) that takes SLOW_S
SLOW_S = 2.0


class ScriptedHop:
    """Answers OPEN/CLOSE/TRUNCATE with nothing and FORWARD with token 7; frame SLOW_STEP is slow,
    and, with `health_hangs`, so is the health check from then on."""

    def __init__(self, health_hangs: bool) -> None:
        self.health_hangs = health_hangs
        self.slow_started = asyncio.Event()
        self.released = asyncio.Event()  # the hung health check answers once the test is over
        self.frames = 0

    async def frame(self, request: web.Request) -> web.Response:
        req = decode_request(await request.read())
        self.frames += 1
        if req.op == Op.FORWARD and self.frames == SLOW_STEP:
            self.slow_started.set()
            await asyncio.sleep(SLOW_S)
        kind = Kind.TOKEN if req.op == Op.FORWARD else Kind.NONE
        n = req.pos_start + req.n_tokens
        return web.Response(body=encode_response(Response(step=req.step, kind=kind, token=7, session_len=n)))

    async def health(self, request: web.Request) -> web.Response:
        if self.health_hangs and self.slow_started.is_set():
            await self.released.wait()
        return web.json_response({"status": "ok"})


async def run(health_hangs: bool) -> tuple[float, list[int], RouteError | None, str]:
    """(seconds from the start of the answer to its end or error, the tokens, the error, the hop's URL)"""
    hop = ScriptedHop(health_hangs)
    app = web.Application()
    app.router.add_post("/v1/frame", hop.frame)
    app.router.add_get("/v1/health", hop.health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    session = os.urandom(16)
    client = RouteClient(
        [Hop(url, 0, 4, b"t" * 8)],
        session_id=session,
        recovery=RecoveryPolicy(deadline_floor_s=FLOOR_S, probe_timeout_s=0.5),
        lane=False,
    )
    got: list[int] = []
    err: RouteError | None = None
    t0 = time.monotonic()
    try:
        async for tok, _ in client.generate([1, 2, 3], SamplingParams(), 12):
            got.append(tok)
    except RouteError as e:
        err = e
    took = time.monotonic() - t0
    hop.released.set()
    await client.close()
    await runner.cleanup()
    return took, got, err, url


async def test_without_a_provider_a_slow_hop_that_answers_its_health_check_is_waited_for() -> None:
    took, got, err, _ = await run(health_hangs=False)
    assert err is None and len(got) == 12
    assert took >= SLOW_S  # the slow step was waited for, past its 0.5 s deadline


async def test_without_a_provider_a_hop_that_stops_answering_is_reported_at_its_deadline_by_name() -> None:
    took, got, err, url = await run(health_hangs=True)
    assert err is not None and err.hop == 0 and err.code == "hop_stopped", err
    assert str(err).startswith(f"hop 0 ({url}") and "health check" in str(err)
    assert took < SLOW_S, f"reported after {took:.2f} s"  # the deadline (0.5 s) and one probe (0.5 s)
    assert len(got) < 12


async def test_the_deadline_applies_without_a_provider() -> None:
    client = RouteClient(
        [Hop("http://127.0.0.1:9", 0, 4, b"t")], recovery=RecoveryPolicy(deadline_floor_s=FLOOR_S), lane=False
    )
    try:
        client.link.rtt[0].extend([0.01] * 8)
        assert client.failover.deadline(0, 1) == FLOOR_S
        assert client.failover.deadline(0, 64) == client.link.timeout_s  # a prompt's chunk: the client's own
    finally:
        await client.close()
