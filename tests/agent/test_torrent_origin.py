"""A stand-in control plane (aiohttp web seed + tracker on 127.0.0.1) for the torrent tests and bench."""

from __future__ import annotations

import asyncio
import ssl
import threading
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from webapp.tracker import logic
from webapp.tracker.webseed import RangeNotSatisfiable, plan_range

_CHUNK = 64 * 1024


@dataclass
class SeedRule:
    """How the web seed treats one passkey: off, throttled, or serving flipped bytes."""

    enabled: bool = True
    rate_bps: float | None = None
    corrupt: bool = False


@dataclass
class Origin:
    """Serves one artifact as a BEP 19 web seed and runs the passkey tracker, both over real HTTP."""

    path: Path
    infohashes: set[bytes] = field(default_factory=set)
    passkeys: set[str] = field(default_factory=set)
    interval_s: int = 2
    total_rate_bps: float | None = None  # the origin's uplink, shared by every web seed request
    rules: dict[str, SeedRule] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    announces: list[tuple[str, bytes]] = field(default_factory=list)
    port: int = 0
    ssl_context: ssl.SSLContext | None = None  # https tracker and web seed (test_torrent_tls.py)

    @property
    def _base(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}"

    def __post_init__(self) -> None:
        self.store = logic.MemoryPeerStore()
        self.config = logic.TrackerConfig(interval_s=self.interval_s, min_interval_s=1)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._uplink_free_at = 0.0
        self._thread = threading.Thread(target=self._run, name="origin", daemon=True)

    # URLs an agent with this passkey uses
    def tracker_url(self, passkey: str) -> str:
        return f"{self._base}/tracker/{passkey}/announce"

    def web_seed_url(self, passkey: str) -> str:
        return f"{self._base}/webseed/{passkey}/{self.path.name}"

    @property
    def origin_bytes(self) -> int:
        return sum(self.served.values())

    def start(self) -> Origin:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("origin server did not start within 10 s")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> Origin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/webseed/{passkey}/{name}", self._webseed)
        app.router.add_get("/tracker/{passkey}/announce", self._announce)
        app.router.add_get("/tracker/{passkey}/scrape", self._scrape)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(runner.cleanup())
            self._loop.close()

    def _known(self, infohash: bytes) -> bool:
        return infohash in self.infohashes

    def _passkey_ok(self, passkey: str) -> bool:
        return passkey in self.passkeys

    async def _announce(self, request: web.Request) -> web.Response:
        passkey = request.match_info["passkey"]
        raw = request.rel_url.raw_query_string
        body = logic.announce(
            raw,
            request.remote or "",
            passkey,
            passkey_ok=self._passkey_ok,
            torrent_known=self._known,
            store=self.store,
            config=self.config,
        )
        self.announces.append((passkey, body))
        return web.Response(body=body, content_type="text/plain")

    async def _scrape(self, request: web.Request) -> web.Response:
        body = logic.scrape(
            request.rel_url.raw_query_string,
            request.match_info["passkey"],
            passkey_ok=self._passkey_ok,
            torrent_known=self._known,
            store=self.store,
        )
        return web.Response(body=body, content_type="text/plain")

    async def _webseed(self, request: web.Request) -> web.StreamResponse:
        passkey = request.match_info["passkey"]
        if passkey not in self.passkeys or request.match_info["name"] != self.path.name:
            return web.Response(status=403, text="unknown passkey or artifact")
        rule = self.rules.get(passkey, SeedRule())
        if not rule.enabled:
            return web.Response(status=503, text="web seed disabled for this node")
        size = self.path.stat().st_size
        try:
            plan = plan_range(request.headers.get("Range"), size)
        except RangeNotSatisfiable as e:
            return web.Response(status=416, text=str(e), headers=e.headers)
        resp = web.StreamResponse(status=plan.status, headers=plan.headers)
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sent = 0
        with open(self.path, "rb") as f:
            f.seek(plan.start)
            while sent < plan.length:
                data = f.read(min(_CHUNK, plan.length - sent))
                if not data:
                    break
                if rule.corrupt:
                    data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
                await resp.write(data)
                sent += len(data)
                self.served[passkey] += len(data)
                if rule.rate_bps:
                    ahead = sent / rule.rate_bps - (loop.time() - t0)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                if self.total_rate_bps:
                    self._uplink_free_at = (
                        max(loop.time(), self._uplink_free_at) + len(data) / self.total_rate_bps
                    )
                    await asyncio.sleep(self._uplink_free_at - loop.time())
        await resp.write_eof()
        return resp


# ------------------------------------------------------------------------------------- tests of the stand-in


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
