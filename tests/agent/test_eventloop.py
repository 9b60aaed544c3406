"""The agent's event loop (agent/eventloop.py): uvloop where installed, else asyncio's."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import urllib.request

import pytest

from agent.eventloop import loop_name, run_loop, running_loop_name


def test_uvloop_is_the_default_where_it_is_installed() -> None:
    assert importlib.util.find_spec("uvloop") is not None  # requirements.txt pins it
    assert loop_name() == "uvloop"
    assert run_loop(_which()) == "uvloop"


def test_an_agent_without_uvloop_runs_on_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a)
    )
    assert loop_name() == "asyncio"
    assert run_loop(_which()) == "asyncio"


def test_a_served_hop_runs_on_uvloop_and_says_so(serve_factory) -> None:  # noqa: ANN001
    hop = serve_factory("0:10", backend="native")
    with urllib.request.urlopen(hop.url + "/v1/health", timeout=10) as r:
        assert json.loads(r.read())["event_loop"] == "uvloop"


async def _which() -> str:
    await asyncio.sleep(0)
    return running_loop_name()
