"""Catalog views: the models page, registration (path/upload/package), and artifact bytes for agents."""

from __future__ import annotations

from celery.result import EagerResult
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET, require_POST

from webapp.catalog import services
from webapp.catalog.models import ModelArtifact
from webapp.core.auth import HtmxHttpRequest, staff_required
from webapp.core.nodeauth import parse_node_authorization
from webapp.fleet.services import authenticate_node
from webapp.fleet.tasks import place_model, unplace_model
from webapp.tracker.http import file_range_response


def _models_context() -> dict[str, object]:
    artifacts = list(ModelArtifact.objects.prefetch_related("shards").all()[:100])
    building = any(a.state in (ModelArtifact.State.PENDING, ModelArtifact.State.BUILDING) for a in artifacts)
    return {"artifacts": artifacts, "building": building}


@require_GET
@staff_required
def index(request: HtmxHttpRequest) -> HttpResponse:
    template = "catalog/htmx/models_table.html" if request.htmx else "catalog/index.html"
    return render(request, template, _models_context())


@require_POST
@staff_required
def register(request: HtmxHttpRequest) -> HttpResponse:
    kind = request.POST.get("kind", "")
    name = request.POST.get("name", "").strip()[:200]
    try:
        if kind == "path":
            services.register_path(request.POST.get("path", "").strip(), request.user, name)
        elif kind == "package":
            services.register_package(request.POST.get("package", "smollm2").strip(), request.user)
        elif kind == "upload":
            f = request.FILES.get("file")
            if f is None:
                raise services.RegistrationError("choose a .gguf file to upload")
            services.register_upload(f, request.user, name)
        else:
            raise services.RegistrationError(f"unknown registration kind {kind!r}")
    except services.RegistrationError as e:
        return render(
            request, "catalog/htmx/models_table.html", {**_models_context(), "error": str(e)}, status=400
        )
    return render(request, "catalog/htmx/models_table.html", _models_context())


@require_POST
@staff_required
def place(request: HtmxHttpRequest, artifact_id: int) -> HttpResponse:
    artifact = get_object_or_404(ModelArtifact, pk=artifact_id)
    replicas = request.POST.get("replicas", "")
    result = place_model.delay(artifact.pk, int(replicas) if replicas.isdigit() else None)
    # Eager mode answers at once; with a worker there is no result backend, so report it queued.
    outcome = result.result if isinstance(result, EagerResult) else {"ok": True, "queued": True}
    status = 200 if outcome.get("ok") else 409
    return render(
        request, "catalog/htmx/place_result.html", {"artifact": artifact, "outcome": outcome}, status=status
    )


@require_POST
@staff_required
def unplace(request: HtmxHttpRequest, artifact_id: int) -> HttpResponse:
    artifact = get_object_or_404(ModelArtifact, pk=artifact_id)
    unplace_model.delay(artifact.pk)
    return render(
        request,
        "catalog/htmx/place_result.html",
        {"artifact": artifact, "outcome": {"ok": True, "unplaced": True}},
    )


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
def artifact_file(request: HttpRequest, sha256: str) -> HttpResponse:
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
