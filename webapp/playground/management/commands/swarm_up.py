"""`manage.py swarm_up`: the one-command demo — web server, worker, two enrolled agents, SmolLM2 placed."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from agent import defaults, procs
from agent.dev import cluster
from webapp.core.adminclient import AdminClient
from webapp.core.files import write_once
from webapp.devcluster import beat_command, web_command, worker_command

ADMIN_USER = "admin"


def admin_password_path() -> Path:
    return settings.DATA_DIR / "admin_password"


def admin_password() -> tuple[str, bool]:
    """(password, generated now): SWARM_ADMIN_PASSWORD, else one generated once and kept (0600) in the
    data dir."""
    env = os.environ.get("SWARM_ADMIN_PASSWORD")
    if env:
        return env, False
    path = admin_password_path()
    fresh = not path.exists()
    if fresh:
        write_once(path, secrets.token_urlsafe(12).encode())
    return path.read_text().strip(), fresh


def password_notice(password: str, fresh: bool, to_terminal: bool) -> str:
    """How `make up` tells the admin their password: the password itself only when it was just
    generated and the output is a terminal (shown once, never written into a log that captures the
    output); otherwise where to find it (issue 17)."""
    if fresh and to_terminal:
        return f"  log in as {ADMIN_USER} / {password}   (shown once; also in {admin_password_path()}, 0600)"
    if os.environ.get("SWARM_ADMIN_PASSWORD"):
        return f"  log in as {ADMIN_USER} with the password in SWARM_ADMIN_PASSWORD"
    return f"  log in as {ADMIN_USER}; the password is in {admin_password_path()} (0600)"


def private_log(path: Path) -> Path:
    """Create (or keep) a log file readable by its owner only: logs may hold node and route details."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)
    return path


async def playground_answer(base: str, admin: AdminClient, model_id: int, message: str) -> str:
    """Ask one question through the playground websocket, as the browser does, and return the answer."""
    from aiohttp import ClientSession

    headers = {"Origin": base, "Cookie": f"sessionid={admin.cookie('sessionid')}"}
    async with (
        ClientSession() as http,
        http.ws_connect(base + "/ws/chat/?format=json", headers=headers) as ws,
    ):
        await ws.send_json({"type": "chat", "model": model_id, "message": message, "max_tokens": 24})
        while True:
            ev = await ws.receive_json(timeout=120)
            if ev["type"] == "error":
                raise CommandError(f"playground: {ev['error']}")
            if ev["type"] == "done":
                return str(ev["text"])


class Command(BaseCommand):
    help = "Start the web server, worker and local agents; register and place SmolLM2; print the URL."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", defaults.WEB_PORT)))
        parser.add_argument("--agents", type=int, default=2)
        parser.add_argument("--model", default="smollm2", help="PyPI-shipped model to register and place")
        parser.add_argument(
            "--threads",
            type=int,
            default=defaults.N_THREADS,
            help="compute threads per agent (default: the agent's own, as `agent serve` and `agent run`)",
        )
        parser.add_argument(
            "--check", action="store_true", help="once up, stream one playground answer, then stop everything"
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        self.procs: list[procs.Process] = []
        self.agents: list[procs.Process] = []
        logs = settings.DATA_DIR / "logs"
        logs.mkdir(mode=0o700, parents=True, exist_ok=True)
        logs.chmod(0o700)
        base = f"http://{opts['host']}:{opts['port']}"
        try:
            admin, model = self._up(opts, base, logs)
            if opts["check"]:
                answer = asyncio.run(playground_answer(base, admin, model["id"], "Say hello in five words."))
                if not answer.strip():
                    raise CommandError("the playground streamed an empty answer")
                self.stdout.write(f"playground check: {answer.strip()!r}")
                return
            self.stdout.write("Ctrl-C stops everything.")
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            self._watch(logs)
        except KeyboardInterrupt:
            pass
        finally:
            self._stop()

    def _watch(self, logs: Path) -> None:
        """Run until the web server or a Celery process exits; an agent may die (that is a demo of failure)."""
        reported: set[int] = set()
        while True:
            for p in self.procs:
                if p.poll() is None or p.pid in reported:
                    continue
                if p in self.agents:
                    reported.add(p.pid)
                    self.stdout.write(
                        f"agent process {p.pid} exited ({p.returncode}); the fleet page shows it offline"
                    )
                else:
                    raise CommandError(f"`{procs.describe(p)}` exited; see the logs in {logs}")
            time.sleep(0.5)

    def _spawn(self, cmd: list[str], log: Path) -> procs.Process:
        p = procs.spawn(cmd, private_log(log), cwd=settings.BASE_DIR, append=True)
        self.procs.append(p)
        return p

    def _stop(self) -> None:
        procs.stop(reversed(self.procs))  # agents first, the web server last

    def _up(self, opts: dict[str, Any], base: str, logs: Path) -> tuple[AdminClient, dict[str, Any]]:
        say = self.stdout.write
        call_command("migrate", interactive=False, verbosity=0)
        self._forget_connections()
        password, fresh = admin_password()
        user, _ = get_user_model().objects.get_or_create(username=ADMIN_USER, defaults={"is_staff": True})
        user.is_staff = user.is_superuser = True
        user.set_password(password)
        user.save()

        say(f"web server on {base} (logs in {logs})")
        # daphne behind webapp.serve: secrets are redacted from its access log
        self._spawn(web_command(opts["host"], opts["port"]), logs / "web.log")
        if not settings.CELERY_TASK_ALWAYS_EAGER:
            say("celery worker + beat (Redis broker)")
            self._spawn(worker_command(), logs / "worker.log")
            self._spawn(beat_command(settings.DATA_DIR / "celerybeat-schedule"), logs / "beat.log")
        try:
            procs.wait_http(base + "/healthz", 120, procs=self.procs, every_s=0.2)
        except procs.ProcessExited as e:
            raise CommandError(f"{e}; see its log in {logs}") from None
        except TimeoutError as e:
            raise CommandError(str(e)) from None

        admin = AdminClient(base)
        admin.login(ADMIN_USER, password)
        node_ids = [self._start_agent(i, base, admin, opts, logs) for i in range(1, opts["agents"] + 1)]
        try:  # fails at once if an agent exits instead of coming online
            cluster.wait_online(admin.status, node_ids, 120, procs=self.agents)
        except procs.ProcessExited as e:
            raise CommandError(f"{e}; see its log in {logs}") from None
        say(f"{len(node_ids)} agents online: {', '.join(node_ids)}")

        model = self._register(admin, opts["model"])
        self._place(admin, model, node_ids)
        say("")
        say(self.style.SUCCESS(f"GGUF Swarm is up: {base}/"))
        say(password_notice(password, fresh, self.stdout.isatty()))
        say(f"  playground: {base}/playground/   fleet: {base}/fleet/")
        return admin, model

    def _forget_connections(self) -> None:
        """No web server runs yet, so no agent is connected: states left by an earlier run are stale."""
        from webapp.fleet.models import Node, ShardAssignment

        Node.objects.filter(state=Node.State.ONLINE).update(state=Node.State.OFFLINE)
        ShardAssignment.objects.filter(state__in=["fetching", "loading", "ready"]).update(
            state="assigned", progress=0
        )

    def _start_agent(self, i: int, base: str, admin: AdminClient, opts: dict[str, Any], logs: Path) -> str:
        from agent.node.config import ConfigError, load_config
        from webapp.fleet.models import Node

        home = settings.DATA_DIR / "agents" / f"agent-{i}"
        config = home / "node.json"
        try:
            cfg = load_config(config)
            known = Node.objects.filter(pk=cfg.node_id).exclude(state=Node.State.REMOVED).exists()
            if not known or cfg.server != base:
                raise ConfigError("stale")
        except ConfigError:
            token = admin.create_enrollment_token(f"local agent {i}")
            cluster.enroll(base, token, config, name=f"agent-{i}", force=True, cwd=settings.BASE_DIR)
            cfg = load_config(config)
        # the launcher the tests and benches use; its torrent swarm stays on loopback
        agent = cluster.start_run(
            config,
            private_log(logs / f"agent-{i}.log"),
            data_dir=home / "data",
            threads=opts["threads"],
            cwd=settings.BASE_DIR,
        )
        self.procs.append(agent.proc)
        self.agents.append(agent.proc)
        return cfg.node_id

    def _register(self, admin: AdminClient, package: str) -> dict[str, Any]:
        from agent.artifacts.packaged import packaged_model_path

        path = str(packaged_model_path(package).resolve())
        existing = next(
            (m for m in admin.status()["models"] if m["state"] != "failed" and m["name"] == Path(path).stem),
            None,
        )
        if existing is None:
            code, body = admin.post("/models/register", {"kind": "package", "package": package})
            if code != 200:
                raise CommandError(f"registering {package} failed (HTTP {code}): {body[:300]}")
        model = admin.wait_for(
            f"{package} manifest",
            lambda s: next(
                (
                    m
                    for m in s["models"]
                    if m["name"] == Path(path).stem and m["state"] in ("ready", "failed")
                ),
                None,
            ),
            300,
        )
        if model["state"] != "ready":
            raise CommandError(f"{package}: {model['error']}")
        self.stdout.write(
            f"model {model['name']} ready ({model['n_layers']} layers, sha256 {model['sha256'][:12]})"
        )
        return model

    def _place(self, admin: AdminClient, model: dict[str, Any], node_ids: list[str]) -> None:
        from webapp.fleet.models import Node, ShardAssignment

        # Shards left on nodes of an earlier run that are not running now would block placement.
        stale = Node.objects.exclude(pk__in=node_ids).exclude(state=Node.State.REMOVED)
        ShardAssignment.objects.filter(node__in=stale).delete()
        stale.update(state=Node.State.REMOVED)
        active = ShardAssignment.objects.filter(artifact_id=model["id"]).exclude(state="failed").exists()
        if not active:
            # One replica: the demo is a route over both agents. SmolLM2 fits on one, so the default two
            # copies would give each agent a whole model and every route one hop (docs/failover.md).
            code, body = admin.post(f"/models/{model['id']}/place", {"replicas": "1"})
            if code != 200:
                raise CommandError(f"placement failed (HTTP {code}): {body[:300]}")

        def ready(s: dict[str, Any]) -> bool:
            shards = [sh for n in s["nodes"] for sh in n["shards"] if sh["artifact_id"] == model["id"]]
            failed = [sh for sh in shards if sh["state"] == "failed"]
            if failed:
                raise CommandError(f"a shard failed to load: {failed[0]['error']}")
            return bool(shards) and all(sh["state"] == "ready" for sh in shards)

        self.stdout.write("placing shards (fetch over HTTP ranges, verify, load)…")
        admin.wait_for("shards ready", ready, 600, every_s=0.5)
        for n in admin.status()["nodes"]:
            for sh in n["shards"]:
                self.stdout.write(
                    f"  {n['name']}: layers {sh['layer_start']}:{sh['layer_end']} {sh['state']}"
                )
