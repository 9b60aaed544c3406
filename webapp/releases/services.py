"""Release decisions that touch the database: publishing, starting, pausing, rolling back and advancing
rollouts, and applying agents' reports. The pure rules are in `webapp.releases.rollout`."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from agent.wire import release as signing
from agent.wire.control import Update, UpdateStatus
from webapp.core.keys import release_public_key
from webapp.fleet.models import Node, ShardAssignment
from webapp.releases import rollout
from webapp.releases.models import Release, Rollout, RolloutNode


class ReleaseError(Exception):
    """A release or rollout request that cannot be carried out; the text says why."""


def _store_wheel(upload: IO[bytes], filename: str) -> tuple[Path, str, int]:
    """Stream the upload to the release dir; (path, sha256, size)."""
    tmp_dir = Path(settings.RELEASE_DIR) / "incoming"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir / f"{os.getpid()}-{filename}"
    h, size = hashlib.sha256(), 0
    with tmp.open("wb") as f:
        for block in iter(lambda: upload.read(1 << 20), b""):
            h.update(block)
            size += len(block)
            f.write(block)
    digest = h.hexdigest()
    dest = Path(settings.RELEASE_DIR) / digest / filename
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, dest)
    return dest, digest, size


def publish(
    upload: IO[bytes], filename: str, version: str, signature: str, user: Any, notes: str = ""
) -> Release:
    """Store a wheel as a release once its signature verifies with the release key.

    Without a signature the web host signs it itself, but only when RELEASE_SIGNING_KEY_FILE is set.
    """
    pinned = release_public_key()
    if not pinned:
        raise ReleaseError("releases are not configured: set RELEASE_PUBLIC_KEY (docs/security.md)")
    version = version.strip() or (filename.split("-")[1] if filename.count("-") >= 4 else "")
    try:
        signing.statement(version, filename, "0" * 64)
    except signing.ReleaseError as e:
        raise ReleaseError(str(e)) from None
    if Release.objects.filter(version=version).exists():
        raise ReleaseError(f"version {version} is already published")
    path, digest, size = _store_wheel(upload, filename)
    if size == 0:
        raise ReleaseError("the wheel is empty")
    signed_here = False
    if not signature.strip():
        if not settings.RELEASE_SIGNING_KEY_FILE:
            raise ReleaseError("send the detached signature (`python -m agent release sign`)")
        key = signing.load_private_key(Path(settings.RELEASE_SIGNING_KEY_FILE))
        signature, signed_here = signing.sign(key, version, filename, digest), True
    try:
        signing.verify(pinned, version, filename, digest, signature)
    except signing.ReleaseError as e:
        raise ReleaseError(f"refused: {e}") from None
    try:
        return Release.objects.create(
            version=version,
            filename=filename,
            sha256=digest,
            size=size,
            signature=signature.strip(),
            notes=notes[:200],
            signed_on_server=signed_here,
            created_by=user,
        )
    except IntegrityError:
        raise ReleaseError(f"version {version} is already published") from None


def update_command(rollout_id: int, r: Release) -> Update:
    return Update(
        rollout_id=rollout_id,
        version=r.version,
        filename=r.filename,
        wheel_url=f"/releases/{r.pk}/wheel",
        sha256=r.sha256,
        size=r.size,
        signature=r.signature,
    )


def start(
    release_id: int, node_ids: Iterable[str] | None, user: Any, rollback_of: int | None = None
) -> Rollout:
    """A running rollout of a release to the given nodes (default: every node not removed)."""
    with transaction.atomic():
        if Rollout.objects.select_for_update().filter(state__in=rollout.ACTIVE).exists():
            raise ReleaseError("another rollout is running or paused; finish, roll back or cancel it first")
        r = Release.objects.get(pk=release_id)
        nodes = Node.objects.exclude(state=Node.State.REMOVED)
        wanted = list(node_ids or [])
        if wanted:
            nodes = nodes.filter(pk__in=wanted)
        nodes_list = list(nodes)
        if not nodes_list:
            raise ReleaseError("no nodes to update")
        ro = Rollout.objects.create(release=r, created_by=user, rollback_of_id=rollback_of)
        RolloutNode.objects.bulk_create(
            RolloutNode(rollout=ro, node=n, position=i, from_version=n.version)
            for i, n in enumerate(nodes_list)
        )
    return ro


def set_paused(rollout_id: int, paused: bool) -> bool:
    """Pause a running rollout or resume a paused one (a conditional update: False if it was not)."""
    old, new = (rollout.RUNNING, rollout.PAUSED) if paused else (rollout.PAUSED, rollout.RUNNING)
    return bool(Rollout.objects.filter(pk=rollout_id, state=old).update(state=new))


def roll_back(rollout_id: int, user: Any) -> tuple[Rollout | None, str]:
    """Stop a rollout and start one that returns its updated nodes to the version each ran before.

    (the new rollout or None, a note for the admin). Each node goes back to its previous version
    only where that version is a published release.
    """
    with transaction.atomic():
        ro = Rollout.objects.select_for_update().select_related("release").get(pk=rollout_id)
        if ro.state in rollout.ACTIVE:
            ro.state = Rollout.State.CANCELLED
            ro.error = "rolled back by an admin"
            ro.save(update_fields=["state", "error", "updated_at"])
        rows = list(ro.nodes.values_list("node_id", "state", "from_version"))
    targets = rollout.rollback_targets(rows, ro.release.version)
    if not targets:
        return None, "no node took this release; nothing to roll back"
    notes, started = [], None
    for version, node_ids in targets.items():
        back = Release.objects.filter(version=version).first()
        if back is None:
            notes.append(
                f"{', '.join(node_ids)}: version {version} is not a published release; publish it first"
            )
            continue
        if started is not None:
            notes.append(f"{', '.join(node_ids)}: roll back to {version} after this one finishes")
            continue
        started = start(back.pk, node_ids, user, rollback_of=ro.pk)
        notes.append(f"{len(node_ids)} node(s) going back to {version}")
    return started, "; ".join(notes)


def _serves_alone(node_id: str) -> bool:
    """Whether some layer this node serves has no ready replica on another online node."""
    mine = ShardAssignment.objects.filter(node_id=node_id, state=ShardAssignment.State.READY)
    for a in mine:
        others = ShardAssignment.objects.filter(
            artifact_id=a.artifact_id, state=ShardAssignment.State.READY, node__state=Node.State.ONLINE
        ).exclude(node_id=node_id)
        covered: set[int] = set()
        for o in others:
            covered.update(range(max(o.layer_start, a.layer_start), min(o.layer_end, a.layer_end)))
        if len(covered) < a.layer_end - a.layer_start:
            return True
    return False


def advance(rollout_id: int) -> Update | None:
    """Apply one step of the state machine; returns the command to send (after commit) if any.

    Runs inside the caller's transaction with the rollout row locked, so two workers never send the
    release to two nodes at once.
    """
    ro = Rollout.objects.select_for_update().select_related("release").filter(pk=rollout_id).first()
    if ro is None or ro.state not in rollout.ACTIVE:
        return None
    now = timezone.now()
    rows = list(ro.nodes.select_related("node"))
    views = [
        rollout.NodeRow(
            id=r.pk,
            node_id=r.node_id,
            state=r.state,
            position=r.position,
            online=r.node.state == Node.State.ONLINE and bool(r.node.dataplane_url),
            version=r.node.version,
            sent_age_s=(now - r.sent_at).total_seconds() if r.sent_at else None,
            serves_alone=r.state == rollout.PENDING and _serves_alone(r.node_id),
        )
        for r in rows
    ]
    d = rollout.step(ro.state, ro.release.version, views, settings.RELEASE_NODE_TIMEOUT_S)
    by_id = {r.pk: r for r in rows}
    for row_id, (state, error) in d.marks.items():
        RolloutNode.objects.filter(pk=row_id, state=by_id[row_id].state).update(
            state=state, error=error, finished_at=now
        )
    if d.rollout_state is not None:
        failed = [by_id[i] for i, (s, _) in d.marks.items() if s in rollout.NODE_BAD] or [
            r for r in rows if r.state in rollout.NODE_BAD
        ]
        error = f"stopped: {failed[0].node_id} {failed[0].state}" if d.rollout_state == rollout.FAILED else ""
        Rollout.objects.filter(pk=ro.pk, state=ro.state).update(
            state=d.rollout_state, error=error, updated_at=now
        )
    if d.send is not None and RolloutNode.objects.filter(pk=d.send, state=rollout.PENDING).update(
        state=rollout.SENT, sent_at=now, step=""
    ):
        return update_command(ro.pk, ro.release)
    return None


def apply_report(node_id: str, status: UpdateStatus) -> int | None:
    """An agent's `update_status`: record it on its own row (never another node's); the rollout id to
    advance, or None when the report changes nothing."""
    row = RolloutNode.objects.filter(
        rollout_id=status.rollout_id, node_id=node_id, rollout__release__version=status.version
    ).first()
    if row is None:
        return None
    new = rollout.report(row.state, status.state)
    if new is None:
        return None
    fields: dict[str, Any] = {"state": new, "step": status.state, "error": status.error[:2000]}
    if new != rollout.SENT:
        fields["finished_at"] = timezone.now()
    RolloutNode.objects.filter(pk=row.pk, state=rollout.SENT).update(**fields)
    return row.rollout_id


def active_rollout_ids() -> list[int]:
    return list(Rollout.objects.filter(state__in=rollout.ACTIVE).values_list("pk", flat=True))


def rollout_for_node(node_id: str) -> int | None:
    """The active rollout in which this node is mid-update, if any."""
    return (
        RolloutNode.objects.filter(node_id=node_id, state=rollout.SENT, rollout__state__in=rollout.ACTIVE)
        .values_list("rollout_id", flat=True)
        .first()
    )
