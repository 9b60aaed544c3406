"""`agent serve` lets idle OpenMP workers sleep: libgomp reads the wait policy when ggml loads it."""

from __future__ import annotations

import re

import pytest

from agent.cli import IDLE_THREADS_ENV, sleep_idle_threads


def test_serving_sets_the_passive_wait_policy_unless_the_operator_chose_one() -> None:
    env: dict[str, str] = {}
    assert sleep_idle_threads(env) == IDLE_THREADS_ENV and env["OMP_WAIT_POLICY"] == "PASSIVE"
    chosen = {"GOMP_SPINCOUNT": "10000"}
    assert sleep_idle_threads(chosen) == {} and chosen == {"GOMP_SPINCOUNT": "10000"}
    active = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert sleep_idle_threads(active) == {} and active["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_native_hop_loads_libgomp_with_a_spin_count_of_zero(serve_factory, monkeypatch) -> None:  # noqa: ANN001
    from agent.backends import libggswarm as native

    if not native.is_available():
        pytest.skip("native library not built (bash native/build.sh)")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_DISPLAY_ENV", "VERBOSE")  # libgomp prints what it read, once, at load
    hop = serve_factory("0:10", backend="native")
    text = hop.log.read_text()
    if "OPENMP DISPLAY ENVIRONMENT" not in text:
        pytest.skip("this ggml build does not use OpenMP (no libgomp loaded)")
    assert re.search(r"GOMP_SPINCOUNT = '0'", text), text[-2000:]
