"""Services restart one at a time while an answer streams: web, Celery worker, an agent, Redis, PostgreSQL.

The data plane does not depend on any of them, so the answer completes token for token; afterwards the
agents are online again with their shards (none loaded twice, none downloaded again) and what the
control plane had recorded is still there. Needs PostgreSQL's and Redis's servers on the machine
(DATABASE_URL, REDIS_URL: CI and scripts/test.sh set them); the control plane gets a Redis and a
PostgreSQL of its own (redis-server, and initdb into a temporary directory, each on a free port), so
restarting them disturbs no other test: the file runs beside the others.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.client.route import Hop, RouteClient
from agent.procs import Process, free_port, spawn, stop, wait_until
from agent.wire.routetoken import load_private_key, mint
from agent.wire.sampling import SamplingParams
from tests.integration.swarm import PASSWORD, QUESTION, Swarm, control_plane

pytestmark = pytest.mark.slow
N_TOKENS = 64


class PrivateRedis:
    """A redis-server of the test's own on a free port (no persistence), restartable on that port."""

    def __init__(self, logdir: Path) -> None:
        self.port, self.logdir = free_port(), logdir
        self.proc = self._start()

    def _ping(self) -> bool | None:
        cmd = ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), "ping"]
        return subprocess.run(cmd, capture_output=True).returncode == 0 or None

    def _start(self) -> Process:
        cmd = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        proc = spawn(cmd, self.logdir / "redis.log", append=True)
        wait_until("redis to answer", self._ping, 30, procs=[proc])
        return proc

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self) -> None:
        stop([self.proc])
        self.proc = self._start()


class PrivatePostgres:
    """A PostgreSQL server of the test's own: a cluster initdb'd into a temporary directory (trust auth,
    no fsync), on a free port and a socket directory of its own, run as the postgres user when the test
    runs as root (initdb refuses root). Restarting it cuts no other test's connections."""

    def __init__(self) -> None:
        versions = sorted(os.listdir("/usr/lib/postgresql"), key=int)
        self.bin = Path("/usr/lib/postgresql") / versions[-1] / "bin"
        # under /tmp itself: pytest's temporary directories are root's alone, and the server's user
        # must reach its data directory
        self.root = Path(tempfile.mkdtemp(prefix="ggs-pg-"))
        self.dir = self.root / "pgdata"
        self.dir.mkdir(mode=0o700)
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.dir, "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self.port = free_port()
        self._run("initdb", "-D", str(self.dir), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        self._ctl("start")

    def _run(self, tool: str, *args: str) -> None:
        cmd = [*self.as_user, str(self.bin / tool), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{tool} failed: {done.stdout[-1000:]}{done.stderr[-1000:]}"

    def _ctl(self, action: str) -> None:
        opts = f"-p {self.port} -h 127.0.0.1 -k {self.dir} -F"
        log = str(self.dir / "server.log")
        self._run(
            "pg_ctl", "-D", str(self.dir), "-o", opts, "-l", log, "-m", "fast", "-w", "-t", "60", action
        )

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def restart(self) -> None:
        self._ctl("restart")

    def close(self) -> None:
        try:
            self._ctl("stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres() -> Iterator[PrivatePostgres]:
    if not os.path.isdir("/usr/lib/postgresql"):
        pytest.skip("no PostgreSQL server binaries (/usr/lib/postgresql) to start a private cluster")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        pytest.skip("running as root without runuser: initdb cannot run")
    pg = PrivatePostgres()
    yield pg
    pg.close()


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    if not (os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL")):
        pytest.skip("restart tests need PostgreSQL and Redis (DATABASE_URL, REDIS_URL)")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on this machine")
    r = PrivateRedis(tmp_path_factory.mktemp("redis"))
    yield r
    stop([r.proc])


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: str, redis: PrivateRedis, postgres: PrivatePostgres
) -> Iterator[Swarm]:
    # NODE_DEAD_AFTER_S: the restarted agent must come back before its shards would be placed elsewhere
    tmp = tmp_path_factory.mktemp("restarts")
    private = {"REDIS_URL": redis.url, "DATABASE_URL": postgres.url}
    with control_plane(tmp, DEFAULT_BACKEND="native", NODE_DEAD_AFTER_S="300", **private) as s:
        for i in (1, 2):
            config, _ = s.enroll(f"agent-{i}")
            s.run_agent(f"agent-{i}", config, "--speed", "1.0")
        s.online(list(s.agents))
        s.register_smollm2()
        code, body = s.admin.post(f"/models/{s.model['id']}/place", {"replicas": "1"})
        assert code == 200, body
        s.shards_ready(300)
        yield s


def _client(s: Swarm) -> RouteClient:
    """A route over the placed shards, tokens minted with the control plane's key (as routing does)."""
    key = load_private_key(s.data_dir / "route_key.pem")
    session = os.urandom(16)
    n_layers = s.model["n_layers"]

    def cover(st: dict[str, Any]) -> list[tuple[int, int, str, str]] | None:
        # a shard whose agent is still re-reporting after a restart is briefly not "ready": wait until
        # the ready shards of online nodes cover 0..n_layers end to end, else the route would stop short
        shards = sorted(
            (sh["layer_start"], sh["layer_end"], n["dataplane_url"], n["id"])
            for n in st["nodes"]
            if n["state"] == "online"
            for sh in n["shards"]
            if sh["state"] == "ready"
        )
        ends = [0] + [b for _, b, _, _ in shards]
        ok = shards and all(a == ends[k] for k, (a, *_rest) in enumerate(shards)) and ends[-1] == n_layers
        return shards if ok else None

    shards = s.admin.wait_for("ready shards covering every layer", cover, 120, every_s=0.25)
    hops = [
        Hop(url, a, b, mint(key, session, s.model["sha256"], a, b, node, 600)) for a, b, url, node in shards
    ]
    return RouteClient(hops, session_id=session)


async def _answer(s: Swarm, prompt: list[int], disturb: Callable[[], None] | None = None) -> list[int]:
    client = _client(s)
    out: list[int] = []
    try:
        async for tok, _ in client.generate(prompt, SamplingParams(), N_TOKENS):
            out.append(tok)
            if len(out) == N_TOKENS // 4 and disturb is not None:
                disturb()  # blocks the loop: no step is in flight, the hops wait for the next one
    finally:
        await client.close()
    return out


@pytest.fixture(scope="module")
def prompt(model_path: str) -> list[int]:
    from agent.client.tokenizer import ChatTokenizer

    return ChatTokenizer(model_path).encode_chat([{"role": "user", "content": QUESTION}])


@pytest.fixture(scope="module")
def recorded(swarm: Swarm) -> dict[str, int]:
    """A playground answer before any restart, and the rows the control plane keeps about it."""
    import asyncio

    asyncio.run(swarm.playground_chat([QUESTION]))
    return _counts(swarm)


@pytest.fixture(scope="module")
def reference(swarm: Swarm, prompt: list[int], recorded: dict[str, int]) -> list[int]:
    import asyncio

    return asyncio.run(_answer(swarm, prompt))


def _sql(s: Swarm, query: str) -> int:
    import psycopg

    with psycopg.connect(s.env["DATABASE_URL"]) as conn:
        row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def _counts(s: Swarm) -> dict[str, int]:
    return {
        "generations": _sql(s, "SELECT count(*) FROM telemetry_generationrecord"),
        "messages": _sql(s, "SELECT count(*) FROM playground_message"),
        "assignments": _sql(s, "SELECT count(*) FROM fleet_shardassignment WHERE state = 'ready'"),
    }


def _loads(s: Swarm) -> int:
    return sum(p.read_text().count("loaded ") for p in s.logs.glob("agent-*.log"))


def _back(s: Swarm, loads_before: int) -> None:
    s.online(list(s.agents))
    s.shards_ready(120)
    assert _loads(s) == loads_before, "a reconnecting agent loaded a shard again"


def _restart_web(s: Swarm) -> None:
    assert s.web is not None
    stop([s.web], grace_s=30)
    s.start_web(int(s.base.rsplit(":", 1)[1]))


def _restart_worker(s: Swarm) -> None:
    worker = next(p for p in s.procs if "worker" in list(p.args) and p.poll() is None)
    stop([worker], grace_s=30)
    s.spawn(
        "worker", [sys.executable, "-m", "celery", "-A", "webapp", "worker", "--pool", "solo", "-l", "INFO"]
    )


async def test_an_answer_completes_while_the_web_server_restarts(
    swarm: Swarm, prompt: list[int], reference: list[int]
) -> None:
    loads = _loads(swarm)
    assert await _answer(swarm, prompt, lambda: _restart_web(swarm)) == reference
    swarm.admin.login("admin", PASSWORD)
    _back(swarm, loads)


async def test_an_answer_completes_while_the_celery_worker_restarts(
    swarm: Swarm, prompt: list[int], reference: list[int]
) -> None:
    loads = _loads(swarm)
    assert await _answer(swarm, prompt, lambda: _restart_worker(swarm)) == reference
    _back(swarm, loads)


def test_a_restarted_agent_serves_again_from_its_shards_on_disk_without_downloading(swarm: Swarm) -> None:
    s = swarm
    node_id, proc = next(iter(s.agents.items()))
    mine = [sh for n in s.admin.status()["nodes"] if n["id"] == node_id for sh in n["shards"]]
    before = mine[0]["transfer"]
    stop([proc], grace_s=30)
    s.run_agent(f"{node_id}-restarted", s.agent_dirs[node_id].parent / "node.json", "--speed", "1.0")
    s.admin.wait_for(
        "the restarted agent's shard ready again",
        lambda st: any(
            sh["state"] == "ready" and sh["transfer"] != before
            for n in st["nodes"]
            if n["id"] == node_id and n["state"] == "online"
            for sh in n["shards"]
        ),
        180,
        every_s=0.5,
    )
    t = next(sh for n in s.admin.status()["nodes"] if n["id"] == node_id for sh in n["shards"])["transfer"]
    print("\nrestarted agent's transfer:", t)
    assert t["downloaded_bytes"] == 0, "the shard on disk was checked by its hashes, not downloaded again"


async def test_an_answer_completes_while_redis_restarts_and_the_agents_go_on_heartbeating(
    swarm: Swarm, prompt: list[int], reference: list[int], redis: PrivateRedis
) -> None:
    loads = _loads(swarm)
    assert await _answer(swarm, prompt, redis.restart) == reference
    _back(swarm, loads)
    seen = {n["id"]: n["last_seen"] for n in swarm.admin.status()["nodes"]}
    swarm.admin.wait_for(  # a reconnected socket that stopped heartbeating would stay behind
        "every agent to heartbeat again",
        lambda st: (
            all(n["state"] == "online" and n["last_seen"] > seen[n["id"]] for n in st["nodes"]) or None
        ),
        30,
    )


async def test_an_answer_completes_while_postgresql_restarts_and_nothing_recorded_is_lost(
    swarm: Swarm, prompt: list[int], reference: list[int], recorded: dict[str, int], postgres: PrivatePostgres
) -> None:
    assert await _answer(swarm, prompt, postgres.restart) == reference
    swarm.online(list(swarm.agents))
    swarm.shards_ready(120)
    after = _counts(swarm)
    assert after["generations"] >= recorded["generations"] and after["messages"] >= recorded["messages"]
    assert after["assignments"] == recorded["assignments"]
    texts, _ = await swarm.playground_chat([QUESTION])  # and the control plane still answers and records
    assert texts[0].strip()
    assert _counts(swarm)["generations"] > after["generations"]
