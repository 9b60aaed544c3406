"""Inline SVG sparklines built server-side: series of (time, value) to polyline coordinates, clamped."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT, PAD = 120, 28, 2
MAX_POINTS = 600  # drawn per line: only the latest beyond (a plot this small shows no more anyway)
MAX_LINES = 8  # lines per plot; the rest are left out

Point = tuple[float, float]  # (unix seconds, value)


def finite(value: object, hi: float) -> float | None:
    """`value` as a float in [0, hi]: below 0 is 0, above `hi` (infinity too) is `hi`; None for NaN and
    anything that is not a number (a bool, a string, None), which the plot leaves out."""
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        return None
    return min(max(float(value), 0.0), hi)


@dataclass(frozen=True)
class Line:
    """One series of a plot: its points (as stored: anything), how it is drawn and its ceiling."""

    points: Sequence[Sequence[object]]
    colour: str = "currentColor"
    dashed: bool = False
    hi: float = 1e12  # a value above this is drawn at it
    floor: float = 1.0  # the plot's top is never below this (noise near 0 must not fill the height)


def clean_points(raw: Sequence[Sequence[object]], hi: float) -> list[Point]:
    """The latest MAX_POINTS plottable points of `raw`, by time: pairs with a finite time and a number
    (clamped into [0, hi]); anything else is dropped."""
    out: list[Point] = []
    for p in list(raw)[-MAX_POINTS:]:
        if not isinstance(p, list | tuple) or len(p) != 2:
            continue
        t, v = p
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t):
            continue
        y = finite(v, hi)
        if y is not None:
            out.append((float(t), y))
    out.sort(key=lambda p: p[0])
    return out


def coordinates(
    points: Sequence[Point],
    t0: float,
    t1: float,
    top: float,
    width: int = WIDTH,
    height: int = HEIGHT,
) -> list[tuple[float, float]]:
    """SVG coordinates of `points`: time from t0 (left) to t1 (right), value from 0 (bottom) to `top`,
    inside a PAD margin. A zero time span puts every point at the right (the latest), and nothing lands
    outside the plot, whatever the values."""
    span = t1 - t0
    inner_w, inner_h = width - 2 * PAD, height - 2 * PAD
    out = []
    for t, v in points:
        fx = (t - t0) / span if span > 0 else 1.0
        fy = v / top if top > 0 else 0.0
        x = PAD + inner_w * min(max(fx, 0.0), 1.0)
        y = height - PAD - inner_h * min(max(fy, 0.0), 1.0)
        out.append((round(x, 1), round(y, 1)))
    return out


def polyline_points(coords: Sequence[tuple[float, float]]) -> str:
    """The `points` attribute of an SVG polyline."""
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)


def _top(lines: Sequence[tuple[Line, list[Point]]]) -> float:
    """The value at the plot's top: the largest point, never below the lines' floor."""
    floor = max((line.floor for line, _ in lines), default=1.0)
    peak = max((v for _, pts in lines for _, v in pts), default=0.0)
    return max(peak, floor)


def sparkline(
    lines: Sequence[Line],
    label: str,
    span: tuple[float, float] | None = None,
    shared_scale: bool = True,
    width: int = WIDTH,
    height: int = HEIGHT,
) -> SafeString:
    """An inline, accessible SVG of `lines` (at most MAX_LINES) over `span` (unix seconds; default the
    points' own), labelled `label` (its title and aria-label: the latest values in words). Lines share
    one scale, or each gets its own (`shared_scale=False`: two units on one plot, named in the label)."""
    cleaned = [(line, clean_points(line.points, line.hi)) for line in lines[:MAX_LINES]]
    times = [t for _, pts in cleaned for t, _ in pts]
    t0, t1 = span if span is not None else (min(times, default=0.0), max(times, default=0.0))
    shared = _top(cleaned)
    text = escape(label)
    parts = [
        f'<svg class="spark" role="img" aria-label="{text}" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg"><title>{text}</title>',
        f'<line class="spark-axis" x1="{PAD}" y1="{height - PAD}" x2="{width - PAD}" y2="{height - PAD}"/>',
    ]
    for line, pts in cleaned:
        top = shared if shared_scale else _top([(line, pts)])
        coords = coordinates(pts, t0, t1, top, width, height)
        colour = escape(line.colour)
        if len(coords) == 1:
            (x, y) = coords[0]
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.5" fill="{colour}"/>')
        elif coords:
            dash = ' stroke-dasharray="3 2"' if line.dashed else ""
            parts.append(
                f'<polyline points="{polyline_points(coords)}" fill="none" stroke="{colour}" '
                f'stroke-width="1.5"{dash}/>'
            )
    parts.append("</svg>")
    # safe: every text in it went through escape(), and the rest is numbers this function formatted
    return mark_safe("".join(parts))
