"""A node's tracker passkey, derived from its id, and the tracker paths its load commands carry.

A passkey is `<node id>.<HMAC-SHA256(SECRET_KEY, "tracker-passkey:" + node id)[:32 hex]>`: derived, so
nothing extra is stored, and revoked with the node. It is a node credential, so it lives in the fleet:
the fleet tells each node its paths, and `webapp.tracker` (an app above this one) checks a passkey's
MAC here and the node's credentials in the fleet's tables.
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings


def derive_passkey(secret: str, node_id: str) -> str:
    """A node's passkey under `secret`: nothing to store or look up."""
    mac = hmac.new(secret.encode(), b"tracker-passkey:" + node_id.encode(), hashlib.sha256).hexdigest()
    return f"{node_id}.{mac[:32]}"


def passkey_claims(secret: str, passkey: str) -> str | None:
    """The node id a passkey was derived for, if its MAC is right (whether the node is still enrolled
    is the caller's question)."""
    node_id, sep, _ = passkey.rpartition(".")
    if not sep or not node_id or not hmac.compare_digest(passkey, derive_passkey(secret, node_id)):
        return None
    return node_id


def node_passkey(node_id: str) -> str:
    """The passkey this node puts in its tracker and web seed URLs."""
    return derive_passkey(settings.SECRET_KEY, node_id)


def tracker_paths(node_id: str, model_sha256: str) -> tuple[str, str]:
    """(announce path, web seed path) on the control plane for this node and artifact."""
    key = node_passkey(node_id)
    return f"/tracker/{key}/announce", f"/webseed/{key}/{model_sha256}"
