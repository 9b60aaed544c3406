"""JSON nested 100,000 levels deep from a hostile peer: a clear refusal naming it, never a 500 or a crash.

A next hop answering a chain step with it (over POST and over its stream), a hop answering a route
client with it, a node's health or hand-off answer, and the control plane's channel (issue 33, item 6;
docs/security.md, "Hostile JSON").
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from aiohttp import ClientSession, WSMsgType, web

from agent.client.recovery import Hop, ReplicaProvider
from agent.client.route import RouteClient, RouteError
from agent.wire.control import ControlError, parse_server_message
from agent.wire.jsonlimits import JsonLimitError, loads_bounded
from agent.wire.routetoken import mint
from agent.wire.stream import STREAM_PATH
from tests.agent import test_dataplane_security as sec
from tests.agent.test_control import ControlPlane, FakeHost, make_agent
from tests.agent.test_dataplane_security import chain_to, error_code, fake_next_hop, ids_frame, post
from tests.conftest import free_port

# the in-process nodes with the tiny llama of the data plane's security tests
tiny, nodes = sec.tiny, sec.nodes
DEEP = "[" * 100_000 + "]" * 100_000  # what json.loads answers with a RecursionError


async def test_a_next_hop_answering_json_nested_100k_deep_is_a_502_naming_it(
    nodes, signing_key, tiny
) -> None:  # noqa: ANN001
    _, manifest = tiny
    a = await nodes("node-a", [(0, 2)])

    async def hostile(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=400, text=DEEP, content_type="application/json")

    async with fake_next_hop("POST", "/v1/frame", hostile) as fake_url:
        session, tok_a, chain = await chain_to(a, fake_url, signing_key, manifest.sha256)
        status, data = await post(a.url, ids_frame(tok_a, session, [1, 2, 3], chain=chain))
    assert (status, error_code(data)) == (502, "downstream")
    assert fake_url in json.loads(data)["message"]
    async with ClientSession() as http, http.get(a.url + "/v1/health") as r:
        assert r.status == 200  # answered as a refusal: the node goes on serving


async def test_a_next_hop_streaming_json_nested_100k_deep_is_a_502_naming_it(
    nodes, signing_key, tiny
) -> None:  # noqa: ANN001
    _, manifest = tiny
    a = await nodes("node-a", [(0, 2)])
    streamed = []

    async def hostile_stream(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                streamed.append(len(msg.data))
                await ws.send_str(DEEP)  # a stream's refusal is a text message holding its JSON
        return ws

    app = web.Application()
    app.router.add_get(STREAM_PATH, hostile_stream)
    runner = web.AppRunner(
        app, shutdown_timeout=1.0
    )  # the hop pools its socket to us: do not wait 60 s for it
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    fake_url = f"http://127.0.0.1:{port}"
    try:
        session, tok_a, chain = await chain_to(a, fake_url, signing_key, manifest.sha256)
        status, data = await post(a.url, ids_frame(tok_a, session, [1, 2, 3], chain=chain))
    finally:
        await runner.cleanup()
    assert streamed, "the step went to the next hop over its stream"
    assert (status, error_code(data)) == (502, "downstream")
    assert fake_url in json.loads(data)["message"]


async def test_a_hop_answering_a_route_client_with_json_nested_100k_deep_is_a_route_error_naming_it(
    signing_key,  # noqa: ANN001
) -> None:
    async def hostile(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=503, text=DEEP, content_type="application/json")

    async with fake_next_hop("POST", "/v1/frame", hostile) as url:
        session = os.urandom(16)
        hop = Hop(url, 0, 4, mint(signing_key, session, "0" * 64, 0, 4, "node-x"))
        client = RouteClient([hop], session_id=session)
        try:
            with pytest.raises(RouteError) as err:
                await client.open()
        finally:
            await client.close()
    assert err.value.status == 503 and err.value.hop == 0
    assert url in str(err.value)


async def test_a_replica_whose_health_is_json_nested_100k_deep_is_skipped_not_a_crash(signing_key) -> None:  # noqa: ANN001
    async def hostile(request: web.Request) -> web.Response:
        return web.Response(text=DEEP, content_type="application/json")

    async with fake_next_hop("GET", "/v1/health", hostile) as url:
        session = os.urandom(16)
        hop = Hop("http://127.0.0.1:9", 0, 4, mint(signing_key, session, "0" * 64, 0, 4, "node-x"))
        provider = ReplicaProvider([url], signing_key, session, probe_timeout_s=5.0)
        assert await provider(0, [hop], "hop 0 died") is None


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, "[" * 5_000 + "[]" * 10, "[" * 4_000 + "[" * 64 + "]" * 64, '{"a":' * 3_000],
    ids=["unclosed", "unclosed-around-pairs", "unclosed-around-64-deep", "unclosed-objects"],
)
def test_brackets_left_unclosed_count_as_depth_and_never_reach_json_loads(text: str) -> None:
    """A next hop's error is cut at 4 KiB before it is parsed: what is left is often unclosed."""
    with pytest.raises(JsonLimitError, match="nested more than 64 levels deep"):
        loads_bounded(text)
    assert loads_bounded("[" * 64 + "]" * 64) is not None


def test_a_control_message_nested_100k_deep_is_a_control_error_not_a_recursion_error() -> None:
    for text in (DEEP, '{"type": "load", "x": ' + DEEP + "}"):
        with pytest.raises(ControlError, match="nested more than 64 levels deep"):
            parse_server_message(text)
    assert issubclass(JsonLimitError, ValueError)


async def test_the_agent_answers_a_control_command_nested_100k_deep_with_an_error_and_keeps_its_connection(
    manifest,
    model_path: str,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    cp = ControlPlane(manifest, model_path)
    app = web.Application()
    app.router.add_get("/ws/agent/", cp.ws)
    runner = web.AppRunner(
        app, shutdown_timeout=1.0
    )  # the hop pools its socket to us: do not wait 60 s for it
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    cp.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    host, stop = FakeHost(), asyncio.Event()
    task = asyncio.create_task(make_agent(cp, host, tmp_path).run(stop))
    try:
        await cp.next("hello")
        ws = cp.sockets[-1]
        await ws.send_str('{"type": "drain", "x": ' + DEEP + "}")
        assert "nested more than 64 levels deep" in (await cp.next("error"))["error"]
        await ws.send_json({"type": "resync"})
        await cp.next("hello")
        assert not task.done() and len(cp.sockets) == 1, "the agent stayed on the same connection"
        assert not host.drained
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await runner.cleanup()
