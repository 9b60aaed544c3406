"""Release views: the releases page (publish, start, pause, resume, roll back), the fleet page's rollout
panel, and the wheel download for nodes (node credentials)."""

from __future__ import annotations

from django.conf import settings
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET, require_POST

from webapp.core.auth import HtmxHttpRequest, staff_required
from webapp.core.keys import release_public_key
from webapp.core.nodeauth import parse_node_authorization
from webapp.fleet.models import Node
from webapp.fleet.services import authenticate_node
from webapp.releases import services
from webapp.releases.models import Release, Rollout
from webapp.releases.tasks import enqueue_advance


def _context() -> dict[str, object]:
    rollouts = Rollout.objects.select_related("release").prefetch_related("nodes__node")[:10]
    return {
        "releases": Release.objects.all()[:50],
        "rollouts": rollouts,
        "active": next((r for r in rollouts if r.active), None),
        "nodes": Node.objects.exclude(state=Node.State.REMOVED),
        "release_key": release_public_key(),
        "signs_on_server": bool(settings.RELEASE_SIGNING_KEY_FILE),
    }


def _panel(request: HttpRequest, message: str = "", status: int = 200) -> HttpResponse:
    return render(request, "releases/htmx/panel.html", {**_context(), "message": message}, status=status)


@require_GET
@staff_required
def index(request: HtmxHttpRequest) -> HttpResponse:
    if request.htmx:
        return _panel(request)
    return render(request, "releases/index.html", _context())


@require_POST
@staff_required
def publish(request: HtmxHttpRequest) -> HttpResponse:
    wheel = request.FILES.get("wheel")
    if wheel is None or not wheel.name:
        return _panel(request, "choose a wheel (.whl) to publish", 400)
    try:
        r = services.publish(
            wheel,
            wheel.name,
            request.POST.get("version", ""),
            request.POST.get("signature", ""),
            request.user,
            request.POST.get("notes", ""),
        )
    except services.ReleaseError as e:
        return _panel(request, str(e), 400)
    return _panel(request, f"published {r.version} ({r.filename}, sha256 {r.sha256[:12]}…)")


@require_POST
@staff_required
def start(request: HtmxHttpRequest, release_id: int) -> HttpResponse:
    release = get_object_or_404(Release, pk=release_id)
    try:
        ro = services.start(release.pk, request.POST.getlist("nodes"), request.user)
    except services.ReleaseError as e:
        return _panel(request, str(e), 409)
    enqueue_advance(ro.pk)
    return _panel(request, f"rollout {ro.pk} of {release.version} started")


@require_POST
@staff_required
def pause(request: HtmxHttpRequest, rollout_id: int) -> HttpResponse:
    ok = services.set_paused(rollout_id, True)
    return _panel(request, "paused" if ok else "that rollout is not running", 200 if ok else 409)


@require_POST
@staff_required
def resume(request: HtmxHttpRequest, rollout_id: int) -> HttpResponse:
    ok = services.set_paused(rollout_id, False)
    if ok:
        enqueue_advance(rollout_id)
    return _panel(request, "resumed" if ok else "that rollout is not paused", 200 if ok else 409)


@require_POST
@staff_required
def roll_back(request: HtmxHttpRequest, rollout_id: int) -> HttpResponse:
    get_object_or_404(Rollout, pk=rollout_id)
    try:
        ro, note = services.roll_back(rollout_id, request.user)
    except services.ReleaseError as e:
        return _panel(request, str(e), 409)
    if ro is not None:
        enqueue_advance(ro.pk)
    return _panel(request, note)


@require_GET
@staff_required
def status_json(request: HttpRequest) -> JsonResponse:
    """Releases and rollouts, machine-readable (scripts, tests)."""
    ctx = _context()
    return JsonResponse(
        {
            "nodes": [
                {"id": n.pk, "name": n.name, "state": n.state, "version": n.version}
                for n in ctx["nodes"]  # type: ignore[attr-defined]  # a queryset of Node
            ],
            "releases": [
                {"id": r.pk, "version": r.version, "filename": r.filename, "sha256": r.sha256}
                for r in Release.objects.all()
            ],
            "rollouts": [
                {
                    "id": ro.pk,
                    "version": ro.release.version,
                    "state": ro.state,
                    "error": ro.error,
                    "rollback_of": ro.rollback_of_id,
                    "nodes": [
                        {"node_id": n.node_id, "state": n.state, "step": n.step, "error": n.error}
                        for n in ro.nodes.all()
                    ],
                }
                for ro in ctx["rollouts"]  # type: ignore[attr-defined]  # a queryset of Rollout
            ],
        }
    )


@require_GET
def wheel(request: HttpRequest, release_id: int) -> HttpResponseBase:
    """The release's wheel, for enrolled nodes (and staff); the node checks its signature itself."""
    creds = parse_node_authorization(request.headers.get("Authorization"))
    staff = request.user.is_authenticated and request.user.is_staff
    if not staff and (creds is None or authenticate_node(*creds) is None):
        return JsonResponse({"error": "node credentials required"}, status=401)
    r = get_object_or_404(Release, pk=release_id)
    if not r.path.is_file():
        raise Http404("the release's wheel is missing from the release dir")
    return FileResponse(r.path.open("rb"), as_attachment=True, filename=r.filename)
