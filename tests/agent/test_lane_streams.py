"""The route client's lane streams against a stand-in lane on 127.0.0.1 (the real one is in
tests/native/test_lane_bundle.py): steps made in one loop turn travel as one bundle, steps made while a
bundle is in flight wait for it and join its members' next steps, and a refused bundle's members go again
alone so that only the one at fault fails."""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from agent.client.lane import LaneStreams
from agent.wire.lane import (
    DIR_ANSWER,
    DIR_REQUEST,
    FRAME_HEAD,
    HEADER,
    KIND_ANSWER,
    KIND_BUNDLE,
    KIND_BUNDLE_ANSWER,
    KIND_REFUSAL,
    BundleMember,
    Head,
    LaneAnswer,
    LaneError,
    pack_head,
    unpack_head,
)

DELAY_S = 0.02  # the stand-in's compute per frame: long enough for other steps to arrive meanwhile


@dataclass
class StandInLane:
    """Answers each step with token = its first id + 1; records how many steps each frame carried."""

    keys: dict[int, bytes]
    frames: list[int] = field(default_factory=list)
    refuse_lane_ids: set[int] = field(default_factory=set)

    def _answer(self, head_b: bytes, payload: bytes) -> bytes:
        h = unpack_head(head_b)
        key = self.keys[h.lane_id]
        plain = AESGCM(key).decrypt(
            struct.pack("<IQ", DIR_REQUEST, h.step), payload + head_b[HEADER:FRAME_HEAD], head_b[:HEADER]
        )
        token = int(np.frombuffer(plain[:4], dtype=np.int32)[0]) + 1
        body = struct.pack("<iidiI", token, h.pos_start + h.n_tokens, -0.5, 1, 0) + struct.pack("<II", 7, 9)
        head = pack_head(Head(KIND_ANSWER, h.lane_id, h.step, h.pos_start, h.n_tokens, len(body)))
        sealed = AESGCM(key).encrypt(struct.pack("<IQ", DIR_ANSWER, h.step), body, head)
        return head + sealed[-16:] + sealed[:-16]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head_b = await reader.readexactly(FRAME_HEAD)
                h = unpack_head(head_b)
                members = []
                if h.kind == KIND_BUNDLE:
                    for _ in range(h.n_tokens):
                        mh = await reader.readexactly(FRAME_HEAD)
                        members.append((mh, await reader.readexactly(unpack_head(mh).payload_len)))
                else:
                    members.append((head_b, await reader.readexactly(h.payload_len)))
                self.frames.append(len(members))
                await asyncio.sleep(DELAY_S)
                if any(unpack_head(m[0]).lane_id in self.refuse_lane_ids for m in members):
                    msg = b"unknown lane session"  # a lone frame's refusal names it, a bundle's does not
                    lone = h.kind != KIND_BUNDLE
                    refusal = Head(
                        KIND_REFUSAL, h.lane_id if lone else 0, h.step if lone else 0, 0, 0, len(msg)
                    )
                    writer.write(pack_head(refusal) + bytes(16) + msg)
                    await writer.drain()
                    break  # a lane closes after a refusal
                answers = [self._answer(mh, p) for mh, p in members]
                if h.kind == KIND_BUNDLE:
                    body = b"".join(answers)
                    writer.write(
                        pack_head(Head(KIND_BUNDLE_ANSWER, 0, 0, 0, len(answers), len(body)))
                        + bytes(16)
                        + body
                    )
                else:
                    writer.write(answers[0])
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


@pytest.fixture
async def lane() -> AsyncIterator[tuple[StandInLane, tuple[str, int]]]:
    stand_in = StandInLane({i: os.urandom(32) for i in range(1, 9)})
    server = await asyncio.start_server(stand_in.serve, "127.0.0.1", 0)
    yield stand_in, ("127.0.0.1", server.sockets[0].getsockname()[1])
    server.close()
    await server.wait_closed()


async def _decode(
    streams: LaneStreams,
    addr: tuple[str, int],
    keys: dict[int, bytes],
    lane_id: int,
    steps: int,
    delay: float = 0.0,
) -> list[LaneAnswer]:
    await asyncio.sleep(delay)
    out = []
    for step in range(1, steps + 1):
        m = BundleMember(keys[lane_id], lane_id, step, 10 + step, np.asarray([100 * lane_id + step]))
        out.append(await streams.run(addr, m, bundle=True))
    return out


async def test_sessions_that_start_apart_end_up_stepping_as_one_bundle(
    lane: tuple[StandInLane, tuple[str, int]],
) -> None:
    stand_in, addr = lane
    streams = LaneStreams()
    try:
        # session 1 starts alone; 2-4 make their first steps while its step is in flight
        got = await asyncio.gather(
            _decode(streams, addr, stand_in.keys, 1, 6),
            *(_decode(streams, addr, stand_in.keys, i, 5, DELAY_S / 2) for i in (2, 3, 4)),
        )
    finally:
        await streams.close()
    for i, answers in enumerate(got, start=1):
        assert [a.token for a in answers] == [100 * i + s + 1 for s in range(1, len(answers) + 1)]
        assert all(a.timings == ((7, 9),) for a in answers)
    # one lone step in flight, then everyone together: never two groups taking turns
    assert stand_in.frames == [1, 4, 4, 4, 4, 4]
    assert streams.bundles_sent == 5


async def test_a_refused_bundle_goes_again_alone_and_only_the_one_at_fault_fails(
    lane: tuple[StandInLane, tuple[str, int]],
) -> None:
    stand_in, addr = lane
    stand_in.refuse_lane_ids = {2}
    streams = LaneStreams()
    try:
        got = await asyncio.gather(
            *(_decode(streams, addr, stand_in.keys, i, 1) for i in (1, 2, 3)), return_exceptions=True
        )
    finally:
        await streams.close()
    assert isinstance(got[1], LaneError) and got[1].refused
    assert [a.token for a in got[0]] == [102] and [a.token for a in got[2]] == [302]  # type: ignore[union-attr]  # why: gather's union, checked above
    assert stand_in.frames == [3, 1, 1, 1]  # the bundle, then each member alone
