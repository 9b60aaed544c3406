"""Machine-wide compute leases: one per core, shared by every hop of this user on the machine.

Hops that share a machine (`make up`'s two local agents, a bench's three, a node serving two shards)
each open a ggml threadpool of `--threads` workers. When several compute at once (sessions pipelined
through the route) their threads outnumber the cores, and ggml's barrier, which waits for every worker
of a graph after each op, then waits for a thread the kernel has parked: on two cores, 8 sessions over
three 2-thread hops ran at 92 tok/s in all, 113 with 1-thread hops (docs/benchmarks.md). So a hop
computes only under leases: it takes up to its thread count of them, at least one, and runs its graph
with as many threads as it holds (the native executor's results do not depend on the thread count:
tests/native/test_threads.py). A hop alone on the machine holds them all, as before.

A lease is an exclusive `flock` on one of N files in a directory private to this user (0700, checked):
the kernel drops it when its holder exits, however it exits, so a killed hop never keeps one. Each
scheduler opens its own descriptors (flock conflicts between open file descriptions, also within one
process). GGSWARM_CORE_LEASES sets N (default: the CPUs this process may run on), 0 turns leases off;
GGSWARM_CORE_DIR the directory (default $XDG_RUNTIME_DIR or the temp dir, ggswarm-cores-<uid>).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from agent.defaults import env_int

log = logging.getLogger("agent.node.cores")

LEASES_ENV = "GGSWARM_CORE_LEASES"
DIR_ENV = "GGSWARM_CORE_DIR"
MAX_LEASES = 1024


class CoreLeaseError(Exception):
    """The lease directory cannot be trusted or used (another owner, group or world access)."""


def machine_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def default_dir(env: Mapping[str, str] | None = None) -> Path:
    e = os.environ if env is None else env
    if e.get(DIR_ENV):
        return Path(e[DIR_ENV])
    base = e.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"ggswarm-cores-{os.getuid()}"


def leases_from_env(env: Mapping[str, str] | None = None) -> int:
    """How many leases the machine has: GGSWARM_CORE_LEASES (0 = off), else its cores.
    ValueError when the variable is out of range."""
    n = env_int(LEASES_ENV, 0, MAX_LEASES, env)
    return machine_cores() if n is None else n


def private_dir(path: Path) -> Path:
    """`path`, created 0700 if missing; refused unless it is a directory of this user that nobody
    else may enter (another local user could otherwise hold every lease and stall our hops)."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=False)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise CoreLeaseError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise CoreLeaseError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise CoreLeaseError(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); want 0700")
    return path


class CoreLeases:
    """One scheduler's handle on the machine's leases: its own descriptor per lease file."""

    def __init__(self, n: int, directory: Path) -> None:
        if not 1 <= n <= MAX_LEASES:
            raise ValueError(f"lease count must be in 1..{MAX_LEASES}, got {n}")
        d = private_dir(directory)
        self.n = n
        self._fds: list[int] = []
        try:
            for i in range(n):
                fd = os.open(d / f"core-{i}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
                self._fds.append(fd)
        except OSError:
            self.close()
            raise
        # where this handle starts looking: hops waiting at once wait on different files
        self._first = os.getpid() % n

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CoreLeases | None:
        """The machine's leases as configured, or None when turned off or unusable (logged: the hop
        then computes as it would alone, which is what it did before leases existed)."""
        try:
            n = leases_from_env(env)
            if n == 0:
                return None
            return cls(n, default_dir(env))
        except (OSError, CoreLeaseError, ValueError) as e:
            log.warning("core leases off: %s", e)
            return None

    def _order(self) -> list[int]:
        return [(self._first + i) % self.n for i in range(self.n)]

    def try_take(self, want: int) -> list[int]:
        """Up to `want` free leases, without waiting (maybe none)."""
        held: list[int] = []
        for i in self._order():
            if len(held) >= want:
                break
            try:
                fcntl.flock(self._fds[i], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            held.append(i)
        return held

    def take_blocking(self, want: int) -> list[int]:
        """At least one lease and up to `want`, waiting for the first (in a thread: it blocks)."""
        held = self.try_take(want)
        if held:
            return held
        first = self._first
        fcntl.flock(self._fds[first], fcntl.LOCK_EX)
        held = [first]
        for i in self._order():
            if len(held) >= want:
                break
            if i == first:
                continue
            try:
                fcntl.flock(self._fds[i], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            held.append(i)
        return held

    async def take(self, want: int) -> list[int]:
        """At least one lease and up to `want`; waits off the event loop when none is free."""
        held = self.try_take(want)
        if held:
            return held
        fut = asyncio.get_running_loop().run_in_executor(None, self.take_blocking, want)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # the waiting thread cannot be interrupted: whatever it gets is given back when it does
            fut.add_done_callback(self._give_result)
            raise

    def _give_result(self, fut: asyncio.Future[list[int]]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.give(fut.result())

    def give(self, held: list[int]) -> None:
        fds = self._fds  # empty once closed (closing dropped the locks; the numbers may be reused)
        for i in held:
            if i < len(fds):
                with contextlib.suppress(OSError):
                    fcntl.flock(fds[i], fcntl.LOCK_UN)

    def close(self) -> None:
        """Give up the descriptors (and with them any lease still held)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
