"""Fleet views: the live fleet page, enrollment tokens, drain/remove, placing models, placement bars,
the enroll API."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from asgiref.sync import async_to_sync
from celery.result import EagerResult
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from agent.wire.jsonlimits import loads_bounded
from webapp.catalog.models import ModelArtifact
from webapp.core import dataplane_tls
from webapp.core.auth import HtmxHttpRequest, staff_required
from webapp.core.broker import BrokerUnavailable, publish
from webapp.core.nodeauth import parse_node_authorization
from webapp.fleet import probe, services
from webapp.fleet.models import Node, ShardAssignment
from webapp.fleet.presenters import Series, history_hours, history_series, placement_bars
from webapp.fleet.tasks import drain_node, place_model, remove_node, unplace_model
from webapp.telemetry.services import samples_since

# Enrollment and certificate requests: a token, a name, a CSR and a URL (8 KiB and 512 bytes at most).
# Bounded and nested at most 64 deep (100,000 levels were a RecursionError, a 500; issue 33).
MAX_NODE_JSON_BYTES = 64 << 10


def fleet_history(hours: int = 1) -> dict[str, Series]:
    """Per node, the throughput and batching series of the last `hours` (seed the live plots)."""
    return history_series(samples_since(timezone.now() - timedelta(hours=hours)))


def fleet_context() -> dict[str, object]:
    nodes = Node.objects.exclude(state=Node.State.REMOVED).prefetch_related("shards__artifact")
    history = fleet_history()
    return {
        "nodes": nodes,
        "offline_after_s": settings.NODE_OFFLINE_AFTER_S,
        "history": history["throughput"],
        "batching_history": history["batching"],
    }


@require_GET
@staff_required
def index(request: HtmxHttpRequest) -> HttpResponse:
    template = "fleet/htmx/node_table.html" if request.htmx else "fleet/index.html"
    return render(request, template, fleet_context())


@require_POST
@staff_required
def create_token(request: HtmxHttpRequest) -> HttpResponse:
    plain, row = services.create_enrollment_token(request.user, request.POST.get("note", ""))
    return render(
        request,
        "fleet/htmx/token_created.html",
        {"token": plain, "row": row, "server": request.build_absolute_uri("/").rstrip("/")},
    )


@require_POST
@staff_required
def drain(request: HtmxHttpRequest, node_id: str) -> HttpResponse:
    node = get_object_or_404(Node, pk=node_id)
    try:
        publish(drain_node, node.pk)
    except BrokerUnavailable as e:
        return _row_with_error(request, node, str(e))
    node.refresh_from_db()
    return render(request, "fleet/htmx/node_row.html", {"node": node})


@require_POST
@staff_required
def remove(request: HtmxHttpRequest, node_id: str) -> HttpResponse:
    node = get_object_or_404(Node, pk=node_id)
    try:
        publish(remove_node, node.pk)
    except BrokerUnavailable as e:
        return _row_with_error(request, node, str(e))
    return HttpResponse("")


def _row_with_error(request: HtmxHttpRequest, node: Node, error: str) -> HttpResponse:
    """The node's row as it stands, the error beside its buttons (htmx swaps 503s in: base.html)."""
    return render(request, "fleet/htmx/node_row.html", {"node": node, "error": error}, status=503)


MAX_REPLICAS = 64


@require_POST
@staff_required
def place(request: HtmxHttpRequest, artifact_id: int) -> HttpResponse:
    artifact = get_object_or_404(ModelArtifact, pk=artifact_id)
    raw = request.POST.get("replicas", "").strip()
    # ASCII digits only: "²".isdigit() is true but int() refuses it, and 5,000 digits must not reach int().
    replicas = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 3 else None
    if (raw and replicas is None) or (replicas is not None and not 1 <= replicas <= MAX_REPLICAS):
        return HttpResponse(f"replicas must be a whole number from 1 to {MAX_REPLICAS}", status=400)
    try:
        result = publish(place_model, artifact.pk, replicas)
    except BrokerUnavailable as e:
        return _place_result(request, artifact, {"ok": False, "error": str(e)}, status=503)
    # Eager mode answers at once; with a worker there is no result backend, so report it queued.
    outcome: dict[str, Any] = {"ok": True, "queued": True}
    if isinstance(result, EagerResult) and isinstance(result.result, dict):
        outcome = result.result
    return _place_result(request, artifact, outcome, status=200 if outcome.get("ok") else 409)


def _place_result(
    request: HtmxHttpRequest, artifact: ModelArtifact, outcome: dict[str, Any], status: int
) -> HttpResponse:
    return render(
        request, "catalog/htmx/place_result.html", {"artifact": artifact, "outcome": outcome}, status=status
    )


@require_POST
@staff_required
def unplace(request: HtmxHttpRequest, artifact_id: int) -> HttpResponse:
    artifact = get_object_or_404(ModelArtifact, pk=artifact_id)
    try:
        publish(unplace_model, artifact.pk)
    except BrokerUnavailable as e:
        return _place_result(request, artifact, {"ok": False, "error": str(e)}, status=503)
    return _place_result(request, artifact, {"ok": True, "unplaced": True}, status=200)


@require_GET
@staff_required
def placement(request: HtmxHttpRequest) -> HttpResponse:
    artifacts = ModelArtifact.objects.filter(state=ModelArtifact.State.READY)
    shards = ShardAssignment.objects.select_related("node").filter(artifact__in=artifacts)
    ctx = {"models": placement_bars(list(artifacts), list(shards))}
    template = "fleet/htmx/placement_bars.html" if request.htmx else "fleet/placement.html"
    return render(request, template, ctx)


@csrf_exempt  # authenticated by the one-time enrollment token in the body, not by a browser session
@require_POST
def enroll_api(request: HttpRequest) -> JsonResponse:
    """POST {"token", "name"} -> {"node_id", "secret", "public_key"}; a token works once, before expiry."""
    try:
        body = loads_bounded(request.body or b"{}", max_bytes=MAX_NODE_JSON_BYTES)
        token, name = body["token"], body.get("name", "")
        if not isinstance(token, str) or not isinstance(name, str):
            raise TypeError
        if not name.isprintable() or len(token) > 200:  # NUL and other controls: never a name (or a 500)
            raise ValueError
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": 'send JSON {"token": "...", "name": "..."}'}, status=400)
    try:
        e = services.redeem_enrollment_token(token, name)
    except services.EnrollmentError as err:
        return JsonResponse({"error": str(err)}, status=403)
    return JsonResponse(
        {
            "node_id": e.node_id,
            "secret": e.secret,
            "public_key": e.public_key,
            "release_public_key": e.release_public_key,
        },
        status=201,
    )


@require_GET
@staff_required
def history_json(request: HttpRequest) -> JsonResponse:
    """GET ?hours=N (1 to TELEMETRY_KEEP_HOURS, default 1) -> {"hours", "throughput": {node: [[t, tok/s]]},
    "batching": {node: [[t, batch steps, queue wait ms, batch compute ms]]}}, t in unix seconds."""
    hours = history_hours(request.GET.get("hours"), settings.TELEMETRY_KEEP_HOURS)
    if hours is None:
        return JsonResponse(
            {"error": f"hours must be a whole number from 1 to {settings.TELEMETRY_KEEP_HOURS}"}, status=400
        )
    return JsonResponse({"hours": hours, **fleet_history(hours)})


@require_GET
@staff_required
def status_json(request: HttpRequest) -> JsonResponse:
    """Machine-readable fleet and model state (scripts, readiness polling, monitoring)."""
    nodes = Node.objects.exclude(state=Node.State.REMOVED).prefetch_related("shards__artifact")
    return JsonResponse(
        {
            "nodes": [
                {
                    "id": n.id,
                    "name": n.name,
                    "state": n.state,
                    "dataplane_url": n.dataplane_url,
                    "last_seen": n.last_seen.isoformat() if n.last_seen else None,
                    "connected_at": n.connected_at.isoformat() if n.connected_at else None,
                    "backends": n.backends,
                    "shards": [
                        {
                            "id": s.pk,
                            "artifact_id": s.artifact_id,
                            "model_sha256": s.artifact.sha256,
                            "layer_start": s.layer_start,
                            "layer_end": s.layer_end,
                            "state": s.state,
                            "progress": s.progress,
                            "transfer": s.transfer,
                            "error": s.error,
                        }
                        for s in n.shards.all()
                    ],
                }
                for n in nodes
            ],
            "models": [
                {
                    "id": a.pk,
                    "name": a.name,
                    "state": a.state,
                    "sha256": a.sha256,
                    "n_layers": a.n_layers,
                    "error": a.error,
                }
                for a in ModelArtifact.objects.all()
            ],
        }
    )


@csrf_exempt  # authenticated by the node's credentials (Authorization: Node <id>:<secret>), not a session
@require_POST
def certificate_api(request: HttpRequest) -> JsonResponse:
    """POST {"csr", "dataplane_url"} -> {"certificate", "ca"}: the node's data-plane TLS certificate,
    naming its node id and the URL's host, for the key it keeps (webapp/core/dataplane_tls.py)."""
    creds = parse_node_authorization(request.headers.get("Authorization"))
    node = services.authenticate_node(*creds) if creds is not None else None
    if node is None:
        return JsonResponse({"error": "invalid or missing node credentials"}, status=401)
    try:
        body = loads_bounded(request.body or b"{}", max_bytes=MAX_NODE_JSON_BYTES)
        csr, url = body["csr"], body["dataplane_url"]
        if not isinstance(csr, str) or not isinstance(url, str) or len(csr) > 8192 or len(url) > 512:
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return JsonResponse(
            {"error": 'send JSON {"csr": "<PEM>", "dataplane_url": "https://..."}'}, status=400
        )
    # the host must be where the node connects from (or allowed), as for its reported URL (probe.py)
    problem = probe.url_problem(url) or async_to_sync(probe.host_problem)(
        url, request.META.get("REMOTE_ADDR"), settings.DATAPLANE_ALLOWED_HOSTS
    )
    if problem:
        return JsonResponse({"error": problem}, status=400)
    try:
        cert = dataplane_tls.issue_node_certificate(node.pk, csr, url)
    except dataplane_tls.CertificateRequestError as e:
        return JsonResponse({"error": str(e)}, status=400)
    return JsonResponse({"certificate": cert, "ca": dataplane_tls.ca_pem()}, status=201)
