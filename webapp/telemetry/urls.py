"""Telemetry URLs (none yet: its data is shown on the fleet and playground pages)."""

from __future__ import annotations

app_name = "telemetry"
urlpatterns: list[object] = []
