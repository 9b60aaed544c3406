"""Issue 17, server files through model registration: only the models directory or a bounded upload.

The attack: staff registered /etc/shadow and the secret key file (their first bytes came back in the
error), /proc/self/environ was accepted, the admin let `ModelArtifact.path` be edited (any file served
through /artifacts/<sha>/file), and uploads were size-checked only after landing, failed ones kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from webapp.catalog.models import ModelArtifact

pytestmark = pytest.mark.django_db


@pytest.fixture
def models_dir(settings: Any, tmp_path: Path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    settings.MODELS_DIR = d
    settings.ARTIFACT_DIR = tmp_path / "artifacts"
    return d


def register(client: Any, path: str) -> Any:
    return client.post("/models/register", {"kind": "path", "path": path})


@pytest.mark.parametrize("target", ["/etc/shadow", "/etc/passwd", "/proc/self/environ", "SECRET_KEY_FILE"])
def test_server_files_outside_the_models_directory_are_refused_without_their_bytes(
    staff_client: Any, models_dir: Path, settings: Any, target: str
) -> None:
    path = str(Path(settings.DATA_DIR) / "secret_key") if target == "SECRET_KEY_FILE" else target
    r = register(staff_client, path)
    assert r.status_code == 400 and b"only files under the models directory" in r.content
    assert b"root:" not in r.content and settings.SECRET_KEY[:8].encode() not in r.content
    assert not ModelArtifact.objects.exists()


def test_dot_dot_out_of_the_models_directory_is_refused(staff_client: Any, models_dir: Path) -> None:
    r = register(staff_client, str(models_dir / ".." / ".." / ".." / "etc" / "passwd"))
    assert r.status_code == 400 and b"only files under the models directory" in r.content


def test_a_symlink_out_of_the_models_directory_is_refused(staff_client: Any, models_dir: Path) -> None:
    (models_dir / "innocent.gguf").symlink_to("/etc/passwd")
    r = register(staff_client, str(models_dir / "innocent.gguf"))
    assert r.status_code == 400 and b"only files under the models directory" in r.content
    assert b"root:" not in r.content and not ModelArtifact.objects.exists()


def test_a_non_gguf_file_inside_the_directory_is_refused_without_quoting_it(
    staff_client: Any, models_dir: Path
) -> None:
    (models_dir / "notes.gguf").write_text("root:$6$saltsalt$hash:19000:0:99999:7:::\n")
    r = register(staff_client, "notes.gguf")  # relative to the models directory
    assert r.status_code == 400 and b"not a GGUF file" in r.content and b"saltsalt" not in r.content


def test_a_gguf_in_the_models_directory_registers(
    staff_client: Any, models_dir: Path, django_capture_on_commit_callbacks: Any
) -> None:
    (models_dir / "tiny.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    r = register(staff_client, "tiny.gguf")
    assert r.status_code == 200
    assert ModelArtifact.objects.get().path == str((models_dir / "tiny.gguf").resolve())


def test_a_too_large_upload_is_refused_and_leaves_no_partial_file(
    staff_client: Any, models_dir: Path, settings: Any, tmp_path: Path
) -> None:
    settings.MAX_UPLOAD_BYTES = 64 << 10
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path / "uploads")
    os.mkdir(settings.FILE_UPLOAD_TEMP_DIR)
    big = SimpleUploadedFile("big.gguf", b"GGUF" + b"\0" * (1 << 20))
    r = staff_client.post("/models/register", {"kind": "upload", "file": big})
    assert r.status_code == 400 and b"larger than the limit" in r.content
    assert not ModelArtifact.objects.exists()
    assert list(Path(settings.FILE_UPLOAD_TEMP_DIR).iterdir()) == []  # the handler's temporary file
    assert not settings.ARTIFACT_DIR.exists() or list(settings.ARTIFACT_DIR.iterdir()) == []


def test_register_upload_removes_its_partial_file_when_the_stream_passes_the_limit(
    models_dir: Path, settings: Any, staff: Any
) -> None:
    """The copy into the artifact directory counts too (an upload whose size was not declared)."""
    from webapp.catalog.services import RegistrationError, register_upload

    settings.MAX_UPLOAD_BYTES = 1000
    f = SimpleUploadedFile("x.gguf", b"GGUF" + b"\0" * 5000)
    f.size = None  # type: ignore[assignment]  # as a streamed upload of unknown length
    with pytest.raises(RegistrationError, match="larger than the limit"):
        register_upload(f, staff)
    assert list(settings.ARTIFACT_DIR.iterdir()) == []


def test_an_upload_that_is_not_gguf_is_removed(models_dir: Path, settings: Any, staff: Any) -> None:
    from webapp.catalog.services import RegistrationError, register_upload

    with pytest.raises(RegistrationError, match="not a GGUF file"):
        register_upload(SimpleUploadedFile("x.gguf", b"root:x:0:0::/root:/bin/bash\n"), staff)
    assert list(settings.ARTIFACT_DIR.iterdir()) == []


def test_the_artifact_path_is_read_only_in_the_django_admin(admin_client: Any) -> None:
    a = ModelArtifact.objects.create(name="m", source="path", path="/srv/models/m.gguf")
    page = admin_client.get(f"/admin/catalog/modelartifact/{a.pk}/change/").content.decode()
    assert 'name="path"' not in page and "/srv/models/m.gguf" in page
    admin_client.post(f"/admin/catalog/modelartifact/{a.pk}/change/", {"name": "m", "path": "/etc/shadow"})
    a.refresh_from_db()
    assert a.path == "/srv/models/m.gguf"
    assert admin_client.get("/admin/catalog/modelartifact/add/").status_code == 403
