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
