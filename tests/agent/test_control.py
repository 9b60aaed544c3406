"""The agent's control client against a scripted control plane (aiohttp), with a fake shard host."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import WSCloseCode, web

from agent.artifacts.fetch import FetchError, fetch_shard, shard_path
from agent.artifacts.manifest import Manifest
from agent.node.config import NodeConfig
from agent.node.control import AgentRejected, ControlAgent, next_backoff, ws_url
from agent.wire.control import parse_agent_message
from webapp.tracker.webseed import RangeNotSatisfiable, plan_range, read_range

SECRET = "sec_test"


class FakeHost:
    """Records load/unload calls; reports what it holds like the data plane's stats()."""

    def __init__(self) -> None:
        self.shards: list[dict[str, Any]] = []
        self.loads: list[tuple[str, int, int, str]] = []
        self.drained = False

    def load_shard(
        self, path: str, manifest: Manifest, a: int, b: int, backend: str = "torch", n_threads: int = 2
    ) -> None:
        self.loads.append((path, a, b, backend))
        self.shards.append({"model_sha256": manifest.sha256, "layer_start": a, "layer_end": b})

    def unload_shard(self, sha: str, a: int, b: int) -> bool:
        self.shards = [s for s in self.shards if (s["layer_start"], s["layer_end"]) != (a, b)]
        return True

    def drain(self) -> None:
        self.drained = True

    def stats(self) -> dict[str, Any]:
        return {
            "sessions": 0,
            "kv_bytes": 0,
            "kv_budget_bytes": 1,
            "tokens_out": 0,
            "shards": list(self.shards),
        }


class ControlPlane:
    """A scripted control plane: the agent websocket plus the artifact endpoints, with a message log."""

    def __init__(self, manifest: Manifest, model_path: str) -> None:
        self.manifest, self.model_path = manifest, model_path
        self.received: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sockets: list[web.WebSocketResponse] = []
        self.close_code: int | None = None
        self.range_requests: list[str] = []
        self.torrent: bytes | None = None
        self.webseed_bytes = 0
        self.unwelcoming = 0  # connections still to accept and then ignore: no welcome, nothing read
        self.ignored: list[web.WebSocketResponse] = []

    def authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Node node-1:{SECRET}"

    async def ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        if not self.authorized(request) or self.close_code:
            await ws.close(code=self.close_code or 4401)
            return ws
        if self.unwelcoming:  # a server side stuck after the accept (the web's channel layer restarting)
            self.unwelcoming -= 1
            self.ignored.append(ws)
            async for _ in ws:
                pass
            return ws
        self.sockets.append(ws)
        await ws.send_json({"type": "welcome", "node_id": "node-1", "heartbeat_interval_s": 0.2})
        async for msg in ws:
            await self.received.put(json.loads(msg.data))
        return ws

    async def manifest_view(self, request: web.Request) -> web.Response:
        return web.json_response(json.loads(self.manifest.to_json()))

    async def file_view(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return web.Response(status=401)
        rng = request.headers["Range"]
        self.range_requests.append(rng)
        a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
        with open(self.model_path, "rb") as f:
            f.seek(a)
            body = f.read(b - a + 1)
        return web.Response(
            status=206, body=body, headers={"Content-Range": f"bytes {a}-{b}/{self.manifest.file_size}"}
        )

    async def torrent_view(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return web.Response(status=401)
        if self.torrent is None:
            return web.json_response({"error": "no .torrent"}, status=404)
        return web.Response(body=self.torrent, content_type="application/x-bittorrent")

    async def webseed_view(self, request: web.Request) -> web.Response:
        """BEP 19 web seed (the agent's swarm falls back to it when no peer has a piece)."""
        size = self.manifest.file_size
        try:
            plan = plan_range(request.headers.get("Range"), size)
        except RangeNotSatisfiable as e:
            return web.Response(status=416, text=str(e), headers=e.headers)
        self.webseed_bytes += plan.length
        body = b"".join(read_range(self.model_path, plan.start, plan.end))
        return web.Response(status=plan.status, body=body, headers=plan.headers)

    async def next(self, kind: str, timeout: float = 30.0) -> dict[str, Any]:
        while True:
            msg = await self.any(timeout)
            if msg["type"] == kind:
                return msg

    async def any(self, timeout: float = 30.0) -> dict[str, Any]:
        """The agent's next message, checked against the schema the real control plane enforces."""
        msg = await asyncio.wait_for(self.received.get(), timeout)
        parse_agent_message(msg)
        return msg


@pytest.fixture
async def plane(manifest: Manifest, model_path: str):  # noqa: ANN201
    cp = ControlPlane(manifest, model_path)
    app = web.Application()
    app.router.add_get("/ws/agent/", cp.ws)
    app.router.add_get("/artifacts/{sha}/manifest", cp.manifest_view)
    app.router.add_get("/artifacts/{sha}/file", cp.file_view)
    app.router.add_get("/artifacts/{sha}/torrent", cp.torrent_view)
    app.router.add_get("/webseed/{key}/{sha}", cp.webseed_view)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = next(iter(runner.addresses))[1]
    cp.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield cp
    await runner.cleanup()


def make_agent(
    cp: ControlPlane, host: FakeHost, tmp_path: Path, secret: str = SECRET, torrent_listen: str | None = None
) -> ControlAgent:
    cfg = NodeConfig(server=cp.url, node_id="node-1", secret=secret, public_key="x")  # type: ignore[attr-defined]
    return ControlAgent(
        cfg,
        host,
        "http://127.0.0.1:7000",
        tmp_path,
        heartbeat_s=0.2,
        backends=lambda: ["torch"],
        speed=5.0,
        torrent_listen=torrent_listen,
    )


def load_command(manifest: Manifest, a: int, b: int, aid: int = 1) -> dict[str, Any]:
    sha = manifest.sha256
    return {
        "type": "load",
        "assignment_id": aid,
        "model_sha256": sha,
        "layer_start": a,
        "layer_end": b,
        "backend": "torch",
        "manifest_url": f"/artifacts/{sha}/manifest",
        "file_url": f"/artifacts/{sha}/file",
    }


def test_websocket_urls_and_backoff() -> None:
    assert ws_url("https://x.example/") == "wss://x.example/ws/agent/"
    assert ws_url("http://127.0.0.1:8000") == "ws://127.0.0.1:8000/ws/agent/"
    assert [next_backoff(x) for x in (0.5, 1, 8, 20)] == [1.0, 2, 16, 30.0]


async def test_the_agent_says_hello_heartbeats_and_loads_a_verified_range(
    plane: ControlPlane, tmp_path: Path, manifest: Manifest
) -> None:
    host, stop = FakeHost(), asyncio.Event()
    task = asyncio.create_task(make_agent(plane, host, tmp_path).run(stop))
    hello = await plane.next("hello")
    assert hello["dataplane_url"] == "http://127.0.0.1:7000" and hello["backends"] == ["torch"]
    assert hello["hardware"]["cpu_count"] >= 1 and hello["speed"] == 5.0
    beat = await plane.next("heartbeat")
    assert "kv_budget_bytes" in beat["telemetry"]

    await plane.sockets[-1].send_json(load_command(manifest, 0, 3))
    states = []
    while not states or states[-1] not in ("ready", "failed"):
        states.append((await plane.next("progress"))["state"])
    assert states[0] == "fetching" and "loading" in states and states[-1] == "ready", states
    path = shard_path(tmp_path, manifest.sha256)
    assert host.loads == [(str(path), 0, 3, "torch")]
    assert path.stat().st_size == manifest.file_size
    assert path.stat().st_blocks * 512 < manifest.file_size, "untouched layers stay sparse"
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_the_agent_reconnects_and_reports_the_shards_it_kept(
    plane: ControlPlane, tmp_path: Path, manifest: Manifest
) -> None:
    host, stop = FakeHost(), asyncio.Event()
    host.shards.append({"model_sha256": manifest.sha256, "layer_start": 0, "layer_end": 30})
    task = asyncio.create_task(make_agent(plane, host, tmp_path).run(stop))
    await plane.next("hello")
    await plane.sockets[-1].close(code=WSCloseCode.GOING_AWAY)
    again = await plane.next("hello")
    assert len(plane.sockets) == 2
    assert again["shards"] == [{"model_sha256": manifest.sha256, "layer_start": 0, "layer_end": 30}]
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_a_connection_accepted_but_never_welcomed_is_closed_and_made_again(
    plane: ControlPlane, tmp_path: Path
) -> None:
    plane.unwelcoming = 1
    host, stop = FakeHost(), asyncio.Event()
    agent = make_agent(plane, host, tmp_path)
    agent.welcome_timeout_s = 0.5
    task = asyncio.create_task(agent.run(stop))
    hello = await plane.next("hello", timeout=15)  # only a welcomed connection's messages are read
    assert hello["dataplane_url"] == "http://127.0.0.1:7000"
    assert len(plane.ignored) == 1 and plane.ignored[0].closed, "the agent closed the silent connection"
    assert len(plane.sockets) == 1
    await plane.next("heartbeat")
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_bad_credentials_stop_the_agent_for_good(plane: ControlPlane, tmp_path: Path) -> None:
    with pytest.raises(AgentRejected, match="4401"):
        await asyncio.wait_for(
            make_agent(plane, FakeHost(), tmp_path, secret="wrong").run(asyncio.Event()), 10
        )


async def test_unload_and_drain_commands_reach_the_host(
    plane: ControlPlane, tmp_path: Path, manifest: Manifest
) -> None:
    host, stop = FakeHost(), asyncio.Event()
    host.shards.append({"model_sha256": manifest.sha256, "layer_start": 0, "layer_end": 30})
    task = asyncio.create_task(make_agent(plane, host, tmp_path).run(stop))
    await plane.next("hello")
    await plane.sockets[-1].send_json({"type": "drain"})
    await plane.sockets[-1].send_json(
        {
            "type": "unload",
            "assignment_id": 4,
            "model_sha256": manifest.sha256,
            "layer_start": 0,
            "layer_end": 30,
        }
    )
    report = await plane.next("progress")
    assert report == {
        "type": "progress",
        "assignment_id": 4,
        "state": "unloaded",
        "progress": 0.0,
        "error": "",
    }
    assert host.drained and host.shards == []
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_a_malformed_or_unknown_command_is_answered_with_an_error_and_the_agent_keeps_running(
    plane: ControlPlane, tmp_path: Path, manifest: Manifest
) -> None:
    host, stop = FakeHost(), asyncio.Event()
    task = asyncio.create_task(make_agent(plane, host, tmp_path).run(stop))
    await plane.next("hello")
    ws = plane.sockets[-1]
    good = load_command(manifest, 0, 3)
    for text, why in [
        ("{", "malformed JSON"),
        ("[1]", "JSON object"),
        (json.dumps({"type": "launch"}), "unknown message type 'launch'"),
        (json.dumps({**good, "layer_start": "0"}), "layer_start"),
        (json.dumps({**good, "manifest_url": "http://elsewhere.example/m"}), "manifest_url"),
        (json.dumps({**good, "backend": "b" * 500}), "backend"),
        (json.dumps({"type": "unload", "model_sha256": manifest.sha256}), "layer_start"),
    ]:
        await ws.send_str(text)
        assert why in (await plane.next("error"))["error"]
    await ws.send_bytes(b"\xff")
    assert "malformed JSON" in (await plane.next("error"))["error"]

    # A malformed error report is only logged: the next message is the hello that resync asks for.
    await ws.send_json({"type": "error", "error": 5})
    await ws.send_json({"type": "resync"})
    while (msg := await plane.any())["type"] != "hello":
        assert msg["type"] == "heartbeat", msg
    await ws.send_json({"type": "drain"})
    await ws.send_json({"type": "resync"})  # commands run in order: this hello means drain ran
    await plane.next("hello")
    assert host.drained and host.loads == [], "refused commands were not acted on"
    assert not task.done() and len(plane.sockets) == 1, "the agent stayed on the same connection"
    stop.set()
    await asyncio.wait_for(task, 10)


class BrokenHost(FakeHost):
    """A host whose unload fails (a backend bug)."""

    def unload_shard(self, sha: str, a: int, b: int) -> bool:
        raise RuntimeError("backend refused")


async def test_a_command_that_fails_on_the_host_is_reported_and_the_agent_keeps_running(
    plane: ControlPlane, tmp_path: Path, manifest: Manifest
) -> None:
    host, stop = BrokenHost(), asyncio.Event()
    task = asyncio.create_task(make_agent(plane, host, tmp_path).run(stop))
    await plane.next("hello")
    await plane.sockets[-1].send_json(
        {"type": "unload", "model_sha256": manifest.sha256, "layer_start": 0, "layer_end": 30}
    )
    assert (await plane.next("error"))["error"] == "unload failed: RuntimeError: backend refused"
    await plane.sockets[-1].send_json({"type": "drain"})
    await plane.sockets[-1].send_json({"type": "resync"})  # commands run in order: this hello means drain ran
    await plane.next("hello")
    assert host.drained and not task.done()
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_a_second_fetch_only_downloads_the_header_and_a_tampered_tensor_is_caught(
    plane: ControlPlane, tmp_path: Path, manifest: Manifest
) -> None:
    import aiohttp

    dest = tmp_path / "m.gguf"
    headers = {"Authorization": f"Node node-1:{SECRET}"}
    url = plane.url + f"/artifacts/{manifest.sha256}/file"  # type: ignore[attr-defined]
    async with aiohttp.ClientSession() as http:
        first = await fetch_shard(http, url, headers, manifest, 28, 30, dest)
        second = await fetch_shard(http, url, headers, manifest, 28, 30, dest)
        assert first > manifest.bytes_for_range(28, 30)
        assert second == manifest.tensor_data_offset
        t = manifest.tensors_for_range(28, 30)[0]
        orig = plane.model_path
        bad = tmp_path / "bad.gguf"
        data = bytearray(Path(orig).read_bytes())
        data[t.offset] ^= 0xFF
        bad.write_bytes(bytes(data))
        plane.model_path = str(bad)
        with pytest.raises(FetchError, match="sha256"):
            await fetch_shard(http, url, headers, manifest, 28, 30, tmp_path / "fresh.gguf")


@pytest.fixture(scope="module")
def torrent(model_path: str, manifest: Manifest) -> bytes:
    lt = pytest.importorskip("libtorrent")
    del lt
    from agent.artifacts.torrent import create_torrent

    return create_torrent(model_path, smallest_layer_bytes=min(x.nbytes for x in manifest.layers))[0]


def swarm_load_command(manifest: Manifest, a: int, b: int, aid: int = 1) -> dict[str, Any]:
    """A load command for a model with a .torrent; no tracker, so the swarm is web-seed-only."""
    sha = manifest.sha256
    return {
        **load_command(manifest, a, b, aid),
        "torrent_url": f"/artifacts/{sha}/torrent",
        "trackers": [],
        "web_seeds": [f"/webseed/key-1/{sha}"],
    }


async def until_done(plane: ControlPlane) -> list[dict[str, Any]]:
    reports: list[dict[str, Any]] = []
    while not reports or reports[-1]["state"] not in ("ready", "failed"):
        reports.append(await plane.next("progress", timeout=120))
    return reports


class VerifyingHost(FakeHost):
    """Checks every tensor of the range against the manifest when asked to load, like a careful backend."""

    def load_shard(
        self, path: str, manifest: Manifest, a: int, b: int, backend: str = "torch", n_threads: int = 2
    ) -> None:
        from agent.artifacts.torrent import verify_tensors

        verify_tensors(path, manifest, a, b)
        super().load_shard(path, manifest, a, b, backend, n_threads)


async def test_a_model_with_a_torrent_is_fetched_over_the_swarm_and_progress_names_the_sources(
    plane: ControlPlane, tmp_path: Path, manifest: Manifest, torrent: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    from agent.artifacts.torrent import shard_byte_ranges

    plane.torrent = torrent
    host, stop = VerifyingHost(), asyncio.Event()
    task = asyncio.create_task(make_agent(plane, host, tmp_path, torrent_listen="127.0.0.1:0").run(stop))
    await plane.next("hello")
    await plane.sockets[-1].send_json(swarm_load_command(manifest, 28, 30))
    reports = await until_done(plane)
    assert reports[-1]["state"] == "ready", reports
    last = [r["transfer"] for r in reports if "transfer" in r][-1]
    assert last["source"] == "swarm" and last["done_bytes"] == last["wanted_bytes"] > 0
    assert last["web_seed_bytes"] == last["downloaded_bytes"] and last["peer_bytes"] == 0
    assert plane.range_requests == [], "the HTTP artifact endpoint was not used"
    assert last["downloaded_bytes"] <= 1.10 * sum(e - s for s, e in shard_byte_ranges(manifest, 28, 30))
    path = Path(host.loads[0][0])
    assert path.parent == tmp_path / "swarm" / manifest.sha256
    assert path.stat().st_blocks * 512 < manifest.file_size / 2, "the file on disk is sparse"

    # Tampered on disk while the swarm still believes it has the pieces: the tensor check catches it,
    # the pieces are re-fetched, and only then is the shard loaded.
    t = manifest.tensors_for_range(28, 30)[3]
    with open(path, "r+b") as f:
        f.seek(t.offset)
        f.write(b"\0" * 64)
    host.shards.clear()
    seen = plane.webseed_bytes
    await plane.sockets[-1].send_json(swarm_load_command(manifest, 28, 30, aid=2))
    reports = await until_done(plane)
    assert reports[-1]["state"] == "ready", reports
    assert len(host.loads) == 2 and plane.webseed_bytes > seen
    assert f"sha256 mismatch for tensor(s) {t.name}" in caplog.text and "re-fetching" in caplog.text
    stop.set()
    await asyncio.wait_for(task, 20)


async def test_without_libtorrent_a_model_with_a_torrent_is_fetched_over_http(
    plane: ControlPlane, tmp_path: Path, manifest: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    plane.torrent = b"d4:infod6:lengthi1eee"  # never read: the agent cannot use it
    monkeypatch.setitem(
        sys.modules, "agent.artifacts.torrent", None
    )  # `from agent.artifacts.torrent import ...` fails
    host, stop = FakeHost(), asyncio.Event()
    task = asyncio.create_task(make_agent(plane, host, tmp_path, torrent_listen="127.0.0.1:0").run(stop))
    await plane.next("hello")
    await plane.sockets[-1].send_json(swarm_load_command(manifest, 0, 3))
    reports = await until_done(plane)
    assert reports[-1]["state"] == "ready", reports
    assert plane.range_requests and plane.webseed_bytes == 0
    assert [r["transfer"]["source"] for r in reports if "transfer" in r] == ["http"]
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_a_tensor_that_never_matches_its_manifest_hash_fails_the_assignment_and_is_never_loaded(
    plane: ControlPlane, tmp_path: Path, manifest: Manifest, torrent: bytes
) -> None:
    data = json.loads(manifest.to_json())
    bad = next(t for t in data["tensors"] if t["layer"] == 29)
    bad["sha256"] = "0" * 64  # the bytes pass every piece hash, but not the manifest's tensor hash
    plane.manifest = Manifest.from_dict(data)
    plane.torrent = torrent
    host, stop = FakeHost(), asyncio.Event()
    task = asyncio.create_task(make_agent(plane, host, tmp_path, torrent_listen="127.0.0.1:0").run(stop))
    await plane.next("hello")
    await plane.sockets[-1].send_json(swarm_load_command(manifest, 29, 30))
    reports = await until_done(plane)
    assert reports[-1]["state"] == "failed"
    assert f"sha256 mismatch for tensor(s) {bad['name']}" in reports[-1]["error"]
    assert host.loads == []
    stop.set()
    await asyncio.wait_for(task, 20)


async def test_a_wider_range_on_the_same_agent_downloads_only_the_newly_needed_pieces(
    plane: ControlPlane, tmp_path: Path, manifest: Manifest, torrent: bytes
) -> None:
    from agent.artifacts.torrent import needed_pieces, shard_byte_ranges, torrent_info

    plane.torrent = torrent
    host, stop = FakeHost(), asyncio.Event()
    task = asyncio.create_task(make_agent(plane, host, tmp_path, torrent_listen="127.0.0.1:0").run(stop))
    await plane.next("hello")
    await plane.sockets[-1].send_json(swarm_load_command(manifest, 28, 30))
    assert (await until_done(plane))[-1]["state"] == "ready"
    first = plane.webseed_bytes
    await plane.sockets[-1].send_json(swarm_load_command(manifest, 26, 30, aid=2))  # a moved/extra range
    reports = await until_done(plane)
    assert reports[-1]["state"] == "ready", reports
    old = needed_pieces(torrent, shard_byte_ranges(manifest, 28, 30))
    new = needed_pieces(torrent, shard_byte_ranges(manifest, 26, 30)) - old
    piece = torrent_info(torrent).piece_length()
    assert 0 < plane.webseed_bytes - first <= len(new) * piece, (
        plane.webseed_bytes - first,
        len(new) * piece,
    )
    assert len({Path(p) for p, *_ in host.loads}) == 1, "both ranges load from the same sparse file"
    stop.set()
    await asyncio.wait_for(task, 20)


async def test_a_model_whose_torrent_is_gone_is_fetched_over_http(
    plane: ControlPlane, tmp_path: Path, manifest: Manifest
) -> None:
    plane.torrent = None  # the control plane answers 404 for the .torrent
    host, stop = FakeHost(), asyncio.Event()
    task = asyncio.create_task(make_agent(plane, host, tmp_path, torrent_listen="127.0.0.1:0").run(stop))
    await plane.next("hello")
    await plane.sockets[-1].send_json(swarm_load_command(manifest, 0, 3))
    reports = await until_done(plane)
    assert reports[-1]["state"] == "ready", reports
    assert plane.range_requests and plane.webseed_bytes == 0
    assert host.loads == [(str(shard_path(tmp_path, manifest.sha256)), 0, 3, "torch")]
    stop.set()
    await asyncio.wait_for(task, 10)
