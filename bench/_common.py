"""What the benchmarks share: their `agent serve` hops, started by agent/dev/cluster.py (the launcher the
tests use too) with the benches' settings, and the aiohttp app of the bare relays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.dev import cluster
from agent.procs import Process

REPO = Path(__file__).resolve().parent.parent
KV_BUDGET_MB = 4096  # every bench hop's KV budget: long contexts and 8 sessions fit
READY_S = 180.0  # how long a hop may take to answer /v1/health (a loaded 2-core machine)


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
    hop = cluster.start_serve(
        model,
        layers,
        public_key=public_key_b64,
        logdir=logdir,
        backend=backend,
        threads=threads,
        kv_budget_mb=KV_BUDGET_MB,
        node_prefix="bench",
        extra_env=extra_env,
        root=repo,
        timeout_s=READY_S,
    )
    return hop.proc, hop.url, hop.node_id


def cpu_kind() -> str:
    """The CPU's widest vector extension from /proc/cpuinfo's flags: "avx512", "avx2" or "other"."""
    flags = Path("/proc/cpuinfo").read_text().split()
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"


async def serve_forever(path: str, handle: Any, port: int) -> None:
    """An aiohttp app answering GET `path` with `handle` on 127.0.0.1:`port`, until cancelled (the bare
    relays of bench/hop_floor.py and bench/archive/chain_legs.py)."""
    import asyncio

    from aiohttp import web

    app = web.Application()
    app.router.add_get(path, handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()
