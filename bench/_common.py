"""Helpers shared by the benchmarks: real serve processes on 127.0.0.1 and health polling."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

from agent.procs import Process, free_port, spawn, stop, wait_http

REPO = Path(__file__).resolve().parent.parent


def health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/health", timeout=5) as r:
        return dict(json.loads(r.read()))


def start_serve(
    model: str,
    layers: str,
    backend: str,
    public_key_b64: str,
    threads: int,
    logdir: Path,
    extra_env: dict[str, str] | None = None,
    repo: Path = REPO,
) -> tuple[Process, str, str]:
    """Start `agent serve` for one layer range and wait until it answers; (process, URL, node id).
    `repo`: the checkout whose agent runs (an A/B of two versions of the hop's code in one run)."""
    port = free_port()
    node = f"bench-{port}"
    cmd = [
        sys.executable,
        "-m",
        "agent",
        "serve",
        "--model",
        model,
        "--layers",
        layers,
        "--backend",
        backend,
        "--port",
        str(port),
        "--public-key",
        public_key_b64,
        "--node-id",
        node,
        "--threads",
        str(threads),
        "--kv-budget-mb",
        "4096",
    ]
    env = {**os.environ, "PYTHONPATH": str(repo), **(extra_env or {})}
    proc = spawn(cmd, logdir / f"serve-{port}.log", env=env, cwd=repo)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/v1/health", 180, procs=[proc])
    except BaseException:
        stop([proc])
        raise
    return proc, url, node


async def serve_forever(path: str, handle: Any, port: int) -> None:
    """An aiohttp app answering GET `path` with `handle` on 127.0.0.1:`port`, until cancelled (the bare
    relays of bench/chain_legs.py and bench/hop_floor.py)."""
    import asyncio

    from aiohttp import web

    app = web.Application()
    app.router.add_get(path, handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()
