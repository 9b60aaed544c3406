"""Tracker views: announce / scrape for enrolled nodes, and the artifact's bytes as a web seed."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET

from webapp.catalog.models import ModelArtifact
from webapp.tracker import logic, services
from webapp.tracker.http import file_range_response


def _bencoded(body: bytes) -> HttpResponse:
    return HttpResponse(body, content_type="text/plain")  # trackers answer 200; refusals are in the body


@require_GET
def announce(request: HttpRequest, passkey: str) -> HttpResponse:
    """BEP 3 announce; the raw QUERY_STRING is parsed because request.GET corrupts the binary info_hash."""
    return _bencoded(
        logic.announce(
            request.META.get("QUERY_STRING", ""),
            request.META.get("REMOTE_ADDR", ""),
            passkey,
            passkey_ok=services.passkey_ok,
            torrent_known=services.torrent_known,
            store=services.peer_store(),
        )
    )


@require_GET
def scrape(request: HttpRequest, passkey: str) -> HttpResponse:
    """BEP 48 scrape of the info_hashes asked for."""
    return _bencoded(
        logic.scrape(
            request.META.get("QUERY_STRING", ""),
            passkey,
            passkey_ok=services.passkey_ok,
            torrent_known=services.torrent_known,
            store=services.peer_store(),
        )
    )


@require_GET
def webseed(request: HttpRequest, passkey: str, sha256: str) -> HttpResponse:
    """BEP 19 web seed: the artifact's bytes, one Range per request, for enrolled nodes only."""
    if not services.passkey_ok(passkey):
        return HttpResponse("unknown passkey", status=403, content_type="text/plain")
    artifact = get_object_or_404(ModelArtifact, sha256=sha256, state=ModelArtifact.State.READY)
    return file_range_response(request, artifact.path)
