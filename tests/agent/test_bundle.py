"""Bundles (agent/wire/bundle.py): the codec's limits, and the client's bundler against a scripted hop."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import ClientSession, WSMsgType, web

from agent.wire.bundle import (
    ANSWER_MAGIC,
    BUNDLE_MAGIC,
    BUNDLE_MAX_FRAMES,
    BUNDLE_PROTOCOL,
    HEAD,
    MAX_BUNDLE_FRAMES,
    decode_answers,
    decode_bundle,
    encode_answers,
    encode_bundle,
    is_bundle,
)
from agent.wire.frames import REQ_HEADER, FrameError
from agent.wire.stream import STREAM_PATH, FrameStreams
from tests.conftest import free_port


def body(i: int, n: int = REQ_HEADER.size + 8) -> bytes:
    """A stand-in request frame: the codec only needs its length (at least a header's)."""
    return struct.pack("<I", i) + bytes(n - 4)


# -- codec ----------------------------------------------------------------------------------------------
def test_a_bundle_decodes_to_its_frames_in_order_without_copying() -> None:
    frames = [body(i, REQ_HEADER.size + i) for i in range(5)]
    data = encode_bundle(frames)
    assert is_bundle(data) and not is_bundle(frames[0])
    got = decode_bundle(data)
    assert [bytes(f) for f in got] == frames
    assert all(isinstance(f, memoryview) for f in got)


def test_answers_decode_to_each_frames_status_and_bytes() -> None:
    answers = [(200, b"frame-a"), (401, b'{"error": "bad_token"}'), (200, b"")]
    got = decode_answers(encode_answers(answers), 3)
    assert [(s, bytes(b)) for s, b in got] == answers


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"GSW", "truncated"),
        (HEAD.pack(b"GSWP", 1, 1) + body(0), "magic"),
        (HEAD.pack(BUNDLE_MAGIC, 2, 1) + struct.pack("<I", REQ_HEADER.size) + body(0), "version"),
        (HEAD.pack(BUNDLE_MAGIC, 1, 0), "1 to"),
        (HEAD.pack(BUNDLE_MAGIC, 1, MAX_BUNDLE_FRAMES + 1), "1 to"),
        (
            HEAD.pack(BUNDLE_MAGIC, 1, 2) + struct.pack("<I", REQ_HEADER.size) + body(0, REQ_HEADER.size),
            "no length",
        ),
        (HEAD.pack(BUNDLE_MAGIC, 1, 1) + struct.pack("<I", 1 << 31) + body(0), "claims"),
        (HEAD.pack(BUNDLE_MAGIC, 1, 1) + struct.pack("<I", 4) + b"tiny", "claims"),
        (encode_bundle([body(0)]) + b"x", "trailing"),
    ],
)
def test_a_malformed_bundle_is_refused_before_any_frame_is_taken(data: bytes, why: str) -> None:
    with pytest.raises(FrameError, match=why):
        decode_bundle(data)


@pytest.mark.parametrize(
    ("data", "count", "why"),
    [
        (encode_answers([(200, b"a")]), 2, "answered with 1"),
        (HEAD.pack(ANSWER_MAGIC, 1, 1) + struct.pack("<HI", 200, 99) + b"a", 1, "bytes of"),
        (HEAD.pack(ANSWER_MAGIC, 1, 1) + struct.pack("<HI", 99, 1) + b"a", 1, "status 99"),
        (encode_answers([(200, b"a")]) + b"zz", 1, "trailing"),
        (encode_bundle([body(0)]), 1, "magic"),
    ],
)
def test_a_malformed_bundle_answer_is_refused(data: bytes, count: int, why: str) -> None:
    with pytest.raises(FrameError, match=why):
        decode_answers(data, count)


def test_more_frames_than_a_bundle_may_carry_cannot_be_encoded() -> None:
    with pytest.raises(FrameError):
        encode_bundle([body(0)] * (MAX_BUNDLE_FRAMES + 1))
    with pytest.raises(FrameError):
        encode_bundle([])


# -- the client's bundler against a scripted hop --------------------------------------------------------
Script = Callable[[list[bytes]], Awaitable[bytes | str]]


class ScriptedHop:
    """A /v1/stream endpoint that records every message and answers as the test scripts it."""

    def __init__(self, protocol: str | None = BUNDLE_PROTOCOL) -> None:
        self.protocol = protocol
        self.messages: list[list[bytes]] = []  # each message's frames (a lone frame: a list of one)
        self.script: Script = self.echo

    @staticmethod
    async def echo(frames: list[bytes]) -> bytes | str:
        return encode_answers([(200, b"re:" + f[:4]) for f in frames])

    async def view(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=(self.protocol,) if self.protocol else ())
        await ws.prepare(request)
        async for msg in ws:
            if msg.type != WSMsgType.BINARY:
                break
            if is_bundle(msg.data):
                frames = [bytes(f) for f in decode_bundle(msg.data)]
                self.messages.append(frames)
                answer = await self.script(frames)
            else:
                self.messages.append([msg.data])
                answer = b"re:" + msg.data[:4]
            if isinstance(answer, str):
                await ws.send_str(answer)
            else:
                await ws.send_bytes(answer)
        return ws


async def serve(h: ScriptedHop) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get(STREAM_PATH, h.view)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def hop() -> AsyncIterator[tuple[ScriptedHop, str]]:
    h = ScriptedHop()
    runner, url = await serve(h)
    yield h, url
    await runner.cleanup()


@pytest.fixture
async def streams() -> AsyncIterator[FrameStreams]:
    http = ClientSession()
    fs = FrameStreams(http, bundling=True)
    yield fs
    await fs.close()
    await http.close()


async def send_all(fs: FrameStreams, url: str, ids: range, timeout_s: float = 5.0) -> list[Any]:
    return await asyncio.gather(
        *(fs.exchange(url, body(i), timeout_s, bundle=True) for i in ids), return_exceptions=True
    )


async def test_frames_sent_to_one_hop_in_one_loop_turn_travel_as_one_message_and_each_gets_its_answer(
    hop: tuple[ScriptedHop, str], streams: FrameStreams
) -> None:
    h, url = hop
    got = await send_all(streams, url, range(6))
    assert got == [(200, b"re:" + struct.pack("<I", i)) for i in range(6)]
    assert [len(m) for m in h.messages] == [6] and streams.bundles_sent == 1


async def test_a_lone_frame_is_sent_as_a_plain_frame(
    hop: tuple[ScriptedHop, str], streams: FrameStreams
) -> None:
    h, url = hop
    assert await streams.exchange(url, body(7), 5.0, bundle=True) == (200, b"re:" + struct.pack("<I", 7))
    assert await streams.exchange(url, body(8), 5.0) == (200, b"re:" + struct.pack("<I", 8))
    assert h.messages == [[body(7)], [body(8)]] and streams.bundles_sent == 0


async def test_more_frames_than_a_bundle_carries_go_in_several_bundles(
    hop: tuple[ScriptedHop, str], streams: FrameStreams
) -> None:
    h, url = hop
    n = BUNDLE_MAX_FRAMES * 2 + 3
    got = await send_all(streams, url, range(n))
    assert got == [(200, b"re:" + struct.pack("<I", i)) for i in range(n)]
    assert sorted(len(m) for m in h.messages) == [3, BUNDLE_MAX_FRAMES, BUNDLE_MAX_FRAMES]


async def test_a_bundle_refused_whole_gives_every_frame_that_refusal(
    hop: tuple[ScriptedHop, str], streams: FrameStreams
) -> None:
    h, url = hop

    async def refuse(frames: list[bytes]) -> str:
        return '{"status": 429, "error": "too_many_requests", "message": "slow down"}'

    h.script = refuse
    got = await send_all(streams, url, range(3))
    assert [status for status, _ in got] == [429, 429, 429]


async def test_a_garbled_bundle_answer_fails_every_frame_as_a_broken_connection(
    hop: tuple[ScriptedHop, str], streams: FrameStreams
) -> None:
    h, url = hop

    async def garble(frames: list[bytes]) -> bytes:
        return encode_answers([(200, b"only one")])

    h.script = garble
    got = await send_all(streams, url, range(3))
    assert all(isinstance(g, ConnectionResetError) for g in got)
    h.script = ScriptedHop.echo  # and the next bundle is answered as ever
    assert (await send_all(streams, url, range(2)))[1] == (200, b"re:" + struct.pack("<I", 1))


async def test_a_caller_that_gives_up_leaves_the_other_frames_of_its_bundle_answered(
    hop: tuple[ScriptedHop, str], streams: FrameStreams
) -> None:
    h, url = hop

    async def slow(frames: list[bytes]) -> bytes:
        await asyncio.sleep(0.3)
        return await ScriptedHop.echo(frames)

    h.script = slow
    quick = streams.exchange(url, body(0), 0.05, bundle=True)
    patient = streams.exchange(url, body(1), 5.0, bundle=True)
    got = await asyncio.gather(quick, patient, return_exceptions=True)
    assert isinstance(got[0], TimeoutError)
    assert got[1] == (200, b"re:" + struct.pack("<I", 1))


async def test_a_hop_that_did_not_agree_to_bundles_gets_every_frame_alone(streams: FrameStreams) -> None:
    old = ScriptedHop(protocol=None)  # an older node: no subprotocol at the upgrade
    runner, url = await serve(old)
    try:
        got = await send_all(streams, url, range(4))
        assert got == [(200, b"re:" + struct.pack("<I", i)) for i in range(4)]
        assert all(len(m) == 1 for m in old.messages) and len(old.messages) == 4
        assert url in streams._no_bundle
    finally:
        await streams.close()  # its idle sockets first: the server waits for open ones when it stops
        await runner.cleanup()


async def test_streams_made_without_bundling_send_frames_alone(hop: tuple[ScriptedHop, str]) -> None:
    # bench/served.py --ab-no-bundles measures against this
    h, url = hop
    async with ClientSession() as http:
        fs = FrameStreams(http, bundling=False)
        try:
            await send_all(fs, url, range(3))
        finally:
            await fs.close()
    assert sorted(len(m) for m in h.messages) == [1, 1, 1]
