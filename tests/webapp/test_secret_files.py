"""Generated secrets' files (webapp/core/files.py: the route signing key, SECRET_KEY): created whole, once, private."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.wire import routetoken
from webapp.core.files import write_once


def _pem() -> bytes:
    return routetoken.private_key_pem(routetoken.generate_key())


def test_the_key_file_appears_only_once_it_is_written_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "route_key.pem"
    seen: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the bytes are written: a reader now must still see no key at all
        seen.append(path.exists())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    pem = _pem()
    write_once(path, pem)
    assert seen == [False]
    assert path.read_bytes() == pem and oct(path.stat().st_mode & 0o777) == "0o600"
    routetoken.load_private_key(path)
    assert [p.name for p in tmp_path.iterdir()] == ["route_key.pem"]  # no temporary file left


def test_a_key_another_process_put_there_first_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "route_key.pem"
    first, second = _pem(), _pem()
    write_once(path, first)
    write_once(path, second)
    assert path.read_bytes() == first
    assert [p.name for p in tmp_path.iterdir()] == ["route_key.pem"]
