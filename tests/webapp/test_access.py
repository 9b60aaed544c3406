"""Access control: staff-only admin views and actions, CSRF on forms, node-only artifact bytes."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from webapp.fleet.models import Node

pytestmark = pytest.mark.django_db

ADMIN_GETS = ["/fleet/", "/fleet/placement/", "/models/", "/fleet/status.json", "/fleet/generations"]


def admin_posts(node_id: str, artifact_id: int) -> list[str]:
    return [
        "/fleet/tokens",
        f"/fleet/nodes/{node_id}/drain",
        f"/fleet/nodes/{node_id}/remove",
        "/models/register",
        f"/models/{artifact_id}/place",
        f"/models/{artifact_id}/unplace",
    ]


def test_non_staff_get_403_on_every_admin_view_and_action(
    member_client: Any, node_with_secret: Any, artifact: Any
) -> None:
    node, _ = node_with_secret
    for url in ADMIN_GETS:
        assert member_client.get(url).status_code == 403, url
    for url in admin_posts(node.id, artifact.pk):
        assert member_client.post(url, {"kind": "package"}).status_code == 403, url
    node.refresh_from_db()
    assert node.state == Node.State.PENDING


def test_anonymous_users_are_sent_to_log_in(client: Any, artifact: Any) -> None:
    for url in [*ADMIN_GETS, "/playground/"]:
        r = client.get(url)
        assert r.status_code == 302 and r["Location"].startswith("/accounts/login/"), url


def test_staff_see_the_admin_pages(staff_client: Any, node_with_secret: Any, artifact: Any) -> None:
    for url in ADMIN_GETS:
        assert staff_client.get(url).status_code == 200, url
    assert b"n1" in staff_client.get("/fleet/").content


def test_forms_without_a_csrf_token_are_refused(staff: Any) -> None:
    c = Client(enforce_csrf_checks=True)
    c.force_login(staff)
    assert c.post("/fleet/tokens", {"note": "x"}).status_code == 403
    page = c.get("/fleet/")
    token = page.cookies["csrftoken"].value
    assert c.post("/fleet/tokens", {"note": "x"}, HTTP_X_CSRFTOKEN=token).status_code == 200


def test_members_can_use_the_playground(member_client: Any) -> None:
    assert member_client.get("/playground/").status_code == 200


def test_artifact_bytes_need_node_credentials(client: Any, artifact: Any) -> None:
    r = client.get(f"/artifacts/{artifact.sha256}/file", HTTP_RANGE="bytes=0-3")
    assert r.status_code == 401
    r = client.get(f"/artifacts/{artifact.sha256}/manifest", HTTP_AUTHORIZATION="Node node-x:nope")
    assert r.status_code == 401


def test_staff_drain_and_remove_a_node_through_the_fleet_page(
    staff_client: Any, node_with_secret: Any
) -> None:
    from webapp.fleet.models import NodeCredential

    node, _ = node_with_secret
    r = staff_client.post(f"/fleet/nodes/{node.id}/drain", HTTP_HX_REQUEST="true")
    assert r.status_code == 200 and b"draining" in r.content
    r = staff_client.post(f"/fleet/nodes/{node.id}/remove", HTTP_HX_REQUEST="true")
    assert r.status_code == 200 and r.content == b""
    node.refresh_from_db()
    assert node.state == Node.State.REMOVED
    assert not NodeCredential.objects.filter(node=node, revoked_at=None).exists()
    assert node.id.encode() not in staff_client.get("/fleet/").content


def test_staff_place_and_unplace_a_model_from_the_models_page(
    staff_client: Any, artifact: Any, django_capture_on_commit_callbacks: Any
) -> None:
    from django.utils import timezone

    from webapp.fleet.models import ShardAssignment

    Node.objects.create(
        name="big",
        state=Node.State.ONLINE,
        dataplane_url="http://big:1",
        backends=["torch"],
        free_memory_bytes=8 << 30,
        last_seen=timezone.now(),
    )
    with django_capture_on_commit_callbacks(execute=True):
        r = staff_client.post(f"/models/{artifact.pk}/place", {"replicas": "1"}, HTTP_HX_REQUEST="true")
    assert r.status_code == 200 and b"Placed 1 shard(s)" in r.content
    assert b"already placed" in staff_client.post(f"/models/{artifact.pk}/place").content
    with django_capture_on_commit_callbacks(execute=True):
        staff_client.post(f"/models/{artifact.pk}/unplace")
    assert set(ShardAssignment.objects.values_list("state", flat=True)) == {"draining"}
