"""Piece arithmetic and the web-seed policy, without libtorrent."""

from __future__ import annotations

import pytest

from agent.artifacts.pieces import (
    KIB,
    PRIORITY_WANT,
    fit_piece_size,
    missing_available,
    pieces_bytes,
    pieces_for_ranges,
    priorities,
    web_seed_needed,
)

SMOLLM2_SIZE = 98_362_432
SMOLLM2_LAYER = 2_216_448


def test_a_smollm2_layer_spans_eight_or_more_256k_pieces() -> None:
    assert fit_piece_size(SMOLLM2_SIZE, SMOLLM2_LAYER) == 256 * KIB
    assert SMOLLM2_LAYER / (256 * KIB) >= 8


def test_piece_size_without_layer_size_aims_at_about_a_thousand_pieces() -> None:
    assert fit_piece_size(SMOLLM2_SIZE) == 128 * KIB
    assert fit_piece_size(1000) == 16 * KIB
    assert fit_piece_size(400 * 10**9) == 16 * KIB * KIB


def test_piece_size_is_clamped_to_block_size_and_16_mib() -> None:
    assert fit_piece_size(10**6, 1000) == 16 * KIB
    assert fit_piece_size(10**12, 10**10) == 16 * KIB * KIB
    with pytest.raises(ValueError):
        fit_piece_size(0)


def test_ranges_map_to_every_piece_they_touch_and_no_other() -> None:
    assert pieces_for_ranges([(0, 1)], 100, 1000) == {0}
    assert pieces_for_ranges([(99, 101)], 100, 1000) == {0, 1}
    assert pieces_for_ranges([(100, 200)], 100, 1000) == {1}
    assert pieces_for_ranges([(150, 150)], 100, 1000) == set()
    assert pieces_for_ranges([(0, 50), (950, 1000)], 100, 1000) == {0, 9}
    assert pieces_for_ranges([(900, 950)], 100, 950) == {9}


def test_a_range_outside_the_file_is_an_error() -> None:
    with pytest.raises(ValueError, match="outside"):
        pieces_for_ranges([(0, 1001)], 100, 1000)
    with pytest.raises(ValueError, match="outside"):
        pieces_for_ranges([(5, 3)], 100, 1000)


def test_every_unwanted_piece_gets_priority_zero() -> None:
    prio = priorities({1, 3}, 5)
    assert prio == [0, PRIORITY_WANT, 0, PRIORITY_WANT, 0]
    with pytest.raises(ValueError):
        priorities({5}, 5)


def test_pieces_bytes_counts_the_short_last_piece() -> None:
    assert pieces_bytes({0, 9}, 100, 950) == 150


def test_over_download_of_a_run_is_under_two_pieces() -> None:
    plen, total = 256 * KIB, SMOLLM2_SIZE
    start, end = 1_785_664 + 12_345, 1_785_664 + 12_345 + SMOLLM2_LAYER
    got = pieces_bytes(pieces_for_ranges([(start, end)], plen, total), plen, total)
    assert end - start <= got < end - start + 2 * plen


def test_missing_available_counts_only_wanted_pieces_a_peer_has_and_we_lack() -> None:
    assert missing_available({0, 1, 2}, [True, False, False, False], [1, 1, 0, 5]) == 1


_BASE = dict(
    elapsed_s=0.0,
    has_trackers=True,
    arrival_rank=None,
    connected_peers=0,
    peers_still_downloading=0,
    seconds_since_progress=0.0,
    missing_available_from_peers=0,
    peer_wait_s=2.0,
    stall_s=1.0,
)


def _needed(policy: str = "fallback", **kw: object) -> bool:
    return web_seed_needed(policy, **{**_BASE, **kw})  # type: ignore[arg-type]


def test_always_and_never_policies_ignore_the_swarm() -> None:
    assert _needed("always", connected_peers=9, missing_available_from_peers=9)
    assert not _needed("never", has_trackers=False)
    with pytest.raises(ValueError):
        _needed("sometimes")


def test_fallback_uses_the_web_seed_at_once_without_a_tracker_or_when_first_in_the_swarm() -> None:
    assert _needed(has_trackers=False)
    assert _needed(arrival_rank=0, connected_peers=2)


def test_fallback_waits_a_while_for_the_tracker_and_for_peers_to_connect() -> None:
    assert not _needed(arrival_rank=None, elapsed_s=1.0)
    assert _needed(arrival_rank=None, elapsed_s=2.0)
    assert not _needed(arrival_rank=2, connected_peers=0, elapsed_s=1.0)
    assert _needed(arrival_rank=2, connected_peers=0, elapsed_s=2.0)


def test_fallback_waits_while_peers_make_progress_or_still_have_pieces_for_us() -> None:
    kw = dict(arrival_rank=1, connected_peers=1, peers_still_downloading=1)
    assert not _needed(**kw, seconds_since_progress=2.5)
    assert not _needed(**kw, seconds_since_progress=3.5, missing_available_from_peers=3)
    assert _needed(**kw, seconds_since_progress=3.5, missing_available_from_peers=0)
    assert _needed(**kw, seconds_since_progress=12.0, missing_available_from_peers=3)


def test_later_arrivals_are_more_patient_so_only_one_agent_at_a_time_uses_the_origin() -> None:
    def patience(rank: int) -> float:
        return next(
            t / 10
            for t in range(100)
            if _needed(
                arrival_rank=rank, connected_peers=2, peers_still_downloading=1, seconds_since_progress=t / 10
            )
        )

    assert [patience(r) for r in (1, 2, 3, 9)] == [3.0, 5.0, 7.0, 7.0]


def test_fallback_goes_to_the_origin_at_once_when_no_peer_can_still_bring_what_we_lack() -> None:
    kw = dict(arrival_rank=2, connected_peers=2, seconds_since_progress=0.0)
    assert _needed(**kw, peers_still_downloading=0, missing_available_from_peers=0)
    assert not _needed(**kw, peers_still_downloading=0, missing_available_from_peers=4)
    assert not _needed(**kw, peers_still_downloading=1, missing_available_from_peers=0)
