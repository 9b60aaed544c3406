"""The integration tests' local cluster: webapp/devcluster.py's control plane, whose agents start through
agent/dev/cluster.py (the launcher the benchmarks use too), and the tests' own question.

Uses PostgreSQL and Redis when DATABASE_URL / REDIS_URL are set (CI), else the embedded SQLite + eager
mode. Every wait polls a readiness condition; nothing sleeps a guessed time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from webapp import devcluster
from webapp.devcluster import PASSWORD, REPO, Swarm

QUESTION = "What is the capital of France? Answer in one sentence."

__all__ = ["PASSWORD", "QUESTION", "REPO", "Swarm", "control_plane"]


@contextlib.contextmanager
def control_plane(tmp: Path, **env_extra: str) -> Iterator[Swarm]:
    """devcluster.control_plane with one compute thread per agent: the suite runs three workers on two
    cores, and these tests check behaviour, not speed (the benches start agents with their default)."""
    with devcluster.control_plane(tmp, **env_extra) as s:
        s.agent_threads = 1
        yield s
