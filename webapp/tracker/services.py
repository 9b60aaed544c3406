"""Tracker decisions that touch settings or the database: whose passkey this is, whether an announce
comes from that node's enrolled address, announces per node and minute, known torrents, the store.

Passkeys are derived per node (`webapp.fleet.passkeys`), so nothing extra is stored; one is refused
once its node is removed, has no live credential, or its passkey was rotated since.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from functools import cache, lru_cache
from urllib.parse import urlsplit

from django.conf import settings

from webapp.catalog.models import ModelArtifact
from webapp.core.redisconn import bounded_redis
from webapp.core.throttle import WindowCounter
from webapp.fleet.models import Node, NodeCredential
from webapp.fleet.passkeys import passkey_claims
from webapp.tracker.logic import Announcer, MemoryPeerStore, PeerStore


def _live_node(passkey: str) -> Node | None:
    claim = passkey_claims(settings.SECRET_KEY, passkey)
    if claim is None:
        return None
    node_id, generation = claim
    # Only the node's current generation: a rotation voids every earlier passkey.
    live = NodeCredential.objects.filter(
        node_id=node_id, revoked_at=None, node__passkey_generation=generation
    ).exclude(node__state=Node.State.REMOVED)
    if not live.exists():
        return None
    return Node.objects.filter(pk=node_id).only("id", "state", "dataplane_url", "dataplane_problem").first()


def passkey_node(passkey: str) -> str | None:
    """The enrolled, not removed node this passkey belongs to, else None."""
    node = _live_node(passkey)
    return node.pk if node is not None else None


@lru_cache(maxsize=256)
def _resolve(host: str, bucket: int) -> frozenset[str]:
    """The addresses of a data-plane host name, cached for a minute (`bucket`)."""
    try:
        return frozenset(str(info[4][0]) for info in socket.getaddrinfo(host, None))
    except OSError:
        return frozenset()


def _same_address(a: str, b: str) -> bool:
    try:
        x, y = ipaddress.ip_address(a), ipaddress.ip_address(b)
    except ValueError:
        return False
    if isinstance(x, ipaddress.IPv6Address) and x.ipv4_mapped is not None:
        x = x.ipv4_mapped
    if isinstance(y, ipaddress.IPv6Address) and y.ipv4_mapped is not None:
        y = y.ipv4_mapped
    return x == y or (x.is_loopback and y.is_loopback)  # loopback is one machine, as the probe counts it


def enrolled_address(node: Node, remote_ip: str) -> bool:
    """Whether `remote_ip` is where the control plane knows this node to be: the node is online and its
    data-plane URL passed the checks (its host is the control socket's peer, webapp.fleet.probe) and
    names this address. A host the admin allows in DATAPLANE_ALLOWED_HOSTS (NAT) is taken on trust."""
    if node.state != Node.State.ONLINE or node.dataplane_problem or not node.dataplane_url:
        return False
    host = urlsplit(node.dataplane_url).hostname or ""
    allowed = set(settings.DATAPLANE_ALLOWED_HOSTS)
    if "*" in allowed or host in allowed:
        return True
    try:
        addresses: frozenset[str] = frozenset({str(ipaddress.ip_address(host))})
    except ValueError:
        addresses = _resolve(host, int(time.time() // 60))
    return any(_same_address(remote_ip, a) for a in addresses)


def identify(passkey: str, remote_ip: str) -> Announcer | None:
    """The node behind a passkey (None: unknown, removed or rotated) and whether it announces from its
    enrolled address."""
    node = _live_node(passkey)
    if node is None:
        return None
    return Announcer(node=node.pk, verified=enrolled_address(node, remote_ip))


class AnnounceRate:
    """Announces and scrapes per node in any minute (`TRACKER_ANNOUNCES_PER_MIN`), counted in Redis when
    the web has it (every web process shares the count)."""

    def __init__(self) -> None:
        self.counter = WindowCounter("tracker-rate")

    @property
    def per_min(self) -> int:
        return int(settings.TRACKER_ANNOUNCES_PER_MIN)

    def allow(self, node: str, now: float) -> bool:
        return self.counter.hit(node, self.per_min, 60, now) == 0.0


announce_rate = AnnounceRate()


def passkey_ok(passkey: str) -> bool:
    return passkey_node(passkey) is not None


def torrent_known(info_hash: bytes) -> bool:
    """Only the torrents of registered, ready artifacts are tracked."""
    return ModelArtifact.objects.filter(infohash=info_hash.hex(), state=ModelArtifact.State.READY).exists()


@cache
def peer_store() -> PeerStore:
    """Redis when REDIS_URL is set (shared by every web process), else this process's memory."""
    if settings.REDIS_URL:
        from webapp.tracker.store import RedisPeerStore

        # a Redis that hangs fails an announce within REDIS_TIMEOUT_S; views.py answers a failure reason
        return RedisPeerStore(bounded_redis(), settings.TRACKER_REDIS_PREFIX)
    return MemoryPeerStore()
