"""The placement simulator's decode prediction against a real 2-hop route with 5 ms injected per link."""

from __future__ import annotations

import asyncio

import pytest

from agent.backends import available_backends

pytestmark = pytest.mark.slow


def test_a_two_hop_route_with_5_ms_links_decodes_within_20_percent_of_the_prediction(
    model_path: str,
    manifest,  # noqa: ANN001
) -> None:
    from bench.simulator import run

    backend = "native" if "native" in available_backends() else "torch"
    out = asyncio.run(run(manifest, model_path, backend, 1, tokens=32, rounds=1, topologies=((2, 5.0),)))
    assert out["placement_2hop_5ms"] == "0:15 15:30"  # the real planner on two equal nodes
    assert out["simulator_topologies_predicted"] == 1
    assert out["rel_error_2hop_5ms"] <= 0.20, out
