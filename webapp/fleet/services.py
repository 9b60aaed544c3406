"""Fleet decisions that touch the database: enrollment, node authentication, heartbeats, commands.

Views, consumers and tasks stay thin and call these; the pure parts (what to send an agent that just
said hello) live in `webapp.fleet.protocol`, the messages in `agent.wire.control`.
"""

from __future__ import annotations

import secrets
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from statistics import median
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from agent.wire import routetoken
from agent.wire.control import Hello, Telemetry
from agent.wire.ids import NodeId
from webapp.core.keys import release_public_key, route_signing_key
from webapp.fleet.hopseries import appended, heartbeat_point
from webapp.fleet.models import EnrollmentToken, Node, NodeCredential, ShardAssignment, hash_secret

# What a node may claim its speed is (GFLOP/s), whatever it sends; placement may only lower a node's
# share with it (webapp.fleet.placement.trusted_speeds).
MIN_REPORTED_SPEED = 0.01
MAX_REPORTED_SPEED = 1e6
SPEED_WINDOW = timedelta(hours=1)  # answers older than this say nothing about a node's speed now
SPEED_RECORDS = 500  # the most recent answers looked at

LOADED_OR_LOADING = [
    ShardAssignment.State.FETCHING,
    ShardAssignment.State.LOADING,
    ShardAssignment.State.READY,
]


class EnrollmentError(Exception):
    """The enrollment token is unknown, expired or already used."""


@dataclass(frozen=True)
class Enrollment:
    """What a node receives once, in exchange for its enrollment token."""

    node_id: NodeId
    secret: str
    public_key: str
    release_public_key: str = ""


def create_enrollment_token(
    user: Any, note: str = "", ttl_s: int | None = None
) -> tuple[str, EnrollmentToken]:
    """A fresh token (plain text returned once; only its hash is stored)."""
    plain = "enr_" + secrets.token_urlsafe(32)
    ttl = settings.ENROLLMENT_TOKEN_TTL_S if ttl_s is None else ttl_s
    row = EnrollmentToken.objects.create(
        token_hash=hash_secret(plain),
        note=note[:100],
        created_by=user,
        expires_at=timezone.now() + timedelta(seconds=ttl),
    )
    return plain, row


def redeem_enrollment_token(plain: str, name: str) -> Enrollment:
    """Exchange a token for node credentials; the conditional update makes the token single-use."""
    now = timezone.now()
    with transaction.atomic():
        row = EnrollmentToken.objects.filter(token_hash=hash_secret(plain)).first()
        if row is None:
            raise EnrollmentError("unknown enrollment token")
        if row.used_at is not None:
            raise EnrollmentError("enrollment token was already used")
        if row.expires_at <= now:
            raise EnrollmentError("enrollment token has expired")
        node = Node.objects.create(name=(name or "node")[:100])
        claimed = EnrollmentToken.objects.filter(pk=row.pk, used_at=None).update(used_at=now, node=node)
        if claimed != 1:
            # Another request redeemed it between our read and this update.
            raise EnrollmentError("enrollment token was already used")
        secret = "sec_" + secrets.token_urlsafe(32)
        NodeCredential.objects.create(node=node, secret_hash=hash_secret(secret))
    public = routetoken.public_key_b64(route_signing_key().public_key())
    return Enrollment(NodeId(node.id), secret, public, release_public_key())


def authenticate_node(node_id: str, secret: str) -> Node | None:
    """The node owning this unrevoked credential, unless it was removed."""
    cred = (
        NodeCredential.objects.select_related("node")
        .filter(secret_hash=hash_secret(secret), node_id=node_id, revoked_at=None)
        .first()
    )
    if cred is None or cred.node.state == Node.State.REMOVED:
        return None
    return cred.node


def mark_connected(node_id: str) -> datetime:
    """A socket opened: online (unless draining), but nothing is routable until its hello says what it
    holds, so the data-plane URL is cleared and loaded shards wait for reconciliation."""
    now = timezone.now()
    Node.objects.filter(pk=node_id).exclude(state__in=[Node.State.REMOVED, Node.State.DRAINING]).update(
        state=Node.State.ONLINE
    )
    Node.objects.filter(pk=node_id).update(connected_at=now, last_seen=now, dataplane_url="")
    ShardAssignment.objects.filter(node_id=node_id, state__in=LOADED_OR_LOADING).update(
        state=ShardAssignment.State.ASSIGNED, progress=0.0
    )
    return now


def mark_disconnected(node_id: str, connected_at: datetime | None = None) -> bool:
    """Offline at once when the socket closes; True when the state changed. A socket that was replaced
    by a newer one (connected later) does not mark the node offline."""
    qs = Node.objects.filter(pk=node_id, state__in=[Node.State.ONLINE, Node.State.PENDING])
    if connected_at is not None:
        qs = qs.filter(connected_at=connected_at)
    return bool(qs.update(state=Node.State.OFFLINE))


def apply_hello(
    node_id: str, hello: Hello, dataplane_problem: str = "", dataplane_rtt_ms: float | None = None
) -> None:
    """Record what the node says about itself. Its speed is clamped, and placement lets it only lower
    the node's share (webapp.fleet.placement.trusted_speeds); routes are chosen on what the control
    plane measures (webapp.routing.services), and the data-plane URL is routed to only if
    `dataplane_problem` is empty (webapp.fleet.probe checked it)."""
    Node.objects.filter(pk=node_id).update(
        hardware=hello.hardware.to_wire(),
        backends=hello.backends,
        version=hello.version,
        dataplane_url=hello.dataplane_url,
        dataplane_problem=dataplane_problem[:300],
        dataplane_rtt_ms=dataplane_rtt_ms,
        speed=min(max(hello.speed, MIN_REPORTED_SPEED), MAX_REPORTED_SPEED),
        free_memory_bytes=hello.free_memory_bytes,
        last_seen=timezone.now(),
    )


def apply_reprobe(node_id: str, url: str, problem: str, rtt_ms: float | None) -> bool:
    """A data plane checked again (webapp.fleet.consumers): its problem and round trip, only if the node
    still reports `url`; True when a row changed."""
    return bool(
        Node.objects.filter(pk=node_id, dataplane_url=url)
        .exclude(dataplane_problem=problem[:300])
        .update(dataplane_problem=problem[:300], dataplane_rtt_ms=rtt_ms)
    )


def wall_layer_ms(node_ids: Iterable[str]) -> dict[str, float]:
    """Median wall-clock ms per layer per decode step of recent answers whose route went through each
    node (absent: none yet), for placement (issue 17). The step time is the web process's own clock
    (`GenerationRecord.tok_s`) and the layers are those of the route it minted, so nothing a node
    reports, not even its per-hop compute and handler times, can make it look faster than it served."""
    from webapp.telemetry.models import GenerationRecord

    wanted = set(node_ids)
    rows = (
        GenerationRecord.objects.filter(
            created_at__gte=timezone.now() - SPEED_WINDOW, error="", session__isnull=False, tok_s__gt=0
        )
        .order_by("-created_at")
        .values_list("tok_s", "session__hops")[:SPEED_RECORDS]
    )
    samples: defaultdict[str, list[float]] = defaultdict(list)
    for tok_s, route in rows:
        hops = [h for h in route if isinstance(h, dict)] if isinstance(route, list) else []
        spans = [h.get("layer_end", 0) - h.get("layer_start", 0) for h in hops]
        layers = sum(x for x in spans if isinstance(x, int) and x > 0)
        if layers <= 0:
            continue
        per = 1e3 / tok_s / layers
        for node in {str(h.get("node")) for h in hops} & wanted:
            samples[node].append(per)
    return {n: float(median(v)) for n, v in samples.items()}


def apply_heartbeat(node_id: str, t: Telemetry) -> bool:
    """Record a heartbeat (its point in the node's bounded ring of recent ones, webapp.fleet.hopseries,
    and a downsampled sample); True when it revived a node marked offline, whose shards may have been
    re-placed meanwhile, so it must say hello again to be reconciled."""
    from webapp.telemetry.services import maybe_store_sample

    now = timezone.now()
    # read, append, write: a second socket of the same node (a reconnect racing the old one) can lose
    # a point of the plots' ring, which is only drawn, never decided on
    ring = Node.objects.filter(pk=node_id).values_list("recent", flat=True).first()
    Node.objects.filter(pk=node_id).update(
        last_seen=now,
        telemetry=t.raw,
        free_memory_bytes=t.free_memory_bytes,
        recent=appended(ring, heartbeat_point(t, now.timestamp())),
    )
    revived = Node.objects.filter(pk=node_id, state__in=[Node.State.OFFLINE, Node.State.PENDING]).update(
        state=Node.State.ONLINE
    )
    maybe_store_sample(node_id, t, now)
    return bool(revived)


def stale_online_nodes(now: Any = None) -> list[str]:
    """Nodes still marked online whose last heartbeat is older than NODE_OFFLINE_AFTER_S."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.NODE_OFFLINE_AFTER_S)
    return list(
        Node.objects.filter(state=Node.State.ONLINE, last_seen__lt=cutoff).values_list("id", flat=True)
    )


WEB_STARTED_KEY = "fleet:web-started-at"


def record_web_start(now: float | None = None) -> None:
    """A web process started (webapp/asgi.py): agents could not heartbeat while the web was down, so
    their silence counts from now when the sweeper judges them lost (silence_start)."""
    cache.set(WEB_STARTED_KEY, time.time() if now is None else now, None)


def silence_start(last_seen: datetime, web_started: datetime | None) -> datetime:
    """When a node's silence began as far as the fleet can tell: its last heartbeat, or the latest web
    start plus the agents' longest reconnect backoff (AGENT_RECONNECT_MAX_S) when that is later. An agent
    cannot heartbeat to a web that is down, and one that kept failing to reach it waits up to that long
    before its next try: a control plane's own restart must not read as its nodes' loss (CI once saw an
    agent replaced after the suite's web restart: on a loaded machine its backoff outgrew the grace)."""
    if web_started is None:
        return last_seen
    return max(last_seen, web_started + timedelta(seconds=settings.AGENT_RECONNECT_MAX_S))


def web_started_at() -> datetime | None:
    """The latest web process start record_web_start kept, if any."""
    started = cache.get(WEB_STARTED_KEY)
    return None if started is None else datetime.fromtimestamp(float(started), tz=UTC)


def mark_offline_if_stale(node_id: str) -> bool:
    """Claim the transition with a conditional update: another sweeper may have got there first."""
    cutoff = timezone.now() - timedelta(seconds=settings.NODE_OFFLINE_AFTER_S)
    return bool(
        Node.objects.filter(pk=node_id, state=Node.State.ONLINE, last_seen__lt=cutoff).update(
            state=Node.State.OFFLINE
        )
    )


def update_progress(
    node_id: str,
    assignment_id: int,
    state: str,
    progress: float,
    error: str,
    transfer: dict[str, Any] | None = None,
) -> bool:
    """Apply an agent's progress report to its own assignment (never another node's); a report without
    download figures keeps the last ones (the fleet page still shows how the shard was fetched)."""
    qs = ShardAssignment.objects.filter(pk=assignment_id, node_id=node_id)
    if state == "unloaded":
        return bool(qs.filter(state=ShardAssignment.State.DRAINING).delete()[0])
    fields: dict[str, Any] = {"state": state, "progress": max(0.0, min(1.0, progress)), "error": error[:2000]}
    if transfer:
        fields["transfer"] = transfer
    return bool(qs.exclude(state=ShardAssignment.State.DRAINING).update(**fields))
