"""`make up` (`manage.py swarm_up --check`) on a fresh data dir, embedded mode, as a new user would, its
output captured to files as a service manager or CI would: it brings up the web server and two agents,
places SmolLM2 and streams a playground answer; and (issue 17) it never writes the admin password into
a log, and its logs are owner-only.

The attack of issue 17: the password `make up` generated was printed into a log file anyone on the host
could read. One bring-up serves both checks (they used to start the same `swarm_up --check` twice).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent import procs

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_make_up_brings_up_two_agents_streams_an_answer_and_logs_no_admin_password(
    tmp_path: Path, model_path: str
) -> None:
    data = tmp_path / "var"
    out, err = tmp_path / "make-up.out", tmp_path / "make-up.err"  # `make up > out 2> err`: not a terminal
    env = {**os.environ, "SWARM_DATA_DIR": str(data), "PYTHONPATH": str(REPO)}
    for name in ("DATABASE_URL", "REDIS_URL", "SWARM_ADMIN_PASSWORD", "CELERY_TASK_ALWAYS_EAGER"):
        env.pop(name, None)  # the embedded mode `make up` starts in
    port = procs.free_port()
    with out.open("w") as fo, err.open("w") as fe:
        rc = subprocess.run(
            [sys.executable, "manage.py", "swarm_up", "--check", "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=fo,
            stderr=fe,
            timeout=900,
        ).returncode
    stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    assert rc == 0, stdout[-3000:] + stderr[-3000:]

    # Up: the URL, both agents' shards ready, one streamed playground answer.
    assert f"GGUF Swarm is up: http://127.0.0.1:{port}/" in stdout
    assert stdout.count(" ready") >= 2
    answer = stdout.split("playground check: ", 1)[1].strip()
    assert len(answer) > 2

    # The generated password: in a 0600 file, only pointed at in the output (not a terminal), in no log.
    password = (data / "admin_password").read_text().strip()
    assert stat.S_IMODE((data / "admin_password").stat().st_mode) == 0o600
    assert "the password is in" in stdout and "admin_password" in stdout  # it says where it is instead
    logs = sorted((data / "logs").glob("*.log"))
    assert logs and {p.name for p in logs} >= {"web.log", "agent-1.log", "agent-2.log"}
    for p in [*logs, out, err]:
        assert password not in p.read_text(errors="replace"), p
    for p in logs:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE((data / "logs").stat().st_mode) == 0o700
