"""Login throttling and lockout for every password login (the login page and the Django admin).

A small equivalent of django-axes (which needs `request` passed to every authenticate() call and its
own tables): failed logins are counted in the cache per (username, client address) and per username,
and past the limits every attempt is refused before the password is even checked, the right one
included, until the window passes. Counting per pair keeps one attacker from locking everyone out of
an account cheaply; the per-username ceiling stops a distributed guess. docs/security.md, "Login
brute force".

`WindowCounter` counts other events in fixed windows (API requests per key and per user, key
creation, tracker announces per node): docs/security.md, "Limits per user" and "Tracker poisoning".
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth.backends import BaseBackend, ModelBackend
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.core.cache import cache
from django.core.exceptions import PermissionDenied
from django.dispatch import receiver
from django.http import HttpRequest


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


# -- fixed-window request counters (API keys and users, tracker announces: issue 33) -----------------
class WindowCounter:
    """Fixed windows of `window_s` seconds per name: in Redis when REDIS_URL is set (shared by every
    web process), else in this process. `hit` counts one event and says how long to wait when it is
    over the limit."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, int], tuple[int, int]] = {}
        self._redis: Any = None
        self.clock: Callable[[], float] = time.time

    def _client(self) -> Any:
        if self._redis is None:
            import redis

            self._redis = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2)
        return self._redis

    def count(self, name: str, window_s: int = 60, now: float | None = None) -> int:
        """Count one event under `name`; returns the window's count so far, this one included."""
        window = int((self.clock() if now is None else now) // window_s)
        if settings.REDIS_URL:
            prefix = settings.TRACKER_REDIS_PREFIX.rsplit(":", 1)[0]
            key = f"{prefix}:{self.namespace}:{name}:{window}" + (f":{window_s}" if window_s != 60 else "")
            pipe = self._client().pipeline()
            pipe.incr(key)
            pipe.expire(key, 2 * window_s)
            return int(pipe.execute()[0])
        with self._lock:
            start, n = self._windows.get((name, window_s), (window, 0))
            n = n + 1 if start == window else 1
            self._windows[(name, window_s)] = (window, n)
            if len(self._windows) > 100_000:  # forget finished windows
                self._windows = {k: v for k, v in self._windows.items() if v[0] == window}
            return n

    def hit(self, name: str | int, limit: int, window_s: int = 60) -> float:
        """Count one event; 0 when it is within `limit` per window, else the seconds until the window
        resets (at least 1)."""
        now = self.clock()
        if self.count(str(name), window_s, now) <= limit:
            return 0.0
        return max(1.0, (int(now // window_s) + 1) * window_s - now)
