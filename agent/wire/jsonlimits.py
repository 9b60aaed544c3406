"""Bounded JSON parsing: the one place JSON from a peer, a browser or an API client is decoded.

`json.loads` recurses once per nesting level, so 100,000 nested brackets in a small body end in a
`RecursionError` (a 500, a websocket closed with 1011) after burning CPU. `loads_bounded` refuses such
input before parsing: it checks the size, then the nesting depth with a handful of byte operations
(all in C, about a tenth of `json.loads`'s own time on an 8 MB body), a slice of `SLICE_BYTES` at a
time, so that no single call holds the GIL for long (issue 33: a whole-buffer pass over 8.5 MB held it
5-10 ms a call, and the event loop of the web with it):

1. drop escaped backslashes and escaped quotes, so every `"` left delimits a string;
2. keep only brackets and quotes; drop adjacent quote pairs (strings with no bracket inside) and then
   whatever lies between the remaining quote pairs, so brackets inside strings do not count;
3. the depth is the most brackets open at once, from a running count of opened minus closed (numpy);
   opening brackets left unclosed count too (`json.loads` descends into each before it finds the text
   cut short).

Input with no more opening brackets than `max_depth` skips the scan. The same bracket string counts
the objects and arrays outside strings, for callers that bound them (`max_containers`). Every refusal raises
`JsonLimitError`, a `ValueError` whose text is safe to send back; malformed JSON still raises
`json.JSONDecodeError` (also a `ValueError`), so callers that catch `ValueError` answer both with a 400.
Imports nothing of ours (numpy only).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

DEFAULT_MAX_DEPTH = 64  # deeper than any message this project sends or accepts

_KEEP = b'[]{}"'
_DELETE = bytes(b for b in range(256) if b not in _KEEP)
_PAIRS = bytes.maketrans(b"[{]}", b"(())")
_OPEN = ord("(")
SLICE_BYTES = 1 << 18  # the scan takes a body this much at a time (about a millisecond of C a call)

JsonInput = bytes | bytearray | memoryview | str


class JsonLimitError(ValueError):
    """The JSON is larger or nested deeper than the receiver accepts; the text says which limit."""


def _utf8(data: JsonInput) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8", "surrogatepass")
    raw = bytes(data)
    encoding = json.detect_encoding(raw)  # what json.loads itself does with bytes
    if encoding == "utf-8" or encoding == "utf-8-sig":
        return raw
    return raw.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")


def _brackets(raw: bytes) -> bytes:
    """The brackets of `raw` outside string literals, as `(` and `)`.

    A slice of SLICE_BYTES at a time: each of the C calls below holds the GIL for its whole buffer
    (8.5 MB took 5-10 ms a call, 32 ms in all, during which no other thread of the process ran, an
    event loop included); between two slices the GIL is free for others. A slice never ends inside an
    escape (after an odd run of backslashes), and whether it starts inside a string is carried over."""
    out: list[bytes] = []
    inside, start, n = False, 0, len(raw)
    while start < n:
        piece = raw[start : start + SLICE_BYTES]
        if start + len(piece) < n:
            # escapes pair backslashes from the left: cut a run of them after an even number only
            piece = piece[: len(piece) - (len(piece) - len(piece.rstrip(b"\\"))) % 2]
        start += len(piece)
        if b"\\" in piece:
            piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"")
        kept = piece.translate(None, _DELETE).replace(b'""', b"")
        if b'"' not in kept:
            if not inside:
                out.append(kept)
            continue
        parts = kept.split(b'"')  # strings with brackets inside: keep what lies between them
        out.append(b"".join(parts[1::2] if inside else parts[::2]))  # one object a slice, not one a string
        inside ^= len(parts) % 2 == 0
    return b"".join(out).translate(_PAIRS)


def _depth(brackets: bytes) -> int:
    """The most brackets open at once: how deep json.loads descends (an unclosed one counts too; the
    text is malformed anyway). Linear, a slice at a time: removing matched pairs once per level took
    47 ms for 100,000 levels, in 64 calls on the event loop of a websocket consumer."""
    deepest = level = 0
    for i in range(0, len(brackets), SLICE_BYTES):
        piece = np.frombuffer(brackets, np.uint8, min(SLICE_BYTES, len(brackets) - i), i)
        # opened minus closed after each bracket of the slice
        open_now = 2 * np.cumsum(piece == _OPEN, dtype=np.int64) - np.arange(1, len(piece) + 1)
        deepest = max(deepest, level + int(open_now.max()))
        level += int(open_now[-1])
    return deepest


def _check_brackets(brackets: bytes, max_depth: int) -> None:
    if _depth(brackets) > max_depth:
        raise JsonLimitError(f"JSON is nested more than {max_depth} levels deep")


def _check_shape(raw: bytes, max_depth: int, max_containers: int | None) -> None:
    opening = raw.count(b"[") + raw.count(b"{")  # an upper bound of both depth and containers
    if opening <= max_depth and (max_containers is None or opening <= max_containers):
        return
    brackets = _brackets(raw)
    _check_brackets(brackets, max_depth)  # first: a deep text is refused for its depth, whatever its count
    if max_containers is not None and (n := brackets.count(b"(")) > max_containers:
        raise JsonLimitError(f"JSON holds {n} objects and arrays; the limit is {max_containers}")


def check_depth(data: JsonInput, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
    """Raise `JsonLimitError` when the JSON text `data` nests arrays and objects deeper than `max_depth`."""
    _check_shape(_utf8(data), max_depth, None)


def loads_bounded(
    data: JsonInput,
    *,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_bytes: int | None = None,
    max_containers: int | None = None,
) -> Any:
    """Parse JSON no larger than `max_bytes` (UTF-8 bytes of a str), nested at most `max_depth` deep and
    holding at most `max_containers` objects and arrays.

    The container count bounds the parse itself: `json.loads` holds the GIL for its whole call, and its
    time grows with the objects it builds (250,000 small chat messages in 8.5 MB: 157 ms, during which
    no other thread of the process runs, an event loop included), while the byte scan that counts them
    is a series of short C calls. Raises `JsonLimitError` (checked before any parsing) or
    `json.JSONDecodeError`; both are `ValueError`.
    """
    if max_bytes is not None:
        # A str's UTF-8 size is at most 4 bytes a character: encode it only when that bound is not enough.
        if isinstance(data, str) and len(data) * 4 <= max_bytes:
            size = len(data)
        else:
            size = len(_utf8(data)) if isinstance(data, str) else memoryview(data).nbytes
        if size > max_bytes:
            raise JsonLimitError(f"JSON body is {size} bytes; the limit is {max_bytes}")
    _check_shape(_utf8(data), max_depth, max_containers)
    return json.loads(data if isinstance(data, str | bytes | bytearray) else bytes(data))
