"""Route choice over ready shards: a pure function."""

from __future__ import annotations

import pytest

from agent.wire.ids import NodeId
from webapp.routing.chooser import NoRoute, ShardCandidate, choose_route


def shard(node: str, a: int, b: int, speed: float = 1.0, sessions: int = 0) -> ShardCandidate:
    return ShardCandidate(NodeId(node), f"http://{node}", a, b, speed, sessions)


def test_a_single_chain_is_chosen_in_layer_order() -> None:
    route = choose_route([shard("b", 15, 30), shard("a", 0, 15)], 30)
    assert [(s.node_id, s.layer_start, s.layer_end) for s in route] == [("a", 0, 15), ("b", 15, 30)]


def test_the_faster_replica_wins() -> None:
    route = choose_route([shard("slow", 0, 30, speed=1.0), shard("fast", 0, 30, speed=4.0)], 30)
    assert [s.node_id for s in route] == ["fast"]


def test_a_loaded_replica_loses_to_an_idle_equal_one() -> None:
    route = choose_route([shard("busy", 0, 30, sessions=20), shard("idle", 0, 30)], 30)
    assert [s.node_id for s in route] == ["idle"]


def test_fewer_hops_win_when_compute_is_equal() -> None:
    route = choose_route([shard("a", 0, 15), shard("b", 15, 30), shard("c", 0, 30)], 30)
    assert [s.node_id for s in route] == ["c"]


def test_chains_may_mix_replicas_at_matching_boundaries() -> None:
    shards = [shard("a", 0, 10, speed=5), shard("b", 0, 10), shard("c", 10, 30), shard("d", 10, 30, speed=5)]
    assert [s.node_id for s in choose_route(shards, 30)] == ["a", "d"]


def test_a_gap_raises_no_route_naming_the_missing_layer() -> None:
    with pytest.raises(NoRoute, match="no ready shard starts at layer 10"):
        choose_route([shard("a", 0, 10), shard("b", 12, 30)], 30)


def test_no_shards_at_all_raises_no_route() -> None:
    with pytest.raises(NoRoute, match="layer 0"):
        choose_route([], 30)
