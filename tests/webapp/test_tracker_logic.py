"""The tracker's pure logic: bencoding, announce validation, passkeys, compact peers, expiry, scrape."""

from __future__ import annotations

from urllib.parse import quote_from_bytes

import pytest

from webapp.tracker import logic
from webapp.tracker.logic import BencodeError, MemoryPeerStore, TrackerConfig, bdecode, bencode

IH = bytes(range(20))
IH2 = b"\xff" * 20


def _q(info_hash: bytes = IH, peer_id: bytes = b"-LT2110-aaaaaaaaaaaa", **kw: object) -> str:
    params = {"port": 6881, "uploaded": 0, "downloaded": 0, "left": 100, "compact": 1, **kw}
    parts = [f"info_hash={quote_from_bytes(info_hash)}", f"peer_id={quote_from_bytes(peer_id)}"]
    parts += [f"{k}={v}" for k, v in params.items() if v is not None]
    return "&".join(parts)


def _announce(
    query: str,
    ip: str = "10.0.0.1",
    passkey: str | None = None,
    store: MemoryPeerStore | None = None,
    now: float = 1000.0,
) -> dict:
    """Announce as the node of `passkey`; by default every peer id is its own node (a passkey is one
    peer per torrent)."""
    if passkey is None:
        passkey = "good-" + logic.parse_query(query).get("peer_id", b"").hex()
    body = logic.announce(
        query,
        ip,
        passkey,
        passkey_ok=lambda k: k.startswith("good"),
        torrent_known=lambda h: h in (IH, IH2),
        store=store if store is not None else MemoryPeerStore(),
        config=TrackerConfig(interval_s=60),
        now=now,
    )
    out = bdecode(body)
    assert isinstance(out, dict)
    return out


def test_bencode_round_trips_and_sorts_keys_as_bytes() -> None:
    value = {"peers": b"\x7f\x00\x00\x01\x1a\xe1", "interval": 1800, "a": [1, -2, "x"], "min interval": 0}
    raw = bencode(value)
    assert raw == b"d1:ali1ei-2e1:xe8:intervali1800e12:min intervali0e5:peers6:\x7f\x00\x00\x01\x1a\xe1e"
    assert bdecode(raw) == {
        b"a": [1, -2, b"x"],
        b"interval": 1800,
        b"min interval": 0,
        b"peers": b"\x7f\x00\x00\x01\x1a\xe1",
    }


def test_bencode_matches_libtorrent_when_it_is_installed() -> None:
    lt = pytest.importorskip("libtorrent")
    value = {"files": {IH: {"complete": 2, "incomplete": 0, "downloaded": 3}}, "x": [b"", 0]}
    assert bencode(value) == lt.bencode(value)


@pytest.mark.parametrize(
    "raw", [b"i01e", b"i-0e", b"ie", b"i1", b"5:abc", b"l", b"d1:ai1e", b"i1ei2e", b"di1ei2ee", b"x", b""]
)
def test_bdecode_rejects_malformed_input(raw: bytes) -> None:
    with pytest.raises(BencodeError):
        bdecode(raw)


def test_an_unknown_passkey_is_refused_with_a_failure_reason() -> None:
    assert _announce(_q(), passkey="stolen") == {b"failure reason": b"unknown passkey"}
    assert _announce(_q(), passkey="") == {b"failure reason": b"unknown passkey"}


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("peer_id=-LT2110-aaaaaaaaaaaa&port=1", b"missing info_hash"),
        (_q(info_hash=b"short"), b"invalid info_hash: 5 bytes, expected 20"),
        (_q(peer_id=b"x"), b"invalid peer_id: 1 bytes, expected 20"),
        (_q(port=0), b"invalid port: 0 is outside 1..65535"),
        (_q(port="http"), b"invalid port: not an integer"),
        (_q(port=None), b"missing port"),
        (_q(left=-1), b"invalid left: -1 is outside 0..9223372036854775808"),
        (_q(event="exploded"), b"invalid event 'exploded'"),
        ("%%%&&&==", b"missing info_hash"),
    ],
)
def test_a_malformed_announce_is_answered_with_a_bencoded_failure_reason(query: str, reason: bytes) -> None:
    assert _announce(query) == {b"failure reason": reason}


def test_an_unregistered_torrent_is_refused() -> None:
    assert _announce(_q(info_hash=b"\x01" * 20)) == {b"failure reason": b"unregistered torrent"}


def test_a_binary_info_hash_survives_url_encoding() -> None:
    a = logic.parse_announce(_q(info_hash=b"%&=+ \x00\xff" + bytes(13)), "127.0.0.1")
    assert a.info_hash == b"%&=+ \x00\xff" + bytes(13)


def test_peers_come_back_compact_without_the_announcing_peer() -> None:
    store = MemoryPeerStore()
    _announce(_q(peer_id=b"A" * 20, port=7001, left=0, event="completed"), ip="127.0.0.1", store=store)
    _announce(_q(peer_id=b"B" * 20, port=7002), ip="10.1.2.3", store=store)
    reply = _announce(_q(peer_id=b"C" * 20, port=7003), ip="::1", store=store)
    assert reply[b"interval"] == 60
    assert reply[b"complete"] == 1 and reply[b"incomplete"] == 2
    peers = reply[b"peers"]
    assert len(peers) == 12
    assert {peers[:6], peers[6:]} == {b"\x7f\x00\x00\x01\x1b\x59", b"\x0a\x01\x02\x03\x1b\x5a"}
    assert b"peers6" not in reply
    reply_a = _announce(_q(peer_id=b"A" * 20, port=7001, left=0), ip="127.0.0.1", store=store)
    assert reply_a[b"peers6"] == bytes(15) + b"\x01" + (7003).to_bytes(2, "big")


def test_numwant_limits_the_peer_list_and_non_compact_lists_dicts() -> None:
    store = MemoryPeerStore()
    for i in range(5):
        _announce(_q(peer_id=bytes([65 + i]) * 20, port=7000 + i), store=store)
    reply = _announce(_q(peer_id=b"Z" * 20, numwant=2), store=store)
    assert len(reply[b"peers"]) == 12
    reply = _announce(_q(peer_id=b"Z" * 20, compact=0, numwant=1), store=store)
    assert reply[b"peers"][0].keys() == {b"peer id", b"ip", b"port"}


def test_a_peer_that_stops_or_goes_silent_is_no_longer_handed_out() -> None:
    store = MemoryPeerStore()
    _announce(_q(peer_id=b"A" * 20), store=store, now=1000.0)
    _announce(_q(peer_id=b"B" * 20), store=store, now=1000.0)
    assert len(_announce(_q(peer_id=b"C" * 20), store=store, now=1001.0)[b"peers"]) == 12
    _announce(_q(peer_id=b"A" * 20, event="stopped"), store=store, now=1002.0)
    assert len(_announce(_q(peer_id=b"C" * 20), store=store, now=1003.0)[b"peers"]) == 6
    ttl = TrackerConfig(interval_s=60).ttl_s
    assert _announce(_q(peer_id=b"D" * 20), store=store, now=1003.0 + ttl + 1)[b"peers"] == b""


def test_a_node_is_one_peer_per_torrent_and_a_new_peer_id_replaces_its_old_one() -> None:
    store = MemoryPeerStore()
    for i in range(50):  # one passkey claiming fifty peers
        _announce(
            _q(peer_id=bytes([65 + i % 26]) * 19 + bytes([i]), port=7000 + i), passkey="good", store=store
        )
    reply = _announce(_q(peer_id=b"Z" * 20, numwant=200), store=store)
    assert reply[b"peers"] == bytes([10, 0, 0, 1]) + (7049).to_bytes(2, "big"), "only its latest claim"
    _announce(_q(peer_id=b"Y" * 20, event="stopped"), passkey="good", store=store)
    assert _announce(_q(peer_id=b"Z" * 20), store=store)[b"peers"] == b"", "it stopped, whatever its id"


def test_unverified_peers_come_after_verified_ones_and_never_outnumber_them() -> None:
    def peer(i: int, verified: bool, age: float) -> logic.Peer:
        return logic.Peer(bytes([i]) * 20, f"10.0.0.{i}", 7000 + i, 0, 1000.0 - age, i, verified)

    live = [peer(i, False, 0.0) for i in range(1, 31)] + [peer(i, True, i) for i in range(40, 43)]
    chosen = logic.favour_verified(live, 200)
    assert [p.verified for p in chosen] == [True] * 3 + [False] * 3
    assert [p.port for p in chosen[:3]] == [7040, 7041, 7042], "most recently seen first"
    assert logic.favour_verified(live, 2) == chosen[:2]
    assert logic.favour_verified([peer(1, False, 0.0)], 50) == [], "no verified peer: no unverified one"


def test_a_limited_node_is_refused_with_a_failure_reason_and_others_are_not() -> None:
    limiter = logic.MemoryAnnounceLimiter(per_min=3)

    def ask(passkey: str, now: float) -> dict:
        out = bdecode(
            logic.announce(
                _q(),
                "10.0.0.1",
                passkey,
                passkey_ok=lambda k: True,
                torrent_known=lambda h: True,
                store=MemoryPeerStore(),
                limiter=limiter,
                now=now,
            )
        )
        assert isinstance(out, dict)
        return out

    assert all(b"failure reason" not in ask("a", 60.0 + i) for i in range(3))
    refused = ask("a", 64.0)[b"failure reason"]
    assert refused.startswith(b"too many announces from this node: at most 3 a minute")
    assert b"failure reason" not in ask("b", 65.0)
    assert b"failure reason" not in ask("a", 120.0), "a new minute"


def test_scrape_reports_counts_for_known_torrents_only() -> None:
    store = MemoryPeerStore()
    _announce(_q(peer_id=b"A" * 20, left=0, event="completed"), store=store)
    _announce(_q(peer_id=b"B" * 20), store=store)
    other = quote_from_bytes(b"\x01" * 20)
    q = f"info_hash={quote_from_bytes(IH)}&info_hash={other}"

    def scrape(query: str, passkey: str = "good") -> object:
        return bdecode(
            logic.scrape(
                query,
                passkey,
                passkey_ok=lambda k: k == "good",
                torrent_known=lambda h: h == IH,
                store=store,
                now=1000.0,
            )
        )

    assert scrape(q) == {b"files": {IH: {b"complete": 1, b"incomplete": 1, b"downloaded": 1}}}
    assert scrape(q, passkey="bad") == {b"failure reason": b"unknown passkey"}
    assert scrape("") == {b"failure reason": b"missing info_hash (a full scrape is not offered)"}


def test_scrape_url_follows_the_announce_convention() -> None:
    assert logic.scrape_url("http://h/tracker/pk/announce") == "http://h/tracker/pk/scrape"
    assert logic.scrape_url("http://h/announce.php?x=1") == "http://h/scrape.php?x=1"
    assert logic.scrape_url("http://h/track") is None
