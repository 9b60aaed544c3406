"""The fleet page's per-hop plots: a bounded ring of heartbeat points on each node, drawn as sparklines."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.utils.safestring import SafeString

from webapp.fleet.sparkline import Line, finite, sparkline
from webapp.telemetry.services import MAX_BATCH_MS, MAX_BATCH_STEPS, bounded

if TYPE_CHECKING:
    from agent.wire.control import Telemetry

# Node.recent keeps the last RECENT_POINTS heartbeats (3 minutes at the default 2 s), each
# [unix time, steps per call, positions per call, wait p50 ms, wait p95 ms, prefills]; a prefill is
# [session tag, layer_start, layer_end, positions done, positions in all]. The time is the control
# plane's own clock; figures are None when the agent predates them (the plot leaves a gap).
RECENT_POINTS = 90
PREFILLS_KEPT = 8  # per point: prompts beyond these are not drawn (the wire allows 16)
MAX_POSITIONS = float(1 << 20)  # per backend call or per session; more is a lie, drawn at this
PREFILL_COLOURS = 8
ACCENT, WARN, BAD = "#2b6cb0", "#b7791f", "#c53030"  # app.css's --accent, --warn and --bad
_FIELDS = 5  # time and four figures before the prefills
_TAG = re.compile(r"[0-9a-f]{8}")  # agent.wire.control.SessionTag


def heartbeat_point(t: Telemetry, at: float) -> list[Any]:
    """The ring's point for heartbeat `t` received at `at` (unix seconds): every figure clamped to a
    ceiling, at most PREFILLS_KEPT prompts, so one node's lies stay within its own plots."""
    w = t.window
    figures: list[float | None] = (
        [
            bounded(w.steps, MAX_BATCH_STEPS),
            bounded(w.tokens, MAX_POSITIONS),
            bounded(w.wait_p50_ms, MAX_BATCH_MS),
            bounded(w.wait_p95_ms, MAX_BATCH_MS),
        ]
        if w is not None
        else [None, None, None, None]
    )
    prefills = [
        [p.session, p.layer_start, p.layer_end, min(p.done, MAX_POSITIONS), min(p.total, MAX_POSITIONS)]
        for p in t.prefills[:PREFILLS_KEPT]
    ]
    return [round(at, 3), *figures, prefills]


def appended(ring: object, point: list[Any], limit: int = RECENT_POINTS) -> list[list[Any]]:
    """`ring` (as stored: anything) with `point` added and only the latest `limit` points kept."""
    kept = [p for p in ring if isinstance(p, list)] if isinstance(ring, list) else []
    return [*kept, point][-max(1, limit) :]


@dataclass(frozen=True)
class Plot:
    """One sparkline and its latest values in words (a short caption; the long form is its label)."""

    svg: SafeString
    caption: str
    label: str


@dataclass(frozen=True)
class HopPlots:
    """A node's three plots over its recent heartbeats."""

    batch: Plot
    wait: Plot
    prefill: Plot
    minutes: float


def _points(ring: object) -> list[list[Any]]:
    """The ring's well-formed points (a finite time and room for every field), latest RECENT_POINTS."""
    if not isinstance(ring, list):
        return []
    out = []
    for p in ring[-RECENT_POINTS:]:
        if not isinstance(p, list) or len(p) < _FIELDS:
            continue
        t = p[0]
        if isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t):
            out.append(p)
    return out


def _series(points: Sequence[list[Any]], i: int) -> list[tuple[Any, Any]]:
    return [(p[0], p[i]) for p in points]


def _latest(points: Sequence[list[Any]], i: int, hi: float) -> float | None:
    """The newest point's figure `i` (None when it is not reported)."""
    return finite(points[-1][i], hi) if points else None


def _prefills(p: list[Any]) -> list[tuple[str, int, int, float, float]]:
    """A point's prefills that have the stored shape, at most PREFILLS_KEPT."""
    raw = p[_FIELDS] if len(p) > _FIELDS and isinstance(p[_FIELDS], list) else []
    out = []
    for e in raw[:PREFILLS_KEPT]:
        if not (isinstance(e, list) and len(e) == 5 and isinstance(e[0], str) and _TAG.fullmatch(e[0])):
            continue
        a, b = finite(e[1], MAX_POSITIONS), finite(e[2], MAX_POSITIONS)
        done, total = finite(e[3], MAX_POSITIONS), finite(e[4], MAX_POSITIONS)
        if a is None or b is None or done is None or total is None:
            continue
        out.append((e[0], int(a), int(b), min(done, total), total))
    return out


def _colour(i: int) -> str:
    return f"hsl({(i % PREFILL_COLOURS) * 137 % 360} 60% 40%)"  # app.js's palette


def _two_lines(
    points: Sequence[list[Any]],
    span: tuple[float, float],
    cols: tuple[tuple[int, str, float], tuple[int, str, float]],
    title: str,
    describe: tuple[str, str, str],
    shared_scale: bool = True,
) -> Plot:
    """A plot of two of the points' columns ((index, colour, ceiling): solid, then dashed) titled
    `title`; `describe` = (what the lines are, the caption and the label's "now" text, each formatted
    with the latest two values as a and b)."""
    (ia, ca, ha), (ib, cb, hb) = cols
    a, b = _latest(points, ia, ha), _latest(points, ib, hb)
    if a is None or b is None:
        caption = "not reported"
        label = f"{title}: not reported by this agent"
    else:
        caption = describe[1].format(a=a, b=b)
        label = f"{title} ({describe[0]}): " + describe[2].format(a=a, b=b)
    lines = [Line(_series(points, ia), ca, hi=ha), Line(_series(points, ib), cb, dashed=True, hi=hb)]
    return Plot(sparkline(lines, label, span, shared_scale=shared_scale), caption, label)


def _batch_plot(points: Sequence[list[Any]], span: tuple[float, float], minutes: float) -> Plot:
    return _two_lines(
        points,
        span,
        ((1, ACCENT, MAX_BATCH_STEPS), (2, WARN, MAX_POSITIONS)),
        f"Batch size per backend call, last {minutes:.0f} min",
        (
            "steps solid, positions dashed, each on its own scale",
            "batch {a:.1f} steps · {b:.0f} pos",
            "now {a:.1f} steps of distinct sessions, {b:.0f} positions",
        ),
        shared_scale=False,
    )


def _wait_plot(points: Sequence[list[Any]], span: tuple[float, float], minutes: float) -> Plot:
    return _two_lines(
        points,
        span,
        ((3, ACCENT, MAX_BATCH_MS), (4, BAD, MAX_BATCH_MS)),
        f"Queue wait for a batch, last {minutes:.0f} min",
        ("p50 solid, p95 dashed", "wait p50 {a:.1f} · p95 {b:.1f} ms", "now p50 {a:.1f} ms, p95 {b:.1f} ms"),
    )


def _prefill_plot(points: Sequence[list[Any]], span: tuple[float, float], minutes: float) -> Plot:
    # by session and shard: a node holding two ranges of one route prefills the prompt on each
    by_session: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for p in points:
        for tag, a, b, done, _ in _prefills(p):
            by_session.setdefault((tag, a, b), []).append((p[0], done))
    # the sessions seen last are the ones drawn when there are more than a plot holds
    tags = list(by_session)[-PREFILLS_KEPT:]
    now = _prefills(points[-1]) if points else []
    words = [f"{tag} [{a}:{b}) {done:,.0f}/{total:,.0f}" for tag, a, b, done, total in now]
    more = f" +{len(words) - 2}" if len(words) > 2 else ""
    caption = "prefill: " + (", ".join(words[:2]) + more if words else "none")
    label = f"Prefill progress per session, last {minutes:.0f} min (positions done on this hop): " + (
        "; ".join(words) if words else "no prompt prefilling now"
    )
    top = max((total for p in points for *_, total in _prefills(p)), default=1.0)
    lines = [
        Line(by_session[tag], _colour(i), hi=MAX_POSITIONS, floor=max(top, 1.0)) for i, tag in enumerate(tags)
    ]
    return Plot(sparkline(lines, label, span), caption, label)


def hop_plots(ring: object) -> HopPlots | None:
    """The batch size, queue wait and prefill plots of a node's ring (Node.recent); None without points.
    The ring is read as untrusted: malformed points and figures are dropped, the rest clamped."""
    points = _points(ring)
    if not points:
        return None
    points.sort(key=lambda p: p[0])
    span = (float(points[0][0]), float(points[-1][0]))
    minutes = max(1.0, (span[1] - span[0]) / 60)
    return HopPlots(
        _batch_plot(points, span, minutes),
        _wait_plot(points, span, minutes),
        _prefill_plot(points, span, minutes),
        minutes,
    )
