"""Registering GGUF artifacts (path, upload, PyPI package) and serving byte ranges of them."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db import transaction

from agent.models import ModelNotFound, packaged_model_path
from webapp.catalog.models import ModelArtifact

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


class RegistrationError(ValueError):
    """The file cannot be registered; the message says why."""


class RangeNotSatisfiable(ValueError):
    """The Range header asks for bytes outside the file (HTTP 416)."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) for a single `bytes=` range; None for the whole file. Multiple ranges are refused."""
    if not header:
        return None
    m = _RANGE_RE.match(header.strip())
    if not m or (not m.group(1) and not m.group(2)):
        raise RangeNotSatisfiable(f"unsupported Range {header!r} (one bytes=a-b range only)")
    a, b = m.group(1), m.group(2)
    if not a:  # suffix: the last b bytes
        n = int(b)
        if n == 0:
            raise RangeNotSatisfiable("empty suffix range")
        return max(size - n, 0), size
    start = int(a)
    end = size if not b else min(int(b) + 1, size)
    if start >= size or start >= end:
        raise RangeNotSatisfiable(f"range {header!r} is outside the file ({size} bytes)")
    return start, end


def _enqueue_build(artifact: ModelArtifact) -> ModelArtifact:
    from webapp.catalog.tasks import build_artifact_manifest

    pk = artifact.pk
    transaction.on_commit(lambda: build_artifact_manifest.delay(pk))
    return artifact


def register_path(
    path: str, user: Any, name: str = "", source: str = ModelArtifact.Source.PATH
) -> ModelArtifact:
    p = Path(path).expanduser()
    if not p.is_absolute():
        raise RegistrationError(f"{path}: give an absolute path on the control plane host")
    if not p.is_file():
        raise RegistrationError(f"{p}: no such file")
    if not os.access(p, os.R_OK):
        raise RegistrationError(f"{p}: not readable by the control plane")
    with transaction.atomic():
        a = ModelArtifact.objects.create(
            name=name or p.stem, source=source, path=str(p.resolve()), created_by=user
        )
        return _enqueue_build(a)


def register_package(name: str, user: Any) -> ModelArtifact:
    try:
        path = packaged_model_path(name)
    except ModelNotFound as e:
        raise RegistrationError(str(e)) from None
    return register_path(str(path), user, name=path.stem, source=ModelArtifact.Source.PACKAGE)


def register_upload(f: UploadedFile, user: Any, name: str = "") -> ModelArtifact:
    if f.size is not None and f.size > settings.MAX_UPLOAD_BYTES:
        raise RegistrationError(f"upload is {f.size} bytes; the limit is {settings.MAX_UPLOAD_BYTES}")
    settings.ARTIFACT_DIR.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="upload-", suffix=".gguf", dir=settings.ARTIFACT_DIR)
    with os.fdopen(fd, "wb") as out:
        for chunk in f.chunks():
            out.write(chunk)
    with transaction.atomic():
        a = ModelArtifact.objects.create(
            name=name or Path(f.name or "upload").stem,
            source=ModelArtifact.Source.UPLOAD,
            path=tmp,
            created_by=user,
        )
        return _enqueue_build(a)
