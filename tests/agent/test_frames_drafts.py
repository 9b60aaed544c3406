"""MTP drafts on the wire (docs/protocol.md): an OPEN asks for them in its `dim`, a sampled-token answer
carries them after its payload (its `dim`), bounded by what one verification takes; where the last hop
starts them after a verification; the client's MtpDrafter proposes them for the step they follow."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest

from agent.backends.base import ForwardResult
from agent.client.drafts import MtpDrafter
from agent.node.steps import draft_start, local_answer
from agent.wire.frames import (
    MAX_DRAFT_TOKENS,
    FrameError,
    Kind,
    Op,
    Request,
    Response,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)

SESSION = b"s" * 16


def test_an_open_asks_for_at_most_a_verifications_worth_of_drafts() -> None:
    frame = encode_request(Request(op=Op.OPEN, session=SESSION, pos_start=64, dim=MAX_DRAFT_TOKENS))
    assert decode_request(frame).mtp_draft == MAX_DRAFT_TOKENS
    assert decode_request(encode_request(Request(op=Op.OPEN, session=SESSION))).mtp_draft == 0
    with pytest.raises(FrameError, match="at most"):
        decode_request(encode_request(Request(op=Op.OPEN, session=SESSION, dim=MAX_DRAFT_TOKENS + 1)))


def test_sampled_token_answers_carry_their_drafts() -> None:
    one = Response(step=3, kind=Kind.TOKEN, token=7, dim=3, payload=np.array([4, 5, 6], "<i4").tobytes())
    got = decode_response(encode_response(one))
    assert (got.token, got.drafts()) == (7, [4, 5, 6])
    ids, lps = np.array([1, 2], "<i4"), np.array([-0.5, -1.5], "<f4")
    many = Response(
        step=4,
        kind=Kind.TOKENS,
        n_tokens=2,
        dim=2,
        token=2,
        payload=ids.tobytes() + lps.tobytes() + np.array([8, 9], "<i4").tobytes(),
    )
    got = decode_response(encode_response(many))
    assert got.tokens() == ([1, 2], [-0.5, -1.5])
    assert got.drafts() == [8, 9]
    # an answer without drafts (dim 0, every earlier answer) reads as none
    assert decode_response(encode_response(Response(step=5, kind=Kind.TOKEN, token=1))).drafts() == []


def test_an_answer_with_more_drafts_than_a_verification_takes_is_refused() -> None:
    n = MAX_DRAFT_TOKENS + 1
    bad = Response(step=3, kind=Kind.TOKEN, token=7, dim=n, payload=np.zeros(n, "<i4").tobytes())
    with pytest.raises(FrameError, match="at most"):
        decode_response(encode_response(bad))
    short = encode_response(Response(step=3, kind=Kind.TOKEN, token=7, dim=2, payload=b"\0" * 8))
    with pytest.raises(FrameError):
        decode_response(short[:-4])


class _State:
    """The part of SessionState draft_start reads."""

    def __init__(self, history: list[int]) -> None:
        self.history = history


def test_drafts_start_after_the_token_sampled_or_where_a_verification_stopped_standing() -> None:
    plain = Request(op=Op.FORWARD, session=SESSION, pos_start=10, n_tokens=1)
    s = cast(Any, _State([0] * 10 + [42]))
    assert draft_start(plain, s, ForwardResult(token=99), None) == (11, 99)
    # sent [t, d1, d2, d3] at 10; the route sampled s0..s3: d1 = s0 and d2 = s1 stood, d3 != s2
    verify = Request(op=Op.FORWARD, session=SESSION, pos_start=10, n_tokens=4)
    s = cast(Any, _State([0] * 10 + [42, 5, 6, 7]))
    sampled = ([5, 6, 8, 3], [0.0] * 4)
    assert draft_start(verify, s, ForwardResult(token=3), sampled) == (13, 8)
    every = ([5, 6, 7, 3], [0.0] * 4)  # every draft stood: after the last position, from its sample
    assert draft_start(verify, s, ForwardResult(token=3), every) == (14, 3)


def test_the_last_hops_answer_carries_the_drafts_unless_it_answers_logits() -> None:
    req = Request(op=Op.FORWARD, session=SESSION, step=2, pos_start=10, n_tokens=1)
    res = ForwardResult(token=99, logprob=-0.25, logits=np.zeros((1, 4), np.float32))
    got = decode_response(local_answer(req, res, 11, None, [1, 2, 3]))
    assert (got.kind, got.token, got.drafts()) == (Kind.TOKEN, 99, [1, 2, 3])
    sampled = ([5, 6], [-0.1, -0.2])
    got = decode_response(local_answer(req, res, 12, sampled, [4]))
    assert (got.kind, got.tokens()[0], got.drafts()) == (Kind.TOKENS, [5, 6], [4])
    req.want_logits = True
    got = decode_response(local_answer(req, res, 11, None, [1, 2, 3]))
    assert (got.kind, got.drafts()) == (Kind.LOGITS, [])


def test_the_mtp_drafter_proposes_the_drafts_for_the_context_they_follow() -> None:
    d = MtpDrafter()
    assert d.propose([1, 2, 3], 4) == []
    d.offer(3, [7, 8, 9])
    assert d.propose([1, 2, 3], 2) == [7, 8]
    assert d.propose([1, 2, 3], 0) == []
    assert d.propose([1, 2, 3, 4], 2) == []  # another context: they follow another token
    d.offer(4, [])
    assert d.propose([1, 2, 3, 4], 2) == [] and d.offered == 1
