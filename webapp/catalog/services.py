"""Registering GGUF artifacts (path, upload, PyPI package) and building their .torrents.

Registration only writes the row; the caller starts the manifest build (`tasks.enqueue_build`), so
this module never imports the tasks that import it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile

from agent.artifacts.manifest import Manifest
from agent.artifacts.packaged import ModelNotFound, packaged_model_path
from webapp.catalog.models import ModelArtifact


class RegistrationError(ValueError):
    """The file cannot be registered; the message says why."""


def build_torrent(path: str, manifest: Manifest) -> tuple[bytes | None, str]:
    """(.torrent bytes, v1 infohash hex) with the piece size fitted to the smallest layer; (None, "")
    when libtorrent is not installed, so agents fall back to plain HTTP range requests.

    Trackers and web seeds are left out: each agent uses its own passkey URLs (they are outside the
    info dict, so they never change the infohash).
    """
    try:
        from agent.artifacts.torrent import create_torrent
    except ImportError:
        return None, ""
    smallest = min((layer.nbytes for layer in manifest.layers if layer.nbytes), default=None)
    return create_torrent(path, smallest_layer_bytes=smallest)


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
    return ModelArtifact.objects.create(
        name=name or p.stem, source=source, path=str(p.resolve()), created_by=user
    )


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
    return ModelArtifact.objects.create(
        name=name or Path(f.name or "upload").stem,
        source=ModelArtifact.Source.UPLOAD,
        path=tmp,
        created_by=user,
    )
