"""Model registration and the HTTP range endpoint agents fetch shards from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from webapp.catalog.models import ModelArtifact

pytestmark = pytest.mark.django_db


def auth(node_with_secret: Any) -> dict[str, str]:
    node, secret = node_with_secret
    return {"HTTP_AUTHORIZATION": f"Node {node.id}:{secret}"}


def test_a_node_reads_one_byte_range_of_the_gguf(client: Any, artifact: Any, node_with_secret: Any) -> None:
    r = client.get(f"/artifacts/{artifact.sha256}/file", HTTP_RANGE="bytes=100-199", **auth(node_with_secret))
    assert r.status_code == 206
    assert r["Content-Range"] == f"bytes 100-199/{artifact.size_bytes}"
    body = b"".join(r.streaming_content)
    assert body == Path(artifact.path).read_bytes()[100:200]


def test_a_range_past_the_end_gets_416(client: Any, artifact: Any, node_with_secret: Any) -> None:
    r = client.get(
        f"/artifacts/{artifact.sha256}/file",
        HTTP_RANGE=f"bytes={artifact.size_bytes}-",
        **auth(node_with_secret),
    )
    assert r.status_code == 416 and r["Content-Range"] == f"bytes */{artifact.size_bytes}"


def test_a_node_reads_the_manifest(client: Any, artifact: Any, node_with_secret: Any) -> None:
    r = client.get(f"/artifacts/{artifact.sha256}/manifest", **auth(node_with_secret))
    assert r.status_code == 200 and r.json()["n_layers"] == 30


@pytest.mark.parametrize("header", ["bytes=0-1,5-6", "items=0-1", "bytes=-", "bytes=9-3"])
def test_the_artifact_endpoint_refuses_bad_ranges_with_the_web_seeds_parser(
    client: Any, artifact: Any, node_with_secret: Any, header: str
) -> None:
    r = client.get(f"/artifacts/{artifact.sha256}/file", HTTP_RANGE=header, **auth(node_with_secret))
    assert r.status_code == 416 and r["Content-Range"] == f"bytes */{artifact.size_bytes}"


def test_the_whole_file_is_served_without_a_range(client: Any, artifact: Any, node_with_secret: Any) -> None:
    r = client.get(f"/artifacts/{artifact.sha256}/file", **auth(node_with_secret))
    assert r.status_code == 200 and r["Accept-Ranges"] == "bytes"
    assert int(r["Content-Length"]) == artifact.size_bytes


def test_registering_the_packaged_model_builds_its_manifest(
    staff_client: Any, model_path: str, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        r = staff_client.post(
            "/models/register", {"kind": "package", "package": "smollm2"}, HTTP_HX_REQUEST="true"
        )
    assert r.status_code == 200
    a = ModelArtifact.objects.get()
    assert a.state == ModelArtifact.State.READY, a.error
    assert a.n_layers == 30 and a.source == ModelArtifact.Source.PACKAGE and len(a.sha256) == 64
    assert a.parsed_manifest.sha256 == a.sha256
    # the .torrent is built with the manifest: v1 infohash, pieces fitted to the smallest layer
    import libtorrent as lt

    ti = lt.torrent_info(lt.bdecode(bytes(a.torrent)))
    assert str(ti.info_hashes().v1) == a.infohash and ti.total_size() == a.size_bytes
    assert ti.piece_length() == 256 * 1024 and ti.priv()


def test_registering_a_missing_path_says_so(staff_client: Any, settings: Any, tmp_path: Path) -> None:
    settings.MODELS_DIR = tmp_path
    r = staff_client.post("/models/register", {"kind": "path", "path": str(tmp_path / "x.gguf")})
    assert r.status_code == 400 and b"no such file" in r.content


def test_registering_a_file_that_is_not_gguf_is_refused_with_the_reason(
    staff_client: Any, tmp_path: Path, settings: Any
) -> None:
    settings.MODELS_DIR = tmp_path
    p = tmp_path / "x.gguf"
    p.write_bytes(b"not a gguf at all, no sir" * 10)
    r = staff_client.post("/models/register", {"kind": "path", "path": str(p)})
    assert r.status_code == 400 and b"not a GGUF" in r.content and b"no sir" not in r.content
    assert not ModelArtifact.objects.exists()


def test_uploading_a_gguf_registers_it(
    staff_client: Any, model_path: str, django_capture_on_commit_callbacks: Any, settings: Any, tmp_path: Path
) -> None:
    settings.ARTIFACT_DIR = tmp_path
    small = tmp_path / "bad.gguf"
    small.write_bytes(b"GGUF" + b"\0" * 40)
    with small.open("rb") as f, django_capture_on_commit_callbacks(execute=True):
        r = staff_client.post("/models/register", {"kind": "upload", "file": f, "name": "up"})
    assert r.status_code == 200
    a = ModelArtifact.objects.get()
    assert a.source == ModelArtifact.Source.UPLOAD and a.name == "up" and Path(a.path).parent == tmp_path
    assert a.state == ModelArtifact.State.FAILED  # 44 bytes of zeros is no model, and the reason is kept
    assert a.error
