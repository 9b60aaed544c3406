"""A Redis-backed tracker peer store, so every web process sees the same swarm (real mode)."""

from __future__ import annotations

import json
from typing import Any

from webapp.tracker.logic import Announce, Peer, favour_verified


class RedisPeerStore:
    """Peers of a torrent in one Redis hash (announcer -> JSON: one entry per node, `Announce.entry`);
    expired entries are dropped on read.

    The hash itself expires ttl_s after the last announce, so an abandoned torrent leaves nothing behind.
    """

    def __init__(self, client: Any, prefix: str) -> None:
        self._r = client
        self._prefix = prefix

    def _key(self, info_hash: bytes, kind: str = "peers") -> str:
        return f"{self._prefix}:{kind}:{info_hash.hex()}"

    def _seq(self, info_hash: bytes, entry: str, ttl_s: float) -> int:
        """The peer's arrival order: a fresh INCR claimed with HSETNX, or the one it already has."""
        seqs, arrivals = self._key(info_hash, "seq"), self._key(info_hash, "arrivals")
        seq = int(self._r.incr(arrivals))
        if not self._r.hsetnx(seqs, entry, seq):
            seq = int(self._r.hget(seqs, entry))
        pipe = self._r.pipeline()
        pipe.expire(seqs, int(ttl_s) + 1)
        pipe.expire(arrivals, int(ttl_s) + 1)
        pipe.execute()
        return seq

    def update(self, a: Announce, now: float, ttl_s: float) -> int:
        key, entry = self._key(a.info_hash), a.entry
        if a.event == "stopped":
            self._r.hdel(key, entry)
            return 0
        seq = self._seq(a.info_hash, entry, ttl_s)
        peer = {
            "peer_id": a.peer_id.hex(),
            "ip": a.ip,
            "port": a.port,
            "left": a.left,
            "expires": now + ttl_s,
            "seq": seq,
            "verified": a.verified,
        }
        pipe = self._r.pipeline()
        pipe.hset(key, entry, json.dumps(peer))
        pipe.expire(key, int(ttl_s) + 1)
        if a.event == "completed":
            pipe.incr(self._key(a.info_hash, "downloaded"))
        pipe.execute()
        return seq

    def _live(self, info_hash: bytes, now: float) -> list[Peer]:
        key = self._key(info_hash)
        live, dead = [], []
        for entry, raw in self._r.hgetall(key).items():
            d = json.loads(raw)
            name = entry.decode() if isinstance(entry, bytes) else entry
            if d["expires"] <= now:
                dead.append(name)
            else:
                live.append(
                    Peer(
                        bytes.fromhex(d.get("peer_id", name)),
                        d["ip"],
                        int(d["port"]),
                        int(d["left"]),
                        d["expires"],
                        d["seq"],
                        bool(d.get("verified", True)),
                    )
                )
        if dead:
            self._r.hdel(key, *dead)
        return live

    def peers(
        self, info_hash: bytes, exclude: bytes, numwant: int, now: float, before_seq: int | None = None
    ) -> list[Peer]:
        live = [
            p
            for p in self._live(info_hash, now)
            if p.peer_id != exclude and (before_seq is None or p.seq < before_seq)
        ]
        return favour_verified(live, numwant)

    def counts(self, info_hash: bytes, now: float) -> tuple[int, int, int]:
        live = self._live(info_hash, now)
        complete = sum(1 for p in live if p.left == 0)
        downloaded = int(self._r.get(self._key(info_hash, "downloaded")) or 0)
        return complete, len(live) - complete, downloaded
