"""Issue 17, every parse path of the web side answers 4xx (or a bencoded refusal), never a 500.

The attacks: a Range header with a 5,000-digit number was a 500 with a traceback in the log; tracker
counters were unbounded. Then property tests (hypothesis, bounded in examples and time) of the
announce and scrape views and the Range parser, and the ASGI body limit that refuses a too-large
request before it is buffered.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from urllib.parse import quote_from_bytes

import pytest
from asgiref.testing import ApplicationCommunicator
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from webapp.catalog.models import ModelArtifact
from webapp.fleet.passkeys import node_passkey
from webapp.fleet.services import create_enrollment_token, redeem_enrollment_token
from webapp.tracker.logic import MAX_SCRAPE_HASHES, bdecode
from webapp.tracker.webseed import RangeNotSatisfiable, plan_range

FUZZ = hsettings(
    max_examples=150,
    deadline=None,  # the first example pays Django's warm-up; the whole test is bounded by max_examples
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples in CI every run
)
HUGE = "9" * 5000
INFO_HASH = hashlib.sha1(b"issue 17").digest()


@pytest.fixture
def artifact_file(db: None, tmp_path: Path) -> ModelArtifact:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 16)
    return ModelArtifact.objects.create(
        name="m",
        source="path",
        path=str(f),
        state=ModelArtifact.State.READY,
        sha256="b" * 64,
        size_bytes=f.stat().st_size,
        infohash=INFO_HASH.hex(),
    )


@pytest.fixture
def passkey(db: None, settings: Any) -> str:
    settings.TRACKER_ANNOUNCES_PER_MIN = 10**6  # the fuzzing node is not rate limited (issue 33)
    return node_passkey(redeem_enrollment_token(create_enrollment_token(None)[0], "fuzz").node_id)


@pytest.mark.parametrize(
    "header",
    [f"bytes={HUGE}-", f"bytes=-{HUGE}", f"bytes=0-{HUGE}", f"bytes={HUGE}-{HUGE}", "bytes=" + " " * 9000],
)
def test_a_range_header_with_a_5000_digit_number_is_a_416_not_a_500(
    staff_client: Any, artifact_file: ModelArtifact, passkey: str, header: str
) -> None:
    for url in (f"/artifacts/{artifact_file.sha256}/file", f"/webseed/{passkey}/{artifact_file.sha256}"):
        r = staff_client.get(url, HTTP_RANGE=header)
        assert r.status_code == 416, (url, r.status_code)
        assert len(r.content) < 300  # the refusal quotes at most a bounded piece of the header


@given(
    header=st.one_of(st.text(max_size=80), st.from_regex(r"\Abytes\s*=\s*\d{0,30}\s*-\s*\d{0,30}\Z")),
    size=st.integers(0, 2**40),
)
@FUZZ
def test_the_range_parser_plans_a_range_inside_the_file_or_refuses(header: str, size: int) -> None:
    try:
        plan = plan_range(header, size)
    except RangeNotSatisfiable as e:
        assert e.headers == {"Content-Range": f"bytes */{size}"}
        return
    assert 0 <= plan.start <= plan.end <= size and plan.status in (200, 206)


def _pct(b: bytes) -> str:
    return quote_from_bytes(b, safe="")


ANNOUNCE_FIELDS = [
    "info_hash",
    "peer_id",
    "port",
    "uploaded",
    "downloaded",
    "left",
    "event",
    "compact",
    "numwant",
    "ip",
]
values = st.one_of(
    st.binary(max_size=30).map(_pct),
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(
        ["", "-0", "+1", "1_000", "0x10", " 7", "started", "stopped", HUGE, "%ZZ", "%", "\u00e9\u4e2d"]
    ),
)
queries = st.lists(
    st.tuples(st.one_of(st.sampled_from(ANNOUNCE_FIELDS), st.text(max_size=8)), values), max_size=12
).map(lambda kv: "&".join(f"{k}={v}" for k, v in kv))


@pytest.mark.django_db
@given(query=queries, good_hash=st.booleans(), path_key=st.one_of(st.just("valid"), st.text(max_size=60)))
@FUZZ
def test_announce_answers_every_query_with_a_bencoded_body(
    client: Any, artifact_file: ModelArtifact, passkey: str, query: str, good_hash: bool, path_key: str
) -> None:
    if good_hash:
        query = f"info_hash={_pct(INFO_HASH)}&peer_id={_pct(b'-GS0001-' + b'z' * 12)}&" + query
    key = passkey if path_key == "valid" else quote_from_bytes(path_key.encode(), safe="")
    r = client.get(f"/tracker/{key}/announce", QUERY_STRING=query)
    assert r.status_code in (200, 404), r.status_code  # 404: a path segment that no URL matches
    if r.status_code == 200:
        assert isinstance(bdecode(r.content), dict)


@pytest.mark.django_db
@given(hashes=st.lists(st.one_of(st.just(INFO_HASH), st.binary(max_size=25)), max_size=80), junk=queries)
@FUZZ
def test_scrape_answers_every_query_with_a_bencoded_body(
    client: Any, artifact_file: ModelArtifact, passkey: str, hashes: list[bytes], junk: str
) -> None:
    query = "&".join([f"info_hash={_pct(h)}" for h in hashes] + [junk])
    r = client.get(f"/tracker/{passkey}/scrape", QUERY_STRING=query)
    assert r.status_code == 200
    body = bdecode(r.content)
    assert isinstance(body, dict)
    if len(hashes) > MAX_SCRAPE_HASHES:
        assert b"too many" in body[b"failure reason"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "value"), [("left", str(2**64)), ("uploaded", HUGE), ("port", "70000"), ("numwant", "-1")]
)
def test_announce_counters_out_of_range_are_refused(
    client: Any, artifact_file: ModelArtifact, passkey: str, field: str, value: str
) -> None:
    base = {"info_hash": _pct(INFO_HASH), "peer_id": "p" * 20, "port": "6881", "left": "0", field: value}
    r = client.get(f"/tracker/{passkey}/announce", QUERY_STRING="&".join(f"{k}={v}" for k, v in base.items()))
    assert r.status_code == 200 and b"failure reason" in bdecode(r.content)  # type: ignore[operator]


# --- the ASGI body limit --------------------------------------------------------------------------------


async def _post(path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, bytes]:
    from webapp.asgi import application

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1"), *headers],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    app = ApplicationCommunicator(application, scope)
    for i, chunk in enumerate(chunks):
        await app.send_input({"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1})
    start = await app.receive_output(10)
    body = await app.receive_output(10)
    await app.wait(10)
    return start["status"], body.get("body", b"")


@pytest.mark.django_db(transaction=True)
async def test_a_declared_oversized_body_is_refused_before_it_is_read(settings: Any) -> None:
    settings.MAX_REQUEST_BYTES = 1 << 20
    status, body = await _post("/v1/chat/completions", [(b"content-length", str(60 << 20).encode())], [b""])
    assert status == 413 and b"limit" in body


@pytest.mark.django_db(transaction=True)
async def test_an_undeclared_body_is_cut_off_once_it_passes_the_limit(settings: Any) -> None:
    settings.MAX_REQUEST_BYTES = 1 << 20
    status, _ = await _post("/accounts/login/", [], [b"x" * (256 << 10)] * 8)
    assert status == 413


@pytest.mark.django_db(transaction=True)
async def test_uploads_get_the_upload_limit_and_other_paths_the_request_limit(settings: Any) -> None:
    settings.MAX_REQUEST_BYTES = 1 << 20
    settings.MAX_UPLOAD_BYTES = 4 << 20
    two_mb = [(b"content-length", str(2 << 20).encode())]
    assert (await _post("/accounts/login/", two_mb, [b""]))[0] == 413
    # Under the upload limit, the request reaches Django (which wants a login first: a redirect).
    status, _ = await _post("/models/register", two_mb, [b"x" * (2 << 20)])
    assert status in (302, 403)


# --- staff and enrollment forms -------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    "form",
    [
        {"kind": "path", "path": "x\x00.gguf"},
        {"kind": "path", "path": "/" + "a" * 5000},
        {"kind": "package", "package": "\x00" * 10},
        {"kind": "k" * 5000},
        {"kind": "upload"},
    ],
)
def test_bad_registration_forms_are_400s(
    staff_client: Any, settings: Any, tmp_path: Path, form: dict[str, str]
) -> None:
    settings.MODELS_DIR = tmp_path
    r = staff_client.post("/models/register", form)
    assert r.status_code == 400 and len(r.content) < 20_000


@pytest.mark.django_db
def test_a_name_with_a_nul_byte_is_cleaned_not_a_500(
    staff_client: Any, settings: Any, tmp_path: Path
) -> None:
    settings.MODELS_DIR = tmp_path
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    r = staff_client.post("/models/register", {"kind": "path", "path": "m.gguf", "name": "bad\x00name"})
    assert r.status_code == 200 and ModelArtifact.objects.get().name == "badname"


@pytest.mark.django_db
@pytest.mark.parametrize("replicas", ["\u00b2", "9" * 5000, "0", "65", "-1", "1.5"])
def test_placing_with_a_bad_replica_count_is_a_400(
    staff_client: Any, artifact_file: ModelArtifact, replicas: str
) -> None:
    r = staff_client.post(f"/models/{artifact_file.pk}/place", {"replicas": replicas})
    assert r.status_code == 400


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body",
    [b'{"token": "enr_x", "name": "a\\u0000b"}', b'{"token": "' + b"x" * 5000 + b'"}', b"[1]", b"\xff\xfe"],
)
def test_bad_enrollment_requests_are_400s(client: Any, body: bytes) -> None:
    r = client.post("/api/agent/enroll", body, content_type="application/json")
    assert r.status_code == 400
