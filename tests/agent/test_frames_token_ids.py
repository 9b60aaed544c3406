"""Protocol version 2: a hidden-state frame carries the positions' token ids for windows whose layers
route experts by token id (deepseek4's hash layers); version-1 frames are refused with a clear error."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from agent.wire.frames import (
    PROTOCOL_VERSION,
    REQ_HEADER,
    FrameError,
    Kind,
    Op,
    Request,
    decode_request,
    encode_request,
)


def _hidden_request(ids: np.ndarray | None) -> Request:
    hidden = np.arange(3 * 8, dtype=np.float16).reshape(3, 8)
    return Request(
        op=Op.FORWARD,
        session=bytes(16),
        step=1,
        n_tokens=3,
        kind=Kind.F16,
        dim=8,
        token=b"t",
        token_ids=ids,
        payload=hidden.tobytes(),
    )


def test_token_ids_travel_with_hidden_states_and_come_back_out() -> None:
    req = decode_request(encode_request(_hidden_request(np.array([5, 6, 7], dtype=np.int32))))
    assert req.token_ids is not None and req.token_ids.tolist() == [5, 6, 7]
    assert req.hidden().shape == (3, 8)


def test_a_hidden_frame_without_ids_decodes_with_none() -> None:
    assert decode_request(encode_request(_hidden_request(None))).token_ids is None


def test_ids_must_match_the_positions_and_come_only_with_hidden_states() -> None:
    with pytest.raises(FrameError, match="one per position"):
        encode_request(_hidden_request(np.array([1, 2], dtype=np.int32)))
    # a token-id frame that also sets the flag is refused on decoding
    frame = bytearray(
        encode_request(
            Request(
                op=Op.FORWARD,
                session=bytes(16),
                step=1,
                n_tokens=1,
                kind=Kind.IDS,
                payload=np.array([1], dtype="<i4").tobytes(),
            )
        )
    )
    frame[7] |= 64
    frame[REQ_HEADER.size : REQ_HEADER.size] = b"\0\0\0\0"
    with pytest.raises(FrameError, match="only with hidden states"):
        decode_request(bytes(frame))


def test_a_frame_cut_inside_the_ids_block_is_refused() -> None:
    frame = encode_request(_hidden_request(np.array([5, 6, 7], dtype=np.int32)))
    with pytest.raises(FrameError):
        decode_request(frame[:-49])


def test_a_version_one_frame_is_refused_with_the_version_in_the_message() -> None:
    assert PROTOCOL_VERSION == 2
    frame = bytearray(encode_request(_hidden_request(None)))
    struct.pack_into("<H", frame, 4, 1)
    with pytest.raises(FrameError, match="protocol version 1 is not supported"):
        decode_request(bytes(frame))
