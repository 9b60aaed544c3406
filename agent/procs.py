"""Starting, waiting for and stopping local processes: `make up`, the tests and the benchmarks share these.

Every wait polls a readiness condition (an HTTP URL, a TCP port, a log line) against a deadline and
fails at once when a watched process exits first: nothing sleeps a guessed time. Processes start in a
session of their own, so stopping one signals its whole process group (whatever it started too), and
a Ctrl-C meant for the caller reaches them only through the caller's own cleanup. Standard library
only: scripts, tests and benchmarks import it before anything heavy.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
Process = subprocess.Popen[bytes]

# How long a stopped process gets to exit after SIGTERM before its group is killed.
STOP_GRACE_S = 10.0


class ProcessExited(RuntimeError):
    """A process that was being waited on exited before it became ready."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the caller hands it to a server soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def describe(p: Process) -> str:
    """The command line of `p`, for messages."""
    args = p.args
    return " ".join(map(str, args)) if isinstance(args, list | tuple) else str(args)


def spawn(
    cmd: Sequence[str | Path],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    append: bool = False,
) -> Process:
    """Start `cmd` in its own session, stdout and stderr into `log`; `env` replaces the environment."""
    with log.open("ab" if append else "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [str(c) for c in cmd],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )


def check_alive(procs: Iterable[Process], what: str = "") -> None:
    """Raise ProcessExited naming the first of `procs` that has exited."""
    for p in procs:
        if p.poll() is not None:
            before = f" before {what}" if what else ""
            raise ProcessExited(f"`{describe(p)}` exited with {p.returncode}{before}")


def wait_until(
    what: str,
    check: Callable[[], T | None],
    timeout_s: float,
    *,
    procs: Iterable[Process] = (),
    every_s: float = 0.1,
) -> T:
    """Poll `check()` until it returns something truthy and return that.

    Raises ProcessExited when one of `procs` exits first, TimeoutError after `timeout_s` seconds.
    """
    watched = list(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        check_alive(watched, what)
        found = check()
        if found:
            return found
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether `url` answers 200 now (refused, reset, timed out or another status: False)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return bool(r.status == 200)
    except (OSError, http.client.HTTPException):  # URLError and HTTPError are OSErrors
        return False


def wait_http(
    url: str, timeout_s: float = 120.0, *, procs: Iterable[Process] = (), every_s: float = 0.1
) -> None:
    """Poll `url` until it answers 200."""
    wait_until(f"{url} to answer 200", lambda: http_ok(url), timeout_s, procs=procs, every_s=every_s)


def port_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections on host:port now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_port(
    host: str, port: int, timeout_s: float = 60.0, *, procs: Iterable[Process] = (), every_s: float = 0.1
) -> None:
    """Poll until host:port accepts TCP connections."""
    wait_until(
        f"{host}:{port} to accept connections",
        lambda: port_open(host, port),
        timeout_s,
        procs=procs,
        every_s=every_s,
    )


def wait_log(
    path: Path,
    pattern: str,
    timeout_s: float = 120.0,
    *,
    procs: Iterable[Process] = (),
    every_s: float = 0.25,
) -> re.Match[str]:
    """Poll the file at `path` until the regular expression `pattern` matches it; return the match."""
    rx = re.compile(pattern)

    def check() -> re.Match[str] | None:
        try:
            return rx.search(path.read_text(errors="replace"))
        except FileNotFoundError:
            return None

    return wait_until(f"{pattern!r} in {path}", check, timeout_s, procs=procs, every_s=every_s)


def _signal(p: Process, sig: signal.Signals) -> None:
    """Send `sig` to p's process group when p leads one (spawn's processes do), else to p alone."""
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)


def stop(procs: Iterable[Process], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every process (its whole group), give them `grace_s` seconds together, SIGKILL the rest.

    SIGCONT follows SIGTERM, so a process stopped with SIGSTOP (a test of a hung node) exits too.
    """
    todo = [p for p in procs if p.poll() is None]
    for p in todo:
        _signal(p, signal.SIGTERM)
        _signal(p, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for p in todo:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()
