"""What bench/abuse.py's parts share: the control plane's Django shell, polling, and a loop on a thread."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def shell(s: Any, code: str) -> Any:
    """Run Python in the control plane's Django (manage.py shell); the JSON its last line prints."""
    cmd = [sys.executable, "manage.py", "shell", "-c", code]
    out = subprocess.run(cmd, cwd=REPO, env=s.env, check=True, capture_output=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def until(cond: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.05)
    return cond()


class LoopThread(threading.Thread):
    """An asyncio loop on a thread of its own running `main()` until `stop()` sets `quit`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.quit: asyncio.Event | None = None
        self.started = threading.Event()

    def run(self) -> None:
        async def go() -> None:
            self.loop, self.quit = asyncio.get_running_loop(), asyncio.Event()
            await self.main(self.quit)

        asyncio.run(go())

    async def main(self, quit: asyncio.Event) -> None:
        raise NotImplementedError

    def stop(self, timeout_s: float = 120) -> None:
        if self.loop is not None and self.quit is not None:
            self.loop.call_soon_threadsafe(self.quit.set)
        self.join(timeout=timeout_s)
