"""The placement simulator's decode prediction against a real 2-hop route with 5 ms injected per link:
bench/simulator.py run as a user runs it, on one topology, its JSON read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.backends import available_backends

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_a_two_hop_route_with_5_ms_links_decodes_within_20_percent_of_the_prediction(model_path: str) -> None:
    backend = "native" if "native" in available_backends() else "torch"
    cmd = [sys.executable, "bench/simulator.py", "--backend", backend, "--threads", "1"]
    cmd += ["--tokens", "32", "--rounds", "1", "--topologies", "2:5"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["placement_2hop_5ms"] == "0:15 15:30"  # the real planner on two equal nodes
    assert out["simulator_topologies_predicted"] == 1
    assert out["rel_error_2hop_5ms"] <= 0.20, out
