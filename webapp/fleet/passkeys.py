"""A node's tracker passkey, derived from its id and passkey generation, and the tracker paths its load
commands carry.

A passkey is `<node id>.<HMAC-SHA256(SECRET_KEY, "tracker-passkey:" + node id)[:32 hex]>` at generation
0, and `<node id>.<generation>.<HMAC(..., "tracker-passkey:<node id>:<generation>")[:32 hex]>` after a
rotation: derived, so nothing secret is stored, and revoked with the node. Rotating (an admin action,
and on removal) bumps `Node.passkey_generation`, which voids every earlier passkey of that node at once
(a leaked one from a log, say). It is a node credential, so it lives in the fleet: the fleet tells each
node its paths, and `webapp.tracker` (an app above this one) checks a passkey here.
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings
from django.db.models import F

from webapp.fleet.models import Node

MAX_PASSKEY = 200  # longer path segments are not passkeys (node ids are short)


def derive_passkey(secret: str, node_id: str, generation: int = 0) -> str:
    """A node's passkey under `secret` at `generation`: nothing to store or look up."""
    message = f"tracker-passkey:{node_id}" + (f":{generation}" if generation else "")
    mac = hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{node_id}.{generation}.{mac}" if generation else f"{node_id}.{mac}"


def passkey_claims(secret: str, passkey: str) -> tuple[str, int] | None:
    """(node id, generation) a passkey was derived for, if its MAC is right (whether the node is still
    enrolled and the generation current is the caller's question)."""
    if len(passkey) > MAX_PASSKEY:
        return None
    head, sep, _ = passkey.rpartition(".")
    if not sep or not head:
        return None
    node_id, generation = head, 0
    prefix, dot, gen = head.rpartition(".")
    if dot and gen.isdigit() and gen.isascii() and len(gen) <= 9 and prefix:
        node_id, generation = prefix, int(gen)
    if not hmac.compare_digest(passkey, derive_passkey(secret, node_id, generation)):
        return None
    return node_id, generation


def passkey_generation(node_id: str) -> int:
    return int(Node.objects.filter(pk=node_id).values_list("passkey_generation", flat=True).first() or 0)


def node_passkey(node_id: str) -> str:
    """The passkey this node puts in its tracker and web seed URLs now."""
    return derive_passkey(settings.SECRET_KEY, node_id, passkey_generation(node_id))


def rotate_passkey(node_id: str) -> str:
    """Void the node's passkey (every URL carrying it is refused from now on) and return the new one."""
    Node.objects.filter(pk=node_id).update(passkey_generation=F("passkey_generation") + 1)
    return node_passkey(node_id)


def tracker_paths(node_id: str, model_sha256: str) -> tuple[str, str]:
    """(announce path, web seed path) on the control plane for this node and artifact."""
    key = node_passkey(node_id)
    return f"/tracker/{key}/announce", f"/webseed/{key}/{model_sha256}"
