"""docker-compose.yml, checked without a Docker daemon: against the Compose specification's schema, rendered
by a compose tool (podman-compose's dry run: interpolation from .env, merge keys), and run natively:
every service's command and environment from the rendered file, against the local PostgreSQL and Redis,
until the playground answers through the two agents and both /metrics pages have moved.

What the native run changes, and only that: container host names and ports become 127.0.0.1 and free
ports, container paths (/data, /config) become temporary directories, the database URL names a fresh
database on the local server, and a shared Redis gets this run's own Celery queue and channel prefix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from agent.procs import Process, free_port, spawn, stop, wait_until
from tests.integration.swarm import QUESTION, Swarm
from webapp.core.adminclient import AdminClient
from webapp.devcluster import database, drop_database

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
BIN = Path(sys.executable).parent
CONTROL_PLANE = ("migrate", "web", "worker", "beat")
AGENTS = ("agent-1", "agent-2")
TEST_ENV = {  # what an admin puts in .env
    "SECRET_KEY": "compose-test-" + "k" * 40,
    "POSTGRES_PASSWORD": "compose-test",
    "DJANGO_SUPERUSER_PASSWORD": "compose-test-password",
    "AGENT_THREADS": "1",
}


def env_file(tmp: Path, **values: str) -> Path:
    """.env.example with the given values filled in."""
    lines = []
    for line in (REPO / ".env.example").read_text().splitlines():
        key = line.split("=", 1)[0]
        lines.append(f"{key}={values[key]}" if key in values and not line.startswith("#") else line)
    path = tmp / ".env"
    path.write_text("\n".join(lines) + "\n")
    return path


def render(env: Path) -> dict[str, Any]:
    """docker-compose.yml as a compose tool resolves it (podman-compose --dry-run config; no daemon)."""
    tool = BIN / "podman-compose"
    if not tool.exists():
        pytest.skip("podman-compose is not installed (requirements.txt pins it)")
    proc = subprocess.run(
        [str(tool), "--dry-run", "-f", str(COMPOSE), "--env-file", str(env), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in TEST_ENV},
    )
    assert proc.returncode == 0, proc.stderr
    rendered: dict[str, Any] = yaml.safe_load(proc.stdout)
    return rendered


def test_the_compose_file_follows_the_compose_specification() -> None:
    tool = BIN / "check-jsonschema"
    if not tool.exists():
        pytest.skip("check-jsonschema is not installed (requirements.txt pins it)")
    proc = subprocess.run(
        [str(tool), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_rendered_file_has_every_service_healthchecks_and_named_volumes(tmp_path: Path) -> None:
    cfg = render(env_file(tmp_path, **TEST_ENV))
    services = cfg["services"]
    assert set(services) == {"postgres", "redis", *CONTROL_PLANE, *AGENTS}
    for name in ("postgres", "redis", "web", "worker", "beat", *AGENTS):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    # web, worker and beat share one image; the agents have their own
    assert {services[n]["image"] for n in CONTROL_PLANE} == {"gguf-swarm-web:latest"}
    assert {services[n]["build"]["dockerfile"] for n in CONTROL_PLANE} == {"docker/web.Dockerfile"}
    assert {services[n]["build"]["dockerfile"] for n in AGENTS} == {"docker/agent.Dockerfile"}
    for dockerfile in ("web", "agent", "agent-cuda"):
        assert (REPO / "docker" / f"{dockerfile}.Dockerfile").is_file()
    # the database and the model caches live on named volumes
    assert "postgres-data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert "agent1-models:/data" in services["agent-1"]["volumes"]
    assert "agent2-models:/data" in services["agent-2"]["volumes"]
    assert {"postgres-data", "agent1-models", "agent2-models"} <= set(cfg["volumes"])
    # .env values reach the services
    assert services["web"]["environment"]["SECRET_KEY"] == TEST_ENV["SECRET_KEY"]
    assert "compose-test@postgres:5432" in services["web"]["environment"]["DATABASE_URL"]


def test_a_missing_secret_is_refused_when_rendering(tmp_path: Path) -> None:
    tool = BIN / "podman-compose"
    if not tool.exists():
        pytest.skip("podman-compose is not installed")
    blank = env_file(tmp_path, SECRET_KEY="", POSTGRES_PASSWORD="", DJANGO_SUPERUSER_PASSWORD="")
    proc = subprocess.run(
        [str(tool), "--dry-run", "-f", str(COMPOSE), "--env-file", str(blank), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in TEST_ENV},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and (
        "set SECRET_KEY in .env" in out or "set POSTGRES_PASSWORD in .env" in out
    ), out


# --- the native run ------------------------------------------------------------------------------------


class NativeRun:
    """Runs compose services as local processes, translating container names, ports and paths."""

    def __init__(self, cfg: dict[str, Any], tmp: Path, database_url: str, redis_url: str) -> None:
        self.cfg, self.tmp = cfg, tmp
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.web_port = free_port()
        self.base = f"http://127.0.0.1:{self.web_port}"
        self.agent_ports = {name: free_port() for name in AGENTS}
        run_id = uuid.uuid4().hex[:8]
        self.shared = tmp / "web-data"  # the web-data volume: web, worker and beat share it
        self.rewrites = [
            ("0.0.0.0:6881", "127.0.0.1:0"),  # libtorrent picks a free port on loopback
            ("http://web:8000", self.base),
            ("http://localhost:8000", self.base),
            ("127.0.0.1:8000", f"127.0.0.1:{self.web_port}"),
        ]
        self.extra = {
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "CELERY_QUEUE": f"swarm-compose-{run_id}",
            "CHANNELS_PREFIX": f"swarmcompose{run_id}",
        }
        self.procs: list[Process] = []
        self.by_name: dict[str, Process] = {}

    def _volume_dir(self, service: str, target: str) -> Path:
        if service in CONTROL_PLANE and target == "/data":
            d = self.shared
        else:
            d = self.tmp / service / target.strip("/")
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d

    def _translate(self, service: str, text: str) -> str:
        spec = self.cfg["services"][service]
        for a, b in self.rewrites:
            text = text.replace(a, b)
        if service in AGENTS:
            port = str(self.agent_ports[service])
            text = text.replace(f"http://{service}:9000", f"http://127.0.0.1:{port}")
            text = text.replace("127.0.0.1:9000", f"127.0.0.1:{port}")
        for volume in spec.get("volumes", []):
            target = volume.split(":")[1]
            if text == target or text.startswith(target + "/") or f" {target}/" in text:
                text = text.replace(target, str(self._volume_dir(service, target)))
        return text

    def argv(self, service: str, *, healthcheck: bool = False) -> list[str]:
        spec = self.cfg["services"][service]
        if healthcheck:
            cmd = list(spec["healthcheck"]["test"][1:])
        else:
            cmd = list(spec.get("entrypoint") or []) + list(spec["command"])
        if cmd[0] == "agent-entrypoint":  # the image's entrypoint script, from the repository
            cmd[0] = str(REPO / "docker" / "agent-entrypoint.sh")
        args = [self._translate(service, c) for c in cmd]
        if service in ("web", *AGENTS) and not healthcheck:
            args = ["127.0.0.1" if a == "0.0.0.0" else a for a in args]
            if service == "web":
                args = [str(self.web_port) if a == "8000" else a for a in args]
            else:
                args = [str(self.agent_ports[service]) if a == "9000" else a for a in args]
        return args

    def env(self, service: str, **more: str) -> dict[str, str]:
        spec = self.cfg["services"][service]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "REDIS_URL"))}
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # `python`, `celery`: this venv's
        env.pop("VIRTUAL_ENV", None)
        env.update({k: self._translate(service, str(v)) for k, v in (spec.get("environment") or {}).items()})
        if service in CONTROL_PLANE:
            env.update(self.extra)
        env.update(more)
        return env

    def start(self, service: str, **more: str) -> Process:
        p = spawn(self.argv(service), self.logs / f"{service}.log", env=self.env(service, **more), cwd=REPO)
        self.procs.append(p)
        self.by_name[service] = p
        return p

    def run_once(self, service: str) -> None:
        proc = subprocess.run(
            self.argv(service), env=self.env(service), cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def healthy(self, service: str) -> bool:
        proc = subprocess.run(
            self.argv(service, healthcheck=True),
            env=self.env(service),
            cwd=REPO,
            capture_output=True,
            timeout=60,
        )
        return proc.returncode == 0

    def wait_healthy(self, service: str, timeout_s: float = 120) -> None:
        wait_until(
            f"{service}'s healthcheck",
            lambda: self.healthy(service),
            timeout_s,
            procs=self.procs,
            every_s=0.5,
        )

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logs.glob("*.log")))


def scrape(url: str, token: str = "") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def tokens_served(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


@pytest.fixture
def native(tmp_path: Path) -> Iterator[NativeRun]:
    if not os.environ.get("DATABASE_URL") or not os.environ.get("REDIS_URL"):
        pytest.skip("the compose services need PostgreSQL and Redis (set DATABASE_URL and REDIS_URL)")
    if shutil.which("curl") is None:
        pytest.skip("the healthchecks run curl")
    cfg = render(env_file(tmp_path, **TEST_ENV, SWARM_METRICS_TOKEN="compose-metrics"))
    db_url, db_name = database()
    run = NativeRun(cfg, tmp_path, db_url, os.environ["REDIS_URL"])
    try:
        yield run
    except BaseException:
        print(run.log_tail())
        raise
    finally:
        stop(run.procs, grace_s=15)
        if db_name:
            drop_database(db_name)


async def test_every_service_runs_natively_from_the_compose_file_until_the_playground_answers(
    native: NativeRun,
) -> None:
    run = native
    run.run_once("migrate")
    for service in ("web", "worker", "beat"):
        run.start(service)
    for service in ("web", "worker", "beat"):
        run.wait_healthy(service)

    admin = AdminClient(run.base)
    admin.login("admin", TEST_ENV["DJANGO_SUPERUSER_PASSWORD"])
    s = Swarm(run.base, run.tmp, run.env("web"), run.logs, admin)
    for name in AGENTS:
        # the admin's step: a token from the fleet page into .env (AGENTn_ENROLL_TOKEN)
        run.start(name, GGUF_SWARM_ENROLL_TOKEN=admin.create_enrollment_token(name))
    for name in AGENTS:
        run.wait_healthy(name, timeout_s=180)
        config = run.tmp / name / "config" / "node.json"
        assert oct(config.stat().st_mode & 0o777) == "0o600"
        s.agents[json.loads(config.read_text())["node_id"]] = run.by_name[name]
    s.online(list(s.agents))

    s.register_smollm2()
    code, body = admin.post(f"/models/{s.model['id']}/place", {"replicas": "1"})
    assert code == 200, body
    shards = s.shards_ready()
    assert {sh["layer_start"] for sh in shards} >= {0}

    token = "compose-metrics"
    web_before = scrape(run.base + "/metrics", token)
    agents_before = {n: scrape(f"http://127.0.0.1:{run.agent_ports[n]}/metrics") for n in AGENTS}
    texts, route = await s.playground_chat([QUESTION], max_tokens=12)
    assert "Paris" in texts[0], texts
    assert route

    web_after = scrape(run.base + "/metrics", token)
    assert tokens_served(web_after, "gguf_swarm_tokens_served_total") > tokens_served(
        web_before, "gguf_swarm_tokens_served_total"
    )
    assert web_after[("gguf_swarm_nodes", (("state", "online"),))] == 2
    moved = {
        n: scrape(f"http://127.0.0.1:{run.agent_ports[n]}/metrics")[("gguf_swarm_agent_tokens_in_total", ())]
        - agents_before[n][("gguf_swarm_agent_tokens_in_total", ())]
        for n in AGENTS
    }
    assert any(v > 0 for v in moved.values()), moved
    served = sum(
        scrape(f"http://127.0.0.1:{run.agent_ports[n]}/metrics")[("gguf_swarm_agent_tokens_served_total", ())]
        for n in AGENTS
    )
    assert served >= 1
