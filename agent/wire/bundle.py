"""Bundles: the small steps of many sessions for one hop as one stream message (docs/protocol.md, "Bundles").

Pure codec. A bundle is `GSWM`, version, count, then each request frame prefixed by its length; its
answer is `GSWN`, version, count, then each frame's (status, length, bytes): the response frame for
200, the error JSON a lone frame would have got otherwise, in the bundle's order. Every length is
checked against what is left of the message before anything is sliced; slices are views, not copies.
"""

from __future__ import annotations

import struct

from agent.wire.frames import REQ_HEADER, FrameError

BUNDLE_MAGIC = b"GSWM"
ANSWER_MAGIC = b"GSWN"
BUNDLE_VERSION = 1
# The WebSocket subprotocol a hop that takes bundles agrees to; a socket without it gets lone frames.
BUNDLE_PROTOCOL = "ggswarm.bundle.1"
# Frames per bundle: a node's per-address concurrency (dataplane PER_IP_CONCURRENCY) is 64, so a full
# bundle never refuses its own frames; the client sends at most BUNDLE_MAX_FRAMES.
MAX_BUNDLE_FRAMES = 64
BUNDLE_MAX_FRAMES = 32
# Steps of at most this many positions are bundled: decode steps and small prefill tails. A bundle's
# answer waits for its slowest frame, so a long prompt's chunk travels alone and never holds decodes.
BUNDLE_STEP_TOKENS = 16

HEAD = struct.Struct("<4sHH")  # magic, version, count
ITEM = struct.Struct("<I")  # length of the request frame that follows
ANSWER_ITEM = struct.Struct("<HI")  # status, length of the answer that follows


def is_bundle(data: bytes | memoryview) -> bool:
    return bytes(data[:4]) == BUNDLE_MAGIC


def encode_bundle(frames: list[bytes]) -> bytes:
    if not 0 < len(frames) <= MAX_BUNDLE_FRAMES:
        raise FrameError(f"a bundle carries 1 to {MAX_BUNDLE_FRAMES} frames, not {len(frames)}")
    parts = [HEAD.pack(BUNDLE_MAGIC, BUNDLE_VERSION, len(frames))]
    for f in frames:
        parts += [ITEM.pack(len(f)), f]
    return b"".join(parts)


def decode_bundle(data: bytes | memoryview) -> list[memoryview]:
    """The request frames of a bundle message (views into it), or FrameError for a malformed one."""
    buf = memoryview(data)
    count = _head(buf, BUNDLE_MAGIC, "bundle")
    if not 0 < count <= MAX_BUNDLE_FRAMES:
        raise FrameError(f"a bundle carries 1 to {MAX_BUNDLE_FRAMES} frames, not {count}", 413)
    off = HEAD.size
    frames = []
    for i in range(count):
        if off + ITEM.size > len(buf):
            raise FrameError(f"truncated bundle: frame {i} of {count} has no length")
        (n,) = ITEM.unpack_from(buf, off)
        off += ITEM.size
        if n < REQ_HEADER.size or n > len(buf) - off:
            raise FrameError(f"bundle frame {i} claims {n} bytes, {len(buf) - off} are left")
        frames.append(buf[off : off + n])
        off += n
    if off != len(buf):
        raise FrameError(f"{len(buf) - off} unexpected trailing bytes after a bundle's frames")
    return frames


def encode_answers(answers: list[tuple[int, bytes]]) -> bytes:
    parts = [HEAD.pack(ANSWER_MAGIC, BUNDLE_VERSION, len(answers))]
    for status, body in answers:
        parts += [ANSWER_ITEM.pack(status, len(body)), body]
    return b"".join(parts)


def decode_answers(data: bytes | memoryview, count: int) -> list[tuple[int, memoryview]]:
    """The (status, answer) of each of a bundle's `count` frames, in order; FrameError when the hop
    answered anything else (another count, a length past the end, a status that is not HTTP's)."""
    buf = memoryview(data)
    got = _head(buf, ANSWER_MAGIC, "bundle answer")
    if got != count:
        raise FrameError(f"a bundle of {count} frames was answered with {got}")
    off = HEAD.size
    out = []
    for i in range(count):
        if off + ANSWER_ITEM.size > len(buf):
            raise FrameError(f"truncated bundle answer: answer {i} of {count} has no header")
        status, n = ANSWER_ITEM.unpack_from(buf, off)
        off += ANSWER_ITEM.size
        if not 200 <= status <= 599 or n > len(buf) - off:
            raise FrameError(f"bundle answer {i}: status {status}, {n} bytes of {len(buf) - off} left")
        out.append((status, buf[off : off + n]))
        off += n
    if off != len(buf):
        raise FrameError(f"{len(buf) - off} unexpected trailing bytes after a bundle's answers")
    return out


def _head(buf: memoryview, magic: bytes, what: str) -> int:
    if len(buf) < HEAD.size:
        raise FrameError(f"truncated {what}: {len(buf)} bytes")
    got, version, count = HEAD.unpack_from(buf, 0)
    if got != magic:
        raise FrameError(f"bad {what} magic {bytes(got)!r}, expected {magic!r}")
    if version != BUNDLE_VERSION:
        raise FrameError(f"{what} version {version} is not supported (this node speaks {BUNDLE_VERSION})")
    return int(count)
