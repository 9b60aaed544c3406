"""The agent's control websocket client: hello, heartbeats, commands (load/unload/drain), reconnects.

It owns no shards itself: a `ShardHost` (the data plane) does, so shards and sessions survive a lost
control connection. Reconnects back off exponentially (1 s doubling to 30 s, reset after a good
session). A close with code 4401 (bad credentials) or 4403 (node removed) is final. Messages are
documented in docs/control-plane.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from agent import __version__
from agent.config import NodeConfig
from agent.fetch import FetchError, fetch_shard, shard_path
from agent.manifest import Manifest, ManifestError

log = logging.getLogger("agent.control")

CLOSE_UNAUTHORIZED = 4401
CLOSE_REMOVED = 4403
FINAL_CLOSE_CODES = {CLOSE_UNAUTHORIZED, CLOSE_REMOVED}


class ShardHost(Protocol):
    """What the control client needs from the data plane."""

    def load_shard(
        self,
        path: str,
        manifest: Manifest,
        layer_start: int,
        layer_end: int,
        backend: str = "torch",
        n_threads: int = 2,
    ) -> Any: ...

    def unload_shard(self, model_sha256: str, layer_start: int, layer_end: int) -> bool: ...

    def drain(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class AgentRejected(Exception):
    """The control plane refused this node for good (bad credentials or removed)."""


def measure_speed(rounds: int = 20, seconds: float = 0.015, pause_s: float = 0.05) -> float:
    """Rough GFLOP/s of small float32 matrix products (relative speed for placement).

    The best of short rounds spread over about a second, so a neighbour that is busy for a moment (two
    agents starting together on one host) does not make this host look slow.
    """
    import numpy as np

    n = 64  # small enough that BLAS stays on one thread (a multi-threaded probe collapses under contention)
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    best = 0.0
    for i in range(rounds):
        if i:
            time.sleep(pause_s)
        ops, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < seconds:
            a @ a
            ops += 2 * n**3
        best = max(best, ops / dt / 1e9)
    return round(best, 2)


def hardware_info() -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": psutil.cpu_count(logical=True),
        "cpu_physical": psutil.cpu_count(logical=False),
        "memory_bytes": vm.total,
        "gpus": [],
    }
    with contextlib.suppress(Exception):  # NVML is optional: only on hosts with NVIDIA GPUs
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            info["gpus"].append(
                {
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                }
            )
    return info


def ws_url(server: str) -> str:
    base = server.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base[len("https://") :] + "/ws/agent/"
    if base.startswith("http://"):
        return "ws://" + base[len("http://") :] + "/ws/agent/"
    raise ValueError(f"server URL must start with http:// or https://, not {server!r}")


def next_backoff(current: float, maximum: float = 30.0) -> float:
    return min(maximum, max(1.0, current * 2))


@dataclass
class ControlAgent:
    """Keeps one control connection alive and executes the control plane's commands."""

    config: NodeConfig
    host: ShardHost
    dataplane_url: str
    data_dir: Path
    n_threads: int = 2
    heartbeat_s: float = 2.0
    backends: Callable[[], list[str]] | None = None
    speed: float = 0.0
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    _ws: aiohttp.ClientWebSocketResponse | None = None
    _loads: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    _http: aiohttp.ClientSession | None = None
    _last_tokens: tuple[float, int] = (0.0, 0)

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": self.config.authorization()}

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, serve, reconnect with backoff until `stop` is set or the node is rejected."""
        if not self.speed:
            self.speed = await asyncio.to_thread(measure_speed)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=60))
        backoff = 1.0
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await self._connect_once(stop)
                except AgentRejected:
                    raise
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    log.warning("control plane unreachable (%s); retrying in %.0f s", e, backoff)
                if stop.is_set():
                    break
                if time.monotonic() - started > 30:
                    backoff = 1.0
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff)
                backoff = next_backoff(backoff)
        finally:
            for t in self._loads.values():
                t.cancel()
            await self._http.close()

    async def _connect_once(self, stop: asyncio.Event) -> None:
        assert self._http is not None
        async with self._http.ws_connect(
            ws_url(self.config.server), headers=self._headers, heartbeat=20
        ) as ws:
            self._ws = ws
            self.connected.set()
            beat = asyncio.create_task(self._heartbeats())
            stopper = asyncio.create_task(stop.wait())
            try:
                await self._send(self.hello())
                while True:
                    recv = asyncio.create_task(ws.receive())
                    done, _ = await asyncio.wait({recv, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    if stopper in done:
                        recv.cancel()
                        await ws.close()
                        return
                    msg = recv.result()
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        await self._dispatch(msg.json())
                    elif msg.type in (
                        aiohttp.WSMsgType.CLOSE,
                        aiohttp.WSMsgType.CLOSED,
                        aiohttp.WSMsgType.CLOSING,
                        aiohttp.WSMsgType.ERROR,
                    ):
                        break
            finally:
                beat.cancel()
                stopper.cancel()
                self._ws = None
                self.connected.clear()
            code = ws.close_code
            if code in FINAL_CLOSE_CODES:
                raise AgentRejected(f"control plane closed the connection with code {code}")
            log.warning("control connection closed (code %s)", code)

    async def _send(self, msg: dict[str, Any]) -> None:
        ws = self._ws
        if ws is None or ws.closed:
            return  # reconciliation on the next hello catches up
        with contextlib.suppress(ConnectionError, aiohttp.ClientError):
            await ws.send_json(msg)

    def _shards(self) -> list[dict[str, Any]]:
        return [
            {"model_sha256": s["model_sha256"], "layer_start": s["layer_start"], "layer_end": s["layer_end"]}
            for s in self.host.stats().get("shards", [])
        ]

    def hello(self) -> dict[str, Any]:
        import psutil

        from agent.backends import available_backends

        return {
            "type": "hello",
            "version": __version__,
            "hardware": hardware_info(),
            "backends": (self.backends or available_backends)(),
            "dataplane_url": self.dataplane_url,
            "speed": self.speed,
            "free_memory_bytes": int(psutil.virtual_memory().available),
            "shards": self._shards(),
        }

    def telemetry(self) -> dict[str, Any]:
        import psutil

        st = self.host.stats()
        served = int(st.get("tokens_out", 0) or 0)
        now = time.monotonic()
        t_prev, n_prev = self._last_tokens
        tok_s = (served - n_prev) / (now - t_prev) if t_prev and now > t_prev else 0.0
        self._last_tokens = (now, served)
        vm = psutil.virtual_memory()
        return {
            "sessions": int(st.get("sessions", 0)),
            "kv_bytes": int(st.get("kv_bytes", 0)),
            "kv_budget_bytes": int(st.get("kv_budget_bytes", 0)),
            "tokens_served": served,
            "tok_s": round(max(tok_s, 0.0), 2),
            "cpu_percent": float(psutil.cpu_percent(interval=None)),
            "mem_used_bytes": int(vm.total - vm.available),
            "free_memory_bytes": int(vm.available),
            "shards": len(st.get("shards", [])),
        }

    async def _heartbeats(self) -> None:
        while True:
            await self._send({"type": "heartbeat", "telemetry": self.telemetry()})
            await asyncio.sleep(self.heartbeat_s)

    async def _dispatch(self, msg: Any) -> None:
        if not isinstance(msg, dict):
            return
        kind = msg.get("type")
        if kind == "welcome":
            self.heartbeat_s = float(msg.get("heartbeat_interval_s", self.heartbeat_s))
        elif kind == "load":
            aid = int(msg["assignment_id"])
            running = self._loads.get(aid)
            if running is None or running.done():
                self._loads[aid] = asyncio.create_task(self._load(msg))
        elif kind == "unload":
            await self._unload(msg)
        elif kind == "drain":
            self.host.drain()
        elif kind == "resync":  # we were marked offline (e.g. paused): say again what we hold
            await self._send(self.hello())
        elif kind == "error":
            log.warning("control plane: %s", msg.get("error"))
        elif kind == "removed":
            log.warning("this node was removed by an admin")

    async def _report(self, aid: int | None, state: str, progress: float = 0.0, error: str = "") -> None:
        if aid is not None:
            await self._send(
                {
                    "type": "progress",
                    "assignment_id": aid,
                    "state": state,
                    "progress": round(progress, 3),
                    "error": error,
                }
            )

    async def _load(self, cmd: dict[str, Any]) -> None:
        aid = int(cmd["assignment_id"])
        sha, a, b = str(cmd["model_sha256"]), int(cmd["layer_start"]), int(cmd["layer_end"])
        if (sha, a, b) in {(s["model_sha256"], s["layer_start"], s["layer_end"]) for s in self._shards()}:
            await self._report(aid, "ready", 1.0)
            return
        assert self._http is not None
        base = self.config.server.rstrip("/")
        try:
            await self._report(aid, "fetching", 0.0)
            async with self._http.get(base + cmd["manifest_url"], headers=self._headers) as r:
                if r.status != 200:
                    raise FetchError(f"manifest: HTTP {r.status}")
                manifest = Manifest.from_dict(await r.json())
            if manifest.sha256 != sha:
                raise FetchError("manifest names another model")
            last = [0.0]

            async def progress(frac: float) -> None:
                if frac - last[0] >= 0.05 or frac >= 1.0:
                    last[0] = frac
                    await self._report(aid, "fetching", frac)

            path = shard_path(self.data_dir, sha)
            await fetch_shard(
                self._http, base + cmd["file_url"], self._headers, manifest, a, b, path, progress
            )
            await self._report(aid, "loading", 0.0)
            await asyncio.to_thread(
                self.host.load_shard,
                str(path),
                manifest,
                a,
                b,
                str(cmd.get("backend") or "torch"),
                self.n_threads,
            )
        except asyncio.CancelledError:
            raise
        except (FetchError, ManifestError, aiohttp.ClientError, OSError, ValueError, KeyError) as e:
            log.warning("load %s[%d:%d) failed: %s", sha[:12], a, b, e)
            await self._report(aid, "failed", 0.0, str(e))
            return
        except Exception as e:  # noqa: BLE001 - a backend error must be reported, not kill the agent
            log.exception("load %s[%d:%d) failed", sha[:12], a, b)
            await self._report(aid, "failed", 0.0, f"{type(e).__name__}: {e}")
            return
        await self._report(aid, "ready", 1.0)

    async def _unload(self, cmd: dict[str, Any]) -> None:
        aid = cmd.get("assignment_id")
        task = self._loads.pop(int(aid), None) if aid is not None else None
        if task is not None:
            task.cancel()
        await asyncio.to_thread(
            self.host.unload_shard, str(cmd["model_sha256"]), int(cmd["layer_start"]), int(cmd["layer_end"])
        )
        await self._report(aid, "unloaded", 0.0)


async def run_agent(
    config: NodeConfig,
    host: ShardHost,
    dataplane_url: str,
    data_dir: Path,
    stop: asyncio.Event,
    n_threads: int = 2,
    on_ready: Callable[[ControlAgent], Awaitable[None]] | None = None,
) -> None:
    agent = ControlAgent(config, host, dataplane_url, data_dir, n_threads)
    if on_ready is not None:
        await on_ready(agent)
    await agent.run(stop)


def default_data_dir() -> Path:
    """Where model files go: $GGUF_SWARM_DATA, else $XDG_DATA_HOME/gguf-swarm (~/.local/share/gguf-swarm)."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    d = Path(os.environ.get("GGUF_SWARM_DATA") or base / "gguf-swarm")
    d.mkdir(parents=True, exist_ok=True)
    return d
