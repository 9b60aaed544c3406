"""`make up`'s promise "Ctrl-C stops everything" (README): the web server and the agents it starts run in
sessions of their own (agent/procs.py), so a terminal's Ctrl-C reaches only the command, and its own
cleanup must stop them. SIGINT to the command alone, on the embedded defaults: every process it started
exits and the web port is free again (a leaked agent would keep its KV, ports and threads)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
import pytest

from agent.procs import free_port, port_open, spawn, stop, wait_log

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
UP_S = 420  # migrate, enroll two agents, place SmolLM2 on a loaded 2-core machine
# A shell's background job starts with SIGINT ignored, and Python keeps it ignored: the command gets
# the default disposition back before it starts, as a terminal's foreground job has it.
WITH_CTRL_C = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


def test_ctrl_c_on_make_up_stops_the_web_server_and_every_agent_it_started(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}  # embedded defaults
    env.update(
        SWARM_DATA_DIR=str(tmp_path / "var"), SWARM_ADMIN_PASSWORD="ctrl-c-Admin-1", PYTHONUNBUFFERED="1"
    )
    port = free_port()
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-c", WITH_CTRL_C, sys.executable, "scripts/up.py", "--port", str(port)]
    proc = spawn(cmd, log, env=env, cwd=REPO)
    started: list[psutil.Process] = []
    try:
        wait_log(log, r"Ctrl-C stops everything", UP_S, procs=[proc], every_s=0.5)
        started += psutil.Process(proc.pid).children(recursive=True)
        cmdlines = [" ".join(p.cmdline()) for p in started]
        assert sum("webapp.serve" in c for c in cmdlines) == 1, cmdlines
        assert sum("agent run" in c for c in cmdlines) == 2, cmdlines
        assert port_open("127.0.0.1", port)

        os.kill(proc.pid, signal.SIGINT)  # the command alone, not its process group
        assert proc.wait(90) == 0, log.read_text()[-2000:]
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        assert not port_open("127.0.0.1", port)
    finally:
        stop([proc], grace_s=10)
        for p in started:  # never leave a leaked server or agent to the next test
            if p.is_running():
                p.kill()
