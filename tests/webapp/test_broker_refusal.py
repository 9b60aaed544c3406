"""A broker that cannot take a task: the staff's buttons answer with the error and change nothing, a model
registered meanwhile stays pending and is built once beat sends it again, and the pages show 4xx/503
replies (htmx 2 swaps none by default)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kombu.exceptions import OperationalError

from agent.procs import free_port
from webapp.catalog import tasks as catalog_tasks
from webapp.catalog.models import ModelArtifact
from webapp.core.broker import BROKER_REFUSED, BrokerUnavailable, publish
from webapp.fleet import tasks as fleet_tasks
from webapp.fleet.models import Node

REPO = Path(__file__).resolve().parents[2]


def _refuse(monkeypatch: pytest.MonkeyPatch, *tasks: Any) -> list[tuple[Any, ...]]:
    """Each task's publish fails as kombu's does when Redis is away; returns the refused calls."""
    refused: list[tuple[Any, ...]] = []

    def delay(*args: Any) -> None:
        refused.append(args)
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    for t in tasks:
        monkeypatch.setattr(t, "delay", delay)
    return refused


def test_a_publish_to_a_broker_that_refuses_raises_broker_unavailable_in_plain_words(
    own_celery_app: Callable[[str], Any],
) -> None:
    """The real kombu against a closed port: what `publish` catches is what a refusing Redis raises."""
    app = own_celery_app(f"redis://127.0.0.1:{free_port()}/0")

    @app.task(name="refused-broker.noop")
    def noop() -> None: ...

    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable) as e:
        publish(noop)
    assert time.monotonic() - t0 < 60 and str(e.value) == BROKER_REFUSED
    assert isinstance(e.value.__cause__, OperationalError)


@pytest.mark.django_db
def test_drain_and_remove_answer_503_with_the_nodes_row_and_the_error_and_change_nothing(
    staff_client: Any, node_with_secret: tuple[Node, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    node, _ = node_with_secret
    refused = _refuse(monkeypatch, fleet_tasks.drain_node, fleet_tasks.remove_node)
    for action in ("drain", "remove"):
        r = staff_client.post(f"/fleet/nodes/{node.id}/{action}", HTTP_HX_REQUEST="true")
        page = r.content.decode()
        # the row stays on the page (its target is the row, swapped whole), the reason under its buttons
        assert r.status_code == 503 and f'id="node-{node.id}"' in page, page[:300]
        assert "The task queue (Redis) did not take the request, so nothing was changed" in page
    assert refused == [(node.pk,), (node.pk,)]
    node.refresh_from_db()
    assert node.state != Node.State.REMOVED and node.state != Node.State.DRAINING
    assert node.credentials.filter(revoked_at=None).exists()


@pytest.mark.django_db
def test_place_and_unplace_answer_503_with_the_error_for_the_models_row(
    staff_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(64))
    a = ModelArtifact.objects.create(name="m", source="path", path=str(f), state=ModelArtifact.State.READY)
    _refuse(monkeypatch, fleet_tasks.place_model, fleet_tasks.unplace_model)
    for action, data in (("place", {"replicas": "1"}), ("unplace", {})):
        r = staff_client.post(f"/models/{a.pk}/{action}", data, HTTP_HX_REQUEST="true")
        assert r.status_code == 503 and 'class="error"' in r.content.decode()
        assert BROKER_REFUSED in r.content.decode()
    assert not a.shards.exists()


@pytest.mark.django_db
def test_a_model_registered_while_the_broker_refuses_stays_pending_marked_and_is_built_when_beat_sends_it(
    staff_client: Any,
    tiny_in_models_dir: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    tiny_model = tiny_in_models_dir("llama")
    with monkeypatch.context() as m:
        refused = _refuse(m, catalog_tasks.build_artifact_manifest)
        with django_capture_on_commit_callbacks(execute=True):
            r = staff_client.post("/models/register", {"kind": "path", "path": tiny_model.name})
        a = ModelArtifact.objects.get()
        assert r.status_code == 200 and refused == [(a.pk,)]  # registered, not a 500 with the row left behind
        assert (a.state, a.error) == (ModelArtifact.State.PENDING, catalog_tasks.BUILD_NOT_QUEUED)
        assert catalog_tasks.BUILD_NOT_QUEUED in staff_client.get("/models/").content.decode()
        assert catalog_tasks.requeue_unqueued_builds() == 0  # still away: marked, tried again next beat
        a.refresh_from_db()
        assert (a.state, a.error) == (ModelArtifact.State.PENDING, catalog_tasks.BUILD_NOT_QUEUED)
    # the broker is back (the tests' eager app runs the build in place)
    assert catalog_tasks.requeue_unqueued_builds() == 1
    a.refresh_from_db()
    assert (a.state, a.error, a.architecture) == (ModelArtifact.State.READY, "", "llama")
    assert catalog_tasks.requeue_unqueued_builds() == 0


def test_the_pages_swap_the_views_4xx_and_503_replies_and_no_other_error() -> None:
    """base.html's htmx-config read the way htmx 2 reads it: the first entry whose code (a regular
    expression, unanchored) matches the status decides. Without it a refused form showed nothing."""
    html = (REPO / "templates" / "base.html").read_text()
    config = json.loads(re.search(r"<meta name=\"htmx-config\" content='([^']*)'>", html).group(1))

    def swaps(status: int) -> bool:
        return next(e["swap"] for e in config["responseHandling"] if re.search(e["code"], str(status)))

    assert [swaps(s) for s in (200, 201, 204, 400, 403, 409, 413, 429, 503)] == [True] * 2 + [False] + [
        True
    ] * 6
    assert not any(swaps(s) for s in (500, 502, 504))
