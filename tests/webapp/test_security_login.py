"""Issue 17, login brute force: 30 wrong admin passwords in 8 s went through with no lockout.

Now failures are counted per (username, address) and per username; past the limit every attempt is
refused before the password is checked, the right one included, on the login page and the admin.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.core.cache import cache

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_counters(settings: Any) -> Iterator[None]:
    """Counters in a cache of this test's own (clearing a shared Redis would hit other runs)."""
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "lockout-tests"}
    }
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def admin_user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_superuser("root", password="right-password-123")


def login(client: Any, password: str, url: str = "/accounts/login/", **extra: Any) -> Any:
    return client.post(url, {"username": "root", "password": password}, **extra)


def test_thirty_wrong_passwords_lock_out_even_the_right_one(
    client: Any, admin_user: Any, settings: Any
) -> None:
    codes = [login(client, f"guess-{i}").status_code for i in range(30)]
    assert codes[: settings.LOGIN_FAILURE_LIMIT] == [200] * settings.LOGIN_FAILURE_LIMIT  # "wrong password"
    assert set(codes[settings.LOGIN_FAILURE_LIMIT :]) == {429}
    r = login(client, "right-password-123")
    assert r.status_code == 429 and b"Too many failed logins" in r.content
    assert "_auth_user_id" not in client.session


def test_the_django_admin_login_is_locked_out_too(client: Any, admin_user: Any) -> None:
    for i in range(30):
        login(client, f"guess-{i}", "/admin/login/")
    r = login(client, "right-password-123", "/admin/login/")
    assert r.status_code == 200 and b"Too many failed logins" in r.content
    assert "_auth_user_id" not in client.session


def test_the_lockout_is_per_address_so_an_attacker_does_not_lock_the_owner_out(
    client: Any, admin_user: Any
) -> None:
    for i in range(30):
        login(client, f"guess-{i}", REMOTE_ADDR="203.0.113.9")
    r = login(client, "right-password-123", REMOTE_ADDR="198.51.100.7")
    assert r.status_code == 302 and client.session["_auth_user_id"] == str(admin_user.pk)


def test_a_distributed_guess_locks_the_username_everywhere(
    client: Any, admin_user: Any, settings: Any
) -> None:
    settings.LOGIN_FAILURE_LIMIT_PER_USER = 20
    for i in range(20):
        login(client, f"guess-{i}", REMOTE_ADDR=f"203.0.113.{i}")
    assert login(client, "right-password-123", REMOTE_ADDR="198.51.100.7").status_code == 429


def test_a_successful_login_clears_the_address_s_count(client: Any, admin_user: Any, settings: Any) -> None:
    for i in range(settings.LOGIN_FAILURE_LIMIT - 1):
        login(client, f"guess-{i}")
    assert login(client, "right-password-123").status_code == 302
    client.logout()
    for i in range(settings.LOGIN_FAILURE_LIMIT - 1):
        login(client, f"guess-{i}")
    assert login(client, "right-password-123").status_code == 302
