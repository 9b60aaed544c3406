"""The route client's side of prefix snapshots: restore a shared prefix's state on every hop, or save it.

A route opened for a prompt whose first `n` ids may be shared with other users' sessions (a system
prompt: the caller says how many) asks every hop for the state kept under the prefix's digest
(`Op.PREFIX_LOAD`, docs/protocol.md "Prefix snapshots"). All hops must hold it: one that misses makes
the others give it back (a truncate to 0) and the route prefills as always. After prefilling a missed
prefix on its own the route asks every hop to keep it (`Op.PREFIX_SAVE`), best effort: a hop that
refuses (full, off, an older node) only costs a later session its prefill.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from agent.client.errors import RouteError
from agent.client.link import RouteLink, Step
from agent.wire.frames import Kind, Op
from agent.wire.prefix import prefix_digest

log = logging.getLogger("agent.client.prefix")
# A shorter shared prefix prefills in about the time the round trips to save or restore it take
PREFIX_MIN_TOKENS = 64


def shareable(prompt_ids: list[int], n: int, held: list[int]) -> bool:
    """Whether `prompt_ids[:n]` is worth naming: long enough, shorter than the prompt (the last position
    must run to sample from), and not already in the route's KV (`held`, its history)."""
    if n < PREFIX_MIN_TOKENS or n >= len(prompt_ids):
        return False
    return not (len(held) >= n and held[:n] == prompt_ids[:n])


class PrefixSharing:
    """Load and save of one route's shared prefixes, over its `link` (frames and round trips)."""

    def __init__(self, link: RouteLink) -> None:
        self.link = link
        self.last: dict[str, Any] = {}  # what the latest generate did: shared_tokens, hit, saved

    async def load(self, ids: list[int]) -> bool:
        """Every hop's (empty) session starts from the state kept under `ids`; False (every hop empty
        again) where any hop does not hold it."""
        digest = prefix_digest(ids)
        n = len(ids)
        held = []
        try:
            for i in range(len(self.link.hops)):
                resp = await self.link.post(i, self.frame(i, Op.PREFIX_LOAD, n, digest), self.link.timeout_s)
                if resp.session_len != n:
                    break
                held.append(i)
        except RouteError as e:
            log.info("prefix load refused: %s", e)
        if len(held) == len(self.link.hops):
            return True
        for i in held:  # the hops that restored it give it back: the route prefills from 0
            await self.link.post(i, self.link.plain_frame(i, Op.TRUNCATE, 0), self.link.timeout_s)
        return False

    async def save(self, ids: list[int]) -> bool:
        """Ask every hop to keep its state at `ids` (the route holds exactly them now); best effort."""
        digest = prefix_digest(ids)
        saved = True
        for i in range(len(self.link.hops)):
            try:
                await self.link.post(i, self.frame(i, Op.PREFIX_SAVE, len(ids), digest), self.link.timeout_s)
            except RouteError as e:
                log.info("hop %d did not keep the prefix: %s", i, e)
                saved = False
        return saved

    def frame(self, i: int, op: Op, n: int, digest: bytes) -> bytes:
        """Hop `i`'s PREFIX_SAVE or PREFIX_LOAD frame for the prefix of `n` ids named by `digest`."""
        return self.link.frame(
            i, op, step=self.link.next_step(), pos_start=n, kind=Kind.DIGEST, payload=digest
        )


def prefix_step(ids: list[int]) -> Step:
    """Hop 0's record of a restored prefix, as if it had been prefilled: a recovery re-prefills it."""
    return Step(0, len(ids), Kind.IDS, 0, np.asarray(ids, dtype="<i4").tobytes())
