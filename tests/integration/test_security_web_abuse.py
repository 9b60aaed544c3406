"""The web server under the attacks of issue 33 items 1, 2 and 6, as a hostile client makes them: the real
daphne (started through webapp.serve, as `make up` and compose do) on 127.0.0.1, raw sockets for the
bodies, the real tokenizer for the prompts (docs/security.md, "Bodies bounded before they are read",
"One request freezes the web", "Hostile JSON"). Every wait is bounded by a socket timeout."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator

import pytest

from agent.dev.hostile import DEEP, GIB, MIB, HealthProbe, address, head, push, rss_mb, send_headers_only
from tests.integration.swarm import Swarm, control_plane
from tests.integration.test_openai_api import create_key

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[Swarm]:
    with control_plane(tmp_path_factory.mktemp("web-abuse")) as s:
        yield s


def test_a_1_gib_anonymous_post_is_refused_before_its_body_is_sent_and_never_read(swarm: Swarm) -> None:
    assert swarm.web is not None
    before = rss_mb(swarm.web.pid)
    reply, took, sock = send_headers_only(address(swarm.base), head("/healthz", f"Content-Length: {GIB}"))
    with sock:
        assert reply.startswith(b"HTTP/1.1 413"), reply
        assert b"Connection: close" in reply and took < 5
        sent = push(sock, 512 * MIB, b"\0" * MIB)  # the attacker sends the body anyway
    assert sent < 128 * MIB, "the server kept reading a refused body"
    growth = rss_mb(swarm.web.pid) - before
    assert growth < 50, f"web RSS grew {growth:.0f} MB"  # it grew 630 MB before (558 -> 1,188)


def test_a_chunked_body_is_cut_off_with_413_once_it_passes_the_limit(swarm: Swarm) -> None:
    assert swarm.web is not None
    before = rss_mb(swarm.web.pid)
    sock = socket.create_connection(address(swarm.base), timeout=10)
    with sock:
        sock.sendall(head("/api/agent/enroll", "Transfer-Encoding: chunked"))
        piece = b"%x\r\n%s\r\n" % (MIB, b"x" * MIB)
        sent = push(sock, 256 * MIB, piece)  # never the final chunk: an endless body
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert sent < 32 * MIB + 96 * MIB, "refused only after far more than MAX_REQUEST_BYTES"
    assert rss_mb(swarm.web.pid) - before < 50


def test_anonymous_and_forged_sessions_get_no_upload_allowance_and_staff_does(swarm: Swarm) -> None:
    big = f"Content-Length: {64 * GIB}"
    for cookie in ([], ["Cookie: sessionid=forged-session-key"]):
        reply, took, sock = send_headers_only(address(swarm.base), head("/models/register", big, *cookie))
        sock.close()
        assert reply.startswith(b"HTTP/1.1 413"), (cookie, reply)  # was: read all 64 GiB, then login
        assert took < 5
    staff = [f"Cookie: sessionid={swarm.admin.cookie('sessionid')}", "Expect: 100-continue"]
    reply, _, sock = send_headers_only(address(swarm.base), head("/models/register", big, *staff))
    sock.close()
    assert reply.startswith(b"HTTP/1.1 100 Continue"), reply  # the upload limit, after the lookup
    # a staff body past MAX_REQUEST_BYTES is read and reaches the application (its CSRF check, 403)
    size = 33 * MIB
    reply, _, sock = send_headers_only(
        address(swarm.base), head("/models/register", f"Content-Length: {size}", *staff)
    )
    with sock:
        assert reply.startswith(b"HTTP/1.1 100 Continue"), reply
        assert push(sock, size, b"\0" * MIB) == size
        sock.settimeout(60)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]


def test_requests_within_the_limits_are_served_as_before(swarm: Swarm) -> None:
    c = http.client.HTTPConnection(*address(swarm.base), timeout=10)
    c.request("POST", "/api/agent/enroll", body=json.dumps({"token": "nope", "name": "x"}))
    r = c.getresponse()
    assert r.status in (400, 403) and b"error" in r.read()
    c.request("GET", "/healthz")
    assert c.getresponse().status == 200


def test_deep_json_to_anonymous_enrollment_is_a_400_from_the_real_server(swarm: Swarm) -> None:
    c = http.client.HTTPConnection(*address(swarm.base), timeout=30)
    c.request("POST", "/api/agent/enroll", body=DEEP, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 400, r.read()[:300]  # was a 500


def test_the_web_keeps_answering_while_one_key_sends_huge_long_and_deep_prompts(swarm: Swarm) -> None:
    swarm.register_smollm2()
    key = create_key(swarm, "abuse")
    model = swarm.model["name"]

    def chat(messages: object) -> tuple[int, dict[str, object]]:
        c = http.client.HTTPConnection(*address(swarm.base), timeout=60)
        body = (
            json.dumps({"model": model, "messages": messages}) if not isinstance(messages, str) else messages
        )
        c.request(
            "POST",
            "/v1/chat/completions",
            body=body,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        r = c.getresponse()
        return r.status, json.loads(r.read())

    probe = HealthProbe(address(swarm.base))
    probe.start()
    try:
        t = time.perf_counter()
        status, body = chat([{"role": "user", "content": "x" * 9_900_000}])  # froze the web 13.6 s
        assert status == 400 and "bytes" in str(body), body
        assert time.perf_counter() - t < 10
        status, body = chat([{"role": "user", "content": "x"}] * 8000)  # 3.9 s of quadratic tokenizing
        assert status == 400 and "messages" in str(body), body
        for _ in range(3):  # allowed in size, expensive to tokenize: done off the event loop
            status, body = chat([{"role": "user", "content": "<|im_end|>x" * 3}] * 1500)
            assert status == 400 and "maximum context length" in str(body), body
        status, body = chat('{"model": "m", "messages": ' + DEEP + "}")
        assert status == 400 and "nested" in str(body), body
    finally:
        probe.stop.set()
        probe.join(timeout=60)
    assert probe.ms, "no health check completed"
    # the freeze this guards against lasted 13.6 s (a 9.9 MB prompt) to minutes (250,000 messages); the
    # 250 ms target is bench/abuse.py's on a quiet machine (web_stall_ms_p99_during_abuse), while the
    # suite shares two cores with two other workers: one run under load gave 450 ms
    assert probe.p99() <= 1000, f"healthz p99 {probe.p99():.0f} ms while the attacks ran"
