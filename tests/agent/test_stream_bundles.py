"""A hop taking bundles over /v1/stream: each frame admitted and answered as if alone, all run as one batch."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
from aiohttp import ClientSession, WSMsgType

import agent.node.stream
from agent.client.recovery import minted_hops
from agent.client.route import Hop, RouteClient
from agent.client.transport import HopTransport, shared_transport
from agent.wire.bundle import (
    BUNDLE_MAGIC,
    BUNDLE_PROTOCOL,
    BUNDLE_STEP_TOKENS,
    HEAD,
    decode_answers,
    encode_bundle,
)
from agent.wire.frames import Kind, Op, decode_response
from agent.wire.routetoken import RouteHop, generate_key, mint
from agent.wire.sampling import SamplingParams
from agent.wire.stream import STREAM_PATH, FrameStreams
from tests.agent.test_dataplane_security import frame, ids_frame, nodes, tiny  # noqa: F401

PROMPTS = [[1, 9690, 198, 2683 + i, 359, 253] for i in range(4)]


async def ws_send(url: str, data: bytes) -> tuple[WSMsgType, Any]:
    async with (
        ClientSession() as http,
        http.ws_connect(url + STREAM_PATH, protocols=(BUNDLE_PROTOCOL,)) as ws,
    ):
        assert ws.protocol == BUNDLE_PROTOCOL  # the hop agreed to bundles
        await ws.send_bytes(data)
        msg = await ws.receive(timeout=30)
        return msg.type, msg.data


async def opened(node: Any, key: Any, sha: str, n: int) -> list[tuple[bytes, bytes]]:
    """`n` sessions opened on `node` over POST: (session, route token)."""
    from tests.agent.test_dataplane_security import post

    out = []
    for _ in range(n):
        session = os.urandom(16)
        token = mint(key, session, sha, 0, 4, node.dp.node_id)
        status, _ = await post(node.url, frame(token, session, op=Op.OPEN, step=1, pos_start=64))
        assert status == 200
        out.append((session, token))
    return out


async def test_a_bundle_is_answered_as_each_frame_alone_and_its_steps_run_as_one_batch(
    nodes,  # noqa: F811
    tiny,  # noqa: F811
    signing_key,
) -> None:
    _, manifest = tiny
    bundled = await nodes("node-b", [(0, 4)], batching=True)
    lone = await nodes("node-l", [(0, 4)], batching=True)
    a = await opened(bundled, signing_key, manifest.sha256, 4)
    b = await opened(lone, signing_key, manifest.sha256, 4)
    kind, data = await ws_send(
        bundled.url, encode_bundle([ids_frame(t, s, p, step=2) for (s, t), p in zip(a, PROMPTS, strict=True)])
    )
    assert kind == WSMsgType.BINARY
    answers = decode_answers(data, 4)
    assert [status for status, _ in answers] == [200] * 4
    for (s, t), p, (_, got) in zip(b, PROMPTS, answers, strict=True):
        kind, alone = await ws_send(lone.url, ids_frame(t, s, p, step=2))
        want, have = decode_response(alone), decode_response(got)
        assert have.kind == want.kind == Kind.TOKEN  # the tiny model's whole stack: a sampled token
        assert (have.token, have.logprob, have.session_len) == (want.token, want.logprob, len(p))
    stats = bundled.dp.stats()
    assert stats["bundles"] == 1 and stats["frames"] == 4 + 4  # 4 opens, 4 bundled steps
    assert stats["batching"]["max_steps"] == 4  # all four in one backend call
    assert lone.dp.stats()["batching"]["max_steps"] == 1


async def test_a_forged_frame_in_a_bundle_is_refused_alone_and_the_others_run(
    nodes,  # noqa: F811
    tiny,  # noqa: F811
    signing_key,
) -> None:
    _, manifest = tiny
    node = await nodes("node-f", [(0, 4)])
    good = await opened(node, signing_key, manifest.sha256, 2)
    forged_session = os.urandom(16)
    forged = mint(generate_key(), forged_session, manifest.sha256, 0, 4, "node-f")
    frames = [
        ids_frame(good[0][1], good[0][0], PROMPTS[0], step=2),
        ids_frame(forged, forged_session, PROMPTS[1], step=2),
        ids_frame(good[1][1], good[1][0], PROMPTS[2], step=2),
    ]
    kind, data = await ws_send(node.url, encode_bundle(frames))
    answers = decode_answers(data, 3)
    assert [status for status, _ in answers] == [200, 401, 200]
    assert json.loads(bytes(answers[1][1]))["error"] == "bad_token"
    assert node.dp.stats()["tokens_in"] == len(PROMPTS[0]) + len(PROMPTS[2])


async def test_a_malformed_bundle_is_refused_whole_and_runs_none_of_its_frames(
    nodes,  # noqa: F811
    tiny,  # noqa: F811
    signing_key,
) -> None:
    _, manifest = tiny
    node = await nodes("node-m", [(0, 4)])
    ((s, t),) = await opened(node, signing_key, manifest.sha256, 1)
    good = encode_bundle([ids_frame(t, s, PROMPTS[0], step=2)])
    lying = HEAD.pack(BUNDLE_MAGIC, 1, 2) + good[HEAD.size :]  # says two frames, carries one
    before = node.dp.stats()["frames"]
    kind, data = await ws_send(node.url, lying)
    assert kind == WSMsgType.TEXT
    err = json.loads(data)
    assert err["status"] == 400 and err["error"] == "bad_frame"
    assert node.dp.stats()["frames"] == before and node.dp.stats()["tokens_in"] == 0


async def test_a_bundled_frame_too_big_to_hold_is_refused_in_its_slot(
    nodes,  # noqa: F811
    tiny,  # noqa: F811
    signing_key,
) -> None:
    # a bundle's answers are held until its last frame is done: long steps and logits go alone
    _, manifest = tiny
    node = await nodes("node-t", [(0, 4)])
    (s1, t1), (s2, t2), (s3, t3) = await opened(node, signing_key, manifest.sha256, 3)
    frames = [
        ids_frame(t1, s1, list(range(300, 300 + BUNDLE_STEP_TOKENS + 1)), step=2),
        ids_frame(t2, s2, PROMPTS[1], step=2, want_logits=True),
        ids_frame(t3, s3, PROMPTS[2], step=2),
    ]
    kind, data = await ws_send(node.url, encode_bundle(frames))
    answers = decode_answers(data, 3)
    assert [status for status, _ in answers] == [413, 413, 200]
    assert json.loads(bytes(answers[0][1]))["error"] == "bundle_step_too_big"
    assert node.dp.stats()["tokens_in"] == len(PROMPTS[2])  # only the small step ran


async def decode_together(clients: list[RouteClient], n: int) -> list[list[int]]:
    """Every client prefills its prompt, then they decode `n` tokens in step (as sessions that started
    together do: each one's next step is sent as soon as its answer is in)."""
    resps = await asyncio.gather(
        *(c.forward(p, SamplingParams()) for c, p in zip(clients, PROMPTS, strict=True))
    )
    out = [[r.token] for r in resps]
    for _ in range(n - 1):
        resps = await asyncio.gather(
            *(c.forward([o[-1]], SamplingParams()) for c, o in zip(clients, out, strict=True))
        )
        for o, r in zip(out, resps, strict=True):
            o.append(r.token)
    return out


@pytest.mark.parametrize(("mode", "hop_takes_bundles"), [("star", True), ("star", False), ("chain", True)])
async def test_route_clients_sharing_a_transport_bundle_their_steps_and_get_what_each_gets_alone(
    nodes,  # noqa: F811
    tiny,  # noqa: F811
    signing_key,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    hop_takes_bundles: bool,
) -> None:
    """In chain mode hop 1 pushes the outputs of the steps it ran together on to hop 2 as one bundle too
    (the route clients bundle only what they send hop 1)."""
    _, manifest = tiny
    if not hop_takes_bundles:  # an older node: it agrees to no subprotocol, so frames go alone
        monkeypatch.setattr(agent.node.stream, "BUNDLE_PROTOCOL", "ggswarm.older")
    a = await nodes("node-1", [(0, 2)], batching=True)
    b = await nodes("node-2", [(2, 4)], batching=True)

    def client(transport: HopTransport | None, mode: str = "star") -> RouteClient:
        session = os.urandom(16)
        plan = [RouteHop(n.dp.node_id, n.url, x, y) for n, (x, y) in ((a, (0, 2)), (b, (2, 4)))]
        hops = minted_hops(signing_key, session, manifest.sha256, plan)  # each names the next hop
        return RouteClient(hops, session_id=session, capacity=256, transport=transport, mode=mode)

    shared = HopTransport()
    together = [client(shared, mode) for _ in PROMPTS]
    try:
        await asyncio.gather(*(c.open() for c in together))
        got = await decode_together(together, 5)
    finally:
        await asyncio.gather(*(c.close() for c in together))
        await shared.close()
    want = []
    for p in PROMPTS:
        c = client(None)
        try:
            want.append([t async for t, _ in c.generate(p, SamplingParams(), 5)])
        finally:
            await c.close()
    assert got == want
    assert a.dp.stats()["sessions"] == b.dp.stats()["sessions"] == 0  # every session closed
    if hop_takes_bundles:
        # every step of the four sessions travelled as one message per hop and ran as one batch
        assert a.dp.stats()["bundles"] == b.dp.stats()["bundles"] == 5
        assert a.dp.stats()["batching"]["max_steps"] == b.dp.stats()["batching"]["max_steps"] == 4
    else:
        assert a.dp.stats()["bundles"] == b.dp.stats()["bundles"] == 0
        assert a.url in shared.streams._no_bundle


async def test_a_route_client_alone_on_a_shared_transport_does_not_wait_for_bundle_partners(
    nodes,  # noqa: F811
    tiny,  # noqa: F811
    signing_key,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, manifest = tiny
    node = await nodes("node-1", [(0, 4)], batching=True)
    offered = 0  # steps offered for a bundle (each waits a loop turn for partners)
    bundled = FrameStreams._bundled

    async def counting(self: FrameStreams, *args: Any) -> Any:
        nonlocal offered
        offered += 1
        return await bundled(self, *args)

    monkeypatch.setattr(FrameStreams, "_bundled", counting)

    def client(transport: HopTransport) -> RouteClient:
        session = os.urandom(16)
        hop = Hop(node.url, 0, 4, mint(signing_key, session, manifest.sha256, 0, 4, node.dp.node_id))
        return RouteClient([hop], session_id=session, capacity=256, transport=transport)

    shared = HopTransport()
    alone = client(shared)
    try:
        first = [t async for t, _ in alone.generate(PROMPTS[0], SamplingParams(), 3)]
        assert offered == 0  # nobody else on the transport: every step went as a plain frame at once
        other = client(shared)
        try:
            await other.open()
            await alone.forward([first[-1]], SamplingParams())
            assert offered == 1  # a second client could share the message now
        finally:
            await other.close()
    finally:
        await alone.close()
        await shared.close()


async def test_route_clients_share_their_loops_transport_and_the_last_to_close_closes_it() -> None:
    t = shared_transport()
    assert shared_transport() is t and t.streams.bundling
    a, b = (RouteClient([Hop("http://127.0.0.1:9", 0, 4, b"t")], transport=shared_transport()) for _ in "ab")
    private = RouteClient([Hop("http://127.0.0.1:9", 0, 4, b"t")])
    assert private.transport is not t and not private.transport.streams.bundling  # nothing to bundle with
    await a.close()
    assert not t.closed  # b still uses it
    await b.close()
    await private.close()
    assert t.closed and private.transport.closed
    assert shared_transport() is not t  # the next client gets a fresh one
    await shared_transport().close()
