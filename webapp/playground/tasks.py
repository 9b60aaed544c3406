"""Playground tasks (none yet)."""
