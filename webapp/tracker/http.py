"""Serving a file's bytes for a Range header as a Django response (the artifact endpoint and web seed)."""

from __future__ import annotations

import os

from django.http import HttpResponse, StreamingHttpResponse

from webapp.tracker.webseed import RangeNotSatisfiable, plan_range, read_range


def file_range_response(path: str, range_header: str | None) -> HttpResponse:
    """200 with the whole file, 206 with one range, 416 with the reason; 410 when the file is gone."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return HttpResponse(
            "artifact file is missing on the control plane", status=410, content_type="text/plain"
        )
    try:
        plan = plan_range(range_header, size)
    except RangeNotSatisfiable as e:
        resp = HttpResponse(str(e), status=416, content_type="text/plain")
        for k, v in e.headers.items():
            resp[k] = v
        return resp
    resp = StreamingHttpResponse(read_range(path, plan.start, plan.end), status=plan.status)
    for k, v in plan.headers.items():
        resp[k] = v
    return resp
