"""The prefix cache: live route clients per API key, found again by the token prefix they hold.

An OpenAI client is stateless: turn 2 re-sends the whole conversation. Each finished request leaves its
RouteClient here with the hops' KV intact; a later request of the same key whose prompt extends that
token history takes the client back, and RouteClient.generate prefills only the new tokens. Entries
are bounded (in all, per key), dropped when idle too long or when their route tokens near expiry,
and closed (KV freed on every hop) when dropped. Only the event loop thread touches it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from webapp.env import envint
from webapp.routing.answer import LiveRoute
from webapp.routing.prefix import common_prefix

MAX_ENTRIES = envint("API_PREFIX_CACHE_MAX", 32, minimum=0)
MAX_PER_KEY = envint("API_PREFIX_CACHE_PER_KEY", 4, minimum=1)
IDLE_S = envint("API_PREFIX_CACHE_IDLE_S", 300, minimum=1)


@dataclass
class Entry:
    """One key's live route (its client holds the token history), and when it was opened and last used."""

    key_id: int
    live: LiveRoute
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False


class PrefixCache:
    """Bounded, LRU, per-process: `take` finds a reusable entry, `put` returns one, both report what
    they evicted so the caller closes it (closing is async I/O; this class does none)."""

    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        max_per_key: int = MAX_PER_KEY,
        idle_s: float = IDLE_S,
        max_age_s: float = 3000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries, self.max_per_key = max_entries, max_per_key
        self.idle_s, self.max_age_s, self.clock = idle_s, max_age_s, clock
        self.entries: list[Entry] = []  # least recently used first
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self.entries)

    def expired(self) -> list[Entry]:
        """Remove and return idle entries past the idle limit or near their route tokens' expiry, and
        entries busy for longer than that (a request that never ran its answer, e.g. a stream response
        the server never started: no real answer takes that long)."""
        now = self.clock()
        old = [
            e
            for e in self.entries
            if (not e.busy and (now - e.last_used > self.idle_s or now - e.created > self.max_age_s))
            or (e.busy and now - e.last_used > self.max_age_s)
        ]
        self.entries = [e for e in self.entries if e not in old]
        return old

    def take(self, key_id: int, artifact_id: int, prompt: list[int]) -> tuple[Entry | None, int]:
        """The idle entry of this key and model sharing the longest prefix with `prompt` (marked busy),
        and that prefix's length; (None, 0) when no entry continues this conversation.

        An entry counts as the same conversation when the shared prefix covers at least 3/4 of its
        history: a new conversation sharing only a system prompt opens its own route instead of
        cutting back another conversation's KV."""
        best, best_n = None, 0
        for e in self.entries:
            if e.busy or e.key_id != key_id or e.live.artifact_id != artifact_id:
                continue
            held = list(e.live.client.history)
            n = common_prefix(held, prompt)
            if n > best_n and 4 * n >= 3 * len(held):
                best, best_n = e, n
        if best is None:
            self.misses += 1
            return None, 0
        self.hits += 1
        best.busy, best.last_used = True, self.clock()
        self.entries.remove(best)
        self.entries.append(best)
        return best, best_n

    def add_busy(self, entry: Entry) -> list[Entry]:
        """Track a freshly opened entry (busy while its request runs); returns evicted idle entries."""
        entry.busy, entry.last_used = True, self.clock()
        self.entries.append(entry)
        return self._evict()

    def put(self, entry: Entry) -> list[Entry]:
        """The request on `entry` finished well: keep it for the next turn; returns evicted entries."""
        entry.busy = False
        entry.last_used = self.clock()
        if entry in self.entries:
            self.entries.remove(entry)
        self.entries.append(entry)
        return self._evict()

    def drop(self, entry: Entry) -> None:
        """Forget `entry` (its request failed or was cancelled; the caller closes it)."""
        if entry in self.entries:
            self.entries.remove(entry)

    def drop_key(self, key_id: int) -> list[Entry]:
        """Remove a revoked key's idle entries."""
        gone = [e for e in self.entries if e.key_id == key_id and not e.busy]
        self.entries = [e for e in self.entries if e not in gone]
        return gone

    def _evict(self) -> list[Entry]:
        out: list[Entry] = []
        counts: dict[int, int] = {}
        for e in self.entries:
            counts[e.key_id] = counts.get(e.key_id, 0) + 1
        for e in list(self.entries):  # oldest first
            over_key = counts[e.key_id] > self.max_per_key
            over_all = len(self.entries) > self.max_entries
            if e.busy or not (over_key or over_all):
                continue
            self.entries.remove(e)
            counts[e.key_id] -= 1
            out.append(e)
        return out
