"""Login throttling and lockout for every password login (the login page and the Django admin).

A small equivalent of django-axes (which needs `request` passed to every authenticate() call and its
own tables): failed logins are counted in the cache per (username, client address) and per username,
and past the limits every attempt is refused before the password is even checked, the right one
included, until the window passes. Counting per pair keeps one attacker from locking everyone out of
an account cheaply; the per-username ceiling stops a distributed guess. docs/security.md, "Login
brute force".

`WindowCounter` limits other events in sliding windows (API requests per key and per user, key
creation, tracker announces per node): docs/security.md, "Limits per user" and "Tracker poisoning".
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth.backends import BaseBackend, ModelBackend
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.core.cache import cache
from django.core.exceptions import PermissionDenied
from django.dispatch import receiver
from django.http import HttpRequest

from webapp.core.redisconn import bounded_redis


class LockedOut(PermissionDenied):
    """Too many failed logins for this username (from this address); says for how long."""


def _client(request: HttpRequest | None) -> str:
    return str(request.META.get("REMOTE_ADDR", "")) if request is not None else ""


def _keys(username: str, request: HttpRequest | None) -> tuple[str, str]:
    user = hashlib.sha256(username.strip().lower().encode()).hexdigest()[:32]
    return f"login-fail:pair:{user}:{_client(request)}", f"login-fail:user:{user}"


def locked_out(username: str, request: HttpRequest | None) -> bool:
    """True while this username (from this address, or from everywhere) is over its failure limit."""
    pair, user = _keys(username, request)
    return int(cache.get(pair, 0)) >= settings.LOGIN_FAILURE_LIMIT or int(cache.get(user, 0)) >= (
        settings.LOGIN_FAILURE_LIMIT_PER_USER
    )


def record_failure(username: str, request: HttpRequest | None) -> None:
    window = settings.LOGIN_LOCKOUT_S
    for key in _keys(username, request):
        # add() starts the window on the first failure; incr() keeps its expiry.
        if not cache.add(key, 1, window):
            try:
                cache.incr(key)
            except ValueError:  # expired between add() and incr()
                cache.add(key, 1, window)


def clear(username: str, request: HttpRequest | None) -> None:
    cache.delete(_keys(username, request)[0])


class ThrottleBackend(BaseBackend):
    """First in AUTHENTICATION_BACKENDS: refuses a locked-out username before any password check."""

    def authenticate(self, request: HttpRequest | None, username: str | None = None, **kwargs: Any) -> None:
        if username is not None and locked_out(username, request):
            raise LockedOut(f"too many failed logins; try again in {settings.LOGIN_LOCKOUT_S // 60} minutes")
        return None  # not locked: the next backend checks the password

    def get_user(self, user_id: Any) -> Any:
        # force_login() and sessions may name this backend (it is listed first): load users as Django does.
        return ModelBackend().get_user(user_id)


@receiver(user_login_failed)
def _failed(sender: Any, credentials: dict[str, Any], request: HttpRequest | None = None, **_: Any) -> None:
    username = credentials.get("username")
    if isinstance(username, str):
        record_failure(username, request)


@receiver(user_logged_in)
def _succeeded(sender: Any, request: HttpRequest | None, user: Any, **_: Any) -> None:
    clear(user.get_username(), request)


# -- sliding-window request limits (API keys and users, key creation, tracker announces: issue 33) -----
# One sorted set of admitted events' times per name: drop those older than the window, admit when fewer
# than the limit remain, else answer how long until the oldest leaves it. Atomic in one script, so
# concurrent web processes never admit past the limit.
_SLIDING = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[2]))
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4])
  redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000))
  return '0'
end
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return tostring(tonumber(oldest[2]) + tonumber(ARGV[2]) - tonumber(ARGV[1]))
"""


class WindowCounter:
    """At most `limit` events per name in any `window_s` seconds (a sliding log, not clock windows: a
    burst across a minute's end cannot pass twice the limit). In Redis when REDIS_URL is set (shared by
    every web process), else in this process. Only admitted events are logged, so a client that keeps
    knocking while refused is let in again as soon as its earlier requests age out."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._lock = threading.Lock()
        self._logs: dict[tuple[str, int], deque[float]] = {}
        self._redis: Any = None
        self._script: Any = None
        self.clock: Callable[[], float] = time.time

    def _run_script(self, key: str, now: float, window_s: int, limit: int) -> float:
        if self._script is None:
            self._redis = bounded_redis()
            self._script = self._redis.register_script(_SLIDING)
        member = f"{now!r}:{uuid.uuid4().hex}"
        return float(self._script(keys=[key], args=[repr(now), window_s, limit, member]))

    def hit(self, name: str | int, limit: int, window_s: int = 60, now: float | None = None) -> float:
        """Admit one event under `name` if fewer than `limit` were admitted in the last `window_s`
        seconds: 0.0 when admitted, else the seconds until one is (at least 1)."""
        now = self.clock() if now is None else now
        if limit <= 0:
            return float(window_s)
        if settings.REDIS_URL:
            prefix = settings.TRACKER_REDIS_PREFIX.rsplit(":", 1)[0]
            wait = self._run_script(f"{prefix}:{self.namespace}:{name}:{window_s}", now, window_s, limit)
        else:
            wait = self._hit_here((str(name), window_s), now, window_s, limit)
        return 0.0 if wait <= 0 else max(1.0, wait)

    def _hit_here(self, key: tuple[str, int], now: float, window_s: int, limit: int) -> float:
        with self._lock:
            log = self._logs.setdefault(key, deque())
            while log and log[0] <= now - window_s:
                log.popleft()
            if len(log) < limit:
                log.append(now)
                if len(self._logs) > 100_000:  # forget names with nothing left in their window
                    self._logs = {k: v for k, v in self._logs.items() if v and v[-1] > now - k[1]}
                return 0.0
            return log[0] + window_s - now
