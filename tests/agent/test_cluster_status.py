"""agent.dev.cluster's readiness reading of /fleet/status.json: after a control-plane restart the
database still lists the old process's nodes online until each agent reconnects."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from agent.dev.cluster import nodes_online

RESTART = datetime(2026, 12, 5, 20, 0, tzinfo=UTC)


def status(connected_at: datetime | None) -> dict[str, Any]:
    node = {
        "id": "n1",
        "state": "online",
        "dataplane_url": "http://127.0.0.1:9",
        "connected_at": connected_at.isoformat() if connected_at else None,
    }
    return {"nodes": [node]}


def test_a_node_online_before_the_restart_is_not_online_since_it() -> None:
    assert nodes_online(status(RESTART - timedelta(seconds=5)), ["n1"])
    assert not nodes_online(status(RESTART - timedelta(seconds=5)), ["n1"], since=RESTART)
    assert not nodes_online(status(None), ["n1"], since=RESTART)


def test_a_node_that_reconnected_after_the_restart_is_online_since_it() -> None:
    assert nodes_online(status(RESTART + timedelta(seconds=1)), ["n1"], since=RESTART)
