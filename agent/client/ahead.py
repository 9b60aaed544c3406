"""The one decode step a route client may send ahead of its consumer, and how it is settled.

Plain and speculative decoding send each step before the consumer has handled the tokens it follows,
so the consumer's work (detokenizing, stop strings, socket writes) overlaps the route's. Until that
step is done no other frame of the session may reach the hops: its answer extends the client's history,
and one landing after the next answer's truncate would leave the history a position past the hops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from agent.wire.frames import Response

log = logging.getLogger(__name__)


class StepAhead:
    """The step in flight ahead of a route client's consumer: forgotten only once it is done."""

    def __init__(self) -> None:
        self.step: asyncio.Future[Response] | None = None

    def send(self, forward: Coroutine[Any, Any, Response]) -> asyncio.Future[Response]:
        step = self.step = asyncio.ensure_future(forward)
        return step

    async def take(self, step: asyncio.Future[Response]) -> Response:
        """The step's answer. A caller cancelled meanwhile (a web client that left) does not cancel the
        step, whose frame has left: it stays ahead, and `settled` waits for it."""
        try:
            return await asyncio.shield(step)
        finally:
            self._landed(step)

    async def drop(self, step: asyncio.Future[Response]) -> None:
        """A step sent ahead of a consumer that stopped: let it finish (settle_ahead)."""
        try:
            await settle_ahead(step)
        finally:
            self._landed(step)

    async def settled(self, within: float | None = None) -> None:
        """Wait for a step still ahead (its consumer stopped, was cancelled or never closed its
        generator) before any other frame goes. `within`: a session being closed waits that long, then
        cancels the step (a hung hop's), as its close frees the KV the step was writing anyway."""
        step = self.step
        if step is None:
            return
        if within is not None and not step.done():
            await asyncio.wait({step}, timeout=within)
            if not step.done():
                log.warning("a step sent ahead did not end within %.1f s of its session's close", within)
                step.cancel()
        await self.drop(step)

    def _landed(self, step: asyncio.Future[Response]) -> None:
        if step.done() and self.step is step:
            self.step = None


async def settle_ahead(step: asyncio.Future[Response]) -> None:
    """A step sent ahead of a consumer that stopped (a stop string, Stop, a closed socket): it is let
    finish, so the hops' KV and the history agree again (a cut-off step would leave them unsure), and
    its failure is logged, not raised: every token the consumer took was already delivered."""
    try:
        await asyncio.shield(step)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # this task is being cancelled: the step still ends on its own; its outcome is collected
            step.add_done_callback(_collect)
            raise
        log.warning("a step sent ahead of a finished answer was cancelled")
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("a step sent ahead of a finished answer failed: %s", e)


def _collect(step: asyncio.Future[Response]) -> None:
    if not step.cancelled() and step.exception() is not None:
        log.warning("a step sent ahead of a finished answer failed: %s", step.exception())
