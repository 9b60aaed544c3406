"""Stalled clients do not cut a hop off (issue 33, item 3; docs/security.md, "Stalled clients").

A real `agent serve` hop on 127.0.0.1 (the tiny llama, torch backend) and, from the same address as its
route client (the web's, in production), 64+ stalled connections of every kind: headers only, a body
that trickles, headers that never end, a stream that never sends a frame. A route client's chat
through the hop goes on while they stall, and the hop closes every one of them within its deadline.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest
from aiohttp import ClientSession, WSMsgType, web

from agent.artifacts.manifest import Manifest, build_manifest
from agent.artifacts.packaged import ModelNotFound, packaged_model_path
from agent.client.recovery import Hop
from agent.client.route import RouteClient
from agent.dev.cluster import ServeHop, health, start_serve
from agent.dev.hostile import STALL_KINDS, ids_frame, open_frame, stall, trickle
from agent.node import admission
from agent.node.dataplane import DataPlane, start_dataplane
from agent.wire.frames import REQ_HEADER
from agent.wire.routetoken import mint, public_key_b64
from agent.wire.sampling import SamplingParams
from agent.wire.stream import STREAM_PATH
from tests.conftest import free_port

DEADLINE_S = admission.HEAD_TIMEOUT_S
MARGIN_S = 3.0  # a loaded 2-core machine: the event loop may be late by this much


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Manifest]:
    """A 4-layer random-weight llama (SmolLM2's vocabulary): one hop holds all of it."""
    from agent.artifacts.tiny import write_tiny_gguf

    try:
        packaged_model_path("smollm2")
    except ModelNotFound as e:
        pytest.skip(f"the tiny model's tokenizer comes from SmolLM2: {e}")
    path = write_tiny_gguf("llama", tmp_path_factory.mktemp("tiny") / "llama.gguf")
    return str(path), build_manifest(path)


@pytest.fixture(scope="module")
def hop(tiny, signing_key, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeHop]:  # noqa: ANN001
    path, _ = tiny
    h = start_serve(
        path,
        "0:4",
        public_key=public_key_b64(signing_key.public_key()),
        logdir=tmp_path_factory.mktemp("serve-logs"),
        backend="torch",
    )
    yield h
    h.stop()


async def until(cond, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    """Poll `cond()` until it holds (readiness, never a guessed sleep)."""
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_a_chat_through_a_hop_goes_on_while_64_stalled_clients_of_its_address_are_cut_off(
    hop: ServeHop,
    tiny,  # noqa: ANN001
    signing_key,  # noqa: ANN001
) -> None:
    _, manifest = tiny
    session = os.urandom(16)
    token = mint(signing_key, session, manifest.sha256, 0, 4, hop.node_id)
    frame = ids_frame(token, os.urandom(16), [1, 2, 3])  # a valid-looking frame, never sent whole
    n = admission.PER_IP_CONCURRENCY + 8
    kinds = list(STALL_KINDS)
    stalled = [await stall(hop.url, kind, frame) for kind in kinds for _ in range(n)]
    trickling = asyncio.create_task(trickle(stalled, frame))
    try:
        # readiness: the hop counts the anonymous ones it holds (ANON_PER_IP at most: the others were
        # cut for newer ones of the same address)
        await until(lambda: health(hop.url)["anonymous"] == admission.ANON_PER_IP)
        t_chat = time.monotonic()
        client = RouteClient(
            [Hop(hop.url, 0, 4, token)], session_id=session, capacity=512, timeout_s=DEADLINE_S + MARGIN_S
        )
        got: list[int] = []
        try:
            async for tok, _ in client.generate([1, 2, 3, 4], SamplingParams(temperature=0.0), 4):
                got.append(tok)
        finally:
            await client.close()
        # and a lone POST (no stream) from the same address
        async with ClientSession() as http:
            other = os.urandom(16)
            tok2 = mint(signing_key, other, manifest.sha256, 0, 4, hop.node_id)
            async with http.post(hop.url + "/v1/frame", data=open_frame(tok2, other)) as r:
                assert r.status == 200, await r.text()
        chat_s = time.monotonic() - t_chat
        assert len(got) == 4
        assert chat_s < DEADLINE_S, f"the chat waited {chat_s:.1f} s behind stalled clients"
        # every stalled connection is closed within its deadline (a cut one at once)
        await asyncio.gather(*(s.wait_closed(DEADLINE_S + 2 * MARGIN_S + 30) for s in stalled))
    finally:
        trickling.cancel()
        for s in stalled:
            s.writer.close()
    for kind in kinds:
        held = max(s.closed - s.opened for s in stalled if s.kind == kind)
        assert held <= DEADLINE_S + MARGIN_S, f"a '{kind}' connection was held {held:.1f} s"
    stats = health(hop.url)
    assert stats["anonymous"] == 0 and stats["inflight_bytes"] == 0
    assert stats["anonymous_cut"] >= 3 * n - admission.ANON_PER_IP  # newer ones cut the oldest


@pytest.fixture
async def node(tiny, signing_key) -> tuple[DataPlane, str, web.AppRunner]:  # noqa: ANN001
    path, manifest = tiny
    dp = DataPlane("node-s", signing_key.public_key())
    dp.load_shard(path, manifest, 0, 4, backend="torch", n_threads=1)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    yield dp, f"http://127.0.0.1:{port}", runner
    await runner.cleanup()


async def test_an_authenticated_frame_whose_body_trickles_is_cut_at_its_deadline_and_frees_its_slots(
    node,  # noqa: ANN001
    tiny,  # noqa: ANN001
    signing_key,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(admission, "BODY_TIMEOUT_S", 1.0)
    dp, url, _ = node
    _, manifest = tiny
    session = os.urandom(16)
    token = mint(signing_key, session, manifest.sha256, 0, 4, "node-s")
    frame = ids_frame(token, session, list(range(64)))
    head = REQ_HEADER.size + len(token)
    s = await stall(url, "headers only", frame)
    s.writer.write(frame[:head])  # header and a valid token: the token's slot and the bytes are held
    await until(lambda: dp.stats()["inflight_bytes"] == len(frame))
    for i in range(head, head + 3):  # then a byte a second, far too slow for its 1 s + length deadline
        s.writer.write(frame[i : i + 1])
        await asyncio.sleep(0.5)
    await s.wait_closed(10)
    assert s.closed - s.opened <= 1.0 + len(frame) / admission.BODY_MIN_RATE + MARGIN_S
    assert dp.stats()["inflight_bytes"] == 0 and dp.admission.anonymous.total() == 0
    async with ClientSession() as http, http.post(url + "/v1/frame", data=open_frame(token, session)) as r:
        assert r.status == 200  # the token's slot came back


async def test_a_stream_is_not_cut_once_a_frame_shows_a_valid_token_however_long_that_frame_runs(
    tiny,  # noqa: ANN001
    signing_key,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agent.node import stream as stream_mod

    monkeypatch.setattr(stream_mod, "HEAD_TIMEOUT_S", 0.5)
    original = DataPlane.answer_frame

    async def slow_answer(self: DataPlane, body: bytes) -> bytes:
        await asyncio.sleep(1.0)  # a first step longer than the anonymous deadline
        return await original(self, body)

    monkeypatch.setattr(DataPlane, "answer_frame", slow_answer)
    path, manifest = tiny
    dp = DataPlane("node-w", signing_key.public_key())
    dp.load_shard(path, manifest, 0, 4, backend="torch", n_threads=1)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    session = os.urandom(16)
    token = mint(signing_key, session, manifest.sha256, 0, 4, "node-w")
    try:
        async with ClientSession() as http, http.ws_connect(f"http://127.0.0.1:{port}{STREAM_PATH}") as ws:
            await ws.send_bytes(open_frame(token, session))
            first = await ws.receive(timeout=10)
            await asyncio.sleep(0.6)  # idle past the deadline too: a trusted stream has none
            await ws.send_bytes(ids_frame(token, session, [1, 2, 3]))
            second = await ws.receive(timeout=10)
        assert first.type == second.type == WSMsgType.BINARY, (first, second)
        assert dp.stats()["anonymous"] == 0
    finally:
        await runner.cleanup()
