"""The delaying TCP relay (agent/dev/relay.py) on 127.0.0.1: the delay each way, order, half-close, the
child process and its live delay changes."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.dev.relay import Delay, Relay, RelayProcess


@pytest.fixture
def echo() -> Iterator[int]:
    """An echo server: sends back what it reads until the peer half-closes, then closes its side."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


def round_trip(port: int, payload: bytes) -> tuple[bytes, float]:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += s.recv(65536)
        elapsed = time.perf_counter() - t0
        s.shutdown(socket.SHUT_WR)
        assert s.recv(1) == b""  # the half-close went through and came back
    return got, elapsed


def test_a_relay_delays_each_direction_and_keeps_the_order(echo: int) -> None:
    relay = Relay(("127.0.0.1", 0), ("127.0.0.1", echo), Delay(0.02))
    try:
        payload = bytes(range(256)) * 400  # several chunks
        got, elapsed = round_trip(relay.address[1], payload)
        assert got == payload
        assert 0.04 <= elapsed < 0.2
    finally:
        relay.close()


def test_jitter_adds_up_to_its_bound_and_a_burst_shares_one_draw() -> None:
    d = Delay(0.01, 0.004, seed=1)
    due, arrived = d.due(100.0, (0.0, 0.0))
    assert 100.01 <= due < 100.014 and arrived == 100.0
    # 0.1 ms later: the same burst, so it leaves with the chunk ahead of it
    assert d.due(100.0001, (due, arrived))[0] == due


def test_the_relay_process_takes_a_new_delay_live_and_exits_when_closed(echo: int, tmp_path: Path) -> None:
    relay = RelayProcess([(("127.0.0.1", 0), ("127.0.0.1", echo))], tmp_path / "relay.log")
    try:
        port = relay.addresses[0][1]
        # no delay yet: the quickest of three trips is well under the 50 ms a 25 ms delay adds (one trip
        # alone took 32 ms on a loaded CI machine, its connections' set-up included)
        assert min(round_trip(port, b"x" * 100)[1] for _ in range(3)) < 0.05
        relay.set_delay(25.0)
        assert round_trip(port, b"x" * 100)[1] >= 0.05
    finally:
        relay.close()
    assert relay.proc.poll() is not None


def test_the_relay_process_opens_more_relays_live_each_dialling_from_the_source_given(tmp_path: Path) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    seen: list[str] = []

    def serve() -> None:
        while True:
            try:
                conn, peer = srv.accept()
            except OSError:
                return
            with conn:
                seen.append(peer[0])
                conn.sendall(b"hi")

    threading.Thread(target=serve, daemon=True).start()
    upstream = ("127.0.0.1", srv.getsockname()[1])
    relay = RelayProcess([], tmp_path / "relay.log")
    try:
        plain, sourced = relay.add([(("127.0.0.1", 0), upstream)]) + relay.add(
            [(("127.0.0.1", 0), upstream)], source="127.0.0.2"
        )
        assert relay.addresses == [plain, sourced]
        for address in (plain, sourced):
            with socket.create_connection(address) as s:
                assert s.recv(2) == b"hi"
        # the service sees the second relay's callers at the source address it was given
        assert seen == ["127.0.0.1", "127.0.0.2"]
        with pytest.raises(RuntimeError, match="refused"):
            relay.add([(plain, upstream)])  # its port is taken: an answer, not a hang
    finally:
        relay.close()
        srv.close()
