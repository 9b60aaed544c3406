"""The process helpers shared by `make up`, the tests and the benchmarks, on real child processes."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from agent.procs import (
    ProcessExited,
    free_port,
    port_open,
    spawn,
    stop,
    wait_http,
    wait_log,
    wait_port,
    wait_until,
)

# A parent that starts a grandchild in its own process group, prints both pids, then waits.
FAMILY = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): read its state.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_stopping_a_spawned_process_stops_what_it_started(tmp_path: Path) -> None:
    log = tmp_path / "family.log"
    parent = spawn([sys.executable, "-c", FAMILY], log)
    child = int(wait_log(log, r"child (\d+)", 30, procs=[parent]).group(1))
    stop([parent], grace_s=5)
    assert parent.returncode == -signal.SIGTERM
    wait_until("the grandchild to exit", lambda: not _alive(child), 5)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    p = spawn([sys.executable, "-c", code], tmp_path / "stubborn.log")
    wait_log(tmp_path / "stubborn.log", "up", 30, procs=[p])
    t0 = time.monotonic()
    stop([p], grace_s=0.5)
    assert p.returncode == -signal.SIGKILL and time.monotonic() - t0 < 5


def test_a_stopped_process_still_exits_on_stop(tmp_path: Path) -> None:
    p = spawn([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "paused.log")
    p.send_signal(signal.SIGSTOP)
    stop([p], grace_s=5)
    assert p.returncode == -signal.SIGTERM


def test_waiting_fails_at_once_naming_the_process_that_exited(tmp_path: Path) -> None:
    p = spawn([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "dies.log")
    t0 = time.monotonic()
    with pytest.raises(ProcessExited, match="exited with 3"):
        wait_http(f"http://127.0.0.1:{free_port()}/", 60, procs=[p])
    assert time.monotonic() - t0 < 30


def test_a_server_is_ready_when_its_port_and_url_answer(tmp_path: Path) -> None:
    port = free_port()
    assert not port_open("127.0.0.1", port)
    server = spawn(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        tmp_path / "server.log",
    )
    try:
        wait_port("127.0.0.1", port, 30, procs=[server])
        wait_http(f"http://127.0.0.1:{port}/", 30, procs=[server])
    finally:
        stop([server])


def test_a_condition_that_never_holds_times_out_with_what_was_awaited() -> None:
    with pytest.raises(TimeoutError, match="the moon"):
        wait_until("the moon", lambda: None, 0.2, every_s=0.05)
