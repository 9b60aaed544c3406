"""Binary data-plane codec: request/response frames between route client and hops (docs/protocol.md).

Pure functions only: no I/O, no backend. Every length is checked against limits before anything is
allocated from a peer-supplied size.
"""

from __future__ import annotations

import struct
import urllib.parse
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any, Literal

import numpy as np

from agent.wire.prefix import DIGEST_BYTES
from agent.wire.sampling import SamplingParams

# Version 1: first release (open/forward/truncate/close, ids or f16/f32 hidden, chain forwarding).
# Version 2: a hidden-state frame may carry the positions' token ids (Flag.TOKEN_IDS), for windows whose
#   layers route experts by token id (deepseek4's hash layers); version-1 frames are refused.
PROTOCOL_VERSION = 2
REQ_MAGIC = b"GSWP"
RESP_MAGIC = b"GSWR"

MAX_TOKENS_PER_FRAME = 8192
MAX_BOUNDARY_DIM = 65536
MAX_FRAME_BYTES = 64 << 20
MAX_CHAIN_HOPS = 16
MAX_URL_LEN = 512
MAX_HISTORY = 1024
MAX_TOKEN_BYTES = 1024  # a route token names its node and its next hop (id and URL): <= 893 bytes
# Steps count up from 1; one near 2**64 would leave no later step for the session, so refuse it.
MAX_STEP = 2**62
# Logits are n_tokens x vocab float32: a prefill asking for all of them would answer megabytes per
# request byte. 32 MiB covers 128 positions of a 64K vocabulary (teacher forcing in chunks).
MAX_LOGITS_BYTES = 32 << 20
# A verification step (Flag.SAMPLE_ALL) computes logits for every position on the last hop: a draft of
# at most 15 tokens plus the token it follows.
MAX_SAMPLE_ALL_TOKENS = 16
# The last hop's own drafts (its model's MTP head, docs/speculative.md): a session asks for at most this
# many at OPEN (its `dim`), and every sampled-token answer (Kind.TOKEN, Kind.TOKENS) carries at most that
# many after its payload (the answer's `dim`): what one verification step can take.
MAX_DRAFT_TOKENS = MAX_SAMPLE_ALL_TOKENS - 1
CONTEXT_CAP = 131072  # product-wide hard cap (128K), applied on top of the model's own limit

# magic, version, op, flags, session, step, pos_start, n_tokens, kind, token_len, dim, payload_len
REQ_HEADER = struct.Struct("<4sHBB16sQIIHHII")
# magic, version, status, kind, step, n_tokens, dim, payload_len, session_len, token, logprob, n_timings
RESP_HEADER = struct.Struct("<4sHBBQIIIIifB")
SAMPLING = struct.Struct("<fifffiQ")  # temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed
TIMING = struct.Struct("<II")  # compute_us, handler_us (time inside the hop, downstream excluded)


class Op(IntEnum):
    OPEN = 1
    FORWARD = 2
    TRUNCATE = 3
    CLOSE = 4
    LANE = 5  # admit the session's decode steps to the hops' native lanes (docs/lane.md)
    PREFIX_SAVE = 6  # keep the session's state at its length (pos_start) under a prefix digest
    PREFIX_LOAD = 7  # an empty session starts from the state kept under a prefix digest (if held)


class Flag(IntFlag):
    SAMPLING = 1  # a sampling block follows the token
    HISTORY = 2  # token ids for the last shard's repetition penalty follow
    WANT_LOGITS = 4  # last shard returns logits of every position (tests, teacher forcing)
    CHAIN = 8  # next hops follow: this hop forwards its output itself
    F16_OUT = 16  # hidden output as float16
    CHAIN_CACHED = 32  # forward along the next hops this session's earlier CHAIN frame named
    TOKEN_IDS = 64  # n_tokens int32 token ids follow the optional blocks, before a hidden payload
    SAMPLE_ALL = 128  # last shard samples every position (speculative verification): Kind.TOKENS back


class Kind(IntEnum):
    NONE = 0
    IDS = 1  # int32 token ids
    F32 = 2  # float32 hidden states, n_tokens x dim
    F16 = 3  # float16 hidden states
    TOKEN = 4  # response: sampled token + logprob in the header (then `dim` int32 MTP drafts)
    LOGITS = 5  # response: float32 logits n_tokens x dim (dim = vocab) + the sampled token
    LANE = 6  # response to Op.LANE: LANE_INFO (the hop's lane id, port and key for the session)
    DIGEST = 7  # request of Op.PREFIX_SAVE / PREFIX_LOAD: the prefix's digest (agent/wire/prefix.py)
    TOKENS = 8  # response to Flag.SAMPLE_ALL: n_tokens int32 sampled ids, their n float32 logprobs
    #   (then `dim` int32 MTP drafts)


# The element type of hidden states at a seam, spelled as frames, the command line and the backends
# spell it. A route sends f32 unless told otherwise: only unrounded seams keep the route equal to one
# process. Any rounding at all (f16, bf16, f24, even one mantissa bit of f32) changes the top-1 token at
# 2-4% of SmolLM2's teacher-forced positions on the native backend; f32 changes none (bench/seam.py,
# docs/benchmarks.md "Default seam"). f16 stays available (half the bytes per hop) for routes that
# prefer bandwidth over exactness.
HiddenDtype = Literal["f16", "f32"]
HIDDEN_DTYPES: tuple[HiddenDtype, ...] = ("f16", "f32")
DEFAULT_HIDDEN_DTYPE: HiddenDtype = "f32"


def hidden_kind(dtype: HiddenDtype) -> Kind:
    """The frame kind that carries hidden states of `dtype`."""
    return Kind.F16 if dtype == "f16" else Kind.F32


def numpy_dtype(dtype: HiddenDtype) -> type[np.floating]:
    return np.float16 if dtype == "f16" else np.float32


# Decoding looks members up by value: calling an Enum or combining Flags costs microseconds each, and
# every hop decodes a frame per step.
_OPS = {int(m): m for m in Op}
_KINDS = {int(m): m for m in Kind}
_REQUEST_KINDS = frozenset((Kind.NONE, Kind.IDS, Kind.F32, Kind.F16, Kind.DIGEST))
_ALL_FLAGS = sum(int(m) for m in Flag)
# plain ints: `int & IntFlag` goes through IntFlag.__rand__ and builds a member
_F_SAMPLING, _F_HISTORY, _F_WANT_LOGITS = int(Flag.SAMPLING), int(Flag.HISTORY), int(Flag.WANT_LOGITS)
_F_CHAIN, _F_F16_OUT, _F_CHAIN_CACHED = int(Flag.CHAIN), int(Flag.F16_OUT), int(Flag.CHAIN_CACHED)
_F_TOKEN_IDS, _F_SAMPLE_ALL = int(Flag.TOKEN_IDS), int(Flag.SAMPLE_ALL)
_U8, _U16, _U32 = struct.Struct("<B"), struct.Struct("<H"), struct.Struct("<I")


class FrameError(Exception):
    """A frame that violates the protocol; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ChainHop:
    url: str
    token: bytes


@dataclass
class Request:
    op: Op
    session: bytes
    step: int = 0
    pos_start: int = 0
    n_tokens: int = 0
    kind: Kind = Kind.NONE
    dim: int = 0
    token: bytes = b""
    sampling: SamplingParams | None = None
    history: list[int] | None = None
    want_logits: bool = False
    sample_all: bool = False  # the last shard samples every position and answers Kind.TOKENS
    f16_out: bool = False
    chain: list[ChainHop] = field(default_factory=list)
    chain_cached: bool = False
    token_ids: np.ndarray | None = None  # with a hidden payload: the positions' ids (Flag.TOKEN_IDS)
    payload: bytes | memoryview = b""

    @property
    def capacity(self) -> int:
        """OPEN: the positions the session may grow to (0: the shard's cap), carried in `pos_start`."""
        return self.pos_start

    @property
    def mtp_draft(self) -> int:
        """OPEN: the MTP drafts the session asks the last hop for after each step (0: none, at most
        MAX_DRAFT_TOKENS), carried in `dim`."""
        return self.dim if self.op == Op.OPEN else 0

    def ids(self) -> np.ndarray:
        return np.frombuffer(self.payload, dtype="<i4", count=self.n_tokens)

    def hidden(self) -> np.ndarray:
        dt = np.float16 if self.kind == Kind.F16 else np.float32
        return np.frombuffer(self.payload, dtype=dt).reshape(self.n_tokens, self.dim)


@dataclass
class Timing:
    compute_us: int
    handler_us: int


@dataclass
class Response:
    step: int
    kind: Kind
    session_len: int = 0
    n_tokens: int = 0
    dim: int = 0
    token: int = -1
    logprob: float = 0.0
    timings: list[Timing] = field(default_factory=list)
    payload: bytes | memoryview = b""

    def hidden(self) -> np.ndarray:
        dt = np.float16 if self.kind == Kind.F16 else np.float32
        return np.frombuffer(self.payload, dtype=dt).reshape(self.n_tokens, self.dim)

    def logits(self) -> np.ndarray:
        return np.frombuffer(self.payload, dtype=np.float32).reshape(self.n_tokens, self.dim)

    def tokens(self) -> tuple[list[int], list[float]]:
        """Kind.TOKENS: the token sampled at each position of the step and its logprob."""
        n = self.n_tokens
        ids = np.frombuffer(self.payload, dtype="<i4", count=n).tolist()
        lps = np.frombuffer(self.payload, dtype="<f4", count=n, offset=4 * n).tolist()
        return ids, lps

    def drafts(self) -> list[int]:
        """Kind.TOKEN / Kind.TOKENS: the last hop's MTP drafts of the tokens after the one it sampled
        (after the last of the verification's that stood, for Kind.TOKENS); [] when none came."""
        if self.kind not in (Kind.TOKEN, Kind.TOKENS) or self.dim <= 0:
            return []
        off = 8 * self.n_tokens if self.kind == Kind.TOKENS else 0
        return [int(t) for t in np.frombuffer(self.payload, dtype="<i4", count=self.dim, offset=off)]


# the answer to Op.LANE: the hop's lane id for the session, its lane's port, and the session's key there
LANE_INFO = struct.Struct("<QI4x32s")


def payload_size(kind: Kind, n_tokens: int, dim: int) -> int:
    if kind == Kind.NONE:
        return 0
    if kind == Kind.LANE:
        return LANE_INFO.size
    if kind == Kind.DIGEST:
        return DIGEST_BYTES
    if kind == Kind.IDS:
        return 4 * n_tokens
    if kind == Kind.TOKENS:
        return 8 * n_tokens + 4 * dim  # dim: the MTP drafts after the sampled tokens
    if kind == Kind.TOKEN:
        return 4 * dim
    if kind in (Kind.F32, Kind.LOGITS):
        return 4 * n_tokens * dim
    if kind == Kind.F16:
        return 2 * n_tokens * dim
    return 0


def encode_request(r: Request) -> bytes:
    flags = 0
    tail: list[bytes] = []
    if r.sampling is not None:
        flags |= _F_SAMPLING
        s = r.sampling
        tail.append(
            SAMPLING.pack(
                s.temperature,
                s.top_k,
                s.top_p,
                s.min_p,
                s.repeat_penalty,
                s.repeat_last_n,
                s.seed & (2**64 - 1),
            )
        )
    if r.history is not None:
        flags |= _F_HISTORY
        h = r.history[-MAX_HISTORY:]
        tail.append(_U32.pack(len(h)) + np.asarray(h, dtype="<i4").tobytes())
    if r.want_logits:
        flags |= _F_WANT_LOGITS
    if r.sample_all:
        flags |= _F_SAMPLE_ALL
    if r.f16_out:
        flags |= _F_F16_OUT
    if r.chain_cached:
        flags |= _F_CHAIN_CACHED
    if r.chain:
        flags |= _F_CHAIN
        parts = [_U8.pack(len(r.chain))]
        for hop in r.chain:
            u = hop.url.encode()
            parts.append(_U16.pack(len(u)) + u + _U16.pack(len(hop.token)) + hop.token)
        tail.append(b"".join(parts))
    if r.token_ids is not None:
        ids = np.asarray(r.token_ids, dtype="<i4").ravel()
        if r.kind not in (Kind.F32, Kind.F16) or len(ids) != r.n_tokens:
            raise FrameError("token ids travel only with hidden states, one per position")
        flags |= _F_TOKEN_IDS
        tail.append(ids.tobytes())
    payload = bytes(r.payload)
    head = REQ_HEADER.pack(
        REQ_MAGIC,
        PROTOCOL_VERSION,
        int(r.op),
        flags,
        r.session,
        r.step,
        r.pos_start,
        r.n_tokens,
        int(r.kind),
        len(r.token),
        r.dim,
        len(payload),
    )
    return b"".join([head, r.token, *tail, payload])


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.off = buf, 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.off + n > len(self.buf):
            raise FrameError(f"truncated frame: {what} needs {n} bytes, {len(self.buf) - self.off} left")
        out = self.buf[self.off : self.off + n]
        self.off += n
        return out

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        return st.unpack(self.take(st.size, what))


def check_request_header(data: bytes | memoryview) -> tuple[int, int]:
    """(route token length, frame length without its optional blocks) from a request header alone,
    with every limit the header can break checked: lets a hop refuse a frame before reading its body."""
    buf = memoryview(data)
    if len(buf) < REQ_HEADER.size:
        raise FrameError(f"truncated frame: {len(buf)} bytes, header needs {REQ_HEADER.size}")
    magic, version, _op, _flags, _session, _step, _pos, n, _kind, token_len, dim, payload_len = (
        REQ_HEADER.unpack_from(buf, 0)
    )
    if magic != REQ_MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}, expected {REQ_MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise FrameError(f"protocol version {version} is not supported (this node speaks {PROTOCOL_VERSION})")
    if n > MAX_TOKENS_PER_FRAME:
        raise FrameError(f"n_tokens {n} exceeds the per-frame limit of {MAX_TOKENS_PER_FRAME}", 413)
    if dim > MAX_BOUNDARY_DIM:
        raise FrameError(f"dim {dim} exceeds the limit of {MAX_BOUNDARY_DIM}", 413)
    if token_len > MAX_TOKEN_BYTES:
        raise FrameError(f"route token of {token_len} bytes exceeds {MAX_TOKEN_BYTES}")
    return token_len, REQ_HEADER.size + token_len + payload_len


def peek_request(data: bytes | memoryview) -> tuple[bytes, bytes, int]:
    """(session, route token, frame length without its optional blocks) from the first
    REQ_HEADER.size + token bytes: lets a hop check the token before it buffers a body."""
    token_len, promised = check_request_header(data)
    buf = memoryview(data)
    if len(buf) < REQ_HEADER.size + token_len:
        raise FrameError("truncated frame: route token")
    session = bytes(buf[8:24])
    return session, bytes(buf[REQ_HEADER.size : REQ_HEADER.size + token_len]), promised


MAX_TAIL_BYTES = (
    SAMPLING.size
    + 4
    + 4 * MAX_HISTORY
    + 1
    + MAX_CHAIN_HOPS * (4 + MAX_URL_LEN + MAX_TOKEN_BYTES)
    + 4 * MAX_TOKENS_PER_FRAME
)


def decode_request(data: bytes | memoryview) -> Request:
    buf = memoryview(data)
    if len(buf) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(buf)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit", 413)
    rd = _Reader(buf)
    if len(buf) < REQ_HEADER.size:
        raise FrameError(f"truncated frame: {len(buf)} bytes, header needs {REQ_HEADER.size}")
    magic, version, op, flags, session, step, pos, n, kind, token_len, dim, payload_len = rd.unpack(
        REQ_HEADER, "header"
    )
    if magic != REQ_MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}, expected {REQ_MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise FrameError(f"protocol version {version} is not supported (this node speaks {PROTOCOL_VERSION})")
    op_e, kind_e = _OPS.get(op), _KINDS.get(kind)
    if op_e is None or kind_e is None or flags & ~_ALL_FLAGS:
        raise FrameError(f"unknown op {op}, kind {kind} or flags {flags:#x}")
    if n > MAX_TOKENS_PER_FRAME:
        raise FrameError(f"n_tokens {n} exceeds the per-frame limit of {MAX_TOKENS_PER_FRAME}", 413)
    if dim > MAX_BOUNDARY_DIM:
        raise FrameError(f"dim {dim} exceeds the limit of {MAX_BOUNDARY_DIM}", 413)
    if kind_e not in _REQUEST_KINDS:
        raise FrameError(f"payload kind {kind_e.name} is not valid in a request")
    if kind_e == Kind.IDS and dim not in (0, 1):
        raise FrameError("token-id payloads carry dim 0")
    if op_e == Op.OPEN and dim > MAX_DRAFT_TOKENS:
        raise FrameError(f"an OPEN asks for at most {MAX_DRAFT_TOKENS} MTP drafts per step, not {dim}")
    expected = payload_size(kind_e, n, dim)
    if payload_len != expected:
        raise FrameError(f"payload is {payload_len} bytes but {n} x {dim} {kind_e.name} needs {expected}")
    if token_len > MAX_TOKEN_BYTES:
        raise FrameError(f"route token of {token_len} bytes exceeds {MAX_TOKEN_BYTES}")
    if step > MAX_STEP:
        raise FrameError(f"step {step} exceeds the limit of {MAX_STEP}")
    req = Request(op=op_e, session=bytes(session), step=step, pos_start=pos, n_tokens=n, kind=kind_e, dim=dim)
    req.token = bytes(rd.take(token_len, "route token"))
    if flags & _F_SAMPLING:
        t, k, p, mp, rp, last_n, seed = rd.unpack(SAMPLING, "sampling block")
        if not (t >= 0 and 0 <= p <= 1 and 0 <= mp <= 1 and rp > 0 and k >= 0):
            raise FrameError("sampling parameters out of range")
        req.sampling = SamplingParams(
            temperature=t, top_k=k, top_p=p, min_p=mp, repeat_penalty=rp, repeat_last_n=last_n, seed=seed
        )
    if flags & _F_HISTORY:
        (count,) = rd.unpack(_U32, "history count")
        if count > MAX_HISTORY:
            raise FrameError(f"history of {count} ids exceeds {MAX_HISTORY}", 413)
        req.history = np.frombuffer(rd.take(4 * count, "history"), dtype="<i4").tolist()
    req.want_logits = bool(flags & _F_WANT_LOGITS)
    req.sample_all = bool(flags & _F_SAMPLE_ALL)
    if req.sample_all and (op_e != Op.FORWARD or n > MAX_SAMPLE_ALL_TOKENS):
        raise FrameError(
            f"a verification step is a FORWARD of at most {MAX_SAMPLE_ALL_TOKENS} positions", 413
        )
    req.f16_out = bool(flags & _F_F16_OUT)
    req.chain_cached = bool(flags & _F_CHAIN_CACHED)
    if req.chain_cached and flags & _F_CHAIN:
        raise FrameError("a frame carries either a chain or the cached-chain flag, not both")
    if flags & _F_CHAIN:
        (count,) = rd.unpack(_U8, "chain count")
        if count > MAX_CHAIN_HOPS:
            raise FrameError(f"chain of {count} hops exceeds {MAX_CHAIN_HOPS}")
        for _ in range(count):
            (ul,) = rd.unpack(_U16, "chain url length")
            if ul > MAX_URL_LEN:
                raise FrameError("chain url too long")
            url = check_url(bytes(rd.take(ul, "chain url")))
            (tl,) = rd.unpack(_U16, "chain token length")
            if tl > MAX_TOKEN_BYTES:
                raise FrameError("chain token too long")
            req.chain.append(ChainHop(url, bytes(rd.take(tl, "chain token"))))
    if flags & _F_TOKEN_IDS:
        if kind_e not in (Kind.F32, Kind.F16):
            raise FrameError("token ids travel only with hidden states")
        # n was checked against MAX_TOKENS_PER_FRAME above: at most 32 KiB, and only a view of the frame
        req.token_ids = np.frombuffer(rd.take(4 * n, "token ids"), dtype="<i4")
    req.payload = rd.take(payload_len, "payload")
    if rd.off != len(buf):
        raise FrameError(f"{len(buf) - rd.off} unexpected trailing bytes")
    return req


def check_url(raw: bytes) -> str:
    """A chain URL as a hop would dial it, or FrameError (400): every malformed part is refused here,
    before any HTTP library sees it."""
    try:
        url = raw.decode("ascii")
    except UnicodeDecodeError:
        raise FrameError("chain url is not ascii") from None
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise FrameError(f"chain url is malformed: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise FrameError("chain url must be http(s)")
    host = parts.hostname or ""
    if not host or parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise FrameError("chain url must be scheme://host[:port][/path] with nothing else")
    if port == 0:
        raise FrameError("chain url port 0")
    if "[" not in parts.netloc:  # IPv6 literals are checked by urlsplit; names by their labels
        labels = host.rstrip(".").split(".")
        if any(not 0 < len(label) <= 63 for label in labels) or len(host) > 253:
            raise FrameError("chain url host has an empty label or one longer than 63 characters")
        if any(not c.isalnum() and c not in "-." for c in host):
            raise FrameError("chain url host has characters a host name cannot have")
    return url


def response_limit(n_tokens: int, dim: int, want_logits: bool) -> int:
    """The most bytes a valid answer to a forward of `n_tokens` x `dim` may take: hidden states as f32,
    the token response with every hop's timing, or (asked for) capped logits."""
    body = max(4 * n_tokens * dim, MAX_LOGITS_BYTES if want_logits else 0)
    return RESP_HEADER.size + (MAX_CHAIN_HOPS + 1) * TIMING.size + body + 4 * MAX_DRAFT_TOKENS


def encode_response(r: Response) -> bytes:
    payload = bytes(r.payload)
    head = RESP_HEADER.pack(
        RESP_MAGIC,
        PROTOCOL_VERSION,
        0,
        int(r.kind),
        r.step,
        r.n_tokens,
        r.dim,
        len(payload),
        r.session_len,
        r.token,
        r.logprob,
        len(r.timings),
    )
    timings = b"".join(TIMING.pack(t.compute_us, t.handler_us) for t in r.timings)
    return b"".join([head, timings, payload])


def _response_header(buf: memoryview) -> tuple[Kind, tuple[Any, ...]]:
    """A response frame's kind and header, with every part checked: the frame is exactly its header,
    its timings and the payload its kind and shape take, nothing more."""
    if len(buf) < RESP_HEADER.size:
        raise FrameError("truncated response")
    head = RESP_HEADER.unpack_from(buf, 0)
    magic, version, _status, kind, _step, n, dim, plen, _slen, _token, _logprob, nt = head
    if magic != RESP_MAGIC or version != PROTOCOL_VERSION:
        raise FrameError("bad response magic or version")
    if nt > MAX_CHAIN_HOPS + 1:
        raise FrameError(f"response carries {nt} timings, more than a route has hops")
    kind_e = _KINDS.get(kind)
    if kind_e is None:
        raise FrameError(f"unknown response kind {kind}")
    if kind_e == Kind.IDS:
        raise FrameError("token ids are not a response")
    if kind_e in (Kind.TOKEN, Kind.TOKENS) and dim > MAX_DRAFT_TOKENS:
        raise FrameError(f"a sampled-token response carries at most {MAX_DRAFT_TOKENS} drafts, not {dim}")
    if plen != payload_size(kind_e, n, dim):
        raise FrameError("response payload size mismatch")
    size = RESP_HEADER.size + nt * TIMING.size + plen
    if len(buf) < size:
        raise FrameError(f"truncated response: {len(buf)} bytes, its header promises {size}")
    if len(buf) > size:
        raise FrameError(f"{len(buf) - size} unexpected trailing bytes in a response")
    return kind_e, head


def decode_response(data: bytes | memoryview) -> Response:
    buf = memoryview(data)
    kind_e, (_, _, _, _, step, n, dim, plen, slen, token, logprob, nt) = _response_header(buf)
    off = RESP_HEADER.size + nt * TIMING.size
    return Response(
        step=step,
        kind=kind_e,
        session_len=slen,
        n_tokens=n,
        dim=dim,
        token=token,
        logprob=logprob,
        timings=[Timing(c, h) for c, h in TIMING.iter_unpack(buf[RESP_HEADER.size : off])],
        payload=buf[off : off + plen],
    )


def response_step(data: bytes | memoryview) -> int:
    """The step a response frame answers, once the whole frame is checked as decode_response checks it
    (a chain hop relays its next hop's answer as it came, with its own timing added in front)."""
    _kind, (_magic, _version, _status, _kind_value, step, *_rest) = _response_header(memoryview(data))
    return int(step)


def with_prepended_timing(resp_bytes: bytes, timing: Timing) -> bytes:
    """Add this hop's timing in front of the others': to its own answer, or to a next hop's answer that
    response_step checked whole (the header's timing count must stay the frame's)."""
    head = bytearray(resp_bytes[: RESP_HEADER.size])
    nt = head[-1]
    head[-1] = nt + 1
    return bytes(head) + TIMING.pack(timing.compute_us, timing.handler_us) + resp_bytes[RESP_HEADER.size :]
