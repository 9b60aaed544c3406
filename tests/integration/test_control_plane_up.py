"""`manage.py swarm_up` (what `make up` runs) on a fresh data dir, embedded mode, as a new user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.procs import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_swarm_up_brings_up_two_agents_places_smollm2_and_streams_an_answer(
    tmp_path: Path, model_path: str
) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_TASK_ALWAYS_EAGER")
    }
    env.update(SWARM_DATA_DIR=str(tmp_path / "data"), PYTHONPATH=str(REPO))
    port = free_port()
    out = subprocess.run(
        [sys.executable, "manage.py", "swarm_up", "--port", str(port), "--check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"GGUF Swarm is up: http://127.0.0.1:{port}/" in out.stdout
    assert out.stdout.count(" ready") >= 2
    answer = out.stdout.split("playground check: ", 1)[1].strip()
    assert len(answer) > 2
    password = (tmp_path / "data" / "admin_password").read_text().strip()
    # not a terminal: the generated password is only pointed at (0600 file), never printed (docs/security.md)
    assert "the password is in" in out.stdout and password not in out.stdout
    assert oct((tmp_path / "data" / "admin_password").stat().st_mode & 0o777) == "0o600"
