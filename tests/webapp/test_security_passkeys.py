"""Issue 17, leaked passkeys: passkeys rotate on demand (admin action) and when a node is removed.

The attack: a passkey read from a log let anyone download the model and inject fake peers, for ever
(passkeys never changed). A rotation now voids every earlier passkey of the node at once.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from urllib.parse import quote_from_bytes

import pytest

from webapp.catalog.models import ModelArtifact
from webapp.fleet.models import Node
from webapp.fleet.passkeys import node_passkey, rotate_passkey, tracker_paths
from webapp.fleet.services import create_enrollment_token, redeem_enrollment_token
from webapp.fleet.tasks import remove_node
from webapp.tracker.logic import bdecode

pytestmark = pytest.mark.django_db
INFO_HASH = hashlib.sha1(b"passkeys").digest()


@pytest.fixture
def artifact(tmp_path: Path) -> ModelArtifact:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\1" * 4096)
    return ModelArtifact.objects.create(
        name="m", source="path", path=str(f), state="ready", sha256="c" * 64, infohash=INFO_HASH.hex()
    )


def enroll() -> str:
    return redeem_enrollment_token(create_enrollment_token(None)[0], "n").node_id


def announce(client: Any, passkey: str) -> dict[bytes, Any]:
    q = f"info_hash={quote_from_bytes(INFO_HASH)}&peer_id={'p' * 20}&port=6881&left=0"
    body = bdecode(client.get(f"/tracker/{passkey}/announce", QUERY_STRING=q).content)
    assert isinstance(body, dict)
    return body


def test_a_rotated_passkey_is_refused_and_the_new_one_works(client: Any, artifact: ModelArtifact) -> None:
    node = enroll()
    leaked = node_passkey(node)
    assert b"failure reason" not in announce(client, leaked)
    fresh = rotate_passkey(node)
    assert fresh != leaked
    assert announce(client, leaked) == {b"failure reason": b"unknown passkey"}
    assert client.get(f"/webseed/{leaked}/{artifact.sha256}").status_code == 403
    assert b"failure reason" not in announce(client, fresh)
    assert client.get(f"/webseed/{fresh}/{artifact.sha256}", HTTP_RANGE="bytes=0-3").status_code == 206
    assert tracker_paths(node, artifact.sha256)[0] == f"/tracker/{fresh}/announce"  # next load commands


def test_removing_a_node_rotates_its_passkey(client: Any, artifact: ModelArtifact) -> None:
    node = enroll()
    leaked = node_passkey(node)
    remove_node(node)
    assert Node.objects.get(pk=node).passkey_generation == 1
    assert announce(client, leaked) == {b"failure reason": b"unknown passkey"}


def test_staff_rotate_passkeys_from_the_django_admin(
    admin_client: Any, client: Any, artifact: ModelArtifact
) -> None:
    node = enroll()
    leaked = node_passkey(node)
    r = admin_client.post(
        "/admin/fleet/node/", {"action": "rotate_tracker_passkeys", "_selected_action": [node], "index": 0}
    )
    assert r.status_code == 302 and Node.objects.get(pk=node).passkey_generation == 1
    assert announce(client, leaked) == {b"failure reason": b"unknown passkey"}


def test_a_forged_generation_is_refused(client: Any, artifact: ModelArtifact) -> None:
    node = enroll()
    node_id, _, mac = node_passkey(node).rpartition(".")
    assert announce(client, f"{node_id}.7.{mac}") == {b"failure reason": b"unknown passkey"}
