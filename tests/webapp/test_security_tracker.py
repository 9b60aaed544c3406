"""Issue 33, item 4: one node poisoned the tracker. It announced 300 made-up peers under its own passkey
in 3.3 s, and an honest node asking for 200 peers got 200 fake ones.

Now a passkey is one peer per torrent (its latest announce replaces the earlier one), announces per node
and minute are limited, and peer lists put peers at their node's enrolled address first, with never
more of the others than of them. The tracker views are driven through Django's test client, each node
from its own address (REMOTE_ADDR).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote_from_bytes

import pytest

from agent.dev.hostile import announce_query, compact_peers
from webapp.fleet.models import Node
from webapp.fleet.passkeys import node_passkey
from webapp.fleet.services import create_enrollment_token, redeem_enrollment_token
from webapp.tracker.logic import bdecode
from webapp.tracker.services import peer_store
from webapp.tracker.store import RedisPeerStore

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_peer_store(settings: Any) -> Iterator[None]:
    peer_store.cache_clear()
    yield
    store = peer_store()
    if isinstance(store, RedisPeerStore):
        keys = store._r.keys(settings.TRACKER_REDIS_PREFIX + ":*")
        if keys:
            store._r.delete(*keys)
    peer_store.cache_clear()


def node_at(name: str, address: str, online: bool = True) -> str:
    """A node enrolled the real way whose data plane the control plane checked at `address`."""
    node_id = redeem_enrollment_token(create_enrollment_token(None)[0], name).node_id
    state = Node.State.ONLINE if online else Node.State.OFFLINE
    Node.objects.filter(pk=node_id).update(state=state, dataplane_url=f"http://{address}:9000")
    return node_id


def announce(
    client: Any, node_id: str, address: str, info_hash: bytes, peer_id: bytes, port: int, numwant: int = 50
) -> dict[bytes, Any]:
    q = announce_query(info_hash, peer_id, port, numwant)
    r = client.get(f"/tracker/{node_passkey(node_id)}/announce", QUERY_STRING=q, REMOTE_ADDR=address)
    assert r.status_code == 200
    body = bdecode(r.content)
    assert isinstance(body, dict)
    return body


def test_a_node_claiming_300_made_up_peers_leaves_an_honest_node_at_least_90_percent_honest_peers(
    client: Any, swarm_artifact: Any, settings: Any
) -> None:
    settings.TRACKER_ANNOUNCES_PER_MIN = 1000  # the flood itself is the rate limit's test, below
    ih = bytes.fromhex(swarm_artifact.infohash)
    honest = {f"10.0.0.{i}": node_at(f"h{i}", f"10.0.0.{i}") for i in range(1, 21)}
    for ip, node_id in honest.items():
        announce(client, node_id, ip, ih, b"-GS0001-" + ip.encode().ljust(12, b"."), 6881)
    evil = node_at("evil", "10.6.6.6")
    for i in range(300):  # made-up peer ids and ports, from its own address and from others it controls
        source = "10.6.6.6" if i % 2 else f"10.7.{i // 250}.{i % 250}"
        announce(client, evil, source, ih, b"-FAKE00-" + b"%012d" % i, 20000 + i)

    asker = "10.0.0.1"
    peers = compact_peers(announce(client, honest[asker], asker, ih, b"-GS0001-" + b"x" * 12, 6881, 200))
    honest_peers = [p for p in peers if p[0] in honest and p[0] != asker]
    assert len(honest_peers) == 19, peers
    assert len(honest_peers) / len(peers) >= 0.9, f"{len(peers) - len(honest_peers)} fake of {len(peers)}"
    assert len(peers) <= 20, "the poisoner is one peer at most"


def test_peers_away_from_their_enrolled_address_never_outnumber_those_at_it(
    client: Any, swarm_artifact: Any, settings: Any
) -> None:
    settings.TRACKER_ANNOUNCES_PER_MIN = 1000
    ih = bytes.fromhex(swarm_artifact.infohash)
    verified = [node_at(f"v{i}", f"10.0.0.{i}") for i in range(1, 4)]
    for i, node_id in enumerate(verified, start=1):
        announce(client, node_id, f"10.0.0.{i}", ih, b"-GS0001-" + b"v%011d" % i, 6881)
    for i in range(30):  # enrolled nodes announcing from addresses that are not theirs, or offline
        node_id = node_at(f"u{i}", f"10.1.0.{i}", online=i % 2 == 0)
        announce(client, node_id, f"10.2.0.{i}" if i % 2 == 0 else f"10.1.0.{i}", ih, b"u%019d" % i, 7000)
    asker = node_at("asker", "10.0.0.9")
    peers = compact_peers(announce(client, asker, "10.0.0.9", ih, b"-GS0001-" + b"a" * 12, 6881, 200))
    at_home = [p for p in peers if p[0].startswith("10.0.0.")]
    assert len(at_home) == 3 and peers[:3] == at_home, "verified peers come first"
    assert len(peers) - len(at_home) <= len(at_home)


def test_an_announce_flood_beyond_the_rate_is_refused_with_a_failure_reason(
    client: Any, swarm_artifact: Any, settings: Any
) -> None:
    ih = bytes.fromhex(swarm_artifact.infohash)
    flooder, other = node_at("flood", "10.6.6.6"), node_at("other", "10.0.0.2")
    limit = settings.TRACKER_ANNOUNCES_PER_MIN
    answers = [
        announce(client, flooder, "10.6.6.6", ih, b"-FAKE00-" + b"%012d" % i, 9000) for i in range(100)
    ]
    refused = [a for a in answers if b"failure reason" in a]
    # a fixed one-minute window: a flood across a minute's end gets at most two windows' worth
    assert len(answers) - len(refused) <= 2 * limit and answers[-1] in refused
    reason = f"too many announces from this node: at most {limit} a minute; announce again after the interval"
    assert refused[-1][b"failure reason"] == reason.encode()
    assert b"failure reason" not in announce(client, other, "10.0.0.2", ih, b"-GS0001-" + b"o" * 12, 6881)
    scrape = client.get(
        f"/tracker/{node_passkey(flooder)}/scrape",
        QUERY_STRING=f"info_hash={quote_from_bytes(ih)}",
        REMOTE_ADDR="10.6.6.6",
    )
    assert bdecode(scrape.content)[b"failure reason"].startswith(b"too many announces")  # type: ignore[index]
