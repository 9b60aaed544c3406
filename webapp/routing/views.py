"""Routing views (none yet: its data is shown on the fleet and playground pages)."""
