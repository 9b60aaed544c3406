"""Login throttling and lockout for every password login (the login page and the Django admin).

A small equivalent of django-axes (which needs `request` passed to every authenticate() call and its
own tables): failed logins are counted in the cache per (username, client address) and per username,
and past the limits every attempt is refused before the password is even checked, the right one
included, until the window passes. Counting per pair keeps one attacker from locking everyone out of
an account cheaply; the per-username ceiling stops a distributed guess. docs/security.md, "Login
brute force".
"""

from __future__ import annotations

import hashlib
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
