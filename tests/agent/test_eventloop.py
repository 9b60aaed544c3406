"""The agent's event loop (agent/eventloop.py): uvloop where installed, the operator's choice otherwise."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import urllib.request

import pytest

from agent.eventloop import EVENT_LOOP_ENV, loop_name, run_loop, running_loop_name


def test_uvloop_is_the_default_where_it_is_installed() -> None:
    assert importlib.util.find_spec("uvloop") is not None  # requirements.txt pins it
    assert loop_name({}) == "uvloop"
    assert run_loop(_which()) == "uvloop"


def test_an_operator_can_keep_the_standard_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    assert loop_name({EVENT_LOOP_ENV: "asyncio"}) == "asyncio"
    monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
    assert run_loop(_which()) == "asyncio"


def test_an_agent_without_uvloop_runs_on_asyncio_unless_uvloop_was_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a)
    )
    assert loop_name({}) == "asyncio"
    with pytest.raises(ValueError, match="not installed"):
        loop_name({EVENT_LOOP_ENV: "uvloop"})


def test_an_unknown_loop_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="GGSWARM_EVENT_LOOP must be one of uvloop, asyncio, not 'trio'"):
        loop_name({EVENT_LOOP_ENV: "trio"})


def test_a_served_hop_runs_on_uvloop_and_says_so(serve_factory) -> None:  # noqa: ANN001
    hop = serve_factory("0:10", backend="native")
    with urllib.request.urlopen(hop.url + "/v1/health", timeout=10) as r:
        assert json.loads(r.read())["event_loop"] == "uvloop"


async def _which() -> str:
    await asyncio.sleep(0)
    return running_loop_name()
