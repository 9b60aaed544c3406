"""The data plane's refusals: DataPlaneError and the JSON answer every part of it sends for one."""

from __future__ import annotations

import json

from aiohttp import web


class DataPlaneError(Exception):
    """A refusal the data plane answers with `status` and a JSON body naming `code`."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def error_response(status: int, code: str, message: str) -> web.Response:
    """The HTTP answer to a refusal: `{"error": code, "message": message}` with `status`."""
    return web.Response(
        status=status, text=json.dumps({"error": code, "message": message}), content_type="application/json"
    )
