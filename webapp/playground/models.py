"""Playground models (none: conversations are RouteSession rows, answers GenerationRecord rows)."""
