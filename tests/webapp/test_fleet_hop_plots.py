"""The fleet page's per-hop plots: heartbeat validation, the bounded ring on each node, the pure SVG
presenter (coordinates, empty and single points, hostile values) and the page and row that show them."""

from __future__ import annotations

import re
from typing import Any

import pytest

from agent.wire.control import MAX_PREFILLS, BatchWindow, ControlError, Heartbeat, Prefill, Telemetry
from agent.wire.control import parse_agent_message as parse
from webapp.fleet import services
from webapp.fleet.consumers import _render_node_row
from webapp.fleet.hopseries import (
    MAX_POSITIONS,
    PREFILLS_KEPT,
    RECENT_POINTS,
    appended,
    heartbeat_point,
    hop_plots,
)
from webapp.fleet.models import Node
from webapp.fleet.sparkline import (
    MAX_LINES,
    MAX_POINTS,
    Line,
    clean_points,
    coordinates,
    finite,
    polyline_points,
    sparkline,
)
from webapp.telemetry.services import MAX_BATCH_MS, MAX_BATCH_STEPS

TAG = "0a1b2c3d"


def polylines(svg: str) -> list[str]:
    return re.findall(r'<polyline points="([^"]*)"', svg)


def beat(telemetry: dict[str, Any]) -> Heartbeat:
    msg = parse({"type": "heartbeat", "telemetry": telemetry})
    assert isinstance(msg, Heartbeat)
    return msg


# -- the wire: what a heartbeat may carry ----------------------------------------------------------------


def test_a_heartbeat_with_a_window_and_prefills_parses_and_one_without_them_still_does() -> None:
    t = beat(
        {
            "window": {
                "seconds": 2.0,
                "batches": 5,
                "steps": 3.5,
                "tokens": 40.0,
                "wait_p50_ms": 1.0,
                "wait_p95_ms": 9.0,
            },
            "prefills": [{"session": TAG, "layer_start": 0, "layer_end": 10, "done": 100, "total": 512}],
        }
    ).telemetry
    assert t.window is not None and t.window.steps == 3.5 and t.prefills[0].done == 100
    old = beat({"sessions": 1}).telemetry  # an agent that predates the figures
    assert old.window is None and old.prefills == []


@pytest.mark.parametrize(
    "telemetry",
    [
        {
            "prefills": [{"session": TAG, "layer_start": 0, "layer_end": 4, "done": 1, "total": 2}]
            * (MAX_PREFILLS + 1)
        },
        {"prefills": [{"session": TAG, "layer_start": 0, "layer_end": 4, "done": 9, "total": 8}]},
        {"prefills": [{"session": TAG, "layer_start": 4, "layer_end": 4, "done": 0, "total": 8}]},
        {"prefills": [{"session": TAG, "layer_start": 0, "layer_end": 4, "done": -1, "total": 8}]},
        {"prefills": [{"session": "<script>", "layer_start": 0, "layer_end": 4, "done": 0, "total": 8}]},
        {"prefills": [{"session": TAG * 2, "layer_start": 0, "layer_end": 4, "done": 0, "total": 8}]},
        {"prefills": [{"session": TAG, "layer_start": 0, "layer_end": 4, "done": 1.5, "total": 8}]},
        {"prefills": {"session": TAG}},
        {"window": {"steps": float("nan")}},
        {"window": {"wait_p95_ms": float("inf")}},
        {"window": {"tokens": -1.0}},
        {"window": {"seconds": 1e9}},
        {"window": {"batches": True}},
    ],
)
def test_the_wire_refuses_malformed_or_oversized_plot_figures(telemetry: dict[str, Any]) -> None:
    with pytest.raises(ControlError):
        parse({"type": "heartbeat", "telemetry": telemetry})


# -- the ring kept on each node --------------------------------------------------------------------------


def test_a_point_clamps_what_the_wire_let_through_and_keeps_a_few_prefills() -> None:
    t = Telemetry(
        window=BatchWindow(steps=1e300, tokens=1e300, wait_p50_ms=1e300, wait_p95_ms=2.5),
        prefills=[
            Prefill(session=TAG, layer_start=0, layer_end=4, done=i, total=1 << 62)
            for i in range(MAX_PREFILLS)
        ],
    )
    p = heartbeat_point(t, 1700000000.123456)
    assert p[:5] == [1700000000.123, MAX_BATCH_STEPS, MAX_POSITIONS, MAX_BATCH_MS, 2.5]
    assert len(p[5]) == PREFILLS_KEPT and p[5][3] == [TAG, 0, 4, 3, MAX_POSITIONS]
    assert heartbeat_point(Telemetry(), 5.0) == [5.0, None, None, None, None, []], "not reported: gaps"


def test_the_ring_keeps_only_the_latest_points_and_drops_junk() -> None:
    ring: object = None
    for i in range(RECENT_POINTS + 7):
        ring = appended(ring, [float(i), 1, 1, 0, 0, []])
    assert isinstance(ring, list) and len(ring) == RECENT_POINTS and ring[0][0] == 7.0
    assert appended({"not": "a list"}, [1.0]) == [[1.0]]
    assert appended(["junk", 5, [0.0]], [1.0]) == [[0.0], [1.0]]


# -- the pure presenter: points to SVG ----------------------------------------------------------------------


def test_points_map_to_polyline_coordinates_inside_the_margin() -> None:
    coords = coordinates([(0.0, 0.0), (10.0, 5.0), (20.0, 10.0)], 0.0, 20.0, 10.0, width=120, height=28)
    assert coords == [(2.0, 26.0), (60.0, 14.0), (118.0, 2.0)]
    assert polyline_points(coords) == "2.0,26.0 60.0,14.0 118.0,2.0"
    svg = sparkline([Line([(0, 0), (10, 5), (20, 10)], floor=1.0)], "label")
    assert polylines(svg) == ["2.0,26.0 60.0,14.0 118.0,2.0"]


def test_an_empty_series_draws_no_line_and_a_single_point_a_dot_at_the_right() -> None:
    empty = sparkline([Line([])], "Queue wait: nothing yet")
    assert 'role="img"' in empty and 'aria-label="Queue wait: nothing yet"' in empty
    assert "<title>Queue wait: nothing yet</title>" in empty
    assert "<polyline" not in empty and "<circle" not in empty
    one = sparkline([Line([(100.0, 4.0)], floor=8.0)], "one")
    assert polylines(one) == [] and '<circle cx="118.0" cy="14.0"' in one
    same_time = coordinates([(5.0, 1.0), (5.0, 2.0)], 5.0, 5.0, 2.0)
    assert [x for x, _ in same_time] == [118.0, 118.0]


def test_hostile_values_are_clamped_or_dropped_and_never_leave_the_plot() -> None:
    assert finite(-5, 10.0) == 0.0 and finite(1e300, 10.0) == 10.0 and finite(float("inf"), 10.0) == 10.0
    assert finite(float("nan"), 10.0) is None and finite("3", 10.0) is None and finite(True, 10.0) is None
    raw = [
        (0, -5),
        (1, float("nan")),
        (2, 1e300),
        (float("inf"), 1),
        ("x", 1),
        (3, "7"),
        [4],
        (5, None),
        (6, 50),
    ]
    assert clean_points(raw, 100.0) == [(0.0, 0.0), (2.0, 100.0), (6.0, 50.0)]
    svg = sparkline([Line(raw, hi=100.0)], "hostile")
    (pts,) = polylines(svg)
    xs_ys = [tuple(map(float, p.split(","))) for p in pts.split()]
    assert all(2.0 <= x <= 118.0 and 2.0 <= y <= 26.0 for x, y in xs_ys)
    assert xs_ys[1][1] == 2.0, "1e300 drawn at the ceiling, the plot's top"
    # points whose time is outside the span asked for are drawn at its edge
    outside = coordinates([(-1e9, 1.0), (1e9, 1.0)], 0.0, 10.0, 1.0)
    assert [x for x, _ in outside] == [2.0, 118.0]


def test_too_many_points_or_lines_are_cut_to_the_latest() -> None:
    many = [(float(i), float(i % 7)) for i in range(MAX_POINTS * 10)]
    (pts,) = polylines(sparkline([Line(many)], "many"))
    assert len(pts.split()) == MAX_POINTS
    lines = [Line([(0, 1), (1, 2)]) for _ in range(MAX_LINES + 5)]
    assert len(polylines(sparkline(lines, "lines"))) == MAX_LINES


def test_the_label_is_escaped_and_lines_may_have_their_own_scale() -> None:
    svg = sparkline([Line([(0, 1), (1, 2)], colour='red" onload="x')], '<script>alert(1)</script> & "q"')
    assert "<script>" not in svg and "&lt;script&gt;" in svg and 'onload="x"' not in svg
    shared = polylines(sparkline([Line([(0, 1), (1, 2)]), Line([(0, 100), (1, 200)])], "s"))
    own = polylines(sparkline([Line([(0, 1), (1, 2)]), Line([(0, 100), (1, 200)])], "s", shared_scale=False))
    assert shared[0] == "2.0,25.9 118.0,25.8" and own[0] == own[1] == "2.0,14.0 118.0,2.0"


def test_a_nodes_ring_becomes_three_labelled_plots_with_the_latest_values() -> None:
    ring = [
        [1000.0, 2.0, 30.0, 0.5, 4.0, [[TAG, 0, 10, 512.0, 2000.0]]],
        [1002.0, 3.0, 45.0, 1.0, 6.0, [[TAG, 0, 10, 1024.0, 2000.0], ["ffffffff", 0, 10, 0.0, 300.0]]],
        [1004.0, 4.0, 52.0, 1.5, 9.5, [["ffffffff", 0, 10, 100.0, 300.0]]],
    ]
    plots = hop_plots(ring)
    assert plots is not None
    assert plots.batch.caption == "batch 4.0 steps · 52 pos" and "now 4.0 steps" in plots.batch.label
    assert plots.wait.caption == "wait p50 1.5 · p95 9.5 ms" and "p95 9.5 ms" in str(plots.wait.svg)
    assert plots.prefill.caption == "prefill: ffffffff [0:10) 100/300"
    assert len(polylines(plots.batch.svg)) == 2 and len(polylines(plots.wait.svg)) == 2
    # the finished session's line ends where it was last seen; the other has two points
    assert len(polylines(plots.prefill.svg)) == 2
    assert (
        hop_plots(None) is None
        and hop_plots([]) is None
        and hop_plots([["x"], 5, [float("nan")] * 6]) is None
    )


def test_an_agent_without_the_figures_gets_plots_that_say_so() -> None:
    plots = hop_plots([[1.0, None, None, None, None, []], [3.0, None, None, None, None, []]])
    assert (
        plots is not None and plots.batch.caption == "not reported" and plots.wait.caption == "not reported"
    )
    assert "not reported by this agent" in plots.batch.label and plots.prefill.caption == "prefill: none"
    assert polylines(plots.batch.svg) == []


def test_a_forged_ring_is_read_as_untrusted() -> None:
    ring = [
        [1.0, "3", {}, -4, 1e300, [["<b>", 0, 1, 5, 4], "junk", [TAG, 0, 1, float("nan"), 2]]],
        [2.0, 1.0, 2.0, 3.0, 4.0, "not a list"],
        "junk",
        [float("nan"), 1, 1, 1, 1, []],
    ]
    plots = hop_plots(ring)
    assert plots is not None and plots.prefill.caption == "prefill: none"
    assert "<b>" not in str(plots.prefill.svg) and polylines(plots.prefill.svg) == []
    assert plots.batch.caption == "batch 1.0 steps · 2 pos"
    assert polylines(plots.batch.svg) == [] and str(plots.batch.svg).count("<circle") == 2
    (p50, p95) = polylines(plots.wait.svg)
    for pts in (p50, p95):
        assert all(2.0 <= float(v) <= 118.0 for xy in pts.split() for v in xy.split(","))


# -- the page and the row ----------------------------------------------------------------------------------


def busy_telemetry(done: int) -> Telemetry:
    return Telemetry(
        sessions=3,
        window=BatchWindow(seconds=2.0, batches=12, steps=3.0, tokens=40.0, wait_p50_ms=1.5, wait_p95_ms=8.5),
        prefills=[Prefill(session=TAG, layer_start=0, layer_end=12, done=done, total=2000)],
    )


def row_of(page: str, node_id: str) -> str:
    row = page[page.index(f'id="node-{node_id}"') :]
    return row[: row.index("</tr>")]


@pytest.mark.django_db
def test_heartbeats_fill_a_bounded_ring_on_the_node() -> None:
    node = Node.objects.create(name="ringed", state=Node.State.ONLINE)
    for i in range(RECENT_POINTS + 3):
        services.apply_heartbeat(node.id, busy_telemetry(min(16 * i, 2000)))
    node.refresh_from_db()
    assert len(node.recent) == RECENT_POINTS
    assert node.recent[-1][1:5] == [3.0, 40.0, 1.5, 8.5] and node.recent[-1][5][0][:2] == [TAG, 0]


@pytest.mark.django_db
def test_the_fleet_page_and_its_htmx_fragment_plot_batch_size_queue_wait_and_prefill(
    staff_client: Any,
) -> None:
    busy = Node.objects.create(name="busy", state=Node.State.ONLINE)
    quiet = Node.objects.create(name="quiet", state=Node.State.ONLINE)
    for done in (512, 1024, 1536):
        services.apply_heartbeat(busy.id, busy_telemetry(done))
    page = staff_client.get("/fleet/").content.decode()
    assert "Per hop, recent" in page
    row = row_of(page, busy.id)
    assert row.count('<svg class="spark" role="img"') == 3
    assert (
        'aria-label="Batch size per backend call' in row
        and "now 3.0 steps of distinct sessions, 40 positions" in row
    )
    assert "wait p50 1.5 · p95 8.5 ms" in row
    assert f"prefill: {TAG} [0:12) 1,536/2,000" in row
    assert len(polylines(row)) == 5, "2 batch lines, 2 wait lines, 1 session"
    assert "no heartbeat yet" in row_of(page, quiet.id)
    fragment = staff_client.get("/fleet/", HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in fragment and row_of(fragment, busy.id).count('class="spark"') == 3


@pytest.mark.django_db
def test_the_row_the_fleet_socket_pushes_after_a_heartbeat_carries_the_plots() -> None:
    node = Node.objects.create(name="pushed", state=Node.State.ONLINE)
    services.apply_heartbeat(node.id, busy_telemetry(100))
    html = _render_node_row(node.id)
    assert html.startswith('<tr hx-swap-oob="outerHTML" ') and html.count('class="spark"') == 3
    assert f"{TAG} [0:12) 100/2,000" in html and '<circle cx="118.0"' in html, "one point so far: a dot"
