"""Catalog views: the models page, registration (path, upload, PyPI package) and each model's replica
count."""

from __future__ import annotations

from django.http import HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.csrf import csrf_exempt, csrf_protect
from django.views.decorators.http import require_GET, require_POST

from webapp.catalog import services, tasks
from webapp.catalog.models import MAX_REPLICAS, ModelArtifact
from webapp.catalog.uploads import LimitedUploadHandler
from webapp.core.auth import HtmxHttpRequest, staff_required


def _models_context() -> dict[str, object]:
    artifacts = list(ModelArtifact.objects.prefetch_related("shards").all()[:100])
    building = any(a.state in (ModelArtifact.State.PENDING, ModelArtifact.State.BUILDING) for a in artifacts)
    return {"artifacts": artifacts, "building": building}


@require_GET
@staff_required
def index(request: HtmxHttpRequest) -> HttpResponse:
    template = "catalog/htmx/models_table.html" if request.htmx else "catalog/index.html"
    return render(request, template, _models_context())


@csrf_exempt  # only so the upload handler goes in before the body is parsed; CSRF is checked below
@require_POST
@staff_required
def register(request: HtmxHttpRequest) -> HttpResponse:
    limited = LimitedUploadHandler(request)
    request.upload_handlers = [limited]
    return _register(request, limited)


@csrf_protect
def _register(request: HtmxHttpRequest, limited: LimitedUploadHandler) -> HttpResponse:
    kind = request.POST.get("kind", "")
    # Names are shown on every page: printable text only (a NUL would also be refused by PostgreSQL).
    name = "".join(c for c in request.POST.get("name", "") if c.isprintable()).strip()[:200]
    try:
        if kind == "path":
            artifact = services.register_path(request.POST.get("path", "").strip(), request.user, name)
        elif kind == "package":
            artifact = services.register_package(request.POST.get("package", "smollm2").strip(), request.user)
        elif kind == "upload":
            f = request.FILES.get("file")
            if limited.too_large:
                raise services.RegistrationError(
                    f"upload is larger than the limit of {limited.limit} bytes (MAX_UPLOAD_BYTES)"
                )
            if f is None:
                raise services.RegistrationError("choose a .gguf file to upload")
            artifact = services.register_upload(f, request.user, name)
        else:
            raise services.RegistrationError(f"unknown registration kind {kind[:40]!r}")
    except services.RegistrationError as e:
        return render(
            request, "catalog/htmx/models_table.html", {**_models_context(), "error": str(e)}, status=400
        )
    tasks.enqueue_build(artifact.pk)
    return render(request, "catalog/htmx/models_table.html", _models_context())


@require_POST
@staff_required
def set_replicas(request: HtmxHttpRequest, artifact_id: int) -> HttpResponse:
    """Set how many copies of each layer range the model keeps (the target of the next placement and of
    re-placement after a node is lost); shards already placed stay where they are."""
    artifact = get_object_or_404(ModelArtifact, pk=artifact_id)
    raw = request.POST.get("replicas", "").strip()
    # ASCII digits only: "²".isdigit() is true but int() refuses it, and 5,000 digits must not reach int().
    replicas = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 3 else 0
    if not 1 <= replicas <= MAX_REPLICAS:
        return HttpResponse(f"replicas must be a whole number from 1 to {MAX_REPLICAS}", status=400)
    ModelArtifact.objects.filter(pk=artifact.pk).update(desired_replicas=replicas)
    artifact.desired_replicas = replicas
    return render(request, "catalog/htmx/replicas_saved.html", {"artifact": artifact})
