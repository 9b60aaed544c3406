"""Speculative decoding's pure parts: prompt-lookup drafts, acceptance, the figures, and the frames."""

from __future__ import annotations

import numpy as np
import pytest

from agent.client.spec import MAX_DRAFT, NgramDrafter, SpecStats, accepted
from agent.wire.frames import (
    MAX_SAMPLE_ALL_TOKENS,
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


def test_prompt_lookup_proposes_what_followed_the_newest_match_of_the_longest_ngram() -> None:
    ctx = [1, 2, 3, 9, 9, 5, 2, 3, 4, 8, 7, 2, 3]
    # the 2-gram (2, 3) last occurred at 6..7 and was followed by 4, 8, 7
    assert NgramDrafter(max_ngram=2).propose(ctx, 3) == [4, 8, 7]
    # the 3-gram (5, 2, 3) matches at 0: what followed it there, not the 2-gram's newer match
    assert NgramDrafter(max_ngram=3).propose([5, 2, 3, 4, 2, 3, 1, 5, 2, 3], 2) == [4, 2]


def test_prompt_lookup_proposes_nothing_without_a_match_or_room() -> None:
    assert NgramDrafter().propose([1, 2, 3, 4], 4) == []
    assert NgramDrafter().propose([1, 2, 1, 2], 0) == []
    assert NgramDrafter().propose([7], 3) == []


def test_prompt_lookup_looks_back_only_over_its_window() -> None:
    ctx = [4, 5, 6] + [0] * 50 + [1, 4, 5]
    assert NgramDrafter(window=10).propose(ctx, 2) == []
    assert NgramDrafter(window=100).propose(ctx, 2) == [6, 0]


def test_acceptance_stops_at_the_first_draft_that_differs_from_the_sample() -> None:
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted([5, 6, 7], [1, 6, 7, 8]) == 0
    assert accepted([], [3]) == 0


def test_figures_count_tokens_per_round_trip() -> None:
    st = SpecStats()
    st.record(4, 4)  # 5 tokens in one round trip
    st.record(4, 0)  # 1 token
    st.plain_steps += 2  # 1 token each
    d = st.as_dict()
    assert d["acceptance"] == 0.5
    assert d["tokens_per_round_trip"] == (5 + 1 + 2) / 4
    assert SpecStats().as_dict()["tokens_per_round_trip"] == 0.0


def verify_frame(n: int, op: Op = Op.FORWARD) -> Request:
    ids = np.arange(n, dtype="<i4")
    return Request(
        op=op,
        session=b"s" * 16,
        step=3,
        pos_start=10,
        n_tokens=n,
        kind=Kind.IDS,
        sample_all=True,
        payload=ids.tobytes(),
    )


def test_a_verification_frame_round_trips_and_is_bounded() -> None:
    req = decode_request(encode_request(verify_frame(MAX_SAMPLE_ALL_TOKENS)))
    assert req.sample_all and req.n_tokens == MAX_SAMPLE_ALL_TOKENS
    assert MAX_DRAFT == MAX_SAMPLE_ALL_TOKENS - 1
    with pytest.raises(FrameError) as e:
        decode_request(encode_request(verify_frame(MAX_SAMPLE_ALL_TOKENS + 1)))
    assert e.value.status == 413
    with pytest.raises(FrameError):
        decode_request(encode_request(verify_frame(1, Op.TRUNCATE)))


def test_a_tokens_answer_carries_every_positions_token_and_logprob() -> None:
    ids = np.asarray([4, 5, 6], dtype="<i4").tobytes()
    lps = np.asarray([-0.5, -1.0, -2.0], dtype="<f4").tobytes()
    resp = Response(step=3, kind=Kind.TOKENS, n_tokens=3, token=6, logprob=-2.0, payload=ids + lps)
    got = decode_response(encode_response(resp))
    assert got.tokens() == ([4, 5, 6], [-0.5, -1.0, -2.0])
    bad = Response(step=3, kind=Kind.TOKENS, n_tokens=3, payload=ids)
    with pytest.raises(FrameError):
        decode_response(encode_response(bad))
