"""A JSON websocket consumer base that answers malformed messages with an error instead of crashing.

Every JSON message from a browser or an agent enters here, through `loads_bounded`: a message nested
deeper than MAX_JSON_DEPTH (100,000 levels took the socket down with 1011, issue 33) gets an error
message and a normal close (1000), before any parsing."""

from __future__ import annotations

import logging
from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from agent.wire.jsonlimits import DEFAULT_MAX_DEPTH, JsonLimitError, loads_bounded

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 256 << 10
MAX_JSON_DEPTH = DEFAULT_MAX_DEPTH


class BadMessage(ValueError):
    """A websocket message we refuse; the text is sent back to the client."""


class SafeJsonConsumer(AsyncJsonWebsocketConsumer):
    """Decodes JSON itself; a bad message gets `{"type": "error"}` and the socket stays open (one nested
    too deep gets the error and a normal close)."""

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        raw = text_data if text_data is not None else (bytes_data or b"")
        if len(raw) > MAX_MESSAGE_BYTES:
            await self.send_error(f"message larger than {MAX_MESSAGE_BYTES} bytes")
            return
        try:
            content = loads_bounded(raw, max_depth=MAX_JSON_DEPTH)  # its size was checked above
        except JsonLimitError as e:  # hostile, not a slip: say why, then end the socket normally
            await self.send_error(f"message refused: {e}")
            await self.close(code=1000)
            return
        except (ValueError, UnicodeDecodeError) as e:
            await self.send_error(f"malformed JSON: {e}")
            return
        try:
            await self.receive_json(content)
        except BadMessage as e:
            await self.send_error(str(e))
        except Exception:  # noqa: BLE001 - one bad message must never take the connection down
            log.exception("%s failed on a message", type(self).__name__)
            await self.send_error("internal error handling this message")

    async def send_error(self, text: str) -> None:
        await self.send_json({"type": "error", "error": text})
