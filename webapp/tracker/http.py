"""Serving a file's bytes for a Range header as a Django response (the artifact endpoint and web seed)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from webapp.tracker.webseed import MAX_CHUNK, RangeNotSatisfiable, plan_range, read_range


async def aread_range(path: str, start: int, end: int, chunk: int = MAX_CHUNK) -> AsyncIterator[bytes]:
    """The bytes [start, end) in chunks, each read in a thread: under ASGI a sync iterator would be
    drained into one list in memory before the first byte went out (a whole shard for the HTTP
    fallback), so the ASGI server gets this instead."""
    f = await asyncio.to_thread(open, path, "rb")
    try:
        await asyncio.to_thread(f.seek, start)
        left = end - start
        while left > 0:
            data = await asyncio.to_thread(f.read, min(chunk, left))
            if not data:
                return
            left -= len(data)
            yield data
    finally:
        f.close()


def file_range_response(request: HttpRequest, path: str) -> HttpResponseBase:
    """200 with the whole file, 206 with one range, 416 with the reason; 410 when the file is gone."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return HttpResponse(
            "artifact file is missing on the control plane", status=410, content_type="text/plain"
        )
    try:
        plan = plan_range(request.headers.get("Range"), size)
    except RangeNotSatisfiable as e:
        refused = HttpResponse(str(e), status=416, content_type="text/plain")
        for k, v in e.headers.items():
            refused[k] = v
        return refused
    body = (
        aread_range(path, plan.start, plan.end)
        if isinstance(request, ASGIRequest)
        else read_range(path, plan.start, plan.end)
    )
    resp = StreamingHttpResponse(body, status=plan.status)
    for k, v in plan.headers.items():
        resp[k] = v
    return resp
