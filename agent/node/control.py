"""The agent's control websocket client: hello, heartbeats, commands (load/unload/drain), reconnects.

It owns no shards itself: a `ShardHost` (the data plane) does, so shards and sessions survive a lost
control connection. Shard bytes come over the torrent swarm (one `SwarmClient` per agent process, which
keeps seeding) when the model has a .torrent and libtorrent is installed, else over HTTP range requests. Reconnects back off exponentially (1 s doubling to 30 s, reset after a good
session). A close with code 4401 (bad credentials) or 4403 (node removed) is final. Every message is
built from, and every command validated against, the shared schema in `agent.wire.control`; a malformed
or unknown command is answered with an error and otherwise ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from agent import defaults
from agent.artifacts.fetch import FetchError, fetch_shard, shard_path
from agent.artifacts.manifest import Manifest, ManifestError
from agent.artifacts.swarm_tls import PeerCertificate
from agent.node.config import NodeConfig
from agent.node.hop_telemetry import batch_window, prefill_progress
from agent.wire.control import (
    FINAL_CLOSE_CODES,
    MAX_NAME,
    MAX_STR,
    MAX_URL,
    PROTOCOL_VERSION,
    AgentMessage,
    ControlError,
    Drain,
    ErrorMessage,
    Gpu,
    Hardware,
    Heartbeat,
    Hello,
    Load,
    Progress,
    Removed,
    Resync,
    ServerMessage,
    ShardRef,
    Telemetry,
    Transfer,
    Unload,
    Update,
    UpdateStatus,
    Welcome,
    parse_server_message,
)
from agent.wire.httpjson import read_json

if TYPE_CHECKING:
    from agent.artifacts.torrent import Progress as SwarmProgress
    from agent.artifacts.torrent import SwarmClient
    from agent.node.update import Updater

log = logging.getLogger("agent.node.control")
# A model's manifest from the control plane (one entry per tensor): read bounded like any peer's JSON.
MANIFEST_MAX = 64 << 20


class ShardHost(Protocol):
    """What the control client needs from the data plane."""

    def load_shard(
        self,
        path: str,
        manifest: Manifest,
        layer_start: int,
        layer_end: int,
        backend: str = defaults.DEFAULT_BACKEND,
        n_threads: int = defaults.N_THREADS,
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


def hardware_info() -> Hardware:
    import psutil

    from agent.node.gpu import native_compute_device, nvml_gpus

    gpus: list[Gpu] = nvml_gpus(live=False)  # NVML is optional: only on hosts with NVIDIA GPUs
    device, gpu_index = native_compute_device()
    return Hardware(
        compute_device=device,
        compute_gpu=gpu_index,
        hostname=socket.gethostname()[:MAX_NAME],
        platform=platform.platform()[:MAX_URL],
        python=platform.python_version(),
        cpu_count=psutil.cpu_count(logical=True),
        cpu_physical=psutil.cpu_count(logical=False),
        memory_bytes=int(psutil.virtual_memory().total),
        gpus=gpus,
    )


def _count(v: Any) -> int:
    """A data-plane counter as the wire wants it (a non-negative int)."""
    return max(0, int(v or 0))


def _batch_figures(b: Any) -> tuple[float, float, float]:
    """Steps per batch, queue wait (ms) and compute per batch (ms) from DataPlane.stats()["batching"]."""
    d: dict[str, Any] = b if isinstance(b, dict) else {}

    def fig(key: str) -> float:
        return max(0.0, float(d.get(key) or 0.0))

    return fig("avg_steps"), fig("avg_queue_wait_ms"), fig("avg_compute_ms")


def ws_url(server: str) -> str:
    base = server.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base[len("https://") :] + "/ws/agent/"
    if base.startswith("http://"):
        return "ws://" + base[len("http://") :] + "/ws/agent/"
    raise ValueError(f"server URL must start with http:// or https://, not {server!r}")


def next_backoff(current: float, maximum: float = defaults.RECONNECT_MAX_S) -> float:
    return min(maximum, max(1.0, current * 2))


@dataclass
class ControlAgent:
    """Keeps one control connection alive and executes the control plane's commands."""

    config: NodeConfig
    host: ShardHost
    dataplane_url: str
    data_dir: Path
    n_threads: int = defaults.N_THREADS
    heartbeat_s: float = defaults.HEARTBEAT_INTERVAL_S
    backends: Callable[[], list[str]] | None = None
    speed: float = 0.0
    # None: never use the swarm (HTTP range requests only).
    torrent_listen: str | None = defaults.TORRENT_LISTEN
    # the node's swarm certificate: joins SSL torrents (agent/artifacts/swarm_tls.py); None: plain only
    torrent_cert: PeerCertificate | None = None
    fetch_timeout_s: float = defaults.FETCH_TIMEOUT_S
    welcome_timeout_s: float = defaults.WELCOME_TIMEOUT_S
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    _welcomed: bool = False  # this connection's welcome arrived
    _ws: aiohttp.ClientWebSocketResponse | None = None
    _loads: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    _http: aiohttp.ClientSession | None = None
    _last_tokens: tuple[float, int] = (0.0, 0)
    _swarm: SwarmClient | None = None
    _swarm_unavailable: str = ""
    updater: Updater | None = None  # signed self-update (agent/node/update.py); None: refused
    restart_requested: bool = False  # an update is installed: `run` exits for the launcher to restart
    _stop: asyncio.Event | None = None
    _update_task: asyncio.Task[None] | None = None

    def request_restart(self) -> None:
        """Stop serving so the launcher starts the version an update installed."""
        self.restart_requested = True
        if self._stop is not None:
            self._stop.set()

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": self.config.authorization()}

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, serve, reconnect with backoff until `stop` is set or the node is rejected."""
        self._stop = stop
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
            if self._swarm is not None:
                await asyncio.to_thread(self._swarm.close)
                self._swarm = None

    async def _connect_once(self, stop: asyncio.Event) -> None:
        assert self._http is not None
        async with self._http.ws_connect(
            ws_url(self.config.server), headers=self._headers, heartbeat=20
        ) as ws:
            self._ws = ws
            self._welcomed = False
            self.connected.set()
            beat = asyncio.create_task(self._heartbeats())
            stopper = asyncio.create_task(stop.wait())
            welcome_by = time.monotonic() + self.welcome_timeout_s
            try:
                await self._send(self.hello())
                while True:
                    recv = asyncio.create_task(ws.receive())
                    wait_s = None if self._welcomed else max(0.0, welcome_by - time.monotonic())
                    done, _ = await asyncio.wait(
                        {recv, stopper}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
                    )
                    if not done:  # accepted but never welcomed: nothing we send there is read
                        recv.cancel()
                        await ws.close()
                        raise TimeoutError(f"no welcome within {self.welcome_timeout_s:g} s of connecting")
                    if stopper in done:
                        recv.cancel()
                        await ws.close()
                        return
                    msg = recv.result()
                    if msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                        await self._dispatch(msg.data)
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

    async def _send(self, msg: AgentMessage) -> None:
        ws = self._ws
        if ws is None or ws.closed:
            return  # reconciliation on the next hello catches up
        with contextlib.suppress(ConnectionError, aiohttp.ClientError):
            await ws.send_json(msg.to_wire())

    def _shards(self) -> list[ShardRef]:
        return [
            ShardRef(model_sha256=s["model_sha256"], layer_start=s["layer_start"], layer_end=s["layer_end"])
            for s in self.host.stats().get("shards", [])
        ]

    def hello(self) -> Hello:
        import psutil

        from agent.backends import available_backends
        from agent.node.update import running_version

        return Hello(
            version=running_version(),
            hardware=hardware_info(),
            backends=(self.backends or available_backends)(),
            dataplane_url=self.dataplane_url,
            speed=max(float(self.speed), 0.0),
            free_memory_bytes=int(psutil.virtual_memory().available),
            shards=self._shards(),
        )

    def telemetry(self) -> Telemetry:
        import psutil

        from agent.node.gpu import nvml_gpus

        st = self.host.stats()
        served = _count(st.get("tokens_out"))
        now = time.monotonic()
        t_prev, n_prev = self._last_tokens
        tok_s = (served - n_prev) / (now - t_prev) if t_prev and now > t_prev else 0.0
        self._last_tokens = (now, served)
        vm = psutil.virtual_memory()
        batch_steps, queue_wait_ms, batch_compute_ms = _batch_figures(st.get("batching"))
        since = now - t_prev if t_prev and now > t_prev else self.heartbeat_s
        return Telemetry(
            sessions=_count(st.get("sessions")),
            kv_bytes=_count(st.get("kv_bytes")),
            kv_budget_bytes=_count(st.get("kv_budget_bytes")),
            tokens_served=served,
            tok_s=round(max(tok_s, 0.0), 2),
            cpu_percent=max(float(psutil.cpu_percent(interval=None)), 0.0),
            mem_used_bytes=_count(vm.total - vm.available),
            free_memory_bytes=_count(vm.available),
            shards=len(st.get("shards", [])),
            gpus=nvml_gpus(),
            batch_steps=batch_steps,
            queue_wait_ms=queue_wait_ms,
            batch_compute_ms=batch_compute_ms,
            window=batch_window(getattr(self.host, "metrics", None), since),
            prefills=prefill_progress(getattr(self.host, "shards", None)),
        )

    async def _heartbeats(self) -> None:
        while True:
            await self._send(Heartbeat(telemetry=self.telemetry()))
            await asyncio.sleep(self.heartbeat_s)

    async def _dispatch(self, raw: str | bytes) -> None:
        """Validate one message from the control plane and act on it; a bad one is answered and dropped."""
        try:
            msg = parse_server_message(raw)
        except ControlError as e:
            log.warning("control plane sent a message we refuse: %s", e)
            if e.kind != "error":  # an error is never answered with an error: two ends could loop
                await self._send(ErrorMessage.about(str(e)))
            return
        try:
            await self._execute(msg)
        except Exception as e:  # noqa: BLE001 - a failing command must be reported, not end the connection
            log.exception("command %r failed", msg.type)
            await self._send(ErrorMessage.about(f"{msg.type} failed: {type(e).__name__}: {e}"))

    async def _execute(self, msg: ServerMessage) -> None:
        if isinstance(msg, Welcome):
            self._welcomed = True
            if msg.protocol != PROTOCOL_VERSION:
                log.warning("control plane speaks protocol %d, this agent %d", msg.protocol, PROTOCOL_VERSION)
            self.heartbeat_s = msg.heartbeat_interval_s
            if self.updater is not None:
                await self.updater.on_welcome(self._send)
        elif isinstance(msg, Load):
            running = self._loads.get(msg.assignment_id)
            if running is None or running.done():
                self._loads[msg.assignment_id] = asyncio.create_task(self._load(msg))
        elif isinstance(msg, Unload):
            await self._unload(msg)
        elif isinstance(msg, Drain):
            self.host.drain()
        elif isinstance(msg, Update):
            if self.updater is None or self._http is None:
                await self._send(
                    UpdateStatus(
                        rollout_id=msg.rollout_id,
                        version=msg.version,
                        state="refused",
                        error="this agent does not take updates",
                    )
                )
            elif self._update_task is None or self._update_task.done():
                self._update_task = asyncio.create_task(self.updater.apply(msg, self._http, self._send))
        elif isinstance(msg, Resync):  # we were marked offline (e.g. paused): say again what we hold
            await self._send(self.hello())
        elif isinstance(msg, ErrorMessage):
            log.warning("control plane: %s", msg.error)
        elif isinstance(msg, Removed):
            log.warning("this node was removed by an admin")

    async def _report(
        self,
        aid: int | None,
        state: str,
        progress: float = 0.0,
        error: str = "",
        transfer: Transfer | None = None,
    ) -> None:
        metrics = getattr(self.host, "metrics", None)  # the data plane's /metrics (agent/node/metrics.py)
        if transfer is not None and aid is not None and metrics is not None:
            metrics.transfer(aid, transfer)
        if aid is not None:
            await self._send(
                Progress.model_validate(
                    {
                        "assignment_id": aid,
                        "state": state,
                        "progress": min(max(round(float(progress), 3), 0.0), 1.0),
                        "error": error[:MAX_STR],
                        "transfer": transfer,
                    }
                )
            )

    def swarm(self) -> SwarmClient | None:
        """This process's one libtorrent session, started on first use; None without libtorrent."""
        if self._swarm is None and self.torrent_listen is not None and not self._swarm_unavailable:
            try:
                from agent.artifacts.torrent import SwarmClient
            except ImportError as e:
                self._swarm_unavailable = str(e)
                log.warning("libtorrent is not available (%s); fetching shards over HTTP", e)
                return None
            self._swarm = SwarmClient(self.torrent_listen, peer_cert=self.torrent_cert)
            log.info(
                "torrent session listening on %s (port %d, SSL torrents on port %s)",
                self.torrent_listen,
                self._swarm.listen_port,
                self._swarm.ssl_listen_port or "none: no certificate",
            )
        return self._swarm

    async def _get_torrent(self, url: str) -> bytes | None:
        """The model's .torrent from the control plane; None when it has none (HTTP fallback)."""
        assert self._http is not None
        async with self._http.get(url, headers=self._headers) as r:
            if r.status == 404:
                return None
            if r.status != 200:
                raise FetchError(f"torrent: HTTP {r.status}")
            return await r.read()

    async def _fetch_over_swarm(
        self,
        aid: int,
        swarm: SwarmClient,
        torrent: bytes,
        manifest: Manifest,
        a: int,
        b: int,
        cmd: Load,
    ) -> Path:
        """Download only this range's pieces (sparse file), verify its tensors, keep seeding."""
        base = self.config.server.rstrip("/")
        loop = asyncio.get_running_loop()
        last_line = [0.0]

        def on_progress(p: SwarmProgress) -> None:  # libtorrent's thread
            done = p.wanted_bytes > 0 and p.done_bytes >= p.wanted_bytes
            if done or time.monotonic() - last_line[0] >= 2.0:
                last_line[0] = time.monotonic()
                log.info("fetch [%d:%d) %s", a, b, p.line())
            transfer = Transfer(
                done_bytes=max(p.done_bytes, 0),
                wanted_bytes=max(p.wanted_bytes, 0),
                downloaded_bytes=max(p.downloaded_bytes, 0),
                rate_bytes_per_s=max(float(p.rate_bytes_per_s), 0.0),
                peers=max(p.peers, 0),
                peer_bytes=max(p.peer_bytes, 0),
                web_seed_bytes=max(p.web_seed_bytes, 0),
                hash_failures=max(p.hash_failures, 0),
                fraction=min(max(round(p.fraction, 4), 0.0), 1.0),
                source="swarm",
                infohash=p.infohash[:64],
            )
            asyncio.run_coroutine_threadsafe(
                self._report(aid, "fetching", p.fraction, transfer=transfer), loop
            )

        return await asyncio.to_thread(
            swarm.fetch_verified,
            torrent,
            self.data_dir / "swarm" / manifest.sha256,
            manifest,
            a,
            b,
            on_progress,
            timeout=self.fetch_timeout_s,
            trackers=[base + u for u in cmd.trackers],
            web_seeds=[base + u for u in cmd.web_seeds],
        )

    async def _fetch_over_http(self, aid: int, manifest: Manifest, a: int, b: int, file_url: str) -> Path:
        """The fallback: one HTTP range request per merged byte range, verified per tensor."""
        assert self._http is not None
        last = [0.0]

        async def progress(frac: float) -> None:
            if frac - last[0] >= 0.05 or frac >= 1.0:
                last[0] = frac
                await self._report(aid, "fetching", frac)

        path = shard_path(self.data_dir, manifest.sha256)
        n = await fetch_shard(self._http, file_url, self._headers, manifest, a, b, path, progress)
        log.info("fetch [%d:%d) over HTTP: %.1f MB", a, b, n / 1e6)
        await self._report(
            aid,
            "fetching",
            1.0,
            transfer=Transfer(source="http", downloaded_bytes=n, done_bytes=n, wanted_bytes=n),
        )
        return path

    async def _load(self, cmd: Load) -> None:
        aid, sha, a, b = cmd.assignment_id, cmd.model_sha256, cmd.layer_start, cmd.layer_end
        if (sha, a, b) in {s.key for s in self._shards()}:
            await self._report(aid, "ready", 1.0)
            return
        assert self._http is not None
        base = self.config.server.rstrip("/")
        try:
            await self._report(aid, "fetching", 0.0)
            async with self._http.get(base + cmd.manifest_url, headers=self._headers) as r:
                if r.status != 200:
                    raise FetchError(f"manifest: HTTP {r.status}")
                manifest = Manifest.from_dict(await read_json(r, MANIFEST_MAX))
            if manifest.sha256 != sha:
                raise FetchError("manifest names another model")
            swarm = self.swarm() if cmd.torrent_url else None
            torrent = (
                await self._get_torrent(base + cmd.torrent_url)
                if swarm is not None and cmd.torrent_url
                else None
            )
            if swarm is not None and torrent is not None:
                path = await self._fetch_over_swarm(aid, swarm, torrent, manifest, a, b, cmd)
            else:
                path = await self._fetch_over_http(aid, manifest, a, b, base + cmd.file_url)
            await self._report(aid, "loading", 0.0)
            await asyncio.to_thread(
                self.host.load_shard,
                str(path),
                manifest,
                a,
                b,
                cmd.backend,
                self.n_threads,
            )
        except asyncio.CancelledError:
            raise
        except (
            FetchError,
            ManifestError,
            aiohttp.ClientError,
            OSError,
            ValueError,  # TensorHashMismatch: re-fetched once already; never loaded
            KeyError,
        ) as e:
            log.warning("load %s[%d:%d) failed: %s", sha[:12], a, b, e)
            await self._report(aid, "failed", 0.0, str(e))
            return
        except Exception as e:  # noqa: BLE001 - a backend error must be reported, not kill the agent
            log.exception("load %s[%d:%d) failed", sha[:12], a, b)
            await self._report(aid, "failed", 0.0, f"{type(e).__name__}: {e}")
            return
        await self._report(aid, "ready", 1.0)

    async def _unload(self, cmd: Unload) -> None:
        aid = cmd.assignment_id
        task = self._loads.pop(aid, None) if aid is not None else None
        if task is not None:
            task.cancel()
        await asyncio.to_thread(self.host.unload_shard, cmd.model_sha256, cmd.layer_start, cmd.layer_end)
        await self._report(aid, "unloaded", 0.0)
