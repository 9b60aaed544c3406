"""Catalog tasks: build an artifact's manifest (hashes every tensor) and .torrent off the request path."""

from __future__ import annotations

import json

from celery import shared_task
from django.db import transaction

from agent.artifacts.manifest import ManifestError, build_manifest
from agent.backends.check import with_executor_check
from webapp.catalog.models import ModelArtifact
from webapp.catalog.services import build_torrent
from webapp.core.broker import BrokerUnavailable, publish
from webapp.core.channels import notify_fleet

# Shown under a pending model's badge while the broker has not taken its build (beat publishes it again).
BUILD_NOT_QUEUED = "waiting for the task queue (Redis), which did not take its build; it is sent again"


def enqueue_build(artifact_id: int) -> None:
    """Build the manifest once the registering transaction commits (a worker must see the row). A broker
    that cannot take the task leaves the model pending and marked, not lost with a 500 to the registering
    user: beat's requeue_unqueued_builds sends it again."""

    def send() -> None:
        if not _publish_build(artifact_id):
            ModelArtifact.objects.filter(pk=artifact_id, state=ModelArtifact.State.PENDING).update(
                error=BUILD_NOT_QUEUED
            )

    transaction.on_commit(send)


def _publish_build(artifact_id: int) -> bool:
    try:
        publish(build_artifact_manifest, artifact_id)
    except BrokerUnavailable:  # logged by publish
        return False
    return True


@shared_task
def requeue_unqueued_builds() -> int:
    """Beat: send again the builds the broker did not take (marked by enqueue_build); returns how many
    went. The build's claim (pending -> building) makes a second delivery a no-op."""
    marked = ModelArtifact.objects.filter(state=ModelArtifact.State.PENDING, error=BUILD_NOT_QUEUED)
    sent = 0
    for pk in list(marked.values_list("pk", flat=True)[:100]):
        if not _publish_build(pk):
            break  # the broker is still away; the next beat tries again
        ModelArtifact.objects.filter(pk=pk, state=ModelArtifact.State.PENDING, error=BUILD_NOT_QUEUED).update(
            error=""
        )
        sent += 1
    return sent


@shared_task
def build_artifact_manifest(artifact_id: int) -> str:
    """pending -> building -> ready (or failed with the reason: unreadable, an architecture neither the
    native executor nor llama.cpp runs, a duplicate); the .torrent is built with the manifest. A model
    whose architecture has no layer windows but that llama.cpp runs is ready as whole-model-only: its
    manifest keeps the facts `ModelArtifact.routing` derives that mode and its reason from."""
    claimed = ModelArtifact.objects.filter(pk=artifact_id, state=ModelArtifact.State.PENDING).update(
        state=ModelArtifact.State.BUILDING, error=""
    )
    if not claimed:
        return "another worker got there first"
    a = ModelArtifact.objects.get(pk=artifact_id)
    try:
        m = with_executor_check(build_manifest(a.path), a.path)
    except ManifestError as e:
        ModelArtifact.objects.filter(pk=artifact_id).update(state=ModelArtifact.State.FAILED, error=str(e))
        return "failed"
    routing = m.routing
    if not routing.servable:
        # Marked with the reason instead of being placed. The row keeps what the file is but no sha256,
        # so the same file registers again once the executor runs its architecture.
        ModelArtifact.objects.filter(pk=artifact_id).update(
            state=ModelArtifact.State.FAILED,
            error=routing.reason,
            size_bytes=m.file_size,
            n_layers=m.n_layers,
            architecture=m.architecture,
        )
        return "not servable"
    if ModelArtifact.objects.filter(sha256=m.sha256).exclude(pk=artifact_id).exists():
        ModelArtifact.objects.filter(pk=artifact_id).update(
            state=ModelArtifact.State.FAILED,
            error=f"this file (sha256 {m.sha256[:12]}) is already registered",
        )
        return "duplicate"
    try:
        torrent, infohash = build_torrent(a.path, m)
    except (OSError, RuntimeError) as e:
        ModelArtifact.objects.filter(pk=artifact_id).update(
            state=ModelArtifact.State.FAILED, error=f"cannot build the .torrent: {e}"
        )
        return "failed"
    ModelArtifact.objects.filter(pk=artifact_id).update(
        state=ModelArtifact.State.READY,
        sha256=m.sha256,
        size_bytes=m.file_size,
        n_layers=m.n_layers,
        architecture=m.architecture,
        manifest=json.loads(m.to_json()),
        torrent=torrent,
        infohash=infohash,
        error="",
    )
    notify_fleet(kind="models")
    return "ready"
