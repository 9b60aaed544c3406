"""BitTorrent HTTP tracker as pure functions: bencoding, announce/scrape parsing, peer store.

Passkeys are node credentials: `webapp.fleet.passkeys` derives and checks them. A passkey is one node,
and a node is one peer per torrent: its latest announce replaces its earlier one whatever peer id or
port it names, so one node cannot fill a swarm with made-up peers; announces per node are rate limited,
and peer lists favour peers whose address is their node's enrolled one (issue 33, docs/security.md).
"""

from __future__ import annotations

import ipaddress
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol
from urllib.parse import unquote_to_bytes

# ---------------------------------------------------------------------------------------------- bencode

Bencodable = int | bytes | str | list["Bencodable"] | dict["bytes | str", "Bencodable"]


class BencodeError(ValueError):
    """Input is not valid bencoding."""


def bencode(value: Bencodable) -> bytes:
    """Encode ints, bytes/str (UTF-8), lists and dicts (keys sorted as raw bytes, as BEP 3 requires)."""
    out: list[bytes] = []
    _encode(value, out)
    return b"".join(out)


def _encode(v: Bencodable, out: list[bytes]) -> None:
    if isinstance(v, bool):
        raise BencodeError("booleans have no bencoding; use 0/1")
    if isinstance(v, int):
        out.append(b"i%de" % v)
    elif isinstance(v, bytes | bytearray | str):
        b = v.encode() if isinstance(v, str) else bytes(v)
        out.append(b"%d:" % len(b))
        out.append(b)
    elif isinstance(v, list | tuple):
        out.append(b"l")
        for x in v:
            _encode(x, out)
        out.append(b"e")
    elif isinstance(v, dict):
        items = sorted(((k.encode() if isinstance(k, str) else bytes(k)), x) for k, x in v.items())
        out.append(b"d")
        for k, x in items:
            _encode(k, out)
            _encode(x, out)
        out.append(b"e")
    else:
        raise BencodeError(f"cannot bencode {type(v).__name__}")


def bdecode(data: bytes) -> Bencodable:
    """Decode one bencoded value (strings stay bytes); trailing bytes or bad syntax raise BencodeError."""
    value, end = _decode(data, 0, 0)
    if end != len(data):
        raise BencodeError(f"{len(data) - end} trailing bytes after the value")
    return value


_MAX_DEPTH = 64


def _decode(data: bytes, i: int, depth: int) -> tuple[Bencodable, int]:
    if depth > _MAX_DEPTH:
        raise BencodeError("nesting too deep")
    if i >= len(data):
        raise BencodeError("unexpected end of data")
    c = data[i : i + 1]
    if c == b"i":
        end = data.find(b"e", i)
        if end < 0:
            raise BencodeError("unterminated integer")
        raw = data[i + 1 : end]
        if not raw or raw == b"-0" or (raw.lstrip(b"-").startswith(b"0") and raw not in (b"0",)):
            raise BencodeError(f"bad integer {raw!r}")
        try:
            return int(raw), end + 1
        except ValueError:
            raise BencodeError(f"bad integer {raw!r}") from None
    if c == b"l":
        items: list[Bencodable] = []
        i += 1
        while data[i : i + 1] != b"e":
            v, i = _decode(data, i, depth + 1)
            items.append(v)
        return items, i + 1
    if c == b"d":
        d: dict[bytes | str, Bencodable] = {}
        i += 1
        while data[i : i + 1] != b"e":
            k, i = _decode(data, i, depth + 1)
            if not isinstance(k, bytes):
                raise BencodeError("dictionary key is not a string")
            d[k], i = _decode(data, i, depth + 1)
        return d, i + 1
    if c.isdigit():
        colon = data.find(b":", i)
        if colon < 0 or not data[i:colon].isdigit():
            raise BencodeError("bad string length")
        n = int(data[i:colon])
        if colon + 1 + n > len(data):
            raise BencodeError("string runs past the end of data")
        return data[colon + 1 : colon + 1 + n], colon + 1 + n
    raise BencodeError(f"unexpected byte {c!r} at {i}")


# ---------------------------------------------------------------------------------------------- announce

EVENTS = ("", "started", "stopped", "completed", "paused")  # "paused": BEP 21 partial seed
DEFAULT_NUMWANT = 50
MAX_NUMWANT = 200
DEFAULT_INTERVAL_S = 1800
MIN_INTERVAL_S = 60
MAX_INT_DIGITS = 19  # every counter below 10**19
MAX_SCRAPE_HASHES = 64  # one scrape asks about at most this many torrents (each is a lookup)


class AnnounceError(ValueError):
    """The request is refused; str(e) is the `failure reason` sent back (bencoded, HTTP 200)."""


@dataclass(frozen=True)
class Announce:
    """A validated announce: who (peer id, address) says what about one torrent."""

    info_hash: bytes
    peer_id: bytes
    ip: str
    port: int
    uploaded: int
    downloaded: int
    left: int
    event: str
    compact: bool
    numwant: int
    node: str = ""  # who announced (one passkey, one node); "" keys the peer by its peer id
    verified: bool = True  # the address is the node's enrolled one (see `Announcer`)

    @property
    def entry(self) -> str:
        """The store's key for this announcer: its node (one peer per node and torrent), else its peer id."""
        return self.node or self.peer_id.hex()


@dataclass(frozen=True)
class Peer:
    """A peer as the store keeps it; seq is its arrival order in the torrent's swarm (1, 2, ...)."""

    peer_id: bytes
    ip: str
    port: int
    left: int
    expires: float
    seq: int = 0
    verified: bool = True


@dataclass(frozen=True)
class Announcer:
    """Who a passkey belongs to, and whether the announce comes from that node's enrolled address (an
    online node whose checked data-plane host is the connection's address): only such peers are
    handed out freely, see `favour_verified`."""

    node: str
    verified: bool


class AnnounceLimiter(Protocol):
    """Announces (and scrapes) per node and minute: `allow` counts one and says whether it is within
    `per_min`."""

    @property
    def per_min(self) -> int: ...

    def allow(self, node: str, now: float) -> bool: ...


class MemoryAnnounceLimiter:
    """Fixed one-minute windows per node, in this process (the web uses Redis when it has it)."""

    def __init__(self, per_min: int) -> None:
        self.per_min = per_min
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[int, int]] = {}

    def allow(self, node: str, now: float) -> bool:
        window = int(now // 60)
        with self._lock:
            start, count = self._windows.get(node, (window, 0))
            count = count + 1 if start == window else 1
            self._windows[node] = (window, count)
            if len(self._windows) > 100_000:  # forget finished windows
                self._windows = {k: v for k, v in self._windows.items() if v[0] == window}
        return count <= self.per_min


def favour_verified(live: Iterable[Peer], numwant: int) -> list[Peer]:
    """Up to `numwant` peers, most recently seen first: every verified peer before any unverified one,
    and never more unverified peers than verified ones in the list (a node that is not where its
    enrollment says cannot outnumber the nodes that are)."""
    ordered = sorted(live, key=lambda p: p.expires, reverse=True)
    verified = [p for p in ordered if p.verified][:numwant]
    room = min(numwant - len(verified), len(verified))
    return verified + [p for p in ordered if not p.verified][:room]


def parse_query(raw_query: str | bytes) -> dict[str, bytes]:
    """Split a raw query string into name -> raw bytes (info_hash is binary; never decode it as text).

    Django's request.GET decodes values as UTF-8 and mangles binary info_hash/peer_id, so views pass
    request.META["QUERY_STRING"] here. A repeated name keeps its first value except info_hash (scrape
    asks about several): use parse_query_multi for that.
    """
    out: dict[str, bytes] = {}
    for name, value in parse_query_multi(raw_query):
        out.setdefault(name, value)
    return out


def parse_query_multi(raw_query: str | bytes) -> list[tuple[str, bytes]]:
    if isinstance(raw_query, str):
        # WSGI hands QUERY_STRING over as latin-1 text, Django's ASGI request as UTF-8 text: take either.
        try:
            q = raw_query.encode("latin-1")
        except UnicodeEncodeError:
            q = raw_query.encode("utf-8", "replace")
    else:
        q = raw_query
    pairs: list[tuple[str, bytes]] = []
    for part in q.split(b"&"):
        if not part:
            continue
        name, _, value = part.partition(b"=")
        key = unquote_to_bytes(name.replace(b"+", b" ")).decode("latin-1")
        pairs.append((key, unquote_to_bytes(value.replace(b"+", b" "))))
    return pairs


def _int_param(
    q: dict[str, bytes], name: str, *, default: int | None = None, lo: int = 0, hi: int = 2**63
) -> int:
    raw = q.get(name)
    if raw is None or raw == b"":
        if default is None:
            raise AnnounceError(f"missing {name}")
        return default
    # Plain decimal digits only (an optional minus), at most 19 of them: int() would also take "+1",
    # "1_000" or spaces, and spend quadratic time on (or refuse oddly) thousands of digits.
    digits = raw[1:] if raw[:1] == b"-" else raw
    if not digits.isdigit() or not digits.isascii():
        raise AnnounceError(f"invalid {name}: not an integer")
    if len(digits) > MAX_INT_DIGITS:
        raise AnnounceError(f"invalid {name}: more than {MAX_INT_DIGITS} digits")
    v = int(raw)
    if not lo <= v <= hi:
        raise AnnounceError(f"invalid {name}: {v} is outside {lo}..{hi}")
    return v


def parse_announce(raw_query: str | bytes, remote_ip: str) -> Announce:
    """Validate an announce query; raises AnnounceError with the failure reason.

    The peer's address is the connection's (remote_ip); a client-supplied `ip` is ignored so a node
    cannot point the swarm at someone else.
    """
    q = parse_query(raw_query)
    info_hash = q.get("info_hash")
    if info_hash is None:
        raise AnnounceError("missing info_hash")
    if len(info_hash) != 20:
        raise AnnounceError(f"invalid info_hash: {len(info_hash)} bytes, expected 20")
    peer_id = q.get("peer_id")
    if peer_id is None:
        raise AnnounceError("missing peer_id")
    if len(peer_id) != 20:
        raise AnnounceError(f"invalid peer_id: {len(peer_id)} bytes, expected 20")
    port = _int_param(q, "port", lo=1, hi=65535)
    event = q.get("event", b"").decode("latin-1")
    if event not in EVENTS:
        raise AnnounceError(f"invalid event {event[:20]!r}")
    try:
        ipaddress.ip_address(remote_ip)
    except ValueError:
        raise AnnounceError("cannot determine your address") from None
    return Announce(
        info_hash=info_hash,
        peer_id=peer_id,
        ip=remote_ip,
        port=port,
        uploaded=_int_param(q, "uploaded", default=0),
        downloaded=_int_param(q, "downloaded", default=0),
        left=_int_param(q, "left", default=0),
        event=event,
        compact=q.get("compact", b"1") != b"0",
        numwant=min(_int_param(q, "numwant", default=DEFAULT_NUMWANT, hi=2**31), MAX_NUMWANT),
    )


def failure(reason: str) -> bytes:
    """Bencoded failure response (sent with HTTP 200, as clients expect)."""
    return bencode({"failure reason": reason})


# ---------------------------------------------------------------------------------------------- peer store


class PeerStore(Protocol):
    """Where the tracker keeps peers; in-memory here, Redis/DB in a multi-process deployment."""

    def update(self, a: Announce, now: float, ttl_s: float) -> int:
        """Record the announce; returns the peer's arrival order (assigned once, atomically)."""
        ...

    def peers(
        self, info_hash: bytes, exclude: bytes, numwant: int, now: float, before_seq: int | None = None
    ) -> list[Peer]:
        """Live peers as `favour_verified` picks them; with before_seq only those that arrived earlier."""
        ...

    def counts(self, info_hash: bytes, now: float) -> tuple[int, int, int]:
        """(complete, incomplete, downloaded) for one torrent."""
        ...


class MemoryPeerStore:
    """Thread-safe in-process peer store; a peer expires ttl_s after its last announce."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[bytes, dict[str, Peer]] = {}  # info_hash -> announcer (`Announce.entry`) -> peer
        self._downloaded: dict[bytes, int] = {}
        self._arrivals: dict[bytes, int] = {}

    def update(self, a: Announce, now: float, ttl_s: float) -> int:
        with self._lock:
            swarm = self._peers.setdefault(a.info_hash, {})
            old = swarm.get(a.entry)
            if a.event == "stopped":
                swarm.pop(a.entry, None)
                return old.seq if old else 0
            if a.event == "completed":
                self._downloaded[a.info_hash] = self._downloaded.get(a.info_hash, 0) + 1
            if old is None:
                self._arrivals[a.info_hash] = seq = self._arrivals.get(a.info_hash, 0) + 1
            else:
                seq = old.seq
            swarm[a.entry] = Peer(a.peer_id, a.ip, a.port, a.left, now + ttl_s, seq, a.verified)
            return seq

    def _live(self, info_hash: bytes, now: float) -> dict[str, Peer]:
        swarm = self._peers.get(info_hash, {})
        for pid in [pid for pid, p in swarm.items() if p.expires <= now]:
            del swarm[pid]
        return swarm

    def peers(
        self, info_hash: bytes, exclude: bytes, numwant: int, now: float, before_seq: int | None = None
    ) -> list[Peer]:
        with self._lock:
            live = [
                p
                for p in self._live(info_hash, now).values()
                if p.peer_id != exclude and (before_seq is None or p.seq < before_seq)
            ]
        return favour_verified(live, numwant)

    def counts(self, info_hash: bytes, now: float) -> tuple[int, int, int]:
        with self._lock:
            live = self._live(info_hash, now).values()
            complete = sum(1 for p in live if p.left == 0)
            return complete, len(live) - complete, self._downloaded.get(info_hash, 0)


def compact_peers(peers: Iterable[Peer]) -> tuple[bytes, bytes]:
    """BEP 23 / BEP 7 compact lists: (6 bytes per IPv4 peer, 18 bytes per IPv6 peer)."""
    v4, v6 = bytearray(), bytearray()
    for p in peers:
        addr = ipaddress.ip_address(p.ip)
        if isinstance(addr, ipaddress.IPv4Address):
            v4 += addr.packed + struct.pack(">H", p.port)
        else:
            v6 += addr.packed + struct.pack(">H", p.port)
    return bytes(v4), bytes(v6)


@dataclass(frozen=True)
class TrackerConfig:
    interval_s: int = DEFAULT_INTERVAL_S
    min_interval_s: int = MIN_INTERVAL_S

    @property
    def ttl_s(self) -> float:
        return self.interval_s * 1.5 + 30  # one missed announce is forgiven


def _who(
    passkey: str,
    remote_ip: str,
    passkey_ok: Callable[[str], bool] | None,
    identify: Callable[[str, str], Announcer | None] | None,
) -> Announcer | None:
    """The announcer behind a passkey: `identify` knows nodes and their addresses; with `passkey_ok`
    alone the passkey itself stands for the node and every address counts as its own."""
    if not passkey:
        return None
    if identify is not None:
        return identify(passkey, remote_ip)
    if passkey_ok is not None and passkey_ok(passkey):
        return Announcer(node=passkey, verified=True)
    return None


def rate_failure(limiter: AnnounceLimiter) -> bytes:
    return failure(
        f"too many announces from this node: at most {limiter.per_min} a minute; "
        "announce again after the interval"
    )


def announce(
    raw_query: str | bytes,
    remote_ip: str,
    passkey: str,
    *,
    passkey_ok: Callable[[str], bool] | None = None,
    identify: Callable[[str, str], Announcer | None] | None = None,
    torrent_known: Callable[[bytes], bool],
    store: PeerStore,
    limiter: AnnounceLimiter | None = None,
    config: TrackerConfig = TrackerConfig(),  # noqa: B008 - frozen dataclass
    now: float | None = None,
) -> bytes:
    """Answer one announce with a bencoded body (always HTTP 200; refusals carry `failure reason`).

    The passkey names the node (`identify`, or `passkey_ok` where the passkey is the node); the
    `limiter` counts the node's announces before anything else is done for it."""
    who = _who(passkey, remote_ip, passkey_ok, identify)
    if who is None:
        return failure("unknown passkey")
    t = time.time() if now is None else now
    if limiter is not None and not limiter.allow(who.node, t):
        return rate_failure(limiter)
    try:
        a = parse_announce(raw_query, remote_ip)
    except AnnounceError as e:
        return failure(str(e))
    if not torrent_known(a.info_hash):
        return failure("unregistered torrent")
    a = replace(a, node=who.node, verified=who.verified)
    seq = store.update(a, t, config.ttl_s)
    complete, incomplete, _ = store.counts(a.info_hash, t)
    body: dict[bytes | str, Bencodable] = {
        "interval": config.interval_s,
        "min interval": config.min_interval_s,
        "complete": complete,
        "incomplete": incomplete,
    }
    # A joining peer hears only of those that arrived before it (they hear of it on their own announces
    # or when it connects): concurrent joins then get distinct list lengths, which agents use as their
    # arrival rank to stagger web seed use (agent.artifacts.pieces.web_seed_needed).
    before = seq if a.event == "started" else None
    peers = [] if a.event == "stopped" else store.peers(a.info_hash, a.peer_id, a.numwant, t, before)
    if a.compact:
        v4, v6 = compact_peers(peers)
        body["peers"] = v4
        if v6:
            body["peers6"] = v6
    else:
        body["peers"] = [{"peer id": p.peer_id, "ip": p.ip, "port": p.port} for p in peers]
    return bencode(body)


def scrape(
    raw_query: str | bytes,
    passkey: str,
    *,
    passkey_ok: Callable[[str], bool] | None = None,
    identify: Callable[[str, str], Announcer | None] | None = None,
    torrent_known: Callable[[bytes], bool],
    store: PeerStore,
    limiter: AnnounceLimiter | None = None,
    remote_ip: str = "",
    now: float | None = None,
) -> bytes:
    """Answer a scrape for the info_hash(es) in the query (known torrents only; none asked -> failure);
    it counts against the node's announce rate like an announce."""
    who = _who(passkey, remote_ip, passkey_ok, identify)
    if who is None:
        return failure("unknown passkey")
    if limiter is not None and not limiter.allow(who.node, time.time() if now is None else now):
        return rate_failure(limiter)
    hashes = [v for k, v in parse_query_multi(raw_query) if k == "info_hash"]
    if not hashes:
        return failure("missing info_hash (a full scrape is not offered)")
    if len(hashes) > MAX_SCRAPE_HASHES:
        return failure(f"too many info_hash values (at most {MAX_SCRAPE_HASHES} per scrape)")
    if any(len(h) != 20 for h in hashes):
        return failure("invalid info_hash: expected 20 bytes")
    t = time.time() if now is None else now
    files: dict[bytes | str, Bencodable] = {}
    for h in hashes:
        if torrent_known(h):
            complete, incomplete, downloaded = store.counts(h, t)
            files[h] = {"complete": complete, "incomplete": incomplete, "downloaded": downloaded}
    return bencode({"files": files})


def scrape_url(announce_url: str) -> str | None:
    """BEP 48 convention: the scrape URL replaces the last `announce` path component by `scrape`."""
    head, sep, tail = announce_url.rpartition("/")
    if not sep or not tail.startswith("announce"):
        return None
    return f"{head}/scrape{tail[len('announce') :]}"
