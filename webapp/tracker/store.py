"""A Redis-backed tracker peer store, so every web process sees the same swarm (real mode)."""

from __future__ import annotations

import json
from typing import Any

from webapp.tracker.logic import Announce, Peer


class RedisPeerStore:
    """Peers of a torrent in one Redis hash (peer id hex -> JSON); expired entries are dropped on read.

    The hash itself expires ttl_s after the last announce, so an abandoned torrent leaves nothing behind.
    """

    def __init__(self, client: Any, prefix: str) -> None:
        self._r = client
        self._prefix = prefix

    def _key(self, info_hash: bytes, kind: str = "peers") -> str:
        return f"{self._prefix}:{kind}:{info_hash.hex()}"

    def _seq(self, info_hash: bytes, pid: str, ttl_s: float) -> int:
        """The peer's arrival order: a fresh INCR claimed with HSETNX, or the one it already has."""
        seqs, arrivals = self._key(info_hash, "seq"), self._key(info_hash, "arrivals")
        seq = int(self._r.incr(arrivals))
        if not self._r.hsetnx(seqs, pid, seq):
            seq = int(self._r.hget(seqs, pid))
        pipe = self._r.pipeline()
        pipe.expire(seqs, int(ttl_s) + 1)
        pipe.expire(arrivals, int(ttl_s) + 1)
        pipe.execute()
        return seq

    def update(self, a: Announce, now: float, ttl_s: float) -> int:
        key, pid = self._key(a.info_hash), a.peer_id.hex()
        if a.event == "stopped":
            self._r.hdel(key, pid)
            return 0
        seq = self._seq(a.info_hash, pid, ttl_s)
        peer = {"ip": a.ip, "port": a.port, "left": a.left, "expires": now + ttl_s, "seq": seq}
        pipe = self._r.pipeline()
        pipe.hset(key, pid, json.dumps(peer))
        pipe.expire(key, int(ttl_s) + 1)
        if a.event == "completed":
            pipe.incr(self._key(a.info_hash, "downloaded"))
        pipe.execute()
        return seq

    def _live(self, info_hash: bytes, now: float) -> list[Peer]:
        key = self._key(info_hash)
        live, dead = [], []
        for pid, raw in self._r.hgetall(key).items():
            d = json.loads(raw)
            pid_hex = pid.decode() if isinstance(pid, bytes) else pid
            if d["expires"] <= now:
                dead.append(pid_hex)
            else:
                live.append(
                    Peer(
                        bytes.fromhex(pid_hex),
                        d["ip"],
                        int(d["port"]),
                        int(d["left"]),
                        d["expires"],
                        d["seq"],
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
        live.sort(key=lambda p: p.expires, reverse=True)  # most recently seen first
        return live[:numwant]

    def counts(self, info_hash: bytes, now: float) -> tuple[int, int, int]:
        live = self._live(info_hash, now)
        complete = sum(1 for p in live if p.left == 0)
        downloaded = int(self._r.get(self._key(info_hash, "downloaded")) or 0)
        return complete, len(live) - complete, downloaded
