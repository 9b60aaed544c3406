"""Tracker decisions that touch settings or the database: per-node passkeys, known torrents, the store.

A node's passkey is `<node id>.<HMAC-SHA256(SECRET_KEY, node id)>`: derived, so nothing extra is
stored, and revoked with the node (a removed node or one without a live credential is refused).
"""

from __future__ import annotations

from functools import cache

from django.conf import settings

from webapp.catalog.models import ModelArtifact
from webapp.fleet.models import Node, NodeCredential
from webapp.tracker.logic import MemoryPeerStore, PeerStore, derive_passkey, passkey_claims


def node_passkey(node_id: str) -> str:
    """The passkey this node puts in its tracker and web seed URLs."""
    return derive_passkey(settings.SECRET_KEY, node_id)


def passkey_node(passkey: str) -> str | None:
    """The enrolled, not removed node this passkey belongs to, else None."""
    node_id = passkey_claims(settings.SECRET_KEY, passkey)
    if node_id is None:
        return None
    live = NodeCredential.objects.filter(node_id=node_id, revoked_at=None).exclude(
        node__state=Node.State.REMOVED
    )
    return node_id if live.exists() else None


def passkey_ok(passkey: str) -> bool:
    return passkey_node(passkey) is not None


def torrent_known(info_hash: bytes) -> bool:
    """Only the torrents of registered, ready artifacts are tracked."""
    return ModelArtifact.objects.filter(infohash=info_hash.hex(), state=ModelArtifact.State.READY).exists()


@cache
def peer_store() -> PeerStore:
    """Redis when REDIS_URL is set (shared by every web process), else this process's memory."""
    if settings.REDIS_URL:
        import redis

        from webapp.tracker.store import RedisPeerStore

        return RedisPeerStore(redis.Redis.from_url(settings.REDIS_URL), settings.TRACKER_REDIS_PREFIX)
    return MemoryPeerStore()


def tracker_paths(node_id: str, model_sha256: str) -> tuple[str, str]:
    """(announce path, web seed path) on the control plane for this node and artifact."""
    key = node_passkey(node_id)
    return f"/tracker/{key}/announce", f"/webseed/{key}/{model_sha256}"
