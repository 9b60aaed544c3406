"""Speculative decoding's pure parts: prompt-lookup drafts, acceptance, the figures, and the frames."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from agent.client.spec import (
    MAX_DRAFT,
    MIN_GAIN,
    PROBE_EVERY,
    NgramDrafter,
    SpecStats,
    accepted,
    draft_length,
    expected_tokens,
    sized_draft,
)
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


def test_expected_tokens_sum_the_chance_of_each_draft_standing() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_drafts_grow_with_the_round_trip_and_the_acceptance_and_vanish_on_a_fast_link() -> None:
    # 150 ms round trips (3 hops, 25 ms each way), 14 ms of compute per position
    slow_link = [draft_length(a, 150.0, 14.0, 8) for a in (0.1, 0.3, 0.6, 0.9)]
    assert slow_link == sorted(slow_link) and slow_link[0] <= 1 and slow_link[-1] >= 5
    # on loopback a round trip is a millisecond: a draft costs more compute than the trip it saves,
    # and one that stands for sure saves too little to leave the lane for
    assert draft_length(0.3, 1.0, 14.0, 8) == 0
    assert draft_length(1.0, 1.0, 14.0, 8) == 0
    assert draft_length(1.0, 5.0, 14.0, 8) >= 1
    # a drafter that computes (a draft model) makes drafts dearer
    assert draft_length(0.6, 150.0, 14.0, 8, draft_ms=30.0) < draft_length(0.6, 150.0, 14.0, 8)
    assert draft_length(0.9, 150.0, 14.0, 3) == 3  # never past the cap


def test_the_acceptance_estimate_follows_the_runs_from_a_prior() -> None:
    st = SpecStats()
    assert st.acceptance_rate() == 0.5
    for _ in range(20):
        st.record(4, 1)  # one stands, the next does not
    assert st.acceptance_rate() == pytest.approx((20 + 1) / (20 + 20 + 2))
    st.timed(5, 200.0, 50.0)
    assert (st.round_trip_ms, st.row_ms) == (150.0, 10.0)
    st.timed(1, 160.0, 10.0)
    assert st.round_trip_ms == pytest.approx(150.0) and st.row_ms == pytest.approx(10.0)


def test_the_round_trip_estimate_starts_from_the_fastest_first_step_and_shrugs_off_a_stall() -> None:
    st = SpecStats()
    st.timed(1, 40.0, 10.0)  # the first step pays for connections and the lane's admission
    st.timed(1, 12.0, 10.0)
    st.timed(1, 13.0, 10.0)
    assert st.round_trip_ms == 2.0
    st.timed(1, 110.0, 10.0)  # one step held up by something else on the machine
    assert st.round_trip_ms == pytest.approx(2.0 + 0.1 * 98.0)
    st.timed(1, 12.0, 10.0)
    assert st.round_trip_ms == pytest.approx(11.8 + 0.2 * (2.0 - 11.8))


def test_a_draft_models_catch_up_with_the_prompt_is_not_priced_per_drafted_token() -> None:
    st = SpecStats()
    st.drafting(4, 900.0)  # the first draft: the draft model evaluated the whole prompt first
    assert st.draft_ms == 0.0
    st.drafting(4, 40.0)
    st.drafting(0, 500.0)  # nothing drafted: nothing learnt
    assert st.draft_ms == 10.0


def test_a_verification_that_costs_more_than_a_plain_step_is_priced_as_it_costs() -> None:
    st = SpecStats()
    for _ in range(3):
        st.timed(1, 12.0, 8.0)  # plain steps on the lanes: a 4 ms round trip
    assert draft_length(0.95, st.round_trip_ms, st.row_ms, 8) >= 1  # priced as a plain step, drafts pay
    st.timed(3, 40.0, 24.0, verify=True)  # off the lanes: 16 ms beyond its compute
    st.timed(1, 18.0, 8.0)  # and back onto them: 6 ms more than a plain step
    assert st.round_trip_ms == 4.0  # neither moved the link's round trip
    assert st.verify_round_trip_ms == 16.0 + 6.0
    assert draft_length(0.95, st.round_trip_ms, st.row_ms, 8, 0.0, st.verify_round_trip_ms) == 0
    # over a slow link the same extra is small against the round trip: drafts still pay
    assert draft_length(0.9, 150.0, 8.0, 8, 0.0, 160.0) >= 5


def test_verifications_back_to_back_are_priced_as_they_cost_without_waiting_for_a_plain_step() -> None:
    # a copied passage drafts at every step: no plain step comes after a verification to close it
    st = SpecStats()
    for _ in range(3):
        st.timed(1, 5.0, 3.0)  # plain steps on the lanes: a 2 ms round trip
    assert draft_length(0.95, st.round_trip_ms, st.row_ms, 8, 0.0, st.verify_round_trip_ms) >= 1
    st.timed(3, 17.0, 9.0, verify=True)  # off the lanes, rows one at a time: 8 ms beyond the compute
    st.timed(3, 17.0, 9.0, verify=True)  # the next one, back to back
    assert st.verify_round_trip_ms == 8.0
    assert draft_length(0.95, st.round_trip_ms, st.row_ms, 8, 0.0, st.verify_round_trip_ms) == 0


def test_a_probe_that_stands_starts_no_run_of_probes() -> None:
    st = SpecStats()
    for _ in range(3):
        st.timed(1, 12.0, 9.0)  # a 3 ms round trip, 9 ms rows: drafts pay only if they always stand
    st.record(1, 0)  # an early rejection holds the acceptance estimate down
    assert draft_length(st.acceptance_rate(), 3.0, 9.0, 8) == 0 < draft_length(1.0, 3.0, 9.0, 8)
    for _ in range(PROBE_EVERY - 1):
        st.plain()
        assert sized_draft(st, 8) == 0
    st.plain()
    assert sized_draft(st, 8) == 1  # PROBE_EVERY plain steps in a row: one draft
    st.record(1, 1)  # it stood
    assert sized_draft(st, 8) == 0  # the next step goes plain, not another probe
    assert sized_draft(SpecStats(), 8) == 0  # an answer's first steps measure the route


def test_no_probe_on_loopback_before_a_verification_is_measured_but_drafts_over_a_slow_link() -> None:
    def after_plain_steps(wall_ms: float, compute_ms: float) -> SpecStats:
        st = SpecStats()
        for _ in range(PROBE_EVERY + 3):
            st.timed(1, wall_ms, compute_ms)
            st.plain()
        return st

    # loopback: a 1.7 ms round trip, 10 ms rows; a verification priced as a plain step would probe
    assert draft_length(1.0, 1.7, 10.0, 8) > 0
    assert sized_draft(after_plain_steps(11.7, 10.0), 8) == 0
    assert sized_draft(after_plain_steps(160.0, 10.0), 8) >= 1  # 25 ms links: 150 ms round trips


def _draft_length_by_every_k(
    a: float, rt: float, row: float, k_max: int, per: float, vrt: float | None
) -> int:
    """draft_length's answer by computing every k's rate (its search stops at the rate's first fall)."""
    vrt = rt if vrt is None else vrt
    rates = [expected_tokens(a, 0) / (max(rt, 0.0) + max(row, 1e-3))]
    rates += [
        expected_tokens(a, k) / (max(vrt, 0.0) + (k + 1) * max(row, 1e-3) + k * max(per, 0.0))
        for k in range(1, k_max + 1)
    ]
    best = max(range(len(rates)), key=lambda k: (rates[k], -k))  # the first k of the highest rate
    return best if rates[best] >= MIN_GAIN * rates[0] else 0


def test_the_draft_length_search_that_stops_at_the_rates_first_fall_finds_the_best_length() -> None:
    grid = itertools.product(
        (0.0, 0.05, 0.3, 0.6, 0.9, 0.99, 1.0),  # acceptance
        (0.5, 2.0, 25.0, 150.0),  # plain round trip, ms
        (0.001, 1.0, 8.0, 14.0),  # one row's compute, ms
        (0, 1, 3, 8, 15),  # most drafts
        (0.0, 2.0, 30.0),  # drafting, ms a token
        (None, 0.5, 40.0, 300.0),  # a verification's round trip, ms
    )
    for a, rt, row, k_max, per, vrt in grid:
        want = _draft_length_by_every_k(a, rt, row, k_max, per, vrt)
        assert draft_length(a, rt, row, k_max, per, vrt) == want, (a, rt, row, k_max, per, vrt)
