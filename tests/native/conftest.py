"""Fixtures for the native (libggswarm) tests: skip cleanly when the library is not built."""

from __future__ import annotations

import pytest

from agent.backends import libggswarm as native


@pytest.fixture(scope="session")
def native_lib() -> None:
    if not native.is_available():
        pytest.skip(f"libggswarm is not built ({native.library_path()}); run `bash native/build.sh`")
