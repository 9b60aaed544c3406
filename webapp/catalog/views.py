"""Catalog views: the models page, registration (path/upload/package), and artifact bytes for agents."""

from __future__ import annotations

import os
from collections.abc import Iterator

from celery.result import EagerResult
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET, require_POST

from webapp.catalog import services
from webapp.catalog.models import ModelArtifact
from webapp.core.auth import HtmxHttpRequest, staff_required
from webapp.core.nodeauth import parse_node_authorization
from webapp.fleet.services import authenticate_node
from webapp.fleet.tasks import place_model, unplace_model

CHUNK = 1 << 20


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


def _file_slice(path: str, start: int, end: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk


@require_GET
def artifact_file(request: HttpRequest, sha256: str) -> HttpResponse:
    """The GGUF bytes with single-range support (agents fetch only their layers; later the web seed)."""
    if not _may_read_artifacts(request):
        return JsonResponse({"error": "node credentials required"}, status=401)
    artifact = _ready_artifact(sha256)
    try:
        size = os.path.getsize(artifact.path)
        rng = services.parse_range(request.headers.get("Range"), size)
    except OSError:
        return JsonResponse({"error": "artifact file is missing on the control plane"}, status=410)
    except services.RangeNotSatisfiable as e:
        resp = JsonResponse({"error": str(e)}, status=416)
        resp["Content-Range"] = f"bytes */{size}"
        return resp
    if rng is None:
        resp: HttpResponse = FileResponse(open(artifact.path, "rb"), content_type="application/octet-stream")  # noqa: SIM115 - FileResponse closes it
        resp["Accept-Ranges"] = "bytes"
        return resp
    start, end = rng
    resp = StreamingHttpResponse(
        _file_slice(artifact.path, start, end), status=206, content_type="application/octet-stream"
    )
    resp["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    resp["Content-Length"] = str(end - start)
    resp["Accept-Ranges"] = "bytes"
    return resp
