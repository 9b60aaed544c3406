"""A node's per-hop batch figures travel in its heartbeat, are sampled, served as history and plotted on
the fleet page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from agent.node.control import _batch_figures
from agent.wire.control import ControlError, Heartbeat, Telemetry, parse_agent_message
from webapp.fleet import services
from webapp.fleet.models import Node
from webapp.fleet.presenters import history_hours, history_series
from webapp.telemetry.models import NodeTelemetrySample
from webapp.telemetry.services import MAX_BATCH_MS, MAX_BATCH_STEPS, bounded


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


@pytest.mark.django_db
def test_a_heartbeat_sample_stores_the_batch_figures() -> None:
    node = Node.objects.create(name="sampled", state=Node.State.ONLINE)
    t = Telemetry(tok_s=40.0, batch_steps=6.4, queue_wait_ms=2.5, batch_compute_ms=31.0)
    services.apply_heartbeat(node.id, t)
    s = NodeTelemetrySample.objects.get(node=node)
    assert (s.batch_steps, s.queue_wait_ms, s.batch_compute_ms) == (6.4, 2.5, 31.0)


def test_the_wire_refuses_negative_and_non_finite_batch_figures() -> None:
    for bad in ('{"batch_steps": -1}', '{"queue_wait_ms": NaN}', '{"batch_compute_ms": Infinity}'):
        with pytest.raises(ControlError):
            parse_agent_message(f'{{"type": "heartbeat", "telemetry": {bad}}}')


@pytest.mark.django_db
def test_absurd_batch_figures_are_stored_at_their_ceiling() -> None:
    node = Node.objects.create(name="liar", state=Node.State.ONLINE)
    t = Telemetry(tok_s=1.0, batch_steps=1e300, queue_wait_ms=1e300, batch_compute_ms=5.0)
    services.apply_heartbeat(node.id, t)
    s = NodeTelemetrySample.objects.get(node=node)
    assert (s.batch_steps, s.queue_wait_ms) == (MAX_BATCH_STEPS, MAX_BATCH_MS)
    assert s.tok_s == 1.0 and s.batch_compute_ms == 5.0, "the rest of the sample is kept"
    assert bounded(float("nan"), 10.0) == 0.0 and bounded(True, 10.0) == 0.0 and bounded(-3, 10.0) == 0.0


def test_samples_become_throughput_and_batching_series_per_node() -> None:
    t0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    rows = [
        ("a", t0, 10.0, 2.0, 1.0, 8.0),
        ("a", t0 + timedelta(seconds=10), 12.0, 3.0, 1.5, 9.0),
        ("b", t0, 0.0, 0.0, 0.0, 0.0),
    ]
    out = history_series(rows)
    ts = t0.timestamp()
    assert out["throughput"] == {"a": [[ts, 10.0], [ts + 10, 12.0]], "b": [[ts, 0.0]]}
    assert out["batching"] == {
        "a": [[ts, 2.0, 1.0, 8.0], [ts + 10, 3.0, 1.5, 9.0]],
        "b": [[ts, 0.0, 0.0, 0.0]],
    }


def test_the_history_window_is_a_whole_number_of_kept_hours() -> None:
    assert history_hours(None, 24) == 1 and history_hours("", 24) == 1 and history_hours("24", 24) == 24
    for bad in ("0", "25", "-1", "1.5", "²", "9" * 5000, "x"):
        assert history_hours(bad, 24) is None


@pytest.mark.django_db
def test_the_history_endpoint_returns_each_nodes_batch_figures(staff_client: Any, member: Any) -> None:
    node = Node.objects.create(name="plotted", state=Node.State.ONLINE)
    now = timezone.now()
    NodeTelemetrySample.objects.create(
        node=node, ts=now, tok_s=40.0, batch_steps=6.4, queue_wait_ms=2.5, batch_compute_ms=31.0
    )
    NodeTelemetrySample.objects.create(node=node, ts=now - timedelta(hours=3), batch_steps=9.0)
    body = staff_client.get("/fleet/history.json").json()
    assert body["hours"] == 1
    assert body["batching"] == {node.id: [[now.timestamp(), 6.4, 2.5, 31.0]]}, "the 3-hour-old one is out"
    assert body["throughput"] == {node.id: [[now.timestamp(), 40.0]]}
    wider = staff_client.get("/fleet/history.json?hours=4").json()
    assert [p[1] for p in wider["batching"][node.id]] == [9.0, 6.4]
    assert staff_client.get("/fleet/history.json?hours=0").status_code == 400
    staff_client.force_login(member)
    assert staff_client.get("/fleet/history.json").status_code == 403, "staff only"


@pytest.mark.django_db
def test_the_fleet_page_has_the_batching_chart_seeded_from_samples(staff_client: Any) -> None:
    node = Node.objects.create(name="batched", state=Node.State.ONLINE)
    NodeTelemetrySample.objects.create(
        node=node, ts=timezone.now(), batch_steps=6.4, queue_wait_ms=2.5, batch_compute_ms=31.0
    )
    services.apply_heartbeat(node.id, Telemetry(batch_steps=3.5, queue_wait_ms=1.25, batch_compute_ms=20.0))
    page = staff_client.get("/fleet/").content.decode()
    assert 'id="batching-chart"' in page and 'id="batching-history"' in page
    seed = page[page.index('id="batching-history"') :]
    assert node.id in seed and "6.4, 2.5, 31.0" in seed
    # the live plot samples the row's figures between heartbeats
    assert 'data-batch-steps="3.5" data-queue-wait-ms="1.25" data-batch-compute-ms="20.0"' in page
