"""The control plane with real processes on 127.0.0.1: web (daphne) + Celery worker + two enrolled agents.

Uses PostgreSQL and Redis when DATABASE_URL / REDIS_URL are set (CI), else the embedded SQLite +
eager mode. Every wait polls a readiness condition; nothing sleeps a guessed time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession

from agent.backends.base import SamplingParams
from agent.client import Hop, RouteClient
from agent.routetoken import load_private_key, mint
from agent.tokenizer import ChatTokenizer
from tests.conftest import free_port, wait_http
from webapp.core.adminclient import AdminClient

pytestmark = pytest.mark.slow
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
    web: subprocess.Popen[bytes] | None = None
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    model: dict[str, Any] = field(default_factory=dict)
    telemetry: list[dict[str, Any]] = field(default_factory=list)

    def spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=self.env,
            stdout=(self.logs / f"{name}.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        self.procs.append(p)
        return p

    def start_web(self, port: int) -> None:
        self.web = self.spawn(
            "web",
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "webapp.asgi:application"],
        )
        wait_http(self.base + "/healthz", timeout=60, proc=self.web)

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


def _database(tmp: Path) -> tuple[str, str | None]:
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


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[Swarm]:
    tmp = tmp_path_factory.mktemp("control-plane")
    logs = tmp / "logs"
    logs.mkdir()
    db_url, db_name = _database(tmp)
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
    }
    port = free_port()
    s = Swarm(f"http://127.0.0.1:{port}", tmp / "data", env, logs, AdminClient(f"http://127.0.0.1:{port}"))
    try:
        s.manage("migrate", "--noinput")
        s.manage("createsuperuser", "--noinput", "--username", "admin", "--email", "admin@example.invalid")
        if redis:
            s.spawn(
                "beat",
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "webapp",
                    "beat",
                    "-l",
                    "INFO",
                    "-s",
                    str(tmp / "beat-schedule"),
                ],
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
        for p in s.procs:
            if p.poll() is None:
                p.terminate()
        for p in s.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if db_name:
            _drop(db_name)


def _online(s: Swarm, node_ids: list[str]) -> Any:
    return s.admin.wait_for(
        "agents online",
        lambda st: all(
            any(n["id"] == nid and n["state"] == "online" and n["dataplane_url"] for n in st["nodes"])
            for nid in node_ids
        ),
        120,
    )


def _shards_ready(s: Swarm) -> list[dict[str, Any]]:
    def check(st: dict[str, Any]) -> list[dict[str, Any]] | None:
        shards = [sh for n in st["nodes"] if n["state"] == "online" for sh in n["shards"]]
        failed = [sh for sh in shards if sh["state"] == "failed"]
        assert not failed, failed
        return shards if shards and all(sh["state"] == "ready" for sh in shards) else None

    return s.admin.wait_for("shards ready", check, 600, every_s=0.5)


def test_two_agents_enroll_with_admin_tokens_and_smollm2_is_placed_across_both(swarm: Swarm) -> None:
    s = swarm
    for i in (1, 2):
        token = s.admin.create_enrollment_token(f"agent {i}")
        config = s.data_dir / f"agent-{i}" / "node.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "agent",
                "enroll",
                "--server",
                s.base,
                "--token",
                token,
                "--name",
                f"agent-{i}",
                "--config",
                str(config),
            ],
            cwd=REPO,
            env=s.env,
            check=True,
        )
        again = subprocess.run(
            [
                sys.executable,
                "-m",
                "agent",
                "enroll",
                "--server",
                s.base,
                "--token",
                token,
                "--config",
                str(config.with_name("reuse.json")),
            ],
            cwd=REPO,
            env=s.env,
            capture_output=True,
            text=True,
        )
        assert again.returncode != 0 and "already used" in again.stderr
        node_id = __import__("json").loads(config.read_text())["node_id"]
        s.agents[node_id] = s.spawn(
            f"agent-{i}",
            [
                sys.executable,
                "-m",
                "agent",
                "run",
                "--config",
                str(config),
                "--data-dir",
                str(config.parent / "data"),
                "--threads",
                "1",
            ],
        )
    _online(s, list(s.agents))

    code, body = s.admin.post("/models/register", {"kind": "package", "package": "smollm2"})
    assert code == 200, body
    s.model = s.admin.wait_for(
        "manifest", lambda st: next((m for m in st["models"] if m["state"] in ("ready", "failed")), None), 300
    )
    assert s.model["state"] == "ready", s.model
    code, body = s.admin.post(f"/models/{s.model['id']}/place", {"replicas": "1"})
    assert code == 200, body
    shards = _shards_ready(s)
    by_node = {n["id"]: n["shards"] for n in s.admin.status()["nodes"]}
    assert all(len(by_node[nid]) == 1 for nid in s.agents), by_node
    ranges = sorted((sh["layer_start"], sh["layer_end"]) for sh in shards)
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 30


async def _playground_chat(s: Swarm, messages: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    headers = {"Origin": s.base, "Cookie": f"sessionid={s.admin.cookie('sessionid')}"}
    texts, route = [], []
    async with (
        ClientSession() as http,
        http.ws_connect(s.base + "/ws/chat/?format=json", headers=headers) as ws,
    ):
        for m in messages:
            await ws.send_json({"type": "chat", "model": s.model["id"], "message": m, "max_tokens": 24})
            parts = []
            while True:
                ev = await ws.receive_json(timeout=120)
                if ev["type"] == "start":
                    route = ev["route"]
                elif ev["type"] == "delta":
                    parts.append(ev["text"])
                elif ev["type"] == "error":
                    raise AssertionError(ev["error"])
                elif ev["type"] == "done":
                    assert ev["text"] == "".join(parts)
                    texts.append(ev["text"])
                    s.telemetry.append(ev["telemetry"])
                    break
    return texts, route


async def test_a_playground_chat_matches_the_route_client_on_the_same_hops(
    swarm: Swarm, model_path: str
) -> None:
    s = swarm
    texts, route = await _playground_chat(s, [QUESTION])
    assert texts[0].strip()
    assert len(route) == 2 and {h["node"] for h in route} == set(s.agents)

    key = load_private_key(s.data_dir / "route_key.pem")
    session = os.urandom(16)
    hops = [
        Hop(
            h["url"],
            h["layer_start"],
            h["layer_end"],
            mint(key, session, s.model["sha256"], h["layer_start"], h["layer_end"], h["node"], 600),
        )
        for h in route
    ]
    client = RouteClient(hops, ChatTokenizer(model_path), session_id=session)
    try:
        parts = [
            ev.text async for ev in client.chat([{"role": "user", "content": QUESTION}], SamplingParams(), 24)
        ]
    finally:
        await client.close()
    assert "".join(parts) == texts[0]


async def test_agents_reconnect_after_the_control_plane_restarts_keeping_their_shards(swarm: Swarm) -> None:
    s = swarm
    assert s.web is not None
    s.web.send_signal(signal.SIGTERM)
    s.web.wait(30)
    s.start_web(int(s.base.rsplit(":", 1)[1]))
    s.admin.login("admin", PASSWORD)
    _online(s, list(s.agents))
    _shards_ready(s)
    logs = "".join((s.logs / f"agent-{i}.log").read_text() for i in (1, 2))
    assert logs.count("loaded ") == 2, "no shard was loaded a second time"
    texts, _ = await _playground_chat(s, [QUESTION, "Now name a famous museum there."])
    assert all(t.strip() for t in texts)
    first, second = s.telemetry[-2:]
    assert second["n_reused"] > first["n_prompt"], "turn 2 reuses the hops' KV and sends only the new tokens"
    assert second["n_prefilled"] == second["n_prompt"] - second["n_reused"] < first["n_prompt"]


def test_a_hung_agent_that_stops_heartbeating_shows_offline_within_ten_seconds(swarm: Swarm) -> None:
    s = swarm
    victim, proc = list(s.agents.items())[1]
    proc.send_signal(signal.SIGSTOP)  # the socket stays open; only the heartbeats stop
    try:
        t0 = time.monotonic()
        s.admin.wait_for(
            "the hung agent offline",
            lambda st: any(n["id"] == victim and n["state"] == "offline" for n in st["nodes"]),
            10,
            every_s=0.2,
        )
        assert time.monotonic() - t0 < 10
    finally:
        proc.send_signal(signal.SIGCONT)
    s.admin.wait_for(
        "the resumed agent online again",
        lambda st: any(n["id"] == victim and n["state"] == "online" for n in st["nodes"]),
        30,
    )


def test_a_killed_agent_shows_offline_within_ten_seconds(swarm: Swarm) -> None:
    s = swarm
    victim, proc = next(iter(s.agents.items()))
    proc.kill()
    t0 = time.monotonic()
    s.admin.wait_for(
        "the killed agent offline",
        lambda st: any(n["id"] == victim and n["state"] == "offline" for n in st["nodes"]),
        10,
        every_s=0.2,
    )
    assert time.monotonic() - t0 < 10


async def test_the_layers_of_a_lost_agent_are_placed_on_the_survivor_and_chat_works_again(
    swarm: Swarm,
) -> None:
    s = swarm
    survivor = list(s.agents)[1]

    def covered(st: dict[str, Any]) -> bool:
        node = next(n for n in st["nodes"] if n["id"] == survivor)
        ready = sorted(
            (sh["layer_start"], sh["layer_end"]) for sh in node["shards"] if sh["state"] == "ready"
        )
        pos = 0
        for a, b in ready:
            if a == pos:
                pos = b
        return pos == 30

    s.admin.wait_for("the survivor to hold every layer", covered, 300, every_s=0.5)
    texts, route = await _playground_chat(s, [QUESTION])
    assert texts[0].strip() and {h["node"] for h in route} == {survivor}
