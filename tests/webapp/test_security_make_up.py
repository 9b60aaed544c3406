"""Issue 17: `make up` never writes the admin password into a log, and its logs are owner-only.

The attack: the password `make up` generated was printed into a log file anyone on the host could
read. This runs the real thing (`manage.py swarm_up --check`: web server, two agents, SmolLM2 placed,
one playground answer) with its output captured to a file, as a service manager or CI would.
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
def test_the_admin_password_is_in_no_log_after_make_up(tmp_path: Path) -> None:
    data = tmp_path / "var"
    out = tmp_path / "make-up.out"  # what `make up > file` would capture: not a terminal
    env = {**os.environ, "SWARM_DATA_DIR": str(data)}
    for name in ("DATABASE_URL", "REDIS_URL", "SWARM_ADMIN_PASSWORD", "CELERY_TASK_ALWAYS_EAGER"):
        env.pop(name, None)  # the embedded mode `make up` starts in
    with out.open("w") as f:
        rc = subprocess.run(
            [sys.executable, "manage.py", "swarm_up", "--check", "--port", str(procs.free_port())],
            cwd=REPO,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=900,
        ).returncode
    assert rc == 0, out.read_text()[-3000:]
    password = (data / "admin_password").read_text().strip()
    assert stat.S_IMODE((data / "admin_password").stat().st_mode) == 0o600
    logs = sorted((data / "logs").glob("*.log"))
    assert logs and {p.name for p in logs} >= {"web.log", "agent-1.log", "agent-2.log"}
    for p in [*logs, out]:
        assert password not in p.read_text(errors="replace"), p
    assert "admin_password" in out.read_text()  # it says where the password is instead
    for p in logs:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE((data / "logs").stat().st_mode) == 0o700
