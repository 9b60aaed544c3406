"""The binary frame codec: layout sizes, round trips, and every malformed input rejected before allocation."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from agent.backends.sampling import wire_exact
from agent.wire.frames import (
    MAX_TOKENS_PER_FRAME,
    PROTOCOL_VERSION,
    REQ_HEADER,
    RESP_HEADER,
    SAMPLING,
    ChainHop,
    FrameError,
    Kind,
    Op,
    Request,
    Response,
    Timing,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    peek_request,
    response_step,
    with_prepended_timing,
)
from agent.wire.sampling import SamplingParams

SID = b"s" * 16


def hidden_frame(n: int = 1, dim: int = 576, **kw: object) -> Request:
    payload = np.arange(n * dim, dtype=np.float16).tobytes()
    return Request(
        op=Op.FORWARD,
        session=SID,
        step=7,
        pos_start=3,
        n_tokens=n,
        kind=Kind.F16,
        dim=dim,
        token=b"t" * 160,
        payload=payload,
        **kw,
    )  # type: ignore[arg-type]


def test_layout_sizes_are_pinned_to_the_protocol_version() -> None:
    # Changing a struct without bumping PROTOCOL_VERSION breaks every deployed node: this test must fail.
    assert PROTOCOL_VERSION == 2
    assert (REQ_HEADER.size, RESP_HEADER.size, SAMPLING.size) == (52, 41, 32)


def test_decode_frame_for_smollm2_fits_the_wire_budget() -> None:
    # P4: a decode step's frame into a hop is d_model x 2 bytes of f16 plus at most 256 bytes.
    frame = encode_request(hidden_frame())
    assert len(frame) <= 576 * 2 + 256


def test_requests_round_trip_with_every_optional_block() -> None:
    req = hidden_frame(
        n=3,
        sampling=SamplingParams(
            temperature=0.7,
            top_k=40,
            top_p=0.9,
            min_p=0.05,
            repeat_penalty=1.1,
            repeat_last_n=32,
            seed=2**63 + 5,
        ),
        history=[1, 2, 3],
        want_logits=True,
        f16_out=True,
        chain=[ChainHop("http://127.0.0.1:9/x", b"tok")],
    )
    out = decode_request(encode_request(req))
    assert out.sampling == wire_exact(req.sampling)
    assert out.history == [1, 2, 3] and out.want_logits and out.f16_out
    assert out.chain == req.chain
    assert np.array_equal(out.hidden(), np.frombuffer(req.payload, np.float16).reshape(3, 576))
    assert (out.step, out.pos_start, out.token) == (7, 3, b"t" * 160)


def test_truncated_frames_are_rejected_at_every_cut() -> None:
    frame = encode_request(hidden_frame(history=[5, 6]))
    for cut in range(0, len(frame), 37):
        with pytest.raises(FrameError) as e:
            decode_request(frame[:cut])
        assert e.value.status == 400


def test_wrong_magic_and_version_are_named() -> None:
    frame = bytearray(encode_request(hidden_frame()))
    with pytest.raises(FrameError, match="bad magic"):
        decode_request(b"XXXX" + bytes(frame[4:]))
    frame[4:6] = struct.pack("<H", 9)
    with pytest.raises(FrameError, match="version 9"):
        decode_request(bytes(frame))


def test_oversized_token_count_is_refused_before_reading_the_payload() -> None:
    head = REQ_HEADER.pack(
        b"GSWP",
        PROTOCOL_VERSION,
        int(Op.FORWARD),
        0,
        SID,
        1,
        0,
        MAX_TOKENS_PER_FRAME + 1,
        int(Kind.F32),
        0,
        576,
        4 * 576 * (MAX_TOKENS_PER_FRAME + 1),
    )
    with pytest.raises(FrameError, match="exceeds the per-frame limit") as e:
        decode_request(head)
    assert e.value.status == 413


def test_payload_size_must_match_the_declared_shape() -> None:
    req = hidden_frame()
    req.payload = bytes(req.payload)[:-2]
    with pytest.raises(FrameError, match="payload is"):
        decode_request(encode_request(req))


def test_trailing_garbage_and_bad_sampling_are_rejected() -> None:
    with pytest.raises(FrameError, match="trailing"):
        decode_request(encode_request(hidden_frame()) + b"\0")
    with pytest.raises(FrameError, match="sampling parameters"):
        decode_request(encode_request(hidden_frame(sampling=SamplingParams(top_p=3.0))))


def test_chain_urls_must_be_http() -> None:
    with pytest.raises(FrameError, match="http"):
        decode_request(encode_request(hidden_frame(chain=[ChainHop("file:///etc/passwd", b"")])))


def test_responses_round_trip_and_chain_timings_prepend() -> None:
    resp = Response(step=4, kind=Kind.TOKEN, session_len=10, token=42, logprob=-0.5)
    raw = with_prepended_timing(encode_response(resp), Timing(100, 120))
    raw = with_prepended_timing(raw, Timing(7, 9))
    out = decode_response(raw)
    assert (out.token, out.session_len, out.step) == (42, 10, 4)
    assert out.logprob == pytest.approx(-0.5)
    assert [(t.compute_us, t.handler_us) for t in out.timings] == [(7, 9), (100, 120)]


@pytest.mark.parametrize(
    "url",
    [
        "http://" + "a" * 64 + ".x/",
        "http://h:99999/",
        "http://u:p@h/",
        "http://h/?q=1",
        "http://[::1/",
        "http://h_h/",
    ],
)
def test_malformed_chain_urls_are_frame_errors_not_library_exceptions(url: str) -> None:
    with pytest.raises(FrameError) as e:
        decode_request(encode_request(hidden_frame(chain=[ChainHop(url, b"")])))
    assert e.value.status == 400


def test_a_step_past_2_62_is_refused() -> None:
    with pytest.raises(FrameError, match="step"):
        decode_request(encode_request(dataclasses.replace(hidden_frame(), step=2**64 - 1)))


def test_the_header_alone_names_the_token_and_the_frame_length() -> None:
    frame = encode_request(hidden_frame())
    session, token, promised = peek_request(frame[: REQ_HEADER.size + 160])
    assert (session, token) == (SID, b"t" * 160) and promised == len(frame)
    with pytest.raises(FrameError):
        peek_request(frame[: REQ_HEADER.size + 10])


def test_responses_with_an_unknown_kind_too_many_timings_or_trailing_bytes_are_refused() -> None:
    good = encode_response(Response(step=1, kind=Kind.TOKEN, token=3))
    bad_kind = bytearray(good)
    bad_kind[7] = 99
    many = bytearray(good)
    many[RESP_HEADER.size - 1] = 200
    for raw in (bytes(bad_kind), bytes(many) + b"\0" * 1600, good + b"x"):
        with pytest.raises(FrameError):
            decode_response(raw)


def test_a_relayed_answer_is_checked_as_whole_as_a_decoded_one() -> None:
    """A chain hop passes its next hop's answer on as it came (response_step, then its own timing in
    front): every frame decode_response refuses, response_step refuses too, and a good one keeps its
    step and payload through the relay."""
    hidden = np.arange(6, dtype=np.float32).reshape(2, 3)
    good = encode_response(
        Response(step=9, kind=Kind.F32, session_len=5, n_tokens=2, dim=3, payload=hidden.tobytes())
    )
    assert response_step(good) == 9
    relayed = decode_response(with_prepended_timing(good, Timing(1, 2)))
    assert relayed.step == 9 and np.array_equal(relayed.hidden(), hidden)
    bad_kind = bytearray(good)
    bad_kind[7] = 99
    many = bytearray(good)
    many[RESP_HEADER.size - 1] = 200
    ids = bytearray(good)
    ids[7] = int(Kind.IDS)
    cuts = [good[:n] for n in (0, RESP_HEADER.size - 1, RESP_HEADER.size, len(good) - 1)]
    for raw in (bytes(bad_kind), bytes(many) + b"\0" * 1600, bytes(ids), good + b"x", *cuts):
        with pytest.raises(FrameError):
            decode_response(raw)
        with pytest.raises(FrameError):
            response_step(raw)
