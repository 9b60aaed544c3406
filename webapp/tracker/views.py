"""Tracker views: announce / scrape and the web seed for enrolled nodes (passkey URLs), and the artifact
endpoints nodes fetch from with their credentials (manifest, .torrent, the HTTP range fallback)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET
from redis.exceptions import RedisError

from webapp.catalog.models import ModelArtifact
from webapp.core.nodeauth import parse_node_authorization
from webapp.fleet.services import authenticate_node
from webapp.tracker import logic, services
from webapp.tracker.http import file_range_response

log = logging.getLogger(__name__)


def _bencoded(answer: Callable[[], bytes]) -> HttpResponse:
    """The tracker's answer (trackers answer 200; refusals are in the body). A Redis that fails or
    does not answer in time (the peer store's and the rate counter's timeouts) is a failure reason the
    node's torrent client understands and retries after, not a 500 it cannot read."""
    try:
        body = answer()
    except RedisError as e:
        log.warning("tracker answered unavailable: Redis %s", e.__class__.__name__)
        body = logic.failure("tracker unavailable, announce again later")
    return HttpResponse(body, content_type="text/plain")


@require_GET
def announce(request: HttpRequest, passkey: str) -> HttpResponse:
    """BEP 3 announce; the raw QUERY_STRING is parsed because request.GET corrupts the binary info_hash."""
    return _bencoded(
        lambda: logic.announce(
            request.META.get("QUERY_STRING", ""),
            request.META.get("REMOTE_ADDR", ""),
            passkey,
            identify=services.identify,
            torrent_known=services.torrent_known,
            store=services.peer_store(),
            limiter=services.announce_rate,
        )
    )


@require_GET
def scrape(request: HttpRequest, passkey: str) -> HttpResponse:
    """BEP 48 scrape of the info_hashes asked for."""
    return _bencoded(
        lambda: logic.scrape(
            request.META.get("QUERY_STRING", ""),
            passkey,
            identify=services.identify,
            torrent_known=services.torrent_known,
            store=services.peer_store(),
            limiter=services.announce_rate,
            remote_ip=request.META.get("REMOTE_ADDR", ""),
        )
    )


@require_GET
def webseed(request: HttpRequest, passkey: str, sha256: str) -> HttpResponseBase:
    """BEP 19 web seed: the artifact's bytes, one Range per request, for enrolled nodes only."""
    if not services.passkey_ok(passkey):
        return HttpResponse("unknown passkey", status=403, content_type="text/plain")
    artifact = get_object_or_404(ModelArtifact, sha256=sha256, state=ModelArtifact.State.READY)
    return file_range_response(request, artifact.path)


def _may_read_artifacts(request: HttpRequest) -> bool:
    if request.user.is_authenticated and request.user.is_staff:
        return True
    creds = parse_node_authorization(request.headers.get("Authorization"))
    return creds is not None and authenticate_node(*creds) is not None


def _ready_artifact(sha256: str) -> ModelArtifact:
    return get_object_or_404(ModelArtifact, sha256=sha256, state=ModelArtifact.State.READY)


@require_GET
def artifact_manifest(request: HttpRequest, sha256: str) -> HttpResponse:
    """The manifest JSON (nodes and staff only)."""
    if not _may_read_artifacts(request):
        return JsonResponse({"error": "node credentials required"}, status=401)
    return JsonResponse(_ready_artifact(sha256).manifest)


@require_GET
def artifact_file(request: HttpRequest, sha256: str) -> HttpResponseBase:
    """The GGUF bytes with single-range support (the HTTP fallback when there is no swarm)."""
    if not _may_read_artifacts(request):
        return JsonResponse({"error": "node credentials required"}, status=401)
    return file_range_response(request, _ready_artifact(sha256).path)


@require_GET
def artifact_torrent(request: HttpRequest, sha256: str) -> HttpResponse:
    """The artifact's .torrent (nodes and staff only); 404 when it has none (agents then use HTTP)."""
    if not _may_read_artifacts(request):
        return JsonResponse({"error": "node credentials required"}, status=401)
    artifact = _ready_artifact(sha256)
    if not artifact.torrent:
        return JsonResponse({"error": "this artifact has no .torrent"}, status=404)
    resp = HttpResponse(bytes(artifact.torrent), content_type="application/x-bittorrent")
    resp["Content-Disposition"] = f'attachment; filename="{sha256}.torrent"'
    return resp
