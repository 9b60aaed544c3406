"""Fetching a shard's bytes from the control plane with HTTP range requests, verified per tensor.

The fallback when a model has no .torrent or the node has no libtorrent (`agent.artifacts.torrent` is
the swarm path). The file is rebuilt sparsely at its original offsets (header + the tensors of the
layer range), so the backends open it like the full GGUF. Tensors already present and matching their
sha256 are not fetched again. `FetchError` here is the one both paths raise.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import BinaryIO

from aiohttp import ClientSession

from agent.artifacts.manifest import Manifest, TensorInfo, merge_ranges
from agent.artifacts.swarm_tls import PlainTransportRefused, check_url

CHUNK = 1 << 20
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
Progress = Callable[[float], Awaitable[None]]


class FetchError(RuntimeError):
    """A shard could not be fetched (HTTP status, timeout, torrent or disk error, a tensor that does not
    match its manifest hash after a retry); the message says which and why."""


def _tensor_ok(f: BinaryIO, t: TensorInfo) -> bool:
    if not t.sha256:
        return False
    h = hashlib.sha256()
    f.seek(t.offset)
    left = t.nbytes
    while left > 0:
        chunk = f.read(min(CHUNK, left))
        if not chunk:
            return False
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest() == t.sha256


def missing_tensors(path: Path, tensors: list[TensorInfo]) -> list[TensorInfo]:
    """Tensors whose bytes in `path` are absent or do not match their sha256 (blocking)."""
    if not path.exists():
        return list(tensors)
    with open(path, "rb") as f:
        return [t for t in tensors if not _tensor_ok(f, t)]


def ranges_to_fetch(manifest: Manifest, missing: list[TensorInfo]) -> list[tuple[int, int]]:
    """The header (always: it holds the tokenizer and tensor table) plus the missing tensors' bytes."""
    return merge_ranges([(0, manifest.header_end)] + [(t.offset, t.end) for t in missing])


def shard_path(data_dir: Path, model_sha256: str) -> Path:
    return data_dir / "models" / f"{model_sha256}.gguf"


async def fetch_shard(
    http: ClientSession,
    file_url: str,
    headers: dict[str, str],
    manifest: Manifest,
    layer_start: int,
    layer_end: int,
    dest: Path,
    progress: Progress | None = None,
) -> int:
    """Bring `dest` up to date for [layer_start, layer_end); returns the bytes downloaded.

    `file_url` over https is verified by `http` (aiohttp: the system store); plain http only to a
    loopback control plane or with GGSWARM_INSECURE_PLAIN_HTTP=1, with a loud warning (FetchError else).
    """
    try:
        check_url(file_url, "HTTP range fallback")
    except PlainTransportRefused as e:
        raise FetchError(str(e)) from None
    tensors = manifest.tensors_for_range(layer_start, layer_end)
    missing = await asyncio.to_thread(missing_tensors, dest, tensors)
    ranges = ranges_to_fetch(manifest, missing)
    total = sum(e - s for s, e in ranges) or 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest, os.O_RDWR | os.O_CREAT, 0o644)
    done = 0
    try:
        if os.fstat(fd).st_size != manifest.file_size:
            os.ftruncate(fd, manifest.file_size)  # sparse: untouched layers take no disk
        for start, end in ranges:
            hdrs = {**headers, "Range": f"bytes={start}-{end - 1}"}
            async with http.get(file_url, headers=hdrs) as r:
                if r.status != 206:
                    raise FetchError(f"GET {file_url} {hdrs['Range']}: HTTP {r.status} (expected 206)")
                m = _CONTENT_RANGE.match(r.headers.get("Content-Range", ""))
                if not m or int(m.group(1)) != start or int(m.group(2)) != end - 1:
                    raise FetchError(
                        f"GET {file_url}: Content-Range {r.headers.get('Content-Range')!r} "
                        f"does not match the requested {start}-{end - 1}"
                    )
                pos = start
                async for chunk in r.content.iter_chunked(CHUNK):
                    if pos + len(chunk) > end:
                        raise FetchError(f"GET {file_url}: server sent more than the requested range")
                    os.pwrite(fd, chunk, pos)
                    pos += len(chunk)
                    done += len(chunk)
                    if progress:
                        await progress(done / total)
                if pos != end:
                    raise FetchError(f"GET {file_url}: range {start}-{end - 1} ended early at {pos}")
        os.fsync(fd)
    finally:
        os.close(fd)
    bad = await asyncio.to_thread(missing_tensors, dest, tensors)
    if bad:
        names = ", ".join(t.name for t in bad[:5])
        raise FetchError(f"{len(bad)} tensor(s) failed sha256 verification after download: {names}")
    return done
