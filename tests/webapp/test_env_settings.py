"""Typed environment helpers fail loudly instead of guessing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from webapp.env import envbool, envint, envlist, envstr


def test_booleans_accept_the_usual_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, expected in (
        ("1", True),
        ("Yes", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("", False),
    ):
        monkeypatch.setenv("X_FLAG", raw)
        assert envbool("X_FLAG", not expected) is expected
    monkeypatch.delenv("X_FLAG")
    assert envbool("X_FLAG", True) is True


def test_a_bad_boolean_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("X_FLAG", "maybe")
    with pytest.raises(ImproperlyConfigured, match="X_FLAG='maybe' is not a boolean"):
        envbool("X_FLAG", False)


def test_integers_are_checked_for_type_and_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("X_N", "12")
    assert envint("X_N", 1, minimum=1) == 12
    monkeypatch.setenv("X_N", "twelve")
    with pytest.raises(ImproperlyConfigured, match="not an integer"):
        envint("X_N", 1)
    monkeypatch.setenv("X_N", "0")
    with pytest.raises(ImproperlyConfigured, match="must be >= 1"):
        envint("X_N", 1, minimum=1)


def test_a_file_variant_wins_and_an_unreadable_file_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "s").write_text("from-file\n")
    monkeypatch.setenv("X_SECRET", "from-env")
    monkeypatch.setenv("X_SECRET_FILE", str(tmp_path / "s"))
    assert envstr("X_SECRET") == "from-file"
    monkeypatch.setenv("X_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfigured, match="X_SECRET_FILE"):
        envstr("X_SECRET")


def test_lists_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("X_HOSTS", "a, b,,c")
    assert envlist("X_HOSTS", []) == ["a", "b", "c"]


def _settings_in_a_fresh_process(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "import django; django.setup(); from django.conf import settings; print(settings.ROUTE_MODE)"
    full = {k: v for k, v in os.environ.items() if k != "ROUTE_MODE"}
    full.update({"DJANGO_SETTINGS_MODULE": "webapp.settings", **env})
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


def test_the_playground_and_api_route_in_chain_mode_unless_the_operator_says_star() -> None:
    assert _settings_in_a_fresh_process({}).stdout.strip() == "chain"
    assert _settings_in_a_fresh_process({"ROUTE_MODE": "star"}).stdout.strip() == "star"


def test_an_unknown_route_mode_stops_the_control_plane_with_its_name() -> None:
    r = _settings_in_a_fresh_process({"ROUTE_MODE": "ring"})
    assert r.returncode != 0
    assert "ROUTE_MODE='ring' must be one of star, chain" in r.stderr


def test_speculation_drafts_up_to_8_tokens_unless_the_operator_sets_another_limit_within_a_verification() -> (
    None
):
    code = "import django; django.setup(); from django.conf import settings; print(settings.ROUTE_SPECULATE)"

    def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        full = {k: v for k, v in os.environ.items() if k != "ROUTE_SPECULATE"}
        full.update({"DJANGO_SETTINGS_MODULE": "webapp.settings", **env})
        return subprocess.run(
            [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120
        )

    assert run({}).stdout.strip() == "8"
    assert run({"ROUTE_SPECULATE": "0"}).stdout.strip() == "0"  # off
    assert run({"ROUTE_SPECULATE": "15"}).stdout.strip() == "15"
    bad = run({"ROUTE_SPECULATE": "16"})  # a verification carries at most 15 drafts
    assert bad.returncode != 0 and "ROUTE_SPECULATE=16 must be 0..15" in bad.stderr


def test_a_postgresql_database_gets_a_pool_of_db_pool_max_connections_and_0_turns_it_off() -> None:
    code = (
        "import django; django.setup(); from django.conf import settings; "
        "print(settings.DATABASES['default'].get('OPTIONS', {}).get('pool', {}).get('max_size', 0))"
    )

    def run(env: dict[str, str]) -> str:
        full = {k: v for k, v in os.environ.items() if k not in ("DB_POOL_MAX", "DATABASE_URL")}
        full.update({"DJANGO_SETTINGS_MODULE": "webapp.settings", **env})
        r = subprocess.run(
            [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    pg = {"DATABASE_URL": "postgres://swarm@db.invalid:5432/swarm"}  # parsed, never connected to
    assert run(pg) == "10"
    assert run({**pg, "DB_POOL_MAX": "3"}) == "3"
    assert run({**pg, "DB_POOL_MAX": "0"}) == "0"  # a connection per request or consumer call
    assert run({}) == "0"  # the embedded SQLite file has no pool
