"""Login forms and view that say "locked out" (HTTP 429) instead of "wrong password" past the limit."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.core.exceptions import ValidationError
from django.http import HttpResponse

from webapp.core.throttle import locked_out


def _lockout_message() -> str:
    return f"Too many failed logins: try again in {settings.LOGIN_LOCKOUT_S // 60} minutes."


class _Throttled:
    """Mixin for Django's authentication forms: refuse a locked-out username before authenticating."""

    request: Any
    data: Any
    locked = False

    def clean(self) -> dict[str, Any]:
        username = self.data.get("username") if self.data else None
        if isinstance(username, str) and locked_out(username, self.request):
            self.locked = True
            raise ValidationError(_lockout_message(), code="locked_out")
        return super().clean()  # type: ignore[misc]  # the form class it is mixed into


class ThrottledAuthenticationForm(_Throttled, AuthenticationForm):
    """The login page's form."""


class ThrottledAdminAuthenticationForm(_Throttled, AdminAuthenticationForm):
    """The Django admin's login form."""


class ThrottledLoginView(LoginView):
    """The login page: 429 with the lockout message while locked out."""

    form_class = ThrottledAuthenticationForm

    def form_invalid(self, form: Any) -> HttpResponse:
        response = super().form_invalid(form)
        if getattr(form, "locked", False):
            response.status_code = 429
        return response
