"""Issue 32: the agents the control plane's launchers start compute with the threads `agent serve` does.

`make up` (manage.py swarm_up) and the tests' and benches' control plane (webapp/devcluster.py) start
enrolled agents through agent/dev/cluster.py's `start_run`; they passed `--threads 1`, while the serve
hops bench/served.py measured ran the agent's default of 2: the product route decoded at 0.54x the
bench route on a 2-core machine, the loss being the hops' compute alone (the lane, chain mode and the
rest were the same). These check the command lines, parsed by the agent's own parser, without starting
anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent import defaults
from agent.cli import build_parser
from agent.dev import cluster
from webapp.devcluster import Swarm


def _threads(cmd: list[str]) -> int:
    """The --threads an agent started with `cmd` (python -m agent ARGS) runs with."""
    assert cmd[1:3] == ["-m", "agent"], cmd
    return int(build_parser().parse_args(cmd[3:]).threads)


def test_an_enrolled_agent_runs_with_the_threads_of_a_serve_hop(tmp_path: Path) -> None:
    serve = cluster.serve_command("m.gguf", "0:10", port=1, public_key="k", node_id="n")
    run = cluster.run_command(tmp_path / "node.json", tmp_path / "data")
    assert _threads(run) == _threads(serve) == defaults.N_THREADS
    assert _threads(cluster.run_command(tmp_path / "node.json", tmp_path / "data", threads=3)) == 3


def test_the_dev_control_planes_agents_get_the_agents_default_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "agent-1" / "node.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"node_id": "node-1"}))
    started: list[list[str]] = []

    def spawn(cmd: list[str], log: Path, **_: Any) -> object:
        started.append([str(c) for c in cmd])
        return object()

    monkeypatch.setattr(cluster, "spawn", spawn)
    # no control plane: run_agent never uses the admin session
    swarm = Swarm("http://127.0.0.1:1", tmp_path, {}, tmp_path, admin=None)  # type: ignore[arg-type]  # none
    swarm.run_agent("agent-1", config)  # what serve_smollm2 (the benches' playground route) runs
    swarm.run_agent("agent-1", config, threads=1)
    assert [_threads(c) for c in started] == [defaults.N_THREADS, 1]


def test_make_up_starts_its_agents_with_the_agents_default_threads() -> None:
    from webapp.playground.management.commands.swarm_up import Command

    opts = Command().create_parser("manage.py", "swarm_up").parse_args([])
    assert opts.threads == defaults.N_THREADS
