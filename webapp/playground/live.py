"""Live routes of saved conversations, and where they wait between websockets.

A conversation's RouteClient holds the hops' KV. When its websocket goes away (a page reload, a closed
tab) the route is parked here for `PARK_S`, so reopening the conversation continues with the hops' KV
instead of prefilling the whole history again. Parked routes are closed (KV freed on every hop) when
their time is up or their conversation is deleted. This lives in the web server process: a reopen that
lands in another process, or comes later, re-prefills. Parked routes count against their user's
route cap (webapp.routing.quota): past it the oldest idle ones are taken from here and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
from dataclasses import dataclass

from webapp.routing import quota
from webapp.routing.answer import LiveRoute
from webapp.routing.session import close_later, close_live

log = logging.getLogger(__name__)

# Well under the agents' session TTL (agent.defaults.SESSION_TTL_S, 30 min), so a parked route's hops
# still hold its KV when it is reclaimed. 0 closes a route as soon as its socket goes.
PARK_S = 600.0


@dataclass
class _Parked:
    live: LiveRoute
    loop: asyncio.AbstractEventLoop
    timer: asyncio.TimerHandle


class Parking:
    """Parked routes by conversation id; `park` and `claim` run in the event loop, `discard` anywhere."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # `discard` comes from sync views in worker threads
        self._parked: dict[int, _Parked] = {}

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, conversation_id: int, live: LiveRoute) -> None:
        loop = asyncio.get_running_loop()
        if PARK_S <= 0:
            close_later([live])
            return
        timer = loop.call_later(PARK_S, self._expire, conversation_id, live)
        with self._lock:
            old = self._parked.pop(conversation_id, None)
            self._parked[conversation_id] = _Parked(live, loop, timer)
        if old is not None:  # two tabs on one conversation: the older route goes
            self._release(old)

    def claim(self, conversation_id: int, artifact_id: int) -> LiveRoute | None:
        """The parked route of this conversation and model, taken out of the parking; else None."""
        with self._lock:
            p = self._parked.pop(conversation_id, None)
        if p is None:
            return None
        if p.loop is not asyncio.get_running_loop() or p.live.artifact_id != artifact_id:
            self._release(p)
            return None
        p.timer.cancel()
        return p.live

    def reclaim(self, live: LiveRoute) -> bool:
        """Take `live` out of the parking to be closed (its user's route cap, webapp.routing.quota)."""
        with self._lock:
            cid = next((c for c, p in self._parked.items() if p.live is live), None)
            p = self._parked.pop(cid) if cid is not None else None
        if p is None:
            return False
        p.timer.cancel()  # (its _expire would find nothing to close anyway)
        return True

    def discard(self, conversation_id: int) -> None:
        """Close the parked route of a deleted conversation (safe from any thread)."""
        with self._lock:
            p = self._parked.pop(conversation_id, None)
        if p is not None:
            self._release(p)

    async def close_all(self) -> None:
        with self._lock:
            parked, self._parked = list(self._parked.values()), {}
        for p in parked:
            p.timer.cancel()
            await close_live(p.live)

    def _expire(self, conversation_id: int, live: LiveRoute) -> None:
        with self._lock:
            p = self._parked.get(conversation_id)
            if p is None or p.live is not live:
                return
            del self._parked[conversation_id]
        log.info("parked route session %s expired", live.session_id)
        close_later([live])

    def _release(self, p: _Parked) -> None:
        def run() -> None:
            p.timer.cancel()
            close_later([p.live])

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is p.loop:
            run()
            return
        # A fresh context: the caller's (a sync view's thread) would make asgiref refuse our DB call.
        with contextlib.suppress(RuntimeError):  # its loop is gone (a test's): the agents' TTL frees it
            p.loop.call_soon_threadsafe(run, context=contextvars.Context())


parking = Parking()
quota.routes.add_reclaimer(parking.reclaim)  # closed tabs' routes count against their user's cap
