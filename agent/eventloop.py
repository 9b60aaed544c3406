"""The event loop the agent's long-running processes run on: uvloop where installed, else asyncio's.

A decode step crosses every hop's loop twice; uvloop's loop turns and socket calls cost less than
asyncio's (bench/hop_floor.py, docs/benchmarks-log.md "The transport's floor, and the event loop").
An agent updated in place with --no-deps may lack uvloop: it then runs on asyncio's loop, as before.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name() -> str:
    """The loop to run: uvloop where it is installed, else asyncio."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the loop loop_name() names."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def use_loop_policy() -> None:
    """New loops are uvloop's where it is installed: for a server that creates its own loop (daphne's
    reactor, webapp/serve.py), called before it does."""
    if loop_name() == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def running_loop_name() -> str:
    """Which loop this coroutine runs on ("uvloop" or "asyncio"), as /v1/health reports it."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
