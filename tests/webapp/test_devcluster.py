"""webapp/devcluster.py's stand-in origin (aiohttp web seed + tracker on 127.0.0.1), which the torrent tests
and bench/distribution.py fetch from: ranges, refusals and the tracker's passkeys over real HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

from webapp.devcluster import Origin
from webapp.tracker import logic


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_origin_serves_a_range_as_206_and_refuses_multiple_ranges_with_416(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    f.write_bytes(bytes(range(256)) * 4)
    with Origin(f, passkeys={"pk"}) as o:
        status, body, headers = _get(o.web_seed_url("pk"), {"Range": "bytes=10-19"})
        assert status == 206 and body == bytes(range(10, 20))
        assert headers["Content-Range"] == "bytes 10-19/1024"
        status, body, headers = _get(o.web_seed_url("pk"), {"Range": "bytes=0-1,5-6"})
        assert status == 416 and b"multiple ranges" in body
        assert headers["Content-Range"] == "bytes */1024"
        assert _get(o.web_seed_url("nope"))[0] == 403
        assert o.served["pk"] == 10


def test_origin_tracker_refuses_an_unknown_passkey_over_http(tmp_path: Path) -> None:
    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * 100)
    with Origin(f, passkeys={"pk"}, infohashes={b"\x01" * 20}) as o:
        q = "info_hash=" + "%01" * 20 + "&peer_id=" + "A" * 20 + "&port=6881&left=0"
        status, body, _ = _get(o.tracker_url("stranger") + "?" + q)
        assert status == 200 and logic.bdecode(body) == {b"failure reason": b"unknown passkey"}
        status, body, _ = _get(o.tracker_url("pk") + "?" + q)
        reply = logic.bdecode(body)
        assert isinstance(reply, dict) and reply[b"peers"] == b"" and reply[b"incomplete"] == 0
