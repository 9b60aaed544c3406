"""Property tests of the data-plane frame codec: round trips, and mutated frames fail only as FrameError."""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from agent.wire.frames import (
    MAX_FRAME_BYTES,
    MAX_STEP,
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
)
from agent.wire.sampling import SamplingParams
from tests.agent._fuzz import FUZZ, mutated

sampling = st.builds(
    SamplingParams,
    temperature=st.floats(0, 4, width=32),
    top_k=st.integers(0, 1000),
    top_p=st.floats(0, 1, width=32),
    min_p=st.floats(0, 1, width=32),
    repeat_penalty=st.floats(0.5, 2, width=32),
    repeat_last_n=st.integers(-1, 512),
    seed=st.integers(0, 2**63),
)
hops = st.lists(
    st.builds(
        ChainHop,
        url=st.sampled_from(["http://127.0.0.1:8001", "https://node-b.example:443/x"]),
        token=st.binary(max_size=160),
    ),
    max_size=3,
)


@st.composite
def requests(draw: st.DrawFn) -> Request:
    kind = draw(st.sampled_from([Kind.NONE, Kind.IDS, Kind.F16, Kind.F32]))
    n = 0 if kind == Kind.NONE else draw(st.integers(1, 6))
    dim = {Kind.NONE: 0, Kind.IDS: 0}.get(kind, draw(st.integers(1, 8)))
    if kind == Kind.IDS:
        payload = np.asarray(
            draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), "<i4"
        ).tobytes()
    elif kind == Kind.NONE:
        payload = b""
    else:
        width = 2 if kind == Kind.F16 else 4
        payload = draw(st.binary(min_size=n * dim * width, max_size=n * dim * width))
    chain = draw(hops)
    return Request(
        op=draw(st.sampled_from(list(Op))),
        session=draw(st.binary(min_size=16, max_size=16)),
        step=draw(st.integers(0, MAX_STEP)),
        pos_start=draw(st.integers(0, 2**31)),
        n_tokens=n,
        kind=kind,
        dim=dim,
        token=draw(st.binary(max_size=200)),
        sampling=draw(st.none() | sampling),
        history=draw(st.none() | st.lists(st.integers(0, 2**31 - 1), max_size=20)),
        want_logits=draw(st.booleans()),
        f16_out=draw(st.booleans()),
        chain=chain,
        chain_cached=not chain and draw(st.booleans()),
        payload=payload,
    )


@FUZZ
@given(requests())
def test_every_valid_request_decodes_to_what_was_encoded(req: Request) -> None:
    got = decode_request(encode_request(req))
    assert (got.op, got.session, got.step, got.pos_start, got.n_tokens, got.kind, got.dim) == (
        req.op,
        req.session,
        req.step,
        req.pos_start,
        req.n_tokens,
        req.kind,
        req.dim,
    )
    assert got.token == req.token and got.chain == req.chain and got.history == req.history
    assert (got.want_logits, got.f16_out, got.chain_cached) == (
        req.want_logits,
        req.f16_out,
        req.chain_cached,
    )
    assert bytes(got.payload) == bytes(req.payload)
    if req.sampling is not None:
        assert got.sampling is not None and got.sampling.seed == req.sampling.seed


@FUZZ
@given(st.data())
def test_a_mutated_request_is_refused_with_a_frame_error_or_decodes_within_limits(
    data: st.DataObject,
) -> None:
    raw = data.draw(mutated(encode_request(data.draw(requests()))))
    for decode in (decode_request, peek_request):
        try:
            out = decode(raw)
        except FrameError as e:
            assert e.status in (400, 413)
            continue
        if isinstance(out, Request):
            assert len(out.payload) <= MAX_FRAME_BYTES and len(out.chain) <= 16


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_never_crash_the_request_decoder(raw: bytes) -> None:
    with contextlib.suppress(FrameError):
        decode_request(raw)


@st.composite
def responses(draw: st.DrawFn) -> Response:
    kind = draw(st.sampled_from([Kind.NONE, Kind.F16, Kind.F32, Kind.TOKEN, Kind.LOGITS]))
    n = draw(st.integers(1, 4)) if kind in (Kind.F16, Kind.F32, Kind.LOGITS) else 0
    dim = draw(st.integers(1, 8)) if n else 0
    width = 2 if kind == Kind.F16 else 4
    return Response(
        step=draw(st.integers(0, 2**63)),
        kind=kind,
        session_len=draw(st.integers(0, 2**31)),
        n_tokens=n,
        dim=dim,
        token=draw(st.integers(-1, 2**31 - 1)),
        logprob=0.0,
        timings=[Timing(1, 2)] * draw(st.integers(0, 3)),
        payload=draw(st.binary(min_size=n * dim * width, max_size=n * dim * width)),
    )


@FUZZ
@given(st.data())
def test_a_mutated_response_is_refused_with_a_frame_error_or_decodes(data: st.DataObject) -> None:
    """What a route client reads from a hop: a broken hop must not raise anything but FrameError."""
    valid = encode_response(data.draw(responses()))
    assert decode_response(valid).kind in Kind
    raw = data.draw(mutated(valid))
    with contextlib.suppress(FrameError):
        decode_response(raw)
