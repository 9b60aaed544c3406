"""Typed environment helpers fail loudly instead of guessing."""

from __future__ import annotations

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
