"""Tracker decisions that touch settings or the database: whose passkey this is, known torrents, the store.

Passkeys are derived per node (`webapp.fleet.passkeys`), so nothing extra is stored; one is refused
once its node is removed, has no live credential, or its passkey was rotated since.
"""

from __future__ import annotations

from functools import cache

from django.conf import settings

from webapp.catalog.models import ModelArtifact
from webapp.fleet.models import Node, NodeCredential
from webapp.fleet.passkeys import passkey_claims
from webapp.tracker.logic import MemoryPeerStore, PeerStore


def passkey_node(passkey: str) -> str | None:
    """The enrolled, not removed node this passkey belongs to, else None."""
    claim = passkey_claims(settings.SECRET_KEY, passkey)
    if claim is None:
        return None
    node_id, generation = claim
    # Only the node's current generation: a rotation voids every earlier passkey.
    live = NodeCredential.objects.filter(
        node_id=node_id, revoked_at=None, node__passkey_generation=generation
    ).exclude(node__state=Node.State.REMOVED)
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
