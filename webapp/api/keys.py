"""API key services: minting (secret shown once), bearer authentication, rate limits per key and per
user (every key of a user shares the owner's budget), caps on keys per user, usage counts."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import F, Sum
from django.utils import timezone

from webapp.api.models import ApiKey, ApiUsage
from webapp.core.throttle import WindowCounter
from webapp.env import envint

KEY_PREFIX = "sk-swarm-"
PREFIX_SHOWN = len(KEY_PREFIX) + 6
# The default and the most a user may choose for a key; the admin may set any value on a key.
MAX_RATE_PER_MIN = envint("API_KEY_RATE_PER_MIN", 60, minimum=1)


def hash_key(plain: str) -> str:
    # Keys are 256 random bits: a fast hash is enough (nothing to brute-force), and lookup stays O(1).
    return hashlib.sha256(plain.encode()).hexdigest()


def create_key(user: Any, name: str, rate_limit_per_min: int | None = None) -> tuple[str, ApiKey]:
    """A new key for `user`; returns (the plain key, to show once, and the stored row)."""
    plain = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(
        user=user,
        name=name.strip()[:100] or "key",
        prefix=plain[:PREFIX_SHOWN],
        hashed=hash_key(plain),
        rate_limit_per_min=rate_limit_per_min or MAX_RATE_PER_MIN,
    )
    return plain, key


def revoke_key(user: Any, key_id: int) -> bool:
    """Revoke one of `user`'s keys (takes effect on the next request); False if there is none."""
    n = ApiKey.objects.filter(pk=key_id, user=user, revoked_at__isnull=True).update(revoked_at=timezone.now())
    return n == 1


def authenticate(authorization: str) -> ApiKey | None:
    """The active key named by an `Authorization: Bearer <key>` header, or None."""
    scheme, _, plain = authorization.partition(" ")
    plain = plain.strip()
    if scheme.lower() != "bearer" or not plain.startswith(KEY_PREFIX):
        return None
    key = (
        ApiKey.objects.select_related("user")
        .filter(hashed=hash_key(plain), revoked_at__isnull=True, user__is_active=True)
        .first()
    )
    if key is not None:
        ApiKey.objects.filter(pk=key.pk).update(last_used=timezone.now())
    return key


class RateLimiter(WindowCounter):
    """Sliding one-minute windows per key (`hit(key.pk, ...)`) and per user (`hit(f"user:{id}", ...)`):
    in Redis when REDIS_URL is set (shared by every web process), else in this process."""

    def __init__(self) -> None:
        super().__init__("api-rate")


rate_limiter = RateLimiter()


def user_limit_per_min() -> int:
    """Requests a minute for all of one user's keys together (`API_USER_RATE_PER_MIN`)."""
    return int(settings.API_USER_RATE_PER_MIN)


def hit_user(user_id: int) -> float:
    """Count one request against the user's budget; 0 if allowed, else seconds until one is."""
    return rate_limiter.hit(f"user:{user_id}", user_limit_per_min())


class KeyLimit(Exception):
    """A user may not create another key now; str(e) says why."""


def check_new_key(user: Any) -> None:
    """Raise KeyLimit when `user` holds `API_KEYS_PER_USER` active keys or has created
    `API_KEY_CREATES_PER_HOUR` keys in this hour (each call counts one creation): keys share their
    owner's budgets, and creating them is bounded too."""
    most = int(settings.API_KEYS_PER_USER)
    if ApiKey.objects.filter(user=user, revoked_at__isnull=True).count() >= most:
        raise KeyLimit(f"you have {most} active keys, the most one user may hold; revoke one first")
    per_hour = int(settings.API_KEY_CREATES_PER_HOUR)
    if key_creations.hit(user.pk, per_hour, 3600):
        raise KeyLimit(f"you created {per_hour} keys in this hour, the most one user may; try again later")


key_creations = WindowCounter("api-key-create")


def record_usage(key_id: int, tokens_in: int, tokens_out: int) -> None:
    """Add one request's tokens to the key's row for today (UTC)."""
    day = timezone.now().date()
    row, _ = ApiUsage.objects.get_or_create(key_id=key_id, day=day)
    ApiUsage.objects.filter(pk=row.pk).update(
        requests=F("requests") + 1,
        tokens_in=F("tokens_in") + tokens_in,
        tokens_out=F("tokens_out") + tokens_out,
    )


def usage_today(keys: list[ApiKey]) -> dict[int, ApiUsage]:
    day = timezone.now().date()
    return {u.key_id: u for u in ApiUsage.objects.filter(key__in=keys, day=day)}


def usage_by_day(user: Any, days: int = 14) -> list[dict[str, Any]]:
    """The user's tokens per day over all their keys, newest first."""
    since = timezone.now().date() - timedelta(days=days - 1)
    return list(
        ApiUsage.objects.filter(key__user=user, day__gte=since)
        .values("day")
        .annotate(requests=Sum("requests"), tokens_in=Sum("tokens_in"), tokens_out=Sum("tokens_out"))
        .order_by("-day")
    )
