"""Core has no models."""
