"""HTTP web seed (BEP 19) as a pure function: which bytes of an artifact to serve for a Range header."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

_RANGE_RE = re.compile(r"^\s*(\d*)\s*-\s*(\d*)\s*$")
MAX_CHUNK = 1 << 20
MAX_RANGE_DIGITS = 19  # every offset below 10**19 bytes; longer numbers are refused before int() (issue 17)
MAX_HEADER_ECHO = 80  # refusals quote at most this much of the header


def _quote(text: str) -> str:
    return repr(text[:MAX_HEADER_ECHO] + ("..." if len(text) > MAX_HEADER_ECHO else ""))


class RangeNotSatisfiable(ValueError):
    """Answer 416 with `headers` (Content-Range: bytes */size) and str(e) as the body."""

    def __init__(self, reason: str, size: int) -> None:
        super().__init__(reason)
        self.headers = {"Content-Range": f"bytes */{size}"}


@dataclass(frozen=True)
class ServePlan:
    """Status, byte range [start, end) and headers of the response to send."""

    status: int
    start: int
    end: int
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.end - self.start


def plan_range(range_header: str | None, size: int) -> ServePlan:
    """200 with the whole file without a Range header, 206 for one satisfiable range, else raise 416.

    Web seeds (libtorrent and others) send one range per request; multi-range requests would need a
    multipart/byteranges body, so they are refused with 416 and a reason rather than half supported.
    """
    base = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
    if range_header is None or not range_header.strip():
        return ServePlan(200, 0, size, {**base, "Content-Length": str(size)})
    unit, sep, spec = range_header.strip().partition("=")
    if not sep or unit.strip().lower() != "bytes":
        raise RangeNotSatisfiable(
            f"unsupported range unit in {_quote(range_header)}; use bytes=start-end", size
        )
    if "," in spec:
        raise RangeNotSatisfiable("multiple ranges are not supported; request one range at a time", size)
    m = _RANGE_RE.match(spec)
    if not m or (not m.group(1) and not m.group(2)):
        raise RangeNotSatisfiable(
            f"malformed range {_quote(spec)}; expected start-end, start- or -suffix", size
        )
    first, last = m.group(1), m.group(2)
    if len(first) > MAX_RANGE_DIGITS or len(last) > MAX_RANGE_DIGITS:
        raise RangeNotSatisfiable(f"range offsets longer than {MAX_RANGE_DIGITS} digits are refused", size)
    spec = spec.strip()
    if first:
        start = int(first)
        end = size if not last else int(last) + 1
        if last and int(last) < start:
            raise RangeNotSatisfiable(f"range {_quote(spec)} ends before it starts", size)
        if start >= size:
            raise RangeNotSatisfiable(
                f"range {_quote(spec)} starts at or past the end of the {size}-byte file", size
            )
        end = min(end, size)
    else:
        suffix = int(last)
        if suffix == 0:
            raise RangeNotSatisfiable("a zero-length suffix range selects nothing", size)
        start, end = max(size - suffix, 0), size
    headers = {
        **base,
        "Content-Length": str(end - start),
        "Content-Range": f"bytes {start}-{end - 1}/{size}",
    }
    return ServePlan(206, start, end, headers)


def read_range(path: str | Path, start: int, end: int, chunk: int = MAX_CHUNK) -> Iterator[bytes]:
    """Yield the bytes [start, end) of a file in chunks (for a streaming response)."""
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            data = f.read(min(chunk, left))
            if not data:
                return
            left -= len(data)
            yield data
