"""The delaying TCP relay of the benches and the link harness: each chunk goes on a set one-way delay (plus jitter) after it arrived.

A `Relay` listens on one address and forwards every connection to one upstream address, both
directions delayed by the shared `Delay` (changeable while connections are open), chunks in the order
they arrived. It runs on threads blocked in `recv()` and `sleep()`, not on an event loop: a loop's timer
rounds a wait up to whole milliseconds and runs late while the loop's owner works, which would blur
the 0.5 ms links the harness emulates. `RelayProcess` runs a set of relays in a child process
(`python -m agent.dev.relay`) so that not even the caller's interpreter lock delays a chunk; it exits
when its parent closes its stdin or dies; `add()` opens more relays in it while it runs. A relay may
dial its upstream from a given source address (`source`): the link harness (agent/dev/links.py) makes
a root-namespace service see a namespace's caller at that namespace's host-side address, as a server
on the internet sees a node's public address. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

Address = tuple[str, int]
CHUNK = 1 << 16
READY_S = 30.0  # how long a relay process may take to say where it listens


BURST_GAP_S = 0.001  # chunks arriving closer together than this are one burst: they share one jitter


class Delay:
    """One-way delay and jitter (uniform in [0, jitter_s)) that a set of relays adds to every burst."""

    def __init__(self, delay_s: float = 0.0, jitter_s: float = 0.0, seed: int = 0) -> None:
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def set(self, delay_s: float, jitter_s: float = 0.0) -> None:
        with self._lock:
            self.delay_s, self.jitter_s = delay_s, jitter_s

    def due(self, arrived: float, previous: tuple[float, float]) -> tuple[float, float]:
        """(when a chunk that arrived at `arrived` leaves, its arrival) given the previous chunk's pair:
        never before the chunk ahead of it (TCP order), and a burst's chunks (a message split into
        records and reads) travel together, as packets of one message do on a path, rather than each
        drawing a jitter of its own (the message would then wait for the largest draw)."""
        last_due, last_arrived = previous
        with self._lock:
            if self.jitter_s > 0 and arrived - last_arrived < BURST_GAP_S and last_due > 0:
                return max(last_due, arrived + self.delay_s), arrived
            extra = self._rng.random() * self.jitter_s if self.jitter_s > 0 else 0.0
            return max(arrived + self.delay_s + extra, last_due), arrived


def _nodelay(s: socket.socket) -> None:
    # small frames must not wait for Nagle / delayed ACKs: they would add 40 ms stalls to a decode step
    with contextlib.suppress(OSError):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _shut(s: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(how)


class _Pipe:
    """One relayed connection: per direction a reader that stamps chunks and a writer that sends each
    when it is due."""

    def __init__(
        self, a: socket.socket, b: socket.socket, delay: Delay, on_done: Callable[[_Pipe], None]
    ) -> None:
        self.socks = (a, b)
        self.delay = delay
        self._left = 2
        self._lock = threading.Lock()
        self._on_done = on_done
        for src, dst in ((a, b), (b, a)):
            q: queue.Queue[tuple[float, bytes | None]] = queue.Queue()
            threading.Thread(target=self._read, args=(src, q), daemon=True).start()
            threading.Thread(target=self._write, args=(dst, q), daemon=True).start()

    def _read(self, src: socket.socket, q: queue.Queue[tuple[float, bytes | None]]) -> None:
        last = (0.0, 0.0)
        try:
            while data := src.recv(CHUNK):
                last = self.delay.due(time.monotonic(), last)
                q.put((last[0], data))
        except OSError:
            pass
        q.put((self.delay.due(time.monotonic(), last)[0], None))

    def _write(self, dst: socket.socket, q: queue.Queue[tuple[float, bytes | None]]) -> None:
        try:
            while True:
                due, data = q.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if data is None:
                    _shut(dst, socket.SHUT_WR)  # the half-close travels, delayed like the data
                    break
                dst.sendall(data)
        except OSError:
            for s in self.socks:  # a reset on one side ends both: unblocks the readers too
                _shut(s)
        with self._lock:
            self._left -= 1
            done = self._left == 0
        if done:
            for s in self.socks:
                s.close()
            self._on_done(self)

    def abort(self) -> None:
        for s in self.socks:
            _shut(s)


class Relay:
    """Listens on `listen` (port 0: one the system picks) and relays each connection to `upstream`,
    dialled from the `source` address when given (else the system's choice)."""

    def __init__(self, listen: Address, upstream: Address, delay: Delay, source: str | None = None) -> None:
        self.upstream = upstream
        self.delay = delay
        self.source = source
        self._sock = socket.create_server(listen, reuse_port=False)
        self.address: Address = self._sock.getsockname()[:2]
        self._pipes: set[_Pipe] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{self.address[0]}:{self.address[1]}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            try:
                bind = (self.source, 0) if self.source else None
                up = socket.create_connection(self.upstream, timeout=10.0, source_address=bind)
                up.settimeout(None)
            except OSError:
                conn.close()
                continue
            for s in (conn, up):
                _nodelay(s)
            with self._lock:
                if self._closed:
                    conn.close()
                    up.close()
                    return
                self._pipes.add(_Pipe(conn, up, self.delay, self._forget))

    def _forget(self, pipe: _Pipe) -> None:
        with self._lock:
            self._pipes.discard(pipe)

    def close(self) -> None:
        """Stop accepting and cut every relayed connection."""
        with self._lock:
            self._closed = True
            pipes = list(self._pipes)
        _shut(self._sock)  # unblocks accept() on Linux
        self._sock.close()
        for p in pipes:
            p.abort()


def pair_arg(listen: Address, upstream: Address, source: str | None = None) -> str:
    """A relay as the child process's command line and `add` command name it: LH:LP=UH:UP[@SOURCE]."""
    (lh, lp), (uh, up) = listen, upstream
    return f"{lh}:{lp}={uh}:{up}" + (f"@{source}" if source else "")


class RelayProcess:
    """Relays (listen -> upstream, port 0 picks one) in a child process sharing one delay; `addresses`
    are where they listen, in the order given (then `add()`'s)."""

    def __init__(self, pairs: Sequence[tuple[Address, Address]], log: Path, delay_ms: float = 0.0) -> None:
        cmd = [sys.executable, "-m", "agent.dev.relay", "--delay-ms", str(delay_ms)]
        for listen, upstream in pairs:
            cmd += ["--pair", pair_arg(listen, upstream)]
        root = Path(__file__).resolve().parents[2]
        with log.open("ab") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=root,
                env={**os.environ, "PYTHONPATH": str(root)},
                start_new_session=True,
            )
        try:
            ready = json.loads(self._line(READY_S))
        except BaseException:
            self.close()
            raise
        self.addresses: list[Address] = [(h, int(p)) for h, p in ready["listening"]]

    def _line(self, timeout_s: float) -> str:
        out = self.proc.stdout
        assert out is not None
        if not select.select([out], [], [], timeout_s)[0]:
            raise TimeoutError(f"the relay process did not answer within {timeout_s:g} s")
        line = out.readline().decode()
        if not line:
            raise RuntimeError(f"the relay process exited with {self.proc.wait()}")
        return line

    def add(self, pairs: Sequence[tuple[Address, Address]], source: str | None = None) -> list[Address]:
        """More relays in the running process (sharing its delay), each dialling its upstream from
        `source` when given; where they listen, in the order given."""
        assert self.proc.stdin is not None
        args = " ".join(pair_arg(listen, upstream, source) for listen, upstream in pairs)
        self.proc.stdin.write(f"add {args}\n".encode())
        self.proc.stdin.flush()
        answer = json.loads(self._line(10.0))
        if "listening" not in answer:
            raise RuntimeError(f"the relay process refused {args}: {answer.get('error')}")
        added = [(h, int(p)) for h, p in answer["listening"]]
        self.addresses += added
        return added

    def set_delay(self, delay_ms: float, jitter_ms: float = 0.0) -> None:
        """Every relay's one-way delay from now on (answered once the relays apply it)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"delay {delay_ms} {jitter_ms}\n".encode())
        self.proc.stdin.flush()
        if self._line(10.0).strip() != "ok":
            raise RuntimeError("the relay process refused the delay")

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # the child exits at EOF
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _address(text: str) -> Address:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def _relay(pair: str, delay: Delay) -> Relay:
    listen, rest = pair.split("=")
    upstream, _, source = rest.partition("@")
    return Relay(_address(listen), _address(upstream), delay, source or None)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agent.dev.relay", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pair", action="append", default=[], help="LISTEN_HOST:PORT=UPSTREAM_HOST:PORT[@SOURCE_HOST]"
    )
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    delay = Delay(args.delay_ms / 1e3, args.jitter_ms / 1e3)
    relays = [_relay(pair, delay) for pair in args.pair]
    print(json.dumps({"listening": [list(r.address) for r in relays]}), flush=True)
    for line in sys.stdin:  # commands until the parent closes stdin (or dies)
        words = line.split()
        if len(words) == 3 and words[0] == "delay":
            delay.set(float(words[1]) / 1e3, float(words[2]) / 1e3)
            print("ok", flush=True)
        elif len(words) >= 2 and words[0] == "add":
            added = []
            try:
                for pair in words[1:]:
                    added.append(_relay(pair, delay))
            except (OSError, ValueError) as e:  # a port taken meanwhile: the caller hears why
                for r in added:  # all or none
                    r.close()
                print(json.dumps({"error": str(e)}), flush=True)
                continue
            relays += added
            print(json.dumps({"listening": [list(r.address) for r in added]}), flush=True)
        else:
            print("error", flush=True)
    for r in relays:
        r.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
