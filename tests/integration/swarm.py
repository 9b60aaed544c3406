"""The integration tests' local cluster: webapp/devcluster.py's control plane, whose agents start through
agent/dev/cluster.py (the launcher the benchmarks use too), and the tests' own question.

Uses PostgreSQL and Redis when DATABASE_URL / REDIS_URL are set (CI), else the embedded SQLite + eager
mode. Every wait polls a readiness condition; nothing sleeps a guessed time.
"""

from __future__ import annotations

from webapp.devcluster import PASSWORD, REPO, Swarm, control_plane

QUESTION = "What is the capital of France? Answer in one sentence."

__all__ = ["PASSWORD", "QUESTION", "REPO", "Swarm", "control_plane"]
