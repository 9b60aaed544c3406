"""Attacks on the data plane (issue 17), each reproduced against live hops on 127.0.0.1 and refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import psutil
import pytest
from aiohttp import ClientSession, web

from agent.artifacts.manifest import Manifest, build_manifest
from agent.artifacts.packaged import ModelNotFound, packaged_model_path
from agent.node import admission
from agent.node import dataplane as dp_mod
from agent.node.dataplane import DataPlane, start_dataplane
from agent.node.errors import DataPlaneError
from agent.wire.frames import (
    MAX_LOGITS_BYTES,
    PROTOCOL_VERSION,
    REQ_HEADER,
    ChainHop,
    Kind,
    Op,
    Request,
    Response,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from agent.wire.routetoken import RouteHop, mint, mint_route
from tests.conftest import free_port

MB = 1 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Manifest]:
    """A 4-layer random-weight llama (hidden 64, SmolLM2's 49,152-token vocabulary)."""
    from agent.artifacts.tiny import write_tiny_gguf

    try:
        packaged_model_path("smollm2")
    except ModelNotFound as e:
        pytest.skip(f"the tiny model's tokenizer comes from SmolLM2: {e}")
    path = write_tiny_gguf("llama", tmp_path_factory.mktemp("tiny") / "llama.gguf")
    return str(path), build_manifest(path)


class Node:
    """A DataPlane serving on 127.0.0.1 in this process."""

    def __init__(self, dp: DataPlane, runner: web.AppRunner, url: str) -> None:
        self.dp, self.runner, self.url = dp, runner, url


@pytest.fixture
async def nodes(tiny, signing_key) -> AsyncIterator[Callable[..., Any]]:  # noqa: ANN001
    started: list[web.AppRunner] = []

    async def start(node_id: str, ranges: list[tuple[int, int]], **kw: Any) -> Node:
        path, manifest = tiny
        ssl_server = kw.pop("ssl_server", None)
        dp = DataPlane(node_id, signing_key.public_key(), **kw)
        for a, b in ranges:
            dp.load_shard(path, manifest, a, b, backend="torch", n_threads=1)
        port = free_port()
        runner = await start_dataplane(dp, "127.0.0.1", port, ssl_context=ssl_server)
        started.append(runner)
        return Node(dp, runner, f"{'https' if ssl_server else 'http'}://127.0.0.1:{port}")

    yield start
    for r in started:
        await r.cleanup()


async def post(url: str, body: bytes, **kw: Any) -> tuple[int, bytes]:
    async with ClientSession() as http, http.post(url + "/v1/frame", data=body, **kw) as r:
        return r.status, await r.read()


def error_code(data: bytes) -> str:
    return str(json.loads(data)["error"])


@contextlib.asynccontextmanager
async def fake_next_hop(
    method: str, path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> AsyncIterator[str]:
    """A hostile "next hop" on 127.0.0.1 answering `method path` with `handler`; yields its URL."""
    app = web.Application()
    app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def chain_to(node: Node, next_url: str, key: Any, sha: str) -> tuple[bytes, bytes, list[ChainHop]]:
    """A session opened on `node` (layers 0:2) whose signed route goes on to `next_url` (layers 2:4):
    (session, the node's token, the chain a forward frame carries)."""
    session = os.urandom(16)
    route = [RouteHop(node.dp.node_id, node.url, 0, 2), RouteHop("node-next", next_url, 2, 4)]
    tok, tok_next = mint_route(key, session, sha, route)
    await post(node.url, frame(tok, session, op=Op.OPEN))
    return session, tok, [ChainHop(next_url, tok_next)]


def frame(token: bytes, session: bytes, **kw: Any) -> bytes:
    return encode_request(Request(session=session, token=token, **kw))


def ids_frame(token: bytes, session: bytes, ids: list[int], step: int = 1, pos: int = 0, **kw: Any) -> bytes:
    arr = np.asarray(ids, dtype="<i4")
    return frame(
        token,
        session,
        op=Op.FORWARD,
        step=step,
        pos_start=pos,
        n_tokens=len(ids),
        kind=Kind.IDS,
        payload=arr.tobytes(),
        **kw,
    )


class Recorder:
    """An HTTP server that records every request it gets (the SSRF target)."""

    def __init__(self) -> None:
        self.hits: list[str] = []

    async def start(self) -> tuple[web.AppRunner, str]:
        async def any_view(request: web.Request) -> web.Response:
            self.hits.append(request.path)
            return web.Response(text="internal admin page")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", any_view)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, f"http://127.0.0.1:{port}"


async def test_a_chain_naming_a_url_the_token_does_not_grant_is_refused_and_no_request_is_made(
    nodes,
    signing_key,
    tiny,  # noqa: ANN001
) -> None:
    _, manifest = tiny
    a = await nodes("node-a", [(0, 2)])
    b = await nodes("node-b", [(2, 4)])
    victim = Recorder()
    vr, victim_url = await victim.start()
    try:
        session = os.urandom(16)
        route = [RouteHop("node-a", a.url, 0, 2), RouteHop("node-b", b.url, 2, 4)]
        tok_a, tok_b = mint_route(signing_key, session, manifest.sha256, route)
        await post(a.url, frame(tok_a, session, op=Op.OPEN))
        cases = {
            # the token holder swaps in any URL it likes, with the real next token beside it
            "other url": [ChainHop(victim_url, tok_b)],
            # the URL the token grants, but a token for another node
            "other node": [ChainHop(b.url, mint(signing_key, session, manifest.sha256, 2, 4, "node-z"))],
            # an extra hop after the last one
            "past the end": [ChainHop(b.url, tok_b), ChainHop(victim_url, tok_b)],
        }
        for name, chain in cases.items():
            status, data = await post(a.url, ids_frame(tok_a, session, [1, 2, 3], chain=chain))
            assert (status, error_code(data)) == (403, "chain_not_granted"), name
        # a token minted without a next hop (star mode, or the last hop) forwards nowhere
        lone = mint(signing_key, session, manifest.sha256, 0, 2, "node-a")
        status, data = await post(
            a.url, ids_frame(lone, session, [1, 2, 3], chain=[ChainHop(victim_url, tok_b)])
        )
        assert (status, error_code(data)) == (403, "chain_not_granted")
        assert victim.hits == []
        # the route the control plane signed still works
        await post(b.url, frame(tok_b, session, op=Op.OPEN))
        status, data = await post(a.url, ids_frame(tok_a, session, [1, 2, 3], chain=[ChainHop(b.url, tok_b)]))
        assert status == 200 and decode_response(data).kind == Kind.TOKEN
        assert len(decode_response(data).timings) == 2
    finally:
        await vr.cleanup()


async def test_a_600_mb_reply_from_the_next_hop_is_cut_off_with_502_and_rss_stays_bounded(
    nodes,
    signing_key,
    tiny,  # noqa: ANN001
) -> None:
    _, manifest = tiny
    a = await nodes("node-a", [(0, 2)])
    sent = [0]

    async def flood(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse()
        await resp.prepare(request)
        chunk = b"\0" * MB
        try:
            for _ in range(600):
                await resp.write(chunk)
                sent[0] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass
        return resp

    async with fake_next_hop("POST", "/v1/frame", flood) as fake_url:
        session, tok_a, chain = await chain_to(a, fake_url, signing_key, manifest.sha256)
        rss0 = psutil.Process().memory_info().rss
        status, data = await post(a.url, ids_frame(tok_a, session, [1, 2, 3], chain=chain))
        grew = psutil.Process().memory_info().rss - rss0
        assert (status, error_code(data)) == (502, "downstream")
        assert "more than" in json.loads(data)["message"]
        assert grew < 64 * MB, f"RSS grew {grew / MB:.0f} MB reading a bounded reply"
        assert sent[0] < 600 * MB  # the hop hung up instead of reading it all


async def test_a_next_hop_reply_that_is_not_a_frame_is_not_passed_back(nodes, signing_key, tiny) -> None:  # noqa: ANN001
    _, manifest = tiny
    a = await nodes("node-a", [(0, 2)])

    async def liar(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"GSWR" + b"\xff" * 60)

    async with fake_next_hop("POST", "/v1/frame", liar) as fake_url:
        session, tok_a, chain = await chain_to(a, fake_url, signing_key, manifest.sha256)
        status, data = await post(a.url, ids_frame(tok_a, session, [1, 2], chain=chain))
        assert (status, error_code(data)) == (502, "downstream") and b"\xff" not in data


@pytest.mark.parametrize("extra", [b"", b"\0"], ids=["exact", "one-byte-more"])
async def test_a_next_hop_answer_is_passed_back_only_when_it_is_exactly_a_frame(
    nodes,  # noqa: ANN001
    signing_key,  # noqa: ANN001
    tiny,  # noqa: ANN001
    extra: bytes,
) -> None:
    """A chain hop relays its next hop's answer as it came (with its own timing in front), so that
    answer must be checked whole: one byte past the frame and nothing goes back but a 502."""
    _, manifest = tiny
    a = await nodes("node-a", [(0, 2)])

    async def last_hop(request: web.Request) -> web.Response:
        req = decode_request(await request.read())
        answer = encode_response(Response(step=req.step, kind=Kind.TOKEN, session_len=2, token=7))
        return web.Response(body=answer + extra)

    async with fake_next_hop("POST", "/v1/frame", last_hop) as fake_url:
        session, tok_a, chain = await chain_to(a, fake_url, signing_key, manifest.sha256)
        status, data = await post(a.url, ids_frame(tok_a, session, [1, 2], chain=chain))
    if extra:
        assert (status, error_code(data)) == (502, "downstream")
        assert "trailing" in json.loads(data)["message"]
    else:
        assert status == 200
        got = decode_response(data)
        assert (got.kind, got.token, got.session_len, len(got.timings)) == (Kind.TOKEN, 7, 2, 1)


async def test_logits_over_a_long_prefill_are_refused_and_retries_hold_no_megabytes(
    nodes,
    signing_key,
    tiny,  # noqa: ANN001
) -> None:
    _, manifest = tiny
    n = await nodes("node-l", [(0, 4)])
    session = os.urandom(16)
    tok = mint(signing_key, session, manifest.sha256, 0, 4, "node-l")
    await post(n.url, frame(tok, session, op=Op.OPEN))
    # The amplification: a few KB of ids asking for every position's logits.
    long = list(range(10, 10 + 600))
    status, data = await post(n.url, ids_frame(tok, session, long, want_logits=True))
    assert (status, error_code(data)) == (413, "logits_too_large")
    assert "at most" in json.loads(data)["message"]
    assert n.dp.stats()["held_bytes"] == 0 and n.dp.sessions.get  # nothing was computed or kept
    # Within the cap: answered (128 x 49,152 floats = 24 MiB), but not kept for retries.
    ok = list(range(10, 10 + 128))
    body = ids_frame(tok, session, ok, want_logits=True)
    status, first = await post(n.url, body)
    assert status == 200 and len(first) > 128 * 49152 * 4 and len(first) < MAX_LOGITS_BYTES + 4096
    st = n.dp.stats()
    assert st["retry_cache_bytes"] <= dp_mod.RETRY_CACHE_MAX
    assert st["held_bytes"] == st["kv_bytes"] + st["retry_cache_bytes"]
    # A retry of that step recomputes it from where it began: same answer, KV not appended twice.
    status, again = await post(n.url, body)
    assert status == 200 and decode_response(again).session_len == 128
    np.testing.assert_array_equal(decode_response(again).logits(), decode_response(first).logits())
    # A decode step's small answer is kept, counted, and replayed.
    step2 = ids_frame(tok, session, [7], step=2, pos=128)
    s1, r1 = await post(n.url, step2)
    s2, r2 = await post(n.url, step2)
    assert (s1, s2) == (200, 200) and decode_response(r1).token == decode_response(r2).token
    st = n.dp.stats()
    assert 0 < st["retry_cache_bytes"] <= 1024 and decode_response(r2).session_len == 129


async def test_a_step_counter_of_2_64_minus_1_is_refused_and_the_session_goes_on(
    nodes,
    signing_key,
    tiny,  # noqa: ANN001
) -> None:
    _, manifest = tiny
    n = await nodes("node-s", [(0, 4)])
    session = os.urandom(16)
    tok = mint(signing_key, session, manifest.sha256, 0, 4, "node-s")
    await post(n.url, frame(tok, session, op=Op.OPEN))
    status, data = await post(n.url, ids_frame(tok, session, [1, 2], step=2**64 - 1))
    assert (status, error_code(data)) == (400, "bad_frame")
    status, _ = await post(n.url, ids_frame(tok, session, [1, 2], step=1))
    assert status == 200


@pytest.mark.parametrize(
    "url",
    [
        "http://" + "a" * 64 + ".example/",
        "http://127.0.0.1:99999/",
        "http://user:pw@127.0.0.1:1/",
        "http://h\u00e9.example/",
        "http://[::1/",
        "ftp://127.0.0.1/",
    ],
)
async def test_a_malformed_chain_url_is_a_400_not_a_500(nodes, signing_key, tiny, url: str) -> None:  # noqa: ANN001
    _, manifest = tiny
    n = await nodes("node-u", [(0, 2)])
    session = os.urandom(16)
    tok = mint(signing_key, session, manifest.sha256, 0, 2, "node-u")
    body = ids_frame(tok, session, [1], chain=[ChainHop("http://x/", tok)])
    # The URL's raw bytes in place of a placeholder's (length prefix included).
    raw = url.encode()
    bad = body.replace(b"\x09\x00http://x/", len(raw).to_bytes(2, "little") + raw)
    status, data = await post(n.url, bad)
    assert (status, error_code(data)) == (400, "bad_frame"), data


async def _raw_post(url: str, head: bytes, content_length: int) -> tuple[int, asyncio.StreamWriter]:
    """Send an HTTP POST's headers and the first bytes of its body; read the status line."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /v1/frame HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {content_length}\r\n\r\n".encode()
        + head
    )
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 10)
    return int(line.split()[1]), writer


async def test_a_pre_auth_flood_of_60_mb_posts_is_refused_before_buffering(nodes, signing_key, tiny) -> None:  # noqa: ANN001
    _, manifest = tiny
    n = await nodes("node-f", [(0, 4)])
    session = os.urandom(16)
    forged = bytearray(mint(signing_key, session, manifest.sha256, 0, 4, "node-f"))
    forged[-1] ^= 1
    # A header promising a 60 MB payload (n_tokens x dim f32), with a forged token.
    n_tok, dim = 7680, 2048
    head = REQ_HEADER.pack(
        b"GSWP",
        PROTOCOL_VERSION,
        int(Op.FORWARD),
        0,
        session,
        1,
        0,
        n_tok,
        int(Kind.F32),
        len(forged),
        dim,
        4 * n_tok * dim,
    ) + bytes(forged)
    total = len(head) + 4 * n_tok * dim
    rss0 = psutil.Process().memory_info().rss
    results = await asyncio.gather(*(_raw_post(n.url, head, total) for _ in range(8)))
    grew = psutil.Process().memory_info().rss - rss0
    for _, w in results:
        w.close()
    assert [s for s, _ in results] == [401] * 8
    assert grew < 32 * MB, f"RSS grew {grew / MB:.0f} MB"
    assert n.dp.stats()["inflight_bytes"] == 0


async def test_one_route_token_gets_at_most_a_few_frames_at_once(nodes, signing_key, tiny) -> None:  # noqa: ANN001
    _, manifest = tiny
    n = await nodes("node-c", [(0, 4)])
    session = os.urandom(16)
    tok = mint(signing_key, session, manifest.sha256, 0, 4, "node-c")
    body = ids_frame(tok, session, [1, 2, 3])
    # Stalled senders: header and token sent, the rest never comes. Each holds a slot.
    stalled = []
    for _ in range(admission.PER_TOKEN_CONCURRENCY):
        host, port = n.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST /v1/frame HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body[: REQ_HEADER.size + len(tok)]
        )
        await writer.drain()
        stalled.append(writer)
    # Readiness: the node has admitted them all (polled, not slept).
    for _ in range(200):
        if n.dp.stats()["inflight_bytes"] == admission.PER_TOKEN_CONCURRENCY * len(body):
            break
        await asyncio.sleep(0.01)
    status, data = await post(n.url, body)
    assert (status, error_code(data)) == (429, "too_many_requests")
    for w in stalled:
        w.close()
    for _ in range(200):
        if n.dp.stats()["inflight_bytes"] == 0:
            break
        await asyncio.sleep(0.01)
    await post(n.url, frame(tok, session, op=Op.OPEN))
    status, _ = await post(n.url, body)
    assert status == 200


async def test_a_frame_without_content_length_or_with_a_lying_one_is_refused(
    nodes, signing_key, tiny
) -> None:  # noqa: ANN001
    _, manifest = tiny
    n = await nodes("node-h", [(0, 4)])
    session = os.urandom(16)
    tok = mint(signing_key, session, manifest.sha256, 0, 4, "node-h")
    body = ids_frame(tok, session, [1, 2, 3])

    async def chunks() -> AsyncIterator[bytes]:
        yield body

    async with ClientSession() as http, http.post(n.url + "/v1/frame", data=chunks()) as r:
        # chunked: no Content-Length
        assert (r.status, error_code(await r.read())) == (411, "length_required")
    status, _w = await _raw_post(n.url, body[:60], len(body) + 10_000_000)
    _w.close()
    assert status == 400


def test_plain_http_is_refused_off_loopback_unless_told_loudly(monkeypatch, signing_key) -> None:  # noqa: ANN001
    monkeypatch.delenv(dp_mod.INSECURE_ENV, raising=False)
    dp = DataPlane("node-p", signing_key.public_key())
    with pytest.raises(DataPlaneError, match="plain HTTP"):
        asyncio.run(start_dataplane(dp, "0.0.0.0", free_port()))
