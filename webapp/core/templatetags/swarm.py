"""Template filters for the dashboard: human byte sizes and percentages."""

from __future__ import annotations

from typing import Any

from django import template

register = template.Library()


@register.filter(name="bytes")
def human_bytes(value: Any) -> str:
    try:
        n = float(value)
    except (TypeError, ValueError):
        return "–"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@register.filter(name="pct")
def pct(value: Any) -> str:
    try:
        return f"{100 * float(value):.0f}%"
    except (TypeError, ValueError):
        return "–"


@register.filter(name="transfer_line")
def transfer_line(t: Any) -> str:
    """A shard download report in words: MB done/needed, rate, peers and where the bytes came from."""
    if not isinstance(t, dict) or not t.get("wanted_bytes"):
        return ""
    src = float(t.get("peer_bytes", 0)) + float(t.get("web_seed_bytes", 0))
    peer_pct = 100 * float(t.get("peer_bytes", 0)) / src if src else 0.0
    via = f" · from peers {peer_pct:.0f}%, web seed {100 - peer_pct:.0f}%" if src else ""
    if t.get("source") == "http":
        via = " · HTTP (no swarm)"
    return (
        f"{human_bytes(t.get('done_bytes', 0))} / {human_bytes(t['wanted_bytes'])}"
        f" · {human_bytes(t.get('rate_bytes_per_s', 0))}/s · {int(t.get('peers', 0))} peers{via}"
    )
