"""The web's own Redis clients (rate windows, answer leases, the tracker's peers): each call bounded."""

from __future__ import annotations

from typing import Any

from django.conf import settings

# Reads and connects (redis-py waits 5 s by default, and a Redis that accepts and never answers held a
# caller that long each time): every caller answers a RedisError itself (503, failure reason, logged).
REDIS_TIMEOUT_S = 2.0


def bounded_redis() -> Any:
    """A client of settings.REDIS_URL whose every call gives up after REDIS_TIMEOUT_S."""
    import redis

    return redis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
    )
