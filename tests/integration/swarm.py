"""Shared helpers of the integration tests: a control plane of real processes on 127.0.0.1 and its agents.

Uses PostgreSQL and Redis when DATABASE_URL / REDIS_URL are set (CI), else the embedded SQLite + eager
mode. Every wait polls a readiness condition; nothing sleeps a guessed time.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import ClientSession

from agent.procs import Process, free_port, spawn, stop, wait_http
from webapp.core.adminclient import AdminClient

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "it-admin-password-1"
QUESTION = "What is the capital of France? Answer in one sentence."


@dataclass
class Swarm:
    """Handles on the running processes and the admin session."""

    base: str
    data_dir: Path
    env: dict[str, str]
    logs: Path
    admin: AdminClient
    web: Process | None = None
    agents: dict[str, Process] = field(default_factory=dict)
    agent_dirs: dict[str, Path] = field(default_factory=dict)
    procs: list[Process] = field(default_factory=list)
    model: dict[str, Any] = field(default_factory=dict)
    telemetry: list[dict[str, Any]] = field(default_factory=list)

    def spawn(self, name: str, cmd: list[str]) -> Process:
        p = spawn(cmd, self.logs / f"{name}.log", env=self.env, cwd=REPO, append=True)
        self.procs.append(p)
        return p

    def start_web(self, port: int) -> None:
        self.web = self.spawn(
            "web",
            [
                sys.executable,
                "-m",
                "webapp.serve",
                "-b",
                "127.0.0.1",
                "-p",
                str(port),
                "webapp.asgi:application",
            ],
        )
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

    def enroll(self, name: str) -> tuple[Path, str]:
        """Enroll an agent with a token created as an admin would; returns (node config path, token)."""
        token = self.admin.create_enrollment_token(name)
        config = self.data_dir / name / "node.json"
        subprocess.run(
            [sys.executable, "-m", "agent", "enroll", "--server", self.base, "--token", token]
            + ["--name", name, "--config", str(config)],
            cwd=REPO,
            env=self.env,
            check=True,
        )
        return config, token

    def run_agent(self, name: str, config: Path, *extra: str) -> str:
        """Start `agent run` for an enrolled config (torrent session on 127.0.0.1); returns its node id."""
        node_id = str(json.loads(config.read_text())["node_id"])
        self.agent_dirs[node_id] = config.parent / "data"
        self.agents[node_id] = self.spawn(
            name,
            [sys.executable, "-m", "agent", "run", "--config", str(config)]
            + ["--data-dir", str(config.parent / "data"), "--threads", "1"]
            + ["--torrent-listen", "127.0.0.1:0", *extra],  # the swarm stays on loopback
        )
        return node_id

    def online(self, node_ids: list[str]) -> Any:
        return self.admin.wait_for(
            "agents online",
            lambda st: all(
                any(n["id"] == nid and n["state"] == "online" and n["dataplane_url"] for n in st["nodes"])
                for nid in node_ids
            ),
            120,
        )

    def shards_ready(self, timeout_s: float = 600) -> list[dict[str, Any]]:
        def check(st: dict[str, Any]) -> list[dict[str, Any]] | None:
            shards = [sh for n in st["nodes"] if n["state"] == "online" for sh in n["shards"]]
            failed = [sh for sh in shards if sh["state"] == "failed"]
            assert not failed, failed
            return shards if shards and all(sh["state"] == "ready" for sh in shards) else None

        return self.admin.wait_for("shards ready", check, timeout_s, every_s=0.5)

    def register_smollm2(self) -> dict[str, Any]:
        code, body = self.admin.post("/models/register", {"kind": "package", "package": "smollm2"})
        assert code == 200, body
        self.model = self.admin.wait_for(
            "manifest",
            lambda st: next((m for m in st["models"] if m["state"] in ("ready", "failed")), None),
            300,
        )
        assert self.model["state"] == "ready", self.model
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
        texts, route = [], []
        async with (
            ClientSession() as http,
            http.ws_connect(self.base + "/ws/chat/?format=json", headers=headers) as ws,
        ):
            for m in messages:
                await ws.send_json(
                    {"type": "chat", "model": self.model["id"], "message": m, "max_tokens": max_tokens}
                )
                parts = []
                while True:
                    ev = await ws.receive_json(timeout=120)
                    if ev["type"] == "start":
                        route = ev["route"]
                    elif ev["type"] == "delta":
                        parts.append(ev["text"])
                        if on_delta is not None:
                            on_delta(len(parts), route)
                    elif ev["type"] == "error":
                        raise AssertionError(ev["error"])
                    elif ev["type"] == "done":
                        assert ev["text"] == "".join(parts)
                        texts.append(ev["text"])
                        self.telemetry.append(ev["telemetry"])
                        break
        return texts, route


def _database() -> tuple[str, str | None]:
    """(DATABASE_URL for the processes, name of a PostgreSQL database to drop afterwards)."""
    url = os.environ.get("DATABASE_URL", "")
    if not url:
        return "", None
    import psycopg

    name = f"swarm_it_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name)), name


def _drop(name: str) -> None:
    import psycopg

    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def control_plane(tmp: Path, **env_extra: str) -> Iterator[Swarm]:
    """Migrate, create the admin, start beat + worker (real mode) and the web server; stop them after."""
    logs = tmp / "logs"
    logs.mkdir(parents=True)
    db_url, db_name = _database()
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
        # These tests compare against the torch oracle on the whole file, so shards run the oracle too.
        "DEFAULT_BACKEND": "torch",
        **env_extra,
    }
    port = free_port()
    s = Swarm(f"http://127.0.0.1:{port}", tmp / "data", env, logs, AdminClient(f"http://127.0.0.1:{port}"))
    try:
        s.manage("migrate", "--noinput")
        s.manage("createsuperuser", "--noinput", "--username", "admin", "--email", "admin@example.invalid")
        if redis:
            s.spawn(
                "beat",
                [sys.executable, "-m", "celery", "-A", "webapp", "beat", "-l", "INFO"]
                + ["-s", str(tmp / "beat-schedule")],
            )
            s.spawn(
                "worker",
                [sys.executable, "-m", "celery", "-A", "webapp", "worker", "--pool", "solo", "-l", "INFO"],
            )
        s.start_web(port)
        s.admin.login("admin", PASSWORD)
        yield s
    except BaseException:
        print(s.log_tail())
        raise
    finally:
        stop(s.procs, grace_s=15)
        if db_name:
            _drop(db_name)
