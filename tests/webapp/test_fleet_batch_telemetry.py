"""A node's per-hop batch figures travel in its heartbeat and show on the fleet page."""

from __future__ import annotations

from typing import Any

import pytest

from agent.node.control import _batch_figures
from agent.wire.control import Heartbeat, Telemetry, parse_agent_message
from webapp.fleet import services
from webapp.fleet.models import Node


def test_the_agent_reports_the_data_planes_last_minute_of_batches() -> None:
    stats = {"avg_steps": 3.25, "avg_queue_wait_ms": 1.5, "avg_compute_ms": 12.0, "batches": 40}
    assert _batch_figures(stats) == (3.25, 1.5, 12.0)
    assert _batch_figures(None) == (0.0, 0.0, 0.0)  # a data plane without the figures reports zeros


def test_a_heartbeat_without_batch_figures_still_parses() -> None:
    msg = parse_agent_message('{"type": "heartbeat", "telemetry": {"sessions": 1}}')
    assert isinstance(msg, Heartbeat) and msg.telemetry.batch_steps == 0.0


@pytest.mark.django_db
def test_the_fleet_row_shows_batch_size_queue_wait_and_compute(staff_client: Any) -> None:
    busy = Node.objects.create(name="busy", state=Node.State.ONLINE)
    idle = Node.objects.create(name="idle", state=Node.State.ONLINE)
    t = Telemetry(sessions=8, tok_s=40.0, batch_steps=6.4, queue_wait_ms=2.5, batch_compute_ms=31.0)
    services.apply_heartbeat(busy.id, t)
    services.apply_heartbeat(idle.id, Telemetry(sessions=0))
    page = staff_client.get("/fleet/").content.decode()
    row = page[page.index(f'id="node-{busy.id}"') :]
    row = row[: row.index("</tr>")]
    assert "batch 6.4 · wait 2.5 ms · compute 31.0 ms" in row
    idle_row = page[page.index(f'id="node-{idle.id}"') :]
    assert "batch-line" not in idle_row[: idle_row.index("</tr>")]
