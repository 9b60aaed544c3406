"""The control plane of a local cluster as real processes on 127.0.0.1, for the integration tests and benches.

`control_plane(tmp)` migrates a fresh database, creates the admin, starts Celery beat + worker (real mode)
and the web server, logs in, and yields a `Swarm`: handles on the processes and the admin session. Its
agents are enrolled and started through agent.dev.cluster (the launcher `make up` uses too), and every
wait polls a readiness condition. PostgreSQL and Redis when DATABASE_URL / REDIS_URL are set (CI; each
cluster gets a database of its own, dropped afterwards), else the embedded SQLite + eager mode.

`Origin` is a stand-in for the control plane's artifact side alone: the passkey tracker and web seed
(webapp.tracker's logic) in an aiohttp server, for the torrent tests and bench/distribution.py.

Project-level, outside the app layers (.importlinter); nothing in the running control plane imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import subprocess
import sys
import threading
import urllib.parse
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, web

from agent.dev import cluster
from agent.procs import Process, free_port, spawn, stop, wait_http
from webapp.core.adminclient import AdminClient
from webapp.tracker import logic
from webapp.tracker.webseed import RangeNotSatisfiable, plan_range

REPO = Path(__file__).resolve().parents[1]
ADMIN_USER = "admin"
PASSWORD = "it-admin-password-1"  # the local cluster's admin password (a throwaway database)


def web_command(host: str, port: int) -> list[str]:
    """The web server (daphne behind webapp.serve, which redacts secrets from its access log)."""
    return [sys.executable, "-m", "webapp.serve", "-b", host, "-p", str(port), "webapp.asgi:application"]


def worker_command() -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "webapp", "worker", "--pool", "solo", "-l", "INFO"]


def beat_command(schedule: Path) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "webapp", "beat", "-l", "INFO", "-s", str(schedule)]


@dataclass
class Swarm:
    """Handles on the running processes and the admin session."""

    base: str
    data_dir: Path
    env: dict[str, str]
    logs: Path
    admin: AdminClient
    web: Process | None = None
    web_started_at: datetime | None = None
    agents: dict[str, Process] = field(default_factory=dict)
    agent_dirs: dict[str, Path] = field(default_factory=dict)
    procs: list[Process] = field(default_factory=list)
    model: dict[str, Any] = field(default_factory=dict)
    telemetry: list[dict[str, Any]] = field(default_factory=list)
    agent_threads: int | None = None  # run_agent's default threads per agent (None: the agent's own)

    def spawn(self, name: str, cmd: list[str]) -> Process:
        p = spawn(cmd, self.logs / f"{name}.log", env=self.env, cwd=REPO, append=True)
        self.procs.append(p)
        return p

    def start_web(self, port: int) -> None:
        self.web_started_at = datetime.now(UTC)
        self.web = self.spawn("web", web_command("127.0.0.1", port))
        wait_http(self.base + "/healthz", 60, procs=[self.web])

    def manage(self, *args: str) -> None:
        subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO,
            env=self.env,
            check=True,
            stdout=subprocess.DEVNULL,
        )

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logs.glob("*.log")))

    def enroll(self, name: str, *, server: str | None = None, prefix: Sequence[str] = ()) -> tuple[Path, str]:
        """Enroll an agent with a token created as an admin would; returns (node config path, token).
        `server`: the control plane's URL as the agent reaches it (default `base`), kept in its config;
        `prefix` wraps `agent enroll` (`ip netns exec NAME`: from inside a network namespace)."""
        token = self.admin.create_enrollment_token(name)
        config = self.data_dir / name / "node.json"
        cluster.enroll(server or self.base, token, config, name=name, env=self.env, cwd=REPO, prefix=prefix)
        return config, token

    def run_agent(
        self,
        name: str,
        config: Path,
        *extra: str,
        threads: int | None = None,
        torrent_listen: str = "127.0.0.1:0",
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Start `agent run` for an enrolled config (torrent session on `torrent_listen`), with `threads`
        compute threads (None: `agent_threads`, by default the agent's own, as `make up`); returns its
        node id. `prefix` wraps the command and `env` goes on top of the cluster's (an agent in a
        network namespace: agent.dev.links.LinkLab.node)."""
        threads = self.agent_threads if threads is None else threads
        agent = cluster.start_run(
            config,
            self.logs / f"{name}.log",
            threads=threads,
            torrent_listen=torrent_listen,
            extra=extra,
            env={**self.env, **(env or {})},
            cwd=REPO,
            prefix=prefix,
        )
        self.procs.append(agent.proc)
        self.agent_dirs[agent.node_id] = agent.data_dir
        self.agents[agent.node_id] = agent.proc
        return agent.node_id

    def online(self, node_ids: list[str]) -> Any:
        """Wait until every one of `node_ids` is online with a data-plane URL over a socket this web
        process accepted (fails at once if one of their processes exits); returns the status that
        showed it."""
        watched = [self.agents[n] for n in node_ids if n in self.agents]
        return cluster.wait_online(self.admin.status, node_ids, 120, procs=watched, since=self.web_started_at)

    def shards_ready(self, timeout_s: float = 600) -> list[dict[str, Any]]:
        def check(st: dict[str, Any]) -> list[dict[str, Any]] | None:
            shards = [sh for n in st["nodes"] if n["state"] == "online" for sh in n["shards"]]
            failed = [sh for sh in shards if sh["state"] == "failed"]
            if failed:
                raise RuntimeError(f"shards failed: {failed}")
            return shards if shards and all(sh["state"] == "ready" for sh in shards) else None

        result: list[dict[str, Any]] = self.admin.wait_for("shards ready", check, timeout_s, every_s=0.5)
        return result

    def register_smollm2(self) -> dict[str, Any]:
        code, body = self.admin.post("/models/register", {"kind": "package", "package": "smollm2"})
        if code != 200:
            raise RuntimeError(f"registering smollm2 failed (HTTP {code}): {body[:300]}")
        self.model = self.admin.wait_for(
            "manifest",
            lambda st: next((m for m in st["models"] if m["state"] in ("ready", "failed")), None),
            300,
        )
        if self.model["state"] != "ready":
            raise RuntimeError(f"smollm2: {self.model}")
        return self.model

    def serve_smollm2(self, n_agents: int = 2, threads: int | None = None) -> dict[str, Any]:
        """`n_agents` enrolled `agent run` agents online (`threads` each, None: the agent's default),
        SmolLM2 registered and placed once across them, its shards ready: the swarm `make up` gives, for
        tests and benches."""
        for i in range(1, n_agents + 1):
            config, _ = self.enroll(f"agent-{i}")
            self.run_agent(f"agent-{i}", config, threads=threads)
        self.online(list(self.agents))
        self.register_smollm2()
        code, body = self.admin.post(f"/models/{self.model['id']}/place", {"replicas": "1"})
        if code != 200:
            raise RuntimeError(f"placing smollm2 failed (HTTP {code}): {str(body)[:300]}")
        self.shards_ready()
        return self.model

    async def playground_chat(
        self,
        messages: list[str],
        max_tokens: int = 24,
        on_delta: Callable[[int, list[dict[str, Any]]], None] | None = None,
    ) -> tuple[list[str], list[dict[str, Any]]]:
        """The messages as the turns of one new conversation (a socket of its own); `on_delta(n, route)`
        is called after a turn's n-th streamed delta, with the route its start event named."""
        headers = {"Origin": self.base, "Cookie": f"sessionid={self.admin.cookie('sessionid')}"}
        texts: list[str] = []
        route: list[dict[str, Any]] = []
        async with (
            ClientSession() as http,
            http.ws_connect(self.base + "/ws/chat/?format=json", headers=headers) as ws,
        ):
            for m in messages:
                await ws.send_json(
                    {"type": "chat", "model": self.model["id"], "message": m, "max_tokens": max_tokens}
                )
                parts: list[str] = []
                while True:
                    ev = await ws.receive_json(timeout=120)
                    if ev["type"] == "start":
                        route = ev["route"]
                    elif ev["type"] == "delta":
                        parts.append(ev["text"])
                        if on_delta is not None:
                            on_delta(len(parts), route)
                    elif ev["type"] == "error":
                        raise RuntimeError(f"the playground answered an error: {ev['error']}")
                    elif ev["type"] == "done":
                        if ev["text"] != "".join(parts):
                            raise RuntimeError(f"done's text {ev['text']!r} is not the deltas' {parts!r}")
                        texts.append(ev["text"])
                        self.telemetry.append(ev["telemetry"])
                        break
        return texts, route


def database() -> tuple[str, str | None]:
    """(DATABASE_URL for the processes, name of a PostgreSQL database to drop afterwards): a fresh
    database next to DATABASE_URL's when it is set, else ("", None): the embedded SQLite."""
    url = os.environ.get("DATABASE_URL", "")
    if not url:
        return "", None
    import psycopg

    name = f"swarm_it_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name)), name


def drop_database(name: str) -> None:
    import psycopg

    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def control_plane(tmp: Path, **env_extra: str) -> Iterator[Swarm]:
    """Migrate, create the admin, start beat + worker (real mode) and the web server; stop them after.

    `env_extra` overrides the processes' settings (e.g. DEFAULT_BACKEND=native); logs go to tmp/logs
    and are printed if starting fails."""
    logs = tmp / "logs"
    logs.mkdir(parents=True)
    db_url, db_name = database()
    redis = os.environ.get("REDIS_URL", "")
    run_id = uuid.uuid4().hex[:8]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DJANGO_SETTINGS_MODULE": "webapp.settings",
        "SWARM_DATA_DIR": str(tmp / "data"),
        "DATABASE_URL": db_url,
        "REDIS_URL": redis,
        "CELERY_TASK_ALWAYS_EAGER": "0" if redis else "1",
        "CELERY_QUEUE": f"swarm-it-{run_id}",
        "CHANNELS_PREFIX": f"swarmit{run_id}",
        "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
        # Long enough that a heartbeat delayed by a loaded CI machine never re-places a live agent.
        "NODE_LOST_AFTER_S": "15",
        # The tests compare against the torch oracle on the whole file, so shards run the oracle too.
        "DEFAULT_BACKEND": "torch",
        **env_extra,
    }
    port = free_port()
    s = Swarm(f"http://127.0.0.1:{port}", tmp / "data", env, logs, AdminClient(f"http://127.0.0.1:{port}"))
    try:
        s.manage("migrate", "--noinput")
        s.manage("createsuperuser", "--noinput", "--username", ADMIN_USER, "--email", "admin@example.invalid")
        if redis:
            s.spawn("beat", beat_command(tmp / "beat-schedule"))
            s.spawn("worker", worker_command())
        s.start_web(port)
        s.admin.login(ADMIN_USER, PASSWORD)
        yield s
    except BaseException:
        print(s.log_tail())
        raise
    finally:
        stop(s.procs, grace_s=15)
        if db_name:
            drop_database(db_name)


# -- the stand-in origin: tracker + web seed without the rest of the control plane ------------------------

_CHUNK = 64 * 1024


@dataclass
class SeedRule:
    """How the web seed treats one passkey: off, throttled, or serving flipped bytes."""

    enabled: bool = True
    rate_bps: float | None = None
    corrupt: bool = False


@dataclass
class Origin:
    """Serves one artifact as a BEP 19 web seed and runs the passkey tracker, both over real HTTP."""

    path: Path
    infohashes: set[bytes] = field(default_factory=set)
    passkeys: set[str] = field(default_factory=set)
    interval_s: int = 2
    total_rate_bps: float | None = None  # the origin's uplink, shared by every web seed request
    rules: dict[str, SeedRule] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    announces: list[tuple[str, bytes]] = field(default_factory=list)
    port: int = 0
    ssl_context: ssl.SSLContext | None = None  # https tracker and web seed (tests/agent/test_torrent_tls.py)

    @property
    def _base(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}"

    def __post_init__(self) -> None:
        self.store = logic.MemoryPeerStore()
        self.config = logic.TrackerConfig(interval_s=self.interval_s, min_interval_s=1)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._uplink_free_at = 0.0
        self._thread = threading.Thread(target=self._run, name="origin", daemon=True)

    # URLs an agent with this passkey uses
    def tracker_url(self, passkey: str) -> str:
        return f"{self._base}/tracker/{passkey}/announce"

    def web_seed_url(self, passkey: str) -> str:
        return f"{self._base}/webseed/{passkey}/{self.path.name}"

    @property
    def origin_bytes(self) -> int:
        return sum(self.served.values())

    def start(self) -> Origin:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("origin server did not start within 10 s")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> Origin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/webseed/{passkey}/{name}", self._webseed)
        app.router.add_get("/tracker/{passkey}/announce", self._announce)
        app.router.add_get("/tracker/{passkey}/scrape", self._scrape)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        self._loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(runner.cleanup())
            self._loop.close()

    def _known(self, infohash: bytes) -> bool:
        return infohash in self.infohashes

    def _passkey_ok(self, passkey: str) -> bool:
        return passkey in self.passkeys

    async def _announce(self, request: web.Request) -> web.Response:
        passkey = request.match_info["passkey"]
        raw = request.rel_url.raw_query_string
        body = logic.announce(
            raw,
            request.remote or "",
            passkey,
            passkey_ok=self._passkey_ok,
            torrent_known=self._known,
            store=self.store,
            config=self.config,
        )
        self.announces.append((passkey, body))
        return web.Response(body=body, content_type="text/plain")

    async def _scrape(self, request: web.Request) -> web.Response:
        body = logic.scrape(
            request.rel_url.raw_query_string,
            request.match_info["passkey"],
            passkey_ok=self._passkey_ok,
            torrent_known=self._known,
            store=self.store,
        )
        return web.Response(body=body, content_type="text/plain")

    async def _webseed(self, request: web.Request) -> web.StreamResponse:
        passkey = request.match_info["passkey"]
        if passkey not in self.passkeys or request.match_info["name"] != self.path.name:
            return web.Response(status=403, text="unknown passkey or artifact")
        rule = self.rules.get(passkey, SeedRule())
        if not rule.enabled:
            return web.Response(status=503, text="web seed disabled for this node")
        size = self.path.stat().st_size
        try:
            plan = plan_range(request.headers.get("Range"), size)
        except RangeNotSatisfiable as e:
            return web.Response(status=416, text=str(e), headers=e.headers)
        resp = web.StreamResponse(status=plan.status, headers=plan.headers)
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sent = 0
        with open(self.path, "rb") as f:
            f.seek(plan.start)
            while sent < plan.length:
                data = f.read(min(_CHUNK, plan.length - sent))
                if not data:
                    break
                if rule.corrupt:
                    data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
                await resp.write(data)
                sent += len(data)
                self.served[passkey] += len(data)
                if rule.rate_bps:
                    ahead = sent / rule.rate_bps - (loop.time() - t0)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                if self.total_rate_bps:
                    self._uplink_free_at = (
                        max(loop.time(), self._uplink_free_at) + len(data) / self.total_rate_bps
                    )
                    await asyncio.sleep(self._uplink_free_at - loop.time())
        await resp.write_eof()
        return resp
