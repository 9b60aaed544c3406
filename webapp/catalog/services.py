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

from agent.artifacts.gguf_meta import GGUF_MAGIC
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
    return create_torrent(path, smallest_layer_bytes=smallest, root_cert=torrent_root_cert())


def torrent_root_cert() -> str | None:
    """The root certificate new .torrents carry: the data-plane CA with SWARM_SSL_TORRENTS (SSL
    torrents: only holders of a node certificate exchange pieces, over TLS), else None (plain)."""
    if not settings.SWARM_SSL_TORRENTS:
        return None
    from webapp.core.dataplane_tls import ca_pem

    return ca_pem()


def _check_gguf_magic(p: Path) -> None:
    """Refuse anything that does not start with the GGUF magic, without ever quoting its bytes (a
    message that echoed them leaked the first bytes of /etc/shadow)."""
    try:
        with p.open("rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise RegistrationError(f"{p}: cannot be read by the control plane ({e.strerror})") from None
    if head != GGUF_MAGIC:
        raise RegistrationError(f"{p}: not a GGUF file (it does not start with the GGUF magic)")


def models_dir() -> Path:
    """SWARM_MODELS_DIR, resolved (symlinks followed): the only place a path registration may name."""
    return Path(settings.MODELS_DIR).resolve()


def resolve_in_models_dir(path: str) -> Path:
    """The real path of `path` (absolute, or relative to the models directory), which must be a regular
    file inside the models directory once every symlink is resolved; RegistrationError otherwise."""
    root = models_dir()
    if "\x00" in path:
        raise RegistrationError("a path cannot contain a NUL byte")
    raw = Path(path)
    if not path.strip():
        raise RegistrationError(f"give a file under the models directory {root}")
    real = (raw if raw.is_absolute() else root / raw).resolve()
    if not real.is_relative_to(root):
        raise RegistrationError(
            f"{path}: only files under the models directory {root} (SWARM_MODELS_DIR) can be registered"
        )
    if not real.exists():
        raise RegistrationError(f"{path}: no such file")
    if not real.is_file():
        raise RegistrationError(f"{path}: not a regular file")
    return real


def register_path(path: str, user: Any, name: str = "") -> ModelArtifact:
    """Register a file from the models directory (what the web form's "path" kind does)."""
    real = resolve_in_models_dir(path)
    return _register_file(real, user, name, ModelArtifact.Source.PATH)


def _register_file(p: Path, user: Any, name: str, source: str) -> ModelArtifact:
    if not os.access(p, os.R_OK):
        raise RegistrationError(f"{p}: not readable by the control plane")
    _check_gguf_magic(p)
    return ModelArtifact.objects.create(name=name or p.stem, source=source, path=str(p), created_by=user)


def register_package(name: str, user: Any) -> ModelArtifact:
    try:
        path = packaged_model_path(name)
    except ModelNotFound as e:
        raise RegistrationError(str(e)) from None
    # A file of an installed package: its path comes from the package, never from the request.
    return _register_file(path.resolve(), user, path.stem, ModelArtifact.Source.PACKAGE)


def register_upload(f: UploadedFile, user: Any, name: str = "") -> ModelArtifact:
    """Copy an upload into the artifact directory, counting bytes as they arrive: past MAX_UPLOAD_BYTES
    (or on any other failure) the partial file is removed and nothing is registered."""
    limit = settings.MAX_UPLOAD_BYTES
    if f.size is not None and f.size > limit:
        raise RegistrationError(f"upload is {f.size} bytes; the limit is {limit}")
    settings.ARTIFACT_DIR.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="upload-", suffix=".gguf", dir=settings.ARTIFACT_DIR)
    try:
        with os.fdopen(fd, "wb") as out:
            seen = 0
            for chunk in f.chunks():
                seen += len(chunk)
                if seen > limit:
                    raise RegistrationError(f"upload is larger than the limit of {limit} bytes")
                out.write(chunk)
        _check_gguf_magic(Path(tmp))
        return ModelArtifact.objects.create(
            name=name or Path(f.name or "upload").stem,
            source=ModelArtifact.Source.UPLOAD,
            path=tmp,
            created_by=user,
        )
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
