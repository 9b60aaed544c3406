"""Access helpers: staff-only views answer 403 to logged-in non-staff and send others to log in."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from django_htmx.middleware import HtmxDetails


class HtmxHttpRequest(HttpRequest):
    """An HttpRequest as seen after django-htmx's middleware."""

    htmx: HtmxDetails


View = Callable[..., HttpResponse]


def staff_required(view: View) -> View:
    """Staff only: anonymous users are sent to log in, everyone else gets 403."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not request.user.is_staff:
            return HttpResponseForbidden("staff only")
        return view(request, *args, **kwargs)

    return wrapper


def login_required_403(view: View) -> View:
    """Logged-in users only; anonymous users are sent to log in."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        return view(request, *args, **kwargs)

    return wrapper
