"""Local agents as real processes, each polled until it is ready: the one launcher of a local cluster.

Two kinds of agent, both started as `python -m agent ...` on 127.0.0.1:

* **serve hops** (`start_serve`): `agent serve` for one layer range, no control plane; ready when
  `/v1/health` answers 200. The tests' `serve_factory` fixture (tests/conftest.py) and the benchmarks
  (bench/) build routes from them.
* **enrolled nodes** (`enroll`, `start_run`): `agent enroll` against a control plane, then `agent run`
  with that config (torrent swarm on loopback); ready when the control plane lists them online with a
  data-plane URL (`wait_online`, `nodes_online`). The control plane of the integration tests and
  benchmarks (webapp/devcluster.py) starts its agents this way; `make up`
  (webapp/playground/management/commands/swarm_up.py) runs the same two commands.

Processes start, wait and stop through agent.procs: every wait polls a readiness condition against a
deadline and fails as soon as a watched process exits; nothing sleeps a guessed time. Standard library
and agent.procs only, so it loads before anything heavy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.procs import Process, free_port, spawn, stop, wait_http, wait_until

# The source tree the agent is imported from (the checkout): agents start there, with it on PYTHONPATH.
ROOT = Path(__file__).resolve().parents[2]


def agent_command(*args: str | Path) -> list[str]:
    """`python -m agent ARGS`, with this interpreter."""
    return [sys.executable, "-m", "agent", *map(str, args)]


def agent_env(
    root: Path = ROOT, extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """An agent process's environment: `base` (default this process's) with PYTHONPATH = `root`, then
    `extra` on top."""
    return {**(os.environ if base is None else base), "PYTHONPATH": str(root), **(extra or {})}


def health(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """An agent's `/v1/health` JSON (`url` is its data plane's base URL)."""
    with urllib.request.urlopen(url + "/v1/health", timeout=timeout_s) as r:
        return dict(json.loads(r.read()))


# -- serve hops: `agent serve`, no control plane ------------------------------------------------------


@dataclass
class ServeHop:
    """A running `agent serve` process on 127.0.0.1."""

    proc: Process
    url: str
    node_id: str
    log: Path

    def health(self) -> dict[str, Any]:
        return health(self.url)

    def stop(self) -> None:
        stop([self.proc])


def serve_command(
    model: str | Path,
    layers: str,
    *,
    port: int,
    public_key: str,
    node_id: str,
    backend: str | None = None,
    threads: int | None = None,
    kv_budget_mb: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The `agent serve` command line for one layer range ("a:b"); None leaves the agent's default
    (agent/defaults.py). `extra` comes last, so its options win over the ones before it."""
    cmd = agent_command("serve", "--model", model, "--layers", layers)
    if backend is not None:
        cmd += ["--backend", backend]
    cmd += ["--port", str(port), "--public-key", public_key, "--node-id", node_id]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    if kv_budget_mb is not None:
        cmd += ["--kv-budget-mb", str(kv_budget_mb)]
    return cmd + list(extra)


def start_serve(
    model: str | Path,
    layers: str,
    *,
    public_key: str,
    logdir: Path,
    backend: str | None = None,
    threads: int | None = 1,
    kv_budget_mb: int | None = None,
    node_prefix: str = "node",
    extra: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    root: Path = ROOT,
    wait: bool = True,
    timeout_s: float = 120.0,
) -> ServeHop:
    """Start `agent serve` for `layers` on a free port and, with `wait`, poll until it answers.

    `public_key`: the route-token key (base64 or @file). The node id is `<node_prefix>-<port>`, the log
    `logdir/serve-<port>.log`. `root`: the checkout whose agent runs (an A/B of two checkouts in one
    bench run); `extra_env` goes on top of this process's environment. A hop that exits or does not
    answer within `timeout_s` is stopped and the wait raises (agent.procs.ProcessExited / TimeoutError).
    """
    port = free_port()
    node_id = f"{node_prefix}-{port}"
    cmd = serve_command(
        model,
        layers,
        port=port,
        public_key=public_key,
        node_id=node_id,
        backend=backend,
        threads=threads,
        kv_budget_mb=kv_budget_mb,
        extra=extra,
    )
    log = logdir / f"serve-{port}.log"
    hop = ServeHop(
        spawn(cmd, log, env=agent_env(root, extra_env), cwd=root), f"http://127.0.0.1:{port}", node_id, log
    )
    if wait:
        wait_ready(hop, timeout_s)
    return hop


def wait_ready(hop: ServeHop, timeout_s: float = 120.0) -> None:
    """Poll `hop` until its `/v1/health` answers 200; stop it and raise if it exits or times out first."""
    try:
        wait_http(hop.url + "/v1/health", timeout_s, procs=[hop.proc])
    except BaseException:
        hop.stop()
        raise


# -- enrolled nodes: `agent enroll`, then `agent run` against a control plane ----------------------------


@dataclass
class RunAgent:
    """A running `agent run` process of an enrolled node."""

    proc: Process
    node_id: str
    config: Path
    data_dir: Path
    log: Path


def node_id_of(config: Path) -> str:
    """The node id an enrolled config (node.json) holds."""
    return str(json.loads(config.read_text())["node_id"])


def enroll(
    server: str,
    token: str,
    config: Path,
    *,
    name: str,
    force: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: Path = ROOT,
    prefix: Sequence[str] = (),
) -> str:
    """`agent enroll` with a one-time token: writes the node's credentials to `config`; its node id.
    `prefix` wraps the command (`ip netns exec NAME`: enrolled from inside a network namespace)."""
    cmd = agent_command("enroll", "--server", server, "--token", token, "--name", name, "--config", config)
    subprocess.run(
        [*prefix, *cmd] + (["--force"] if force else []),
        cwd=cwd,
        env=dict(env) if env is not None else None,
        check=True,
    )
    return node_id_of(config)


def run_command(
    config: Path,
    data_dir: Path,
    *,
    threads: int | None = None,
    torrent_listen: str = "127.0.0.1:0",
    extra: Sequence[str] = (),
) -> list[str]:
    """The `agent run` command line of an enrolled node; the torrent swarm listens on loopback unless told.
    `threads` None leaves the agent's default (agent/defaults.py N_THREADS), the count `agent serve`
    and the benchmarks' serve hops compute with: the route `make up` and the control plane's tests and
    benches build is the route bench/served.py's serve hops measure (issue 32: one thread per agent
    decoded at 0.54x their speed)."""
    cmd = agent_command("run", "--config", config, "--data-dir", data_dir)
    if threads is not None:
        cmd += ["--threads", str(threads)]
    return cmd + ["--torrent-listen", torrent_listen, *extra]


def start_run(
    config: Path,
    log: Path,
    *,
    data_dir: Path | None = None,
    threads: int | None = None,
    torrent_listen: str = "127.0.0.1:0",
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: Path = ROOT,
    append: bool = True,
    prefix: Sequence[str] = (),
) -> RunAgent:
    """Start `agent run` for an enrolled `config` (data in `data_dir`, default next to it), output
    appended to `log`; `threads` None: the agent's default (run_command). `prefix` wraps the command
    (`ip netns exec NAME`, which execs it: the process is the agent's). It is ready once the control
    plane lists it online: `wait_online`."""
    data = data_dir if data_dir is not None else config.parent / "data"
    cmd = run_command(config, data, threads=threads, torrent_listen=torrent_listen, extra=extra)
    proc = spawn([*prefix, *cmd], log, env=env, cwd=cwd, append=append)
    return RunAgent(proc, node_id_of(config), config, data, log)


def nodes_online(status: Mapping[str, Any], node_ids: Iterable[str], since: datetime | None = None) -> bool:
    """Whether the control plane's status (/fleet/status.json) lists every one of `node_ids` online with
    a data-plane URL, over a socket opened at or after `since` when given (after a control-plane restart
    the database still says what the old process last saw until each agent reconnects)."""

    def fresh(n: Mapping[str, Any]) -> bool:
        at = n.get("connected_at")
        return since is None or (isinstance(at, str) and datetime.fromisoformat(at) >= since)

    nodes = status["nodes"]
    return all(
        any(n["id"] == nid and n["state"] == "online" and n["dataplane_url"] and fresh(n) for n in nodes)
        for nid in node_ids
    )


def wait_online(
    status: Callable[[], Mapping[str, Any]],
    node_ids: Sequence[str],
    timeout_s: float = 120.0,
    *,
    procs: Iterable[Process] = (),
    every_s: float = 0.25,
    since: datetime | None = None,
) -> Mapping[str, Any]:
    """Poll `status()` (the control plane's /fleet/status.json) until every one of `node_ids` is online
    (connected at or after `since`, when given: nodes_online); return that status. Raises ProcessExited
    when one of `procs` exits first, TimeoutError (with the last status) after `timeout_s`."""
    last: list[Mapping[str, Any]] = [{}]

    def check() -> Mapping[str, Any] | None:
        last[0] = status()
        return last[0] if nodes_online(last[0], node_ids, since) else None

    try:
        return wait_until(f"{len(node_ids)} agents online", check, timeout_s, procs=procs, every_s=every_s)
    except TimeoutError as e:
        raise TimeoutError(f"{e}; last status: {last[0]}") from None
