"""The tracker and web seed as served by Django: passkeys, raw announces, compact peers, byte ranges."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote_from_bytes

import pytest

from webapp.fleet.models import Node
from webapp.fleet.passkeys import node_passkey
from webapp.fleet.protocol import load_command
from webapp.fleet.services import create_enrollment_token, redeem_enrollment_token
from webapp.fleet.tasks import assignment_view
from webapp.tracker.logic import bdecode
from webapp.tracker.services import peer_store
from webapp.tracker.store import RedisPeerStore

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_peer_store(settings: Any) -> Iterator[None]:
    """Each test starts with an empty swarm: a new in-memory store, or this run's Redis keys removed."""
    peer_store.cache_clear()
    yield
    store = peer_store()
    if isinstance(store, RedisPeerStore):
        keys = store._r.keys(settings.TRACKER_REDIS_PREFIX + ":*")
        if keys:
            store._r.delete(*keys)
    peer_store.cache_clear()


def enroll(name: str, address: str = "127.0.0.1") -> str:
    """A node as it is when it announces: enrolled, online, its data plane checked at `address`."""
    node_id = redeem_enrollment_token(create_enrollment_token(None)[0], name).node_id
    Node.objects.filter(pk=node_id).update(state=Node.State.ONLINE, dataplane_url=f"http://{address}:9000")
    return node_id


def announce_query(info_hash: bytes, peer_id: bytes, port: int, **extra: str) -> str:
    q = f"info_hash={quote_from_bytes(info_hash)}&peer_id={quote_from_bytes(peer_id)}&port={port}"
    q += "&uploaded=0&downloaded=0&left=1000&compact=1"
    return q + "".join(f"&{k}={v}" for k, v in extra.items())


def get(client: Any, path: str, query: str) -> dict[bytes, Any]:
    r = client.get(path, QUERY_STRING=query)
    assert r.status_code == 200 and r["Content-Type"].startswith("text/plain")
    body = bdecode(r.content)
    assert isinstance(body, dict)
    return body


def test_two_enrolled_nodes_find_each_other_through_the_tracker(client: Any, swarm_artifact: Any) -> None:
    ih = bytes.fromhex(swarm_artifact.infohash)
    a, b = enroll("a"), enroll("b")
    pid_a, pid_b = b"-GS0001-" + b"\xff" * 12, b"-GS0001-" + b"\x80" * 12  # not UTF-8 on purpose
    first = get(client, f"/tracker/{node_passkey(a)}/announce", announce_query(ih, pid_a, 6881))
    assert first[b"peers"] == b"" and first[b"incomplete"] == 1
    second = get(client, f"/tracker/{node_passkey(b)}/announce", announce_query(ih, pid_b, 6882))
    assert second[b"peers"] == bytes([127, 0, 0, 1]) + struct.pack(">H", 6881)
    assert second[b"incomplete"] == 2 and second[b"interval"] > 0

    scraped = get(client, f"/tracker/{node_passkey(a)}/scrape", f"info_hash={quote_from_bytes(ih)}")
    assert scraped[b"files"][ih][b"incomplete"] == 2


def test_joining_peers_hear_only_of_earlier_arrivals_so_their_ranks_differ(
    client: Any, swarm_artifact: Any
) -> None:
    ih = bytes.fromhex(swarm_artifact.infohash)
    nodes = [enroll(n) for n in "abc"]
    lengths = []
    for i, node in enumerate(nodes):
        q = announce_query(ih, bytes([65 + i]) * 20, 7000 + i, event="started")
        lengths.append(len(get(client, f"/tracker/{node_passkey(node)}/announce", q)[b"peers"]) // 6)
    assert lengths == [0, 1, 2]
    again = get(client, f"/tracker/{node_passkey(nodes[0])}/announce", announce_query(ih, b"A" * 20, 7000))
    assert len(again[b"peers"]) // 6 == 2  # a regular re-announce lists everyone


@pytest.mark.parametrize(
    "passkey",
    ["nobody", "node-000000000000.0123456789abcdef0123456789abcdef", "{node}.forged", "{node}"],
)
def test_an_unknown_or_forged_passkey_is_refused_with_a_failure_reason(
    client: Any, swarm_artifact: Any, passkey: str
) -> None:
    node = enroll("a")
    query = announce_query(bytes.fromhex(swarm_artifact.infohash), b"x" * 20, 6881)
    body = get(client, f"/tracker/{passkey.format(node=node)}/announce", query)
    assert body == {b"failure reason": b"unknown passkey"}


def test_a_removed_nodes_passkey_is_refused(client: Any, swarm_artifact: Any) -> None:
    node = enroll("a")
    Node.objects.filter(pk=node).update(state=Node.State.REMOVED)
    query = announce_query(bytes.fromhex(swarm_artifact.infohash), b"x" * 20, 6881)
    assert get(client, f"/tracker/{node_passkey(node)}/announce", query) == {
        b"failure reason": b"unknown passkey"
    }


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("", b"missing info_hash"),
        ("info_hash=abc&peer_id=" + "x" * 20 + "&port=1", b"invalid info_hash: 3 bytes, expected 20"),
        ("info_hash=" + "a" * 20 + "&port=1", b"missing peer_id"),
        ("info_hash=" + "a" * 20 + "&peer_id=" + "x" * 20 + "&port=99999", b"invalid port"),
        ("info_hash=" + "a" * 20 + "&peer_id=" + "x" * 20 + "&port=1&event=exploded", b"invalid event"),
    ],
)
def test_a_malformed_announce_gets_a_bencoded_failure_reason(
    client: Any, swarm_artifact: Any, query: str, reason: bytes
) -> None:
    body = get(client, f"/tracker/{node_passkey(enroll('a'))}/announce", query)
    assert set(body) == {b"failure reason"} and body[b"failure reason"].startswith(reason)


def test_an_unregistered_torrent_is_refused(client: Any, swarm_artifact: Any) -> None:
    body = get(
        client, f"/tracker/{node_passkey(enroll('a'))}/announce", announce_query(b"\x01" * 20, b"x" * 20, 1)
    )
    assert body == {b"failure reason": b"unregistered torrent"}


def test_the_web_seed_serves_one_byte_range_to_a_node_with_its_passkey(
    client: Any, swarm_artifact: Any
) -> None:
    url = f"/webseed/{node_passkey(enroll('a'))}/{swarm_artifact.sha256}"
    r = client.get(url, HTTP_RANGE="bytes=1000-1999")
    assert r.status_code == 206 and r["Content-Range"] == f"bytes 1000-1999/{swarm_artifact.size_bytes}"
    assert b"".join(r.streaming_content) == Path(swarm_artifact.path).read_bytes()[1000:2000]
    assert client.get(url, HTTP_RANGE="bytes=0-1,4-5").status_code == 416


def test_the_web_seed_refuses_an_unknown_passkey(client: Any, swarm_artifact: Any) -> None:
    r = client.get(f"/webseed/nobody/{swarm_artifact.sha256}", HTTP_RANGE="bytes=0-9")
    assert r.status_code == 403


def test_a_node_downloads_the_torrent_and_others_do_not(
    client: Any, swarm_artifact: Any, node_with_secret: Any
) -> None:
    node, secret = node_with_secret
    url = f"/artifacts/{swarm_artifact.sha256}/torrent"
    assert client.get(url).status_code == 401
    r = client.get(url, HTTP_AUTHORIZATION=f"Node {node.id}:{secret}")
    assert r.status_code == 200 and r.content == bytes(swarm_artifact.torrent)


def test_an_artifact_without_a_torrent_answers_404_so_agents_use_http(
    client: Any, artifact: Any, node_with_secret: Any
) -> None:
    node, secret = node_with_secret
    r = client.get(f"/artifacts/{artifact.sha256}/torrent", HTTP_AUTHORIZATION=f"Node {node.id}:{secret}")
    assert r.status_code == 404


def test_a_load_command_carries_this_nodes_passkey_urls(swarm_artifact: Any, node_with_secret: Any) -> None:
    from webapp.fleet.models import ShardAssignment

    node, _ = node_with_secret
    a = ShardAssignment.objects.create(node=node, artifact=swarm_artifact, layer_start=0, layer_end=10)
    cmd = load_command(assignment_view(a))
    key = node_passkey(node.id)
    assert cmd.torrent_url == f"/artifacts/{swarm_artifact.sha256}/torrent"
    assert cmd.trackers == [f"/tracker/{key}/announce"]
    assert cmd.web_seeds == [f"/webseed/{key}/{swarm_artifact.sha256}"]


def test_a_load_command_without_a_torrent_names_only_the_http_file(
    artifact: Any, node_with_secret: Any
) -> None:
    from webapp.fleet.models import ShardAssignment

    a = ShardAssignment.objects.create(
        node=node_with_secret[0], artifact=artifact, layer_start=0, layer_end=10
    )
    cmd = load_command(assignment_view(a))
    assert cmd.torrent_url is None and cmd.trackers == [] and cmd.web_seeds == []


def test_the_fleet_page_shows_a_fetching_shards_progress_bar_and_sources(
    staff_client: Any, swarm_artifact: Any, node_with_secret: Any
) -> None:
    from webapp.fleet.models import ShardAssignment
    from webapp.fleet.services import update_progress

    node, _ = node_with_secret
    a = ShardAssignment.objects.create(node=node, artifact=swarm_artifact, layer_start=0, layer_end=10)
    transfer = {"done_bytes": 27e6, "wanted_bytes": 54e6, "rate_bytes_per_s": 3e6, "peers": 2}
    transfer |= {"peer_bytes": 9e6, "web_seed_bytes": 18e6, "source": "swarm"}
    assert update_progress(node.id, a.pk, "fetching", 0.5, "", transfer)
    page = staff_client.get("/fleet/").content.decode()
    assert '<progress class="transfer" max="54000000.0" value="27000000.0">' in page
    assert "27.0 MB / 54.0 MB · 3.0 MB/s · 2 peers · from peers 33%, web seed 67%" in page
    assert update_progress(node.id, a.pk, "ready", 1.0, "")  # a report without figures keeps the last ones
    a.refresh_from_db()
    assert a.transfer["peer_bytes"] == 9e6


@pytest.mark.django_db(transaction=True)  # the view runs in another thread than the test
async def test_under_asgi_the_web_seed_streams_without_buffering_the_range(
    async_client: Any, swarm_artifact: Any
) -> None:
    from channels.db import database_sync_to_async

    key = await database_sync_to_async(lambda: node_passkey(enroll("a")))()
    r = await async_client.get(
        f"/webseed/{key}/{swarm_artifact.sha256}", headers={"Range": "bytes=10-3000000"}
    )
    assert r.status_code == 206 and r.is_async  # an async iterator: chunks are read as they are sent
    body = b"".join([chunk async for chunk in r.streaming_content])
    assert body == Path(swarm_artifact.path).read_bytes()[10:3000001]
    from django.db import connections

    await database_sync_to_async(connections.close_all)()  # the view's thread connection


class _AllowAll:
    """An announce-rate limiter that admits everything (so the peer store meets the hung Redis)."""

    per_min = 60

    def allow(self, node: str, now: float) -> bool:
        return True


@pytest.mark.parametrize("first", ["peer store", "rate counter"])
def test_a_redis_that_never_answers_gets_the_node_a_failure_reason_in_seconds(
    client: Any,
    swarm_artifact: Any,
    settings: Any,
    hung_redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    first: str,
) -> None:
    """An announce against a Redis that accepted and never answered was a 500 once a client's read
    timed out (redis-py's default 5 s for the peer store, 2 s for the rate counter), which the node's
    torrent client cannot read. It is now a bencoded failure reason, which it reads and retries after."""
    from webapp.core.throttle import WindowCounter
    from webapp.tracker import services

    a = enroll("a")
    before = settings.REDIS_URL
    settings.REDIS_URL = hung_redis_url
    limiter = _AllowAll() if first == "peer store" else services.AnnounceRate()
    if isinstance(limiter, services.AnnounceRate):
        limiter.counter = WindowCounter("tracker-rate")  # a client of its own, to the hung Redis
    monkeypatch.setattr(services, "announce_rate", limiter)
    peer_store.cache_clear()
    try:
        t0 = time.monotonic()
        q = announce_query(bytes.fromhex(swarm_artifact.infohash), b"-GS0001-" + b"a" * 12, 6881)
        body = get(client, f"/tracker/{node_passkey(a)}/announce", q)
        assert b"unavailable" in body[b"failure reason"]
        assert time.monotonic() - t0 < 15  # a 2 s timeout, on a loaded machine
    finally:
        settings.REDIS_URL = before
        peer_store.cache_clear()
