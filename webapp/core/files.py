"""Secrets the control plane generates into its data dir on first start, written once and whole."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_once(path: Path, data: bytes) -> None:
    """Put `data` at `path` (mode 0600) unless something is there already: the first process wins.

    Web, worker and beat start together and each may generate the same secret (the route signing key,
    SECRET_KEY). The file is written whole under a private temporary name and then hard-linked into
    place, so another process sees either nothing or the complete file (creating `path` and then
    writing it let a reader load it empty: a 500 on enrollment in CI), and a link never replaces what
    another process put there first. Also `make up`'s admin password. Imports nothing of Django:
    settings.py uses it.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
