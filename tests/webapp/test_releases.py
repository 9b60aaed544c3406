"""Releases and rollouts: the pure state machine, publishing (signature checked), one node at a time,
agents' reports, pause and roll back, and the release key handed out at enrollment."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.utils import timezone

from agent.wire import release as signing
from agent.wire.control import Update, UpdateStatus, parse_server_message
from webapp.asgi import application
from webapp.fleet.models import Node
from webapp.fleet.services import create_enrollment_token
from webapp.releases import rollout, services
from webapp.releases.models import Rollout, RolloutNode
from webapp.releases.rollout import NodeRow, step
from webapp.releases.tasks import advance_rollout

WHEEL = "gguf_swarm_agent-2.0.0-py3-none-any.whl"


def row(i: int, state: str = "pending", online: bool = True, version: str = "1.0.0", **kw: Any) -> NodeRow:
    return NodeRow(id=i, node_id=f"n{i}", state=state, position=i, online=online, version=version, **kw)


def test_a_rollout_sends_the_release_to_one_node_at_a_time() -> None:
    d = step("running", "2.0.0", [row(1), row(2)], 60)
    assert d.send == 1 and d.rollout_state is None
    d = step("running", "2.0.0", [row(1, "sent", sent_age_s=5), row(2)], 60)
    assert d.send is None and not d.marks


def test_a_node_that_says_hello_on_the_new_version_is_done_and_the_next_is_sent() -> None:
    d = step("running", "2.0.0", [row(1, "sent", version="2.0.0", sent_age_s=5), row(2)], 60)
    assert d.marks == {1: ("updated", "")} and d.send == 2


def test_nodes_with_a_replica_elsewhere_update_before_a_node_that_serves_alone() -> None:
    d = step("running", "2.0.0", [row(1, serves_alone=True), row(2)], 60)
    assert d.send == 2


def test_an_offline_node_is_skipped_and_a_finished_rollout_is_done() -> None:
    d = step("running", "2.0.0", [row(1, "updated", version="2.0.0"), row(2, online=False)], 60)
    assert d.marks == {2: ("skipped", "offline when its turn came")} and d.rollout_state == "done"


@pytest.mark.parametrize("bad", ["refused", "failed", "rolled_back"])
def test_the_first_bad_node_stops_the_rollout(bad: str) -> None:
    d = step("running", "2.0.0", [row(1, bad), row(2)], 60)
    assert d.rollout_state == "failed" and d.send is None


def test_a_silent_node_fails_after_the_timeout_and_stops_the_rollout() -> None:
    d = step("running", "2.0.0", [row(1, "sent", online=False, sent_age_s=61), row(2)], 60)
    assert d.marks[1][0] == "failed" and "60 s" in d.marks[1][1] and d.rollout_state == "failed"


def test_a_paused_rollout_records_progress_but_sends_nothing() -> None:
    d = step("paused", "2.0.0", [row(1, "sent", version="2.0.0"), row(2)], 60)
    assert d.marks == {1: ("updated", "")} and d.send is None and d.rollout_state is None
    assert step("done", "2.0.0", [row(2)], 60).send is None


def test_only_a_node_mid_update_takes_reports() -> None:
    assert rollout.report("sent", "downloading") == "sent"
    assert rollout.report("sent", "rolled_back") == "rolled_back"
    assert rollout.report("updated", "rolled_back") is None  # a repeat after reconnecting changes nothing


def test_rolling_back_returns_updated_nodes_to_what_each_ran_before() -> None:
    rows = [
        ("a", "updated", "1.0.0"),
        ("b", "updated", "1.1.0"),
        ("c", "pending", "1.0.0"),
        ("d", "sent", "1.0.0"),
    ]
    assert rollout.rollback_targets(rows, "2.0.0") == {"1.0.0": ["a", "d"], "1.1.0": ["b"]}


# --- with the database -----------------------------------------------------------------------------------


@pytest.fixture
def release_key(settings: Any) -> Any:
    key = signing.generate_key()
    settings.RELEASE_PUBLIC_KEY = signing.public_key_b64(key)
    return key


def publish(
    key: Any, version: str = "2.0.0", body: bytes = b"wheel-bytes", signature: str | None = None
) -> Any:
    name = WHEEL.replace("2.0.0", version)
    digest = hashlib.sha256(body).hexdigest()
    sig = signature if signature is not None else signing.sign(key, version, name, digest)
    return services.publish(io.BytesIO(body), name, version, sig, None)


def node(name: str, version: str = "1.0.0") -> Node:
    return Node.objects.create(
        name=name,
        state=Node.State.ONLINE,
        dataplane_url=f"http://{name}:1",
        version=version,
        last_seen=timezone.now(),
    )


@pytest.mark.django_db
def test_a_release_signed_by_another_key_is_not_published(release_key: Any) -> None:
    with pytest.raises(services.ReleaseError, match="not signed by the pinned release key"):
        publish(signing.generate_key())
    r = publish(release_key)
    assert r.path.read_bytes() == b"wheel-bytes" and r.size == 11
    with pytest.raises(services.ReleaseError, match="already published"):
        publish(release_key)


@pytest.mark.django_db
def test_without_a_release_key_nothing_is_published(settings: Any) -> None:
    settings.RELEASE_PUBLIC_KEY = ""
    settings.RELEASE_SIGNING_KEY_FILE = ""
    with pytest.raises(services.ReleaseError, match="RELEASE_PUBLIC_KEY"):
        services.publish(io.BytesIO(b"x"), WHEEL, "2.0.0", "", None)


@pytest.mark.django_db
def test_a_rollout_advances_node_by_node_on_reports_and_hellos(release_key: Any) -> None:
    r = publish(release_key)
    a, b = node("a"), node("b")
    ro = services.start(r.pk, None, None)
    with pytest.raises(services.ReleaseError, match="another rollout"):
        services.start(r.pk, None, None)
    cmd = services.advance(ro.pk)
    assert cmd is not None and cmd.version == "2.0.0" and cmd.wheel_url == f"/releases/{r.pk}/wheel"
    assert services.advance(ro.pk) is None  # one at a time
    first = RolloutNode.objects.get(rollout=ro, state="sent").node_id
    status = UpdateStatus(rollout_id=ro.pk, version="2.0.0", state="installing")
    assert services.apply_report(first, status) == ro.pk
    other = b.pk if first == a.pk else a.pk
    assert services.apply_report(other, status) is None  # never another node's row
    Node.objects.filter(pk=first).update(version="2.0.0")  # its hello after the restart
    cmd = services.advance(ro.pk)
    assert cmd is not None and RolloutNode.objects.get(rollout=ro, node_id=other).state == "sent"
    services.apply_report(other, UpdateStatus(rollout_id=ro.pk, version="2.0.0", state="updated"))
    services.advance(ro.pk)
    ro.refresh_from_db()
    assert ro.state == "done"


@pytest.mark.django_db
def test_a_refusal_stops_the_rollout_and_names_the_node(release_key: Any) -> None:
    r = publish(release_key)
    n = node("a")
    node("b")
    ro = services.start(r.pk, [n.pk, "unknown"], None)
    assert ro.nodes.count() == 1
    services.advance(ro.pk)
    services.apply_report(
        n.pk, UpdateStatus(rollout_id=ro.pk, version="2.0.0", state="refused", error="forged")
    )
    services.advance(ro.pk)
    ro.refresh_from_db()
    assert ro.state == "failed" and n.pk in ro.error
    assert RolloutNode.objects.get(rollout=ro).error == "forged"


@pytest.mark.django_db
def test_pause_resume_and_roll_back_to_the_previous_published_release(release_key: Any) -> None:
    v1, v2 = publish(release_key, "1.0.0", b"one"), publish(release_key, "2.0.0", b"two")
    n = node("a")
    ro = services.start(v2.pk, None, None)
    assert services.set_paused(ro.pk, True) and not services.set_paused(ro.pk, True)
    assert services.advance(ro.pk) is None
    assert services.set_paused(ro.pk, False)
    services.advance(ro.pk)
    Node.objects.filter(pk=n.pk).update(version="2.0.0")
    services.advance(ro.pk)
    back, note = services.roll_back(ro.pk, None)
    assert back is not None and back.release == v1 and "back to 1.0.0" in note
    ro.refresh_from_db()
    assert ro.state == "done"  # finished before the roll back: left as it was
    assert services.advance(back.pk) is not None  # node a is told to install 1.0.0


@pytest.mark.django_db
def test_the_enroll_response_carries_the_release_key_to_pin(client: Any, release_key: Any) -> None:
    token, _ = create_enrollment_token(None)
    r = client.post(
        "/api/agent/enroll", json.dumps({"token": token, "name": "n"}), content_type="application/json"
    )
    assert r.status_code == 201 and r.json()["release_public_key"] == signing.public_key_b64(release_key)


@pytest.mark.django_db
def test_the_wheel_needs_node_credentials_and_the_releases_page_shows_it(
    staff_client: Any, release_key: Any
) -> None:
    r = publish(release_key)
    assert Client().get(f"/releases/{r.pk}/wheel").status_code == 401
    got = staff_client.get(f"/releases/{r.pk}/wheel")
    assert got.status_code == 200 and b"".join(got.streaming_content) == b"wheel-bytes"
    page = staff_client.get("/releases/")
    assert page.status_code == 200 and r.version in page.content.decode()


# --- over the agent websocket ----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clear_channel_layer")
async def test_an_update_reaches_the_node_s_socket_and_its_refusal_stops_the_rollout(
    node_with_secret: Any, release_key: Any
) -> None:
    node, secret = node_with_secret
    ws = WebsocketCommunicator(
        application, "/ws/agent/", headers=[(b"authorization", f"Node {node.id}:{secret}".encode())]
    )
    assert (await ws.connect())[0]
    assert (await ws.receive_json_from())["type"] == "welcome"
    await database_sync_to_async(Node.objects.filter(pk=node.id).update)(
        state=Node.State.ONLINE, dataplane_url="http://127.0.0.1:1", version="1.0.0"
    )
    r = await database_sync_to_async(publish)(release_key)
    ro = await database_sync_to_async(services.start)(r.pk, [node.id], None)
    assert await database_sync_to_async(advance_rollout)(ro.pk)
    cmd = parse_server_message(await ws.receive_json_from())
    assert isinstance(cmd, Update) and cmd.rollout_id == ro.pk and cmd.signature == r.signature
    await ws.send_json_to(
        {
            "type": "update_status",
            "rollout_id": ro.pk,
            "version": "2.0.0",
            "state": "refused",
            "error": "forged",
        }
    )
    await ws.send_to(text_data="{")  # the error reply proves the report was handled first
    assert (await ws.receive_json_from())["type"] == "error"
    ro = await database_sync_to_async(Rollout.objects.get)(pk=ro.pk)
    assert ro.state == "failed" and node.id in ro.error
    await ws.disconnect()


@pytest.mark.django_db
def test_the_fleet_page_shows_the_rollout_panel_with_each_node_s_step(
    staff_client: Any, release_key: Any
) -> None:
    r = publish(release_key)
    n = node("gpu-1")
    ro = services.start(r.pk, None, None)
    services.advance(ro.pk)
    services.apply_report(n.pk, UpdateStatus(rollout_id=ro.pk, version="2.0.0", state="installing"))
    assert 'hx-get="/releases/"' in staff_client.get("/fleet/").content.decode()
    panel = staff_client.get("/releases/", HTTP_HX_REQUEST="true").content.decode()
    assert "gpu-1" in panel and "sent</span> installing" in panel and "1.0.0 → 2.0.0" in panel
    assert staff_client.post(f"/rollouts/{ro.pk}/pause").status_code == 200
    assert staff_client.post(f"/rollouts/{ro.pk}/pause").status_code == 409


def test_a_task_publish_to_a_redis_that_never_answers_gives_up_within_the_transports_timeouts(
    hung_redis_url: str, own_celery_app: Callable[[str], Any]
) -> None:
    """kombu waits for Redis without a timeout by default: one `.delay()` against a Redis that accepted
    and never answered blocked its caller for good (over 120 s, measured), e.g. a rollout step enqueued
    from an agent's hello on the web's shared database thread. The control plane's Celery settings bound
    each try (CELERY_BROKER_TRANSPORT_OPTIONS)."""
    import time

    from celery import current_app
    from kombu.exceptions import OperationalError

    before = current_app._get_current_object()
    app = own_celery_app(hung_redis_url)
    t0 = time.monotonic()
    with pytest.raises(OperationalError):
        app.send_task("publish-bound.noop")
    assert time.monotonic() - t0 < 30
    assert current_app._get_current_object() is before


@pytest.mark.django_db
def test_a_rollout_step_the_broker_cannot_take_is_logged_not_raised_into_the_agents_hello(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, django_capture_on_commit_callbacks: Any
) -> None:
    from kombu.exceptions import OperationalError

    from webapp.releases import tasks

    def refused(*args: Any) -> None:
        raise OperationalError("Timeout reading from socket")

    monkeypatch.setattr(tasks.advance_rollout, "delay", refused)
    with django_capture_on_commit_callbacks(execute=True):
        tasks.enqueue_advance(1)  # published at commit, as from a consumer's database call
    assert "rollout 1 not advanced now" in caplog.text
