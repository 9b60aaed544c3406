"""GGUF Swarm control plane: a Django project with one app per domain."""

from __future__ import annotations

from webapp.celery_app import app as celery_app

__all__ = ["celery_app"]
