"""`agent serve` lets idle OpenMP workers sleep soon: libgomp reads its spin count when ggml loads it."""

from __future__ import annotations

import re

import pytest

from agent.cli import IDLE_THREADS_ENV, sleep_idle_threads


def test_serving_caps_the_spin_count_unless_the_operator_chose_a_policy() -> None:
    env: dict[str, str] = {}
    assert sleep_idle_threads(env) == IDLE_THREADS_ENV and env["GOMP_SPINCOUNT"] == "10000"
    # never the passive policy: it puts every thread to sleep at every op barrier of a graph
    assert "OMP_WAIT_POLICY" not in env
    chosen = {"GOMP_SPINCOUNT": "300000"}
    assert sleep_idle_threads(chosen) == {} and chosen == {"GOMP_SPINCOUNT": "300000"}
    active = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert sleep_idle_threads(active) == {} and active == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_a_native_hop_loads_libgomp_with_the_capped_spin_count(serve_factory, monkeypatch) -> None:  # noqa: ANN001
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
    assert re.search(r"GOMP_SPINCOUNT = '10000'", text), text[-2000:]


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("GGSWARM_BUSY_CHUNK_TOKENS", "0", "GGSWARM_BUSY_CHUNK_TOKENS=0 is outside 1..512"),
        ("GGSWARM_PREFILL_BUDGET", "20", "GGSWARM_PREFILL_BUDGET=20 is outside 0.05..8.0"),
        ("GGSWARM_PREFILL_BUDGET", "much", "GGSWARM_PREFILL_BUDGET='much' is not a number"),
        ("GGSWARM_BARRIER_SPIN", "lots", "GGSWARM_BARRIER_SPIN='lots' is not an integer"),
        ("GGSWARM_BARRIER_SPIN", "-1", "GGSWARM_BARRIER_SPIN=-1 is outside 0..100000000"),
        ("GGSWARM_BARRIER_SPIN", "100000001", "GGSWARM_BARRIER_SPIN=100000001 is outside 0..100000000"),
        ("GGSWARM_ONE_THREAD_BYTES", "-1", "GGSWARM_ONE_THREAD_BYTES=-1 is outside 0..1099511627776"),
        ("GGSWARM_ONE_THREAD_BYTES", "2M", "GGSWARM_ONE_THREAD_BYTES='2M' is not an integer"),
    ],
)
def test_serving_with_a_bad_setting_fails_at_once_with_its_name(
    monkeypatch, capsys, name: str, value: str, message: str
) -> None:  # noqa: ANN001
    from agent.cli import main

    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # serve would set it in os.environ otherwise
    monkeypatch.setenv(name, value)
    argv = ["serve", "--model", "pkg:smollm2", "--port", "1", "--public-key", "unused"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_barrier_settings_in_range_or_unset_are_accepted() -> None:
    from agent.backends.libggswarm import check_barrier_env

    check_barrier_env({})
    check_barrier_env({"GGSWARM_BARRIER_SPIN": "0", "GGSWARM_BARRIER_YIELD": " 20 "})
    with pytest.raises(ValueError, match="GGSWARM_BARRIER_YIELD='x' is not an integer"):
        check_barrier_env({"GGSWARM_BARRIER_YIELD": "x"})
