"""Enrollment: admins create one-time tokens; nodes exchange them once, before expiry, for credentials."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from agent.wire.routetoken import load_public_key
from webapp.core.keys import route_signing_key
from webapp.fleet.models import EnrollmentToken, Node, NodeCredential, hash_secret
from webapp.fleet.services import authenticate_node, create_enrollment_token

pytestmark = pytest.mark.django_db


def enroll(client: Any, token: str, name: str = "n1") -> Any:
    return client.post(
        "/api/agent/enroll", data=json.dumps({"token": token, "name": name}), content_type="application/json"
    )


def test_staff_create_a_token_that_is_shown_once_and_stored_hashed(staff_client: Any) -> None:
    r = staff_client.post("/fleet/tokens", {"note": "box"}, HTTP_HX_REQUEST="true")
    assert r.status_code == 200
    token = r.content.decode().split('<pre id="enrollment-token">')[1].split("<")[0]
    row = EnrollmentToken.objects.get()
    assert row.token_hash == hash_secret(token) and token not in json.dumps(
        list(EnrollmentToken.objects.values()), default=str
    )
    assert row.expires_at > timezone.now()


def test_a_token_is_exchanged_for_credentials_and_the_route_public_key(client: Any) -> None:
    token, _ = create_enrollment_token(None)
    r = enroll(client, token)
    assert r.status_code == 201
    body = r.json()
    node = Node.objects.get(pk=body["node_id"])
    assert node.name == "n1" and node.state == Node.State.PENDING
    assert NodeCredential.objects.get(node=node).secret_hash == hash_secret(body["secret"])
    assert authenticate_node(node.id, body["secret"]) == node
    pub = load_public_key(body["public_key"])
    assert pub.public_bytes_raw() == route_signing_key().public_key().public_bytes_raw()


def test_a_reused_token_is_refused(client: Any) -> None:
    token, _ = create_enrollment_token(None)
    assert enroll(client, token).status_code == 201
    r = enroll(client, token, "n2")
    assert r.status_code == 403 and "already used" in r.json()["error"]
    assert Node.objects.count() == 1


def test_an_expired_token_is_refused(client: Any) -> None:
    token, row = create_enrollment_token(None)
    EnrollmentToken.objects.filter(pk=row.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    r = enroll(client, token)
    assert r.status_code == 403 and "expired" in r.json()["error"]
    assert not Node.objects.exists()


def test_an_unknown_token_is_refused(client: Any) -> None:
    assert enroll(client, "enr_nope").status_code == 403


def test_a_malformed_enroll_request_gets_400(client: Any) -> None:
    r = client.post("/api/agent/enroll", data="{", content_type="application/json")
    assert r.status_code == 400


def test_a_wrong_secret_or_revoked_credential_does_not_authenticate(
    node_with_secret: tuple[Node, str],
) -> None:
    node, secret = node_with_secret
    assert authenticate_node(node.id, secret + "x") is None
    assert authenticate_node("node-other", secret) is None
    NodeCredential.objects.filter(node=node).update(revoked_at=timezone.now())
    assert authenticate_node(node.id, secret) is None
