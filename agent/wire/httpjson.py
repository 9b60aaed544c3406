"""A peer's JSON answer read bounded: at most `max_bytes` of body, parsed by `loads_bounded`.

`ClientResponse.json()` reads the whole body and hands it to `json.loads`: a hostile peer (a node's
health, a hand-off's answer) could send gigabytes, or 100,000 nested brackets that end in a
`RecursionError`. `read_json` stops reading past the limit and refuses deep nesting; every refusal is a
`ValueError` (`JsonLimitError` or `json.JSONDecodeError`), which callers already treat as a bad answer.
"""

from __future__ import annotations

from typing import Any

from aiohttp import ClientResponse

from agent.wire.jsonlimits import DEFAULT_MAX_DEPTH, JsonLimitError, loads_bounded

# A node's /v1/health or a hand-off's answer: a few KiB (one entry per shard); 1 MiB is generous.
PEER_JSON_MAX = 1 << 20


async def read_json(
    r: ClientResponse, max_bytes: int = PEER_JSON_MAX, max_depth: int = DEFAULT_MAX_DEPTH
) -> Any:
    """The JSON body of `r`, read in chunks and never more than `max_bytes` (+ one chunk) of it."""
    if r.content_length is not None and r.content_length > max_bytes:
        raise JsonLimitError(f"JSON answer of {r.content_length} bytes; the limit is {max_bytes}")
    buf = bytearray()
    async for chunk in r.content.iter_chunked(1 << 16):
        buf += chunk
        if len(buf) > max_bytes:
            raise JsonLimitError(f"JSON answer longer than {max_bytes} bytes")
    return loads_bounded(bytes(buf), max_depth=max_depth, max_bytes=max_bytes)
