"""Telemetry: per-answer generation records and downsampled node samples."""
