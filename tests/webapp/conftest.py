"""Django test setup: real PostgreSQL/Redis when DATABASE_URL/REDIS_URL are set, else SQLite/in-memory."""

from __future__ import annotations

import os
import socket
import tempfile
import threading

# what this file puts in the environment for this process alone (pytest_xdist_setupnodes below)
_SET_HERE = [
    k for k in ("DJANGO_SETTINGS_MODULE", "SWARM_DATA_DIR", "CHANNELS_PREFIX") if k not in os.environ
]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
os.environ.setdefault("SWARM_DATA_DIR", tempfile.mkdtemp(prefix="swarm-test-"))
os.environ["CELERY_TASK_ALWAYS_EAGER"] = "1"  # unit tests run tasks inline; integration tests start workers
os.environ.setdefault("CHANNELS_PREFIX", f"swarmtest{os.getpid()}")

import django  # noqa: E402

django.setup()  # test modules import models at collection time

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402


def pytest_xdist_setupnodes(config: pytest.Config, specs: Any) -> None:
    """Pointed at tests/webapp, pytest-xdist's controller runs this file before it starts its workers,
    which inherit its environment: pytest-django would then set Django up in each worker from the
    controller's settings module before tests/conftest.py gives the worker its own Redis database, and
    every worker would share the controller's data directory and channel prefix (tracker tests deleted
    each other's keys). The controller runs no tests: it drops what this file set, so each worker sets
    its own when it loads this file (`make test` never loads it in the controller)."""
    for name in _SET_HERE:
        os.environ.pop(name, None)


@pytest.fixture(autouse=True)
def _fast_hasher(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def _no_recent_web_start() -> None:
    """The web process started long ago unless a test says otherwise: importing webapp.asgi records a
    start (webapp/fleet/services.py, silence_start), which would give every silent node a grace."""
    from django.core.cache import cache

    from webapp.fleet.services import WEB_STARTED_KEY

    cache.delete(WEB_STARTED_KEY)


@pytest.fixture(autouse=True)
def _fresh_user_accounting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-user accounting of this test only (webapp/routing/quota.py): routes a test leaves open in
    a replaced cache would otherwise count against a later test's user with the same id."""
    from webapp.routing import quota

    routes = quota.UserRoutes()
    for reclaim in quota.routes._reclaimers:
        routes.add_reclaimer(reclaim)
    monkeypatch.setattr(quota, "routes", routes)
    monkeypatch.setattr(quota, "streams", quota.StreamSlots())


@pytest.fixture
def staff(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("alice", password="alice-pass-123", is_staff=True)


@pytest.fixture
def member(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("bob", password="bob-pass-123")


@pytest.fixture
def staff_client(client: Any, staff: Any) -> Any:
    client.force_login(staff)
    return client


@pytest.fixture
def member_client(client: Any, member: Any) -> Any:
    client.force_login(member)
    return client


@pytest.fixture
def tiny_in_models_dir(tmp_path: Path, settings: Any) -> Callable[[str], Path]:
    """Writes a tiny GGUF of an architecture into the models directory (path registrations name only
    files there); skips where SmolLM2, whose tokenizer the tiny files carry, is not installed."""
    from agent.artifacts.packaged import ModelNotFound, packaged_model_path
    from agent.artifacts.tiny import write_tiny_gguf

    try:
        packaged_model_path("smollm2")
    except ModelNotFound as e:
        pytest.skip(f"the tiny models carry SmolLM2's tokenizer: {e}")
    settings.MODELS_DIR = tmp_path
    return lambda arch: write_tiny_gguf(arch, tmp_path / f"{arch}.gguf")


@pytest.fixture
def node_with_secret(db: None) -> tuple[Any, str]:
    """An enrolled node and its plain secret (enrolled the real way, through a token)."""
    from webapp.fleet.models import Node
    from webapp.fleet.services import create_enrollment_token, redeem_enrollment_token

    plain, _ = create_enrollment_token(None, "test")
    e = redeem_enrollment_token(plain, "n1")
    return Node.objects.get(pk=e.node_id), e.secret


@pytest.fixture(autouse=True)
def own_channel_layer() -> Iterator[None]:
    """Each test gets a channel layer object of its own. channels-redis keeps per-event-loop state in
    it (receive locks, backup-cleaner tasks) and every test runs its own loop: a receive lock that a
    finished test's loop still held made a later socket's receive wait on a future of that dead loop,
    and cancelling it at the end of the test never returned (CI: a 900 s teardown timeout)."""
    from channels.layers import DEFAULT_CHANNEL_LAYER, channel_layers

    channel_layers.backends.pop(DEFAULT_CHANNEL_LAYER, None)
    yield
    channel_layers.backends.pop(DEFAULT_CHANNEL_LAYER, None)


@pytest.fixture
def clear_channel_layer() -> Iterator[None]:
    """Delete the test's messages and groups afterwards, through a fresh layer: the test's own may hold
    cleaner tasks of its closed loop, which `flush` would wait for forever."""
    from asgiref.sync import async_to_sync
    from channels.layers import DEFAULT_CHANNEL_LAYER, channel_layers, get_channel_layer

    yield
    channel_layers.backends.pop(DEFAULT_CHANNEL_LAYER, None)
    layer = get_channel_layer()
    if hasattr(layer, "flush"):
        async_to_sync(layer.flush)()
    channel_layers.backends.pop(DEFAULT_CHANNEL_LAYER, None)


@pytest.fixture
def artifact(db: None, manifest: Any, model_path: str) -> Any:
    """SmolLM2 registered and ready (manifest reused from the session fixture, not rebuilt)."""
    import json

    from webapp.catalog.models import ModelArtifact

    return ModelArtifact.objects.create(
        name="SmolLM2",
        source=ModelArtifact.Source.PACKAGE,
        path=model_path,
        state=ModelArtifact.State.READY,
        sha256=manifest.sha256,
        size_bytes=manifest.file_size,
        n_layers=manifest.n_layers,
        architecture=manifest.architecture,
        manifest=json.loads(manifest.to_json()),
    )


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    """A PostgreSQL test database per run, so two runs sharing one server (a developer and CI) never
    drop each other's database."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    if "postgresql" in db["ENGINE"]:
        db.setdefault("TEST", {})["NAME"] = f"test_swarm_{os.getpid()}"


@pytest.fixture(scope="session")
def smollm2_torrent(model_path: str, manifest: Any) -> tuple[bytes, str]:
    """SmolLM2's .torrent and infohash, built once the way registration builds them."""
    from webapp.catalog.services import build_torrent

    torrent, infohash = build_torrent(model_path, manifest)
    if torrent is None:
        pytest.skip("libtorrent is not installed")
    return torrent, infohash


@pytest.fixture
def swarm_artifact(artifact: Any, smollm2_torrent: tuple[bytes, str]) -> Any:
    """The ready SmolLM2 artifact with its .torrent, as the registration job leaves it."""
    artifact.torrent, artifact.infohash = smollm2_torrent
    artifact.save(update_fields=["torrent", "infohash"])
    return artifact


@pytest.fixture
def own_celery_app() -> Iterator[Callable[[str], Any]]:
    """Makes Celery apps with the control plane's settings on a given broker, not eager, closed after.
    Never the current app: the shared tasks keep the eager test app (a new current app sent the next
    tests' tasks to its broker, a closed socket)."""
    from celery import Celery

    apps: list[Any] = []

    def make(broker_url: str) -> Any:
        app = Celery(f"own-{len(apps)}", set_as_current=False)
        app.config_from_object("django.conf:settings", namespace="CELERY")
        app.conf.broker_url, app.conf.task_always_eager = broker_url, False
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.close()


@pytest.fixture
def hung_redis_url() -> Iterator[str]:
    """A "Redis" on 127.0.0.1 that accepts connections and never answers (hung, or hostile)."""
    srv = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:  # closed at teardown
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"redis://127.0.0.1:{srv.getsockname()[1]}/0"
    srv.close()
    for c in held:
        c.close()
