"""ASGI middleware: refuse a request body past its limit before it is buffered (413), not after.

Django's ASGI handler spools the whole body before any view runs, so a size check in a view comes
too late: the limit is enforced here, on Content-Length when the client declares one, and by counting
the body messages as daphne hands them over otherwise. Uploads to the models page may carry
MAX_UPLOAD_BYTES; everything else MAX_REQUEST_BYTES.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

UPLOAD_PATHS = frozenset({"/models/register"})
_SLACK = 1 << 20  # multipart framing and the form's other fields around an upload


class BodyTooLarge(Exception):
    """The body passed its limit while arriving."""


def limit_for(path: str) -> int:
    if path in UPLOAD_PATHS:
        return int(settings.MAX_UPLOAD_BYTES) + _SLACK
    return int(settings.MAX_REQUEST_BYTES)


def _declared_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return None


async def _refuse(send: Any, status: int, text: str) -> None:
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Wraps the HTTP application; websockets pass through (their frames have their own limits)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = limit_for(scope.get("path", ""))
        declared = _declared_length(scope)
        if declared is not None and (declared < 0 or declared > limit):
            what = "a malformed Content-Length" if declared < 0 else f"{declared} bytes"
            await _refuse(
                send, 413 if declared >= 0 else 400, f"request body of {what}; the limit is {limit}\n"
            )
            return
        seen = 0
        started = False

        async def counted_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return message

        async def tracked_send(message: Any) -> None:
            nonlocal started
            if message.get("type") == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _refuse(send, 413, f"request body larger than the limit of {limit} bytes\n")
