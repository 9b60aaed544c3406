"""The event loop the agent's long-running processes run on: uvloop where installed, else asyncio's.

A decode step crosses every hop's loop twice; uvloop's loop turns and socket calls cost less than
asyncio's (bench/hop_floor.py and bench/served.py --ab-serve-env GGSWARM_EVENT_LOOP=asyncio,
docs/benchmarks-log.md "The transport's floor, and the event loop"). An agent updated in place with --no-deps may lack uvloop: it
then runs on asyncio's loop, as before. GGSWARM_EVENT_LOOP=asyncio keeps the standard loop (an
operator's A/B); GGSWARM_EVENT_LOOP=uvloop insists on uvloop (an error where it is not installed).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
EVENT_LOOP_ENV = "GGSWARM_EVENT_LOOP"
LOOPS = ("uvloop", "asyncio")


def loop_name(env: Mapping[str, str] | None = None) -> str:
    """The loop to run: GGSWARM_EVENT_LOOP's, else uvloop where it is installed, else asyncio.
    ValueError for another name, or for uvloop asked for but not installed."""
    asked = (os.environ if env is None else env).get(EVENT_LOOP_ENV, "")
    have_uvloop = importlib.util.find_spec("uvloop") is not None
    if not asked:
        return "uvloop" if have_uvloop else "asyncio"
    if asked not in LOOPS:
        raise ValueError(f"{EVENT_LOOP_ENV} must be one of {', '.join(LOOPS)}, not {asked!r}")
    if asked == "uvloop" and not have_uvloop:
        raise ValueError(f"{EVENT_LOOP_ENV}=uvloop but uvloop is not installed (pip install uvloop)")
    return asked


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the loop loop_name() names."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def running_loop_name() -> str:
    """Which loop this coroutine runs on ("uvloop" or "asyncio"), as /v1/health reports it."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
