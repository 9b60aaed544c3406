"""Frames over the data plane's WebSocket (/v1/stream): same answers as POST, same refusals, POST fallback."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
from aiohttp import web

from agent.client.route import Hop, RouteClient, RouteError
from agent.node.dataplane import DataPlane, start_dataplane
from agent.wire.routetoken import generate_key, mint
from agent.wire.sampling import SamplingParams
from agent.wire.stream import STREAM_MAX_FRAME, TRANSPORT_ENV
from tests.agent.test_dataplane_security import (  # noqa: F401
    MB,
    chain_to,
    error_code,
    fake_next_hop,
    ids_frame,
    nodes,
    post,
    tiny,
)
from tests.conftest import free_port

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 504, 3575, 282, 4649, 314]


@pytest.fixture
async def node(model_path, manifest, signing_key):  # noqa: ANN001, ANN201
    dp = DataPlane("node-s", signing_key.public_key())
    dp.load_shard(model_path, manifest, 0, 30, backend="torch", n_threads=1)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    yield dp, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _client(url: str, key, manifest) -> RouteClient:  # noqa: ANN001
    session = os.urandom(16)
    return RouteClient(
        [Hop(url, 0, 30, mint(key, session, manifest.sha256, 0, 30, "node-s"))], session_id=session
    )


async def _greedy(client: RouteClient, n: int) -> list[int]:
    try:
        return [t async for t, _ in client.generate(PROMPT, SamplingParams(), n)]
    finally:
        await client.close()


async def test_a_route_over_streams_gives_the_tokens_it_gives_over_post(
    node, manifest, signing_key, monkeypatch
) -> None:  # noqa: ANN001
    dp, url = node
    streamed = _client(url, signing_key, manifest)
    got = await _greedy(streamed, 6)
    monkeypatch.setenv(TRANSPORT_ENV, "http")
    posted = _client(url, signing_key, manifest)
    assert not posted.link.streams.enabled
    assert await _greedy(posted, 6) == got
    # both clients' frames were counted by the node, and no session is left behind
    assert dp.stats()["frames"] >= 2 * 7 and dp.stats()["sessions"] == 0


async def test_a_frame_refused_on_a_stream_is_the_same_error_with_the_same_status(node, manifest) -> None:  # noqa: ANN001
    _, url = node
    forged = _client(url, generate_key(), manifest)  # a token signed by a key the node does not trust
    try:
        with pytest.raises(RouteError) as e:
            await forged.forward(PROMPT, SamplingParams())
    finally:
        await forged.close()
    assert e.value.status == 401 and e.value.code == "bad_token"


async def test_a_frame_bigger_than_a_stream_message_goes_over_post(node, manifest, signing_key) -> None:  # noqa: ANN001
    dp, url = node
    client = _client(url, signing_key, manifest)
    try:
        await client.open()
        got = await client.link.streams.exchange(url, bytes(STREAM_MAX_FRAME + 1), 5.0)
        assert got is None  # the caller posts it instead
        # a real step still travels over the stream
        before = dp.stats()["frames"]
        await client.forward(PROMPT, SamplingParams())
        assert dp.stats()["frames"] == before + 1
        assert client.link.streams._idle  # the socket went back to the pool for the next step
    finally:
        await client.close()


async def test_a_hop_without_a_stream_endpoint_is_reached_over_post(manifest, signing_key) -> None:  # noqa: ANN001
    # an older node: POST /v1/frame only; it answers a refusal so the test needs no model
    async def frame(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": "bad_token", "message": "old node"}, status=401)

    app = web.Application()
    app.router.add_post("/v1/frame", frame)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    client = _client(url, signing_key, manifest)
    try:
        with pytest.raises(RouteError) as e:
            await client.forward(PROMPT, SamplingParams())
        assert e.value.code == "bad_token" and "old node" in str(e.value)
        assert url in client.link.streams._no_stream  # remembered: no upgrade is tried again
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_node_with_idle_streams_open_stops_promptly(model_path, manifest, signing_key) -> None:  # noqa: ANN001
    import time

    dp = DataPlane("node-s", signing_key.public_key())
    dp.load_shard(model_path, manifest, 0, 30, backend="torch", n_threads=1)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    client = _client(f"http://127.0.0.1:{port}", signing_key, manifest)
    try:
        await client.forward(PROMPT, SamplingParams())
        assert client.link.streams._idle  # an idle socket the node's handler is waiting on
        t0 = time.monotonic()
        await runner.cleanup()  # aiohttp waits for handlers; the stream's ends only with its socket
        assert time.monotonic() - t0 < 5
    finally:
        await client.link.streams.close()
        await client.link.http.close()


def _serve_flood(port: int) -> None:
    """A hostile next hop in a child process: its 32 MiB message (and aiohttp's copy of it while it
    writes) must not count in the RSS the test measures of the hop that reads it."""

    async def flood(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.receive()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_bytes(bytes(32 * MB))  # one message: under a client's 64 MiB, over a chain's 4
        return ws

    app = web.Application()
    app.router.add_get("/v1/stream", flood)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=False)


async def test_a_next_hop_flooding_its_stream_answer_gets_502_and_the_hop_buffers_a_bounded_amount(
    nodes,  # noqa: F811
    signing_key,
    tiny,  # noqa: F811
) -> None:  # noqa: ANN001
    import json
    import multiprocessing

    import psutil

    from agent.procs import wait_port

    _, manifest = tiny
    a = await nodes("node-a", [(0, 2)])
    port = free_port()
    flooder = multiprocessing.get_context("spawn").Process(target=_serve_flood, args=(port,), daemon=True)
    flooder.start()
    try:
        await asyncio.to_thread(wait_port, "127.0.0.1", port, 30.0)
        fake_url = f"http://127.0.0.1:{port}"
        session, tok_a, chain = await chain_to(a, fake_url, signing_key, manifest.sha256)
        rss0 = psutil.Process().memory_info().rss
        status, data = await post(a.url, ids_frame(tok_a, session, [1, 2, 3], chain=chain))
        grew = psutil.Process().memory_info().rss - rss0
        assert (status, error_code(data)) == (502, "downstream"), json.loads(data)
        # the socket was given up at CHAIN_MAX_ANSWER bytes ("ended"), not read whole and then
        # found too long ("answered more than")
        assert "ended" in json.loads(data)["message"], json.loads(data)
        assert grew < 32 * MB, f"RSS grew {grew / MB:.0f} MB reading a bounded stream answer"
    finally:
        flooder.terminate()
        flooder.join(10)
