"""The web and the swarm under the hostile load of issue 33, on a live cluster on 127.0.0.1 (prints JSON last).

    nice -n 10 python bench/abuse.py [--backend native] [--rounds 6] [--rate-s 60] [--honest-nodes 19]
                                     [--only web,streams,web,streams]

A control plane (webapp/devcluster.py: daphne through webapp.serve; PostgreSQL, Redis and Celery when
DATABASE_URL / REDIS_URL are set) and two agents serving SmolLM2 in two hops. The attacks are the tests'
own (agent/dev/hostile.py; docs/security.md, the sections of issue 33), each bounded in count and time;
nothing here asserts a target.

* web_stall_ms_p99_during_abuse: /healthz (answered on the web's event loop, an async view since 2026-12-07;
  a sync one before, through the thread pool) timed back to back while one key sends a 9.9 MB prompt, 8,000
  and 250,000 messages, three 7,500-special-token chats and 100k-deep JSON (chat, anonymous enrollment, the
  playground socket), and anonymous bodies: 1 GiB to /healthz, an endless chunked one, 64 GiB declared to
  /models/register. web_rss_growth_mb_1gib_upload: the web's peak RSS while the 1 GiB is pushed, minus before.
* hop_chat_success_during_slowloris: the share of --chats API chats (spread over --slowloris-s) that succeed
  while each hop holds --stalled-per-hop stalled connections from 127.0.0.1 (the web's address; four
  kinds), each reopened --reopen-s after the hop closes it.
* ttft_ratio_other_user_during_10_streams: another user's time to first token of a ~150-token prompt while
  one user asks for --streams streams at once (a key each; a refusal retried after --retry-s) over the
  same with that user idle, medians of --rounds alternating rounds.
* requests_per_min_one_user_many_keys: one user makes --keys keys (the page caps them) and sends GET
  /v1/models round-robin over them, paced evenly over --rate-s: the most answered within any 60 s.
* honest_peer_share_after_poisoning: --honest-nodes enrolled, online nodes announce the model's torrent,
  then one more (online, at its enrolled address) announces --claims made-up peers; the share of an honest
  node's 200-peer answer that is not one of them. These nodes are stand-ins in this process: the agent's
  real control connection (agent.node.control.ControlAgent) and a data plane answering its health check.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import http.client
import itertools
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.dev import hostile as h  # noqa: E402
from agent.dev.hostile import GIB, MIB, Stalled, address  # noqa: E402
from bench._abuse_common import LoopThread, shell, until  # noqa: E402
from bench._abuse_tracker import poisoning  # noqa: E402
from bench._common import cpu_kind  # noqa: E402
from bench.api import api_stream  # noqa: E402

PASSWORD = "bench-abuse-password-1"
SETTINGS = ("API_USER_RATE_PER_MIN", "USER_MAX_STREAMS", "API_KEYS_PER_USER", "TRACKER_ANNOUNCES_PER_MIN")
PARAGRAPH = (
    "The harbour town kept its records in a long room above the customs house, where clerks copied the "
    "names of ships, their cargo, their masters and the weather of each arrival into ledgers bound in "
    "green cloth. Over two centuries the ledgers filled three walls, and the town's children learned to "
    "read from them, tracing the names of schooners and steamers that had long since sunk or been broken "
    "up for their timber and iron. "
)
PARTS = ("web", "slowloris", "streams", "keys", "tracker")  # in the order a full run takes them
TARGETS = {
    "web_stall_ms_p99_during_abuse": "<= 250",
    "web_rss_growth_mb_1gib_upload": "<= 50",
    "hop_chat_success_during_slowloris": "1.0",
    "honest_peer_share_after_poisoning": ">= 0.9",
    "requests_per_min_one_user_many_keys": "<= 1.1 x user_limit_per_min",
    "ttft_ratio_other_user_during_10_streams": "<= 1.5",
}


def new_key(c: Any, name: str) -> str | None:
    """A new API key through the keys page, as its user makes one; None when the page refuses."""
    code, html = c.post("/api-keys/new", {"name": name})
    m = re.search(r'id="new-key-secret">(sk-swarm-[^<]+)<', html)
    return m.group(1) if code == 200 and m else None


def status_of(reply: bytes) -> int:
    """The status code of a raw HTTP answer (0: none came)."""
    parts = reply.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


# -- items 1, 2 and 6: the web server -------------------------------------------------------------------
def web_abuse(s: Any, key: str, model: str) -> dict[str, Any]:
    addr, got, spans = address(s.base), dict[str, Any](), dict[str, tuple[int, int]]()
    pid = s.web.pid
    probe = h.HealthProbe(addr)

    def attack(name: str, fn: Callable[[], Any]) -> None:
        i = len(probe.ms)
        got[name] = fn()
        spans[name] = (i, len(probe.ms) + 1)  # and the probe in flight when it ended

    def post(path: str, body: str, auth: bool = True) -> int:
        c = http.client.HTTPConnection(*addr, timeout=120)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if auth else {})}
        c.request("POST", path, body=body, headers=headers)
        r = c.getresponse()
        r.read()
        c.close()
        return r.status

    def chat(messages: list[dict[str, str]]) -> Callable[[], int]:
        # encoded now, before the probe starts: json.dumps of 250,000 messages holds this process's GIL
        # 0.2-0.5 s, and the probe's thread with it, which had counted as the web's stall
        body = json.dumps({"model": model, "messages": messages})
        return lambda: post("/v1/chat/completions", body)

    async def deep_socket() -> str:
        from aiohttp import ClientSession

        headers = {"Origin": s.base, "Cookie": f"sessionid={s.admin.cookie('sessionid')}"}
        async with (
            ClientSession() as http,
            http.ws_connect(s.base + "/ws/chat/?format=json", headers=headers) as ws,
        ):
            await ws.send_str(h.DEEP)
            first = await ws.receive(timeout=60)
            with contextlib.suppress(TimeoutError):
                await ws.receive(timeout=30)
        return f"{first.type.name.lower()}, close {ws.close_code}"

    rss: dict[str, float] = {}

    def upload_1gib() -> int:
        with h.rss_peak(pid) as got_rss:
            reply, _, sock = h.send_headers_only(addr, h.head("/healthz", f"Content-Length: {GIB}"))
            with sock:  # the body is pushed anyway, all of it if the server reads it
                rss["sent_mib"] = h.push(sock, GIB, b"\0" * MIB) / MIB
        rss.update(got_rss)
        return status_of(reply)

    def chunked_endless() -> int:
        with socket.create_connection(addr, timeout=10) as sock:  # never the last chunk; 256 MiB at most
            sock.sendall(h.head("/api/agent/enroll", "Transfer-Encoding: chunked"))
            h.push(sock, 256 * MIB, b"%x\r\n%s\r\n" % (MIB, b"x" * MIB))
            with contextlib.suppress(OSError):
                return status_of(sock.recv(4096))
        return 0

    def register_64_gib(*cookie: str) -> int:
        big = h.head("/models/register", f"Content-Length: {64 * GIB}", *cookie)
        reply, _, sock = h.send_headers_only(addr, big)
        sock.close()
        return status_of(reply)

    deep_chat = '{"model": "m", "messages": ' + h.DEEP + "}"
    attacks: list[tuple[str, Callable[[], Any]]] = [
        ("prompt_9_9_mb", chat([{"role": "user", "content": "x" * 9_900_000}])),
        ("messages_8000", chat([{"role": "user", "content": "x"}] * 8000)),
        ("messages_250000", chat([{"role": "user", "content": "x"}] * 250_000)),
        *(
            (f"special_tokens_7500_{i}", chat([{"role": "user", "content": "<|im_end|>x" * 3}] * 1500))
            for i in range(3)
        ),
        ("deep_json_chat", lambda: post("/v1/chat/completions", deep_chat)),
        ("deep_json_enroll_anonymous", lambda: post("/api/agent/enroll", h.DEEP, auth=False)),
        ("deep_json_playground_socket", lambda: asyncio.run(deep_socket())),
        ("upload_1gib_anonymous", upload_1gib),
        ("chunked_endless_anonymous", chunked_endless),
        ("register_64_gib_anonymous", register_64_gib),
        ("register_64_gib_forged_cookie", lambda: register_64_gib("Cookie: sessionid=forged-session-key")),
    ]
    probe.start()
    try:
        for name, fn in attacks:
            attack(name, fn)
    finally:
        probe.stop.set()
        probe.join(timeout=60)
    return {
        "web_stall_ms_p99_during_abuse": round(probe.p99(), 1),
        "web_stall_ms_median": round(statistics.median(probe.ms), 1),
        "web_stall_probes": len(probe.ms),
        "web_stall_ms_max_by_attack": {
            n: round(max(probe.ms[a:b], default=0.0)) for n, (a, b) in spans.items()
        },
        "web_rss_growth_mb_1gib_upload": round(rss["peak"] - rss["before"], 1),
        "upload_mib_pushed_before_the_close": round(rss["sent_mib"], 1),
        "abuse_statuses": got,
    }


# -- item 3: stalled clients on both hops -----------------------------------------------------------------
class Slowloris(LoopThread):
    """Keeps `per_hop` stalled connections (the four kinds in turn) open to each hop, each reopened
    `reopen_s` after the hop closes it, until stopped or `max_conns` were opened."""

    def __init__(self, frames: dict[str, bytes], per_hop: int, reopen_s: float, max_conns: int) -> None:
        super().__init__()
        self.frames, self.per_hop, self.reopen_s, self.max_conns = frames, per_hop, reopen_s, max_conns
        self.opened = self.closed_by_hop = 0
        self.held_max_s = 0.0

    async def main(self, quit: asyncio.Event) -> None:
        tasks: list[asyncio.Task[None]] = []
        every: list[list[Stalled]] = []
        for url, frame in self.frames.items():
            kinds = [h.STALL_KINDS[i % len(h.STALL_KINDS)] for i in range(self.per_hop)]
            every.append([await h.stall(url, kind, frame) for kind in kinds])
            self.opened += len(kinds)
            tasks.append(asyncio.create_task(h.trickle(every[-1], frame)))
            tasks += [asyncio.create_task(self._slot(url, frame, every[-1], i)) for i in range(len(kinds))]
        self.started.set()
        await quit.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for st in itertools.chain.from_iterable(every):
            st.writer.close()

    async def _slot(self, url: str, frame: bytes, stalled: list[Stalled], i: int) -> None:
        while self.opened < self.max_conns:
            await stalled[i].wait_closed(3600)
            self.closed_by_hop += 1
            self.held_max_s = max(self.held_max_s, stalled[i].closed - stalled[i].opened)
            while self.opened < self.max_conns:
                await asyncio.sleep(self.reopen_s)
                with contextlib.suppress(OSError):
                    stalled[i] = await h.stall(url, stalled[i].kind, frame)
                    self.opened += 1
                    break


def slowloris(s: Any, client: Any, model: str, args: argparse.Namespace) -> dict[str, Any]:
    from agent.dev.cluster import health
    from agent.node.admission import ANON_PER_IP
    from agent.wire.ids import SessionId
    from agent.wire.routetoken import load_private_key, mint

    key = load_private_key(s.data_dir / "route_key.pem")
    frames = {}
    for n in s.admin.status()["nodes"]:
        for sh in n["shards"]:
            a, b, sha = sh["layer_start"], sh["layer_end"], sh["model_sha256"]
            token = mint(key, SessionId(os.urandom(16)), sha, a, b, n["id"])
            frames[n["dataplane_url"]] = h.ids_frame(token, os.urandom(16), [1, 2, 3])  # never sent whole
    attack = Slowloris(frames, args.stalled_per_hop, args.reopen_s, args.max_conns)
    attack.start()
    ok, took = 0, []
    try:
        if not attack.started.wait(120):
            raise RuntimeError("the stalled connections did not open within 120 s")
        # the hops hold as many anonymous requests as they allow ("slow headers" are not requests yet)
        want = min(ANON_PER_IP, args.stalled_per_hop - args.stalled_per_hop // len(h.STALL_KINDS))
        until(lambda: all(health(u)["anonymous"] >= want for u in frames), 30)
        t0 = time.monotonic()
        for i in range(args.chats):  # spread over --slowloris-s: the hops close and cut them meanwhile
            time.sleep(max(0.0, t0 + i * args.slowloris_s / args.chats - time.monotonic()))
            t = time.perf_counter()
            with contextlib.suppress(Exception):
                q = [{"role": "user", "content": f"Question {i}: name a colour."}]
                r = client.chat.completions.create(model=model, messages=q, max_tokens=8)
                ok += bool(r.choices and r.choices[0].message.content)
            took.append(time.perf_counter() - t)
        cut = sum(int(health(u)["anonymous_cut"]) for u in frames)
    finally:
        attack.stop()
    return {
        "hop_chat_success_during_slowloris": round(ok / args.chats, 3),
        "slowloris_chat_s_median": round(statistics.median(took), 2),
        "slowloris_connections_opened": attack.opened,
        "slowloris_closed_by_hops": attack.closed_by_hop,
        "slowloris_anonymous_cut": cut,
        "slowloris_held_s_max": round(attack.held_max_s, 1),
    }


# -- item 5: one user's many streams and many keys -------------------------------------------------------
class Streams:
    """One user asking for a stream on each of `clients`' threads (a key each) while `go` is set; a
    refusal is retried after `retry_s`."""

    def __init__(self, clients: list[Any], model: str, tokens: int, retry_s: float) -> None:
        self.model, self.tokens, self.retry_s = model, tokens, retry_s
        self.go, self.quit, self.lock = threading.Event(), threading.Event(), threading.Lock()
        self.active = self.started = self.refused = self.errors = 0
        self.threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in clients]
        for t in self.threads:
            t.start()

    def _count(self, **deltas: int) -> None:
        with self.lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def _run(self, client: Any) -> None:
        import openai

        while not self.quit.is_set():
            if not self.go.wait(0.2):
                continue
            ask = [
                {"role": "user", "content": f"Story {uuid.uuid4().hex[:8]}: a lighthouse keeper and his log."}
            ]
            try:
                stream = client.chat.completions.create(
                    model=self.model, messages=ask, max_tokens=self.tokens, stream=True
                )
            except openai.APIError as e:
                refused = getattr(e, "status_code", 0) == 429
                self._count(refused=int(refused), errors=int(not refused))
                self.quit.wait(self.retry_s)
                continue
            self._count(active=1, started=1)
            try:
                for _ in stream:
                    pass
            except openai.APIError:
                self._count(errors=1)
            finally:
                self._count(active=-1)

    def close(self) -> None:
        self.go.clear()
        self.quit.set()
        for t in self.threads:
            t.join(timeout=120)


def fairness(other: Any, streams: Streams, model: str, rounds: int, cap: int) -> dict[str, Any]:
    alone, during, running = [], [], []

    def ttft_ms(r: int) -> float:
        prompt = [{"role": "user", "content": f"Note {r}-{uuid.uuid4().hex[:6]}. {PARAGRAPH}Summarise it."}]
        return api_stream(other, model, prompt, 4)[0] * 1e3

    for r in range(rounds):
        streams.go.clear()
        until(lambda: streams.active == 0, 120)
        alone.append(ttft_ms(r))
        streams.go.set()
        until(lambda: streams.active >= cap, 30)
        running.append(streams.active)
        during.append(ttft_ms(r))
    streams.go.clear()
    a, d = statistics.median(alone), statistics.median(during)
    return {
        "ttft_ratio_other_user_during_10_streams": round(d / a, 3),
        "ttft_ms_other_user_alone": round(a, 1),
        "ttft_ms_other_user_during": round(d, 1),
        "ttft_ms_alone_rounds": [round(x) for x in alone],
        "ttft_ms_during_rounds": [round(x) for x in during],
        "heavy_user_streams_running_at_each_during": running,
        "heavy_user_streams_started": streams.started,
        "heavy_user_requests_refused_429": streams.refused,
        "heavy_user_errors": streams.errors,
    }


def many_keys(base: str, keys: list[str], rate_s: float, max_requests: int) -> dict[str, Any]:
    """GET /v1/models round-robin over `keys` on 4 connections, paced evenly over `rate_s`."""
    t0, counter, lock = time.monotonic(), itertools.count(), threading.Lock()
    answers: list[tuple[float, int]] = []

    def worker() -> None:
        c = http.client.HTTPConnection(*address(base), timeout=30)
        while (i := next(counter)) < max_requests:
            time.sleep(max(0.0, t0 + i * rate_s / max_requests - time.monotonic()))
            try:
                c.request("GET", "/v1/models", headers={"Authorization": f"Bearer {keys[i % len(keys)]}"})
                r = c.getresponse()
                r.read()
                code = r.status
            except (OSError, http.client.HTTPException):
                c.close()
                c, code = http.client.HTTPConnection(*address(base), timeout=30), 0
            with lock:
                answers.append((time.time(), code))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = sorted(t for t, code in answers if code == 200)
    minutes = sorted({int(t // 60) for t, _ in answers})
    return {
        "requests_per_min_one_user_many_keys": max(
            (bisect.bisect_left(ok, t + 60) - i for i, t in enumerate(ok)), default=0
        ),
        "rate_answered": len(ok),
        "rate_answered_per_clock_minute": [sum(int(t // 60) == m for t in ok) for m in minutes],
        "rate_refused_429": sum(code == 429 for _, code in answers),
        "rate_requests_sent": len(answers),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="native", help="the agents' backend (native, torch, llamacpp)")
    ap.add_argument("--rounds", type=int, default=6, help="TTFT rounds, alone and during the streams")
    ap.add_argument("--streams", type=int, default=10, help="streams the heavy user asks for at once")
    ap.add_argument("--stream-tokens", type=int, default=64, help="max_tokens of each of those streams")
    ap.add_argument("--retry-s", type=float, default=8.0, help="the heavy user's pause after a refusal")
    ap.add_argument("--keys", type=int, default=30, help="API keys the rate attacker tries to make")
    ap.add_argument("--rate-s", type=float, default=60.0, help="how long the rate attack runs")
    ap.add_argument("--rate-requests", type=int, default=3000, help="requests of the rate attack, at most")
    ap.add_argument("--stalled-per-hop", type=int, default=288, help="stalled connections per hop")
    ap.add_argument("--reopen-s", type=float, default=2.0, help="pause before a closed one is reopened")
    ap.add_argument("--max-conns", type=int, default=20000, help="stalled connections opened, at most")
    ap.add_argument("--chats", type=int, default=10, help="API chats during the stalled connections")
    ap.add_argument("--slowloris-s", type=float, default=30.0, help="the chats are spread over this long")
    ap.add_argument("--honest-nodes", type=int, default=19, help="honest nodes announcing the torrent")
    ap.add_argument("--claims", type=int, default=300, help="made-up peers the poisoner announces")
    ap.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"the parts to run, comma-separated (default all: {','.join(PARTS)}); repeat a part to run it "
        "again on the same cluster (keys of later runs end _2, _3...)",
    )
    args = ap.parse_args()
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    if unknown := set(parts) - set(PARTS):
        ap.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")

    import openai

    from webapp.core.adminclient import AdminClient
    from webapp.devcluster import control_plane

    result: dict[str, Any] = {"cpu": cpu_kind(), "backend": args.backend}
    with (
        tempfile.TemporaryDirectory(prefix="bench-abuse-") as tmp,
        control_plane(Path(tmp), DEFAULT_BACKEND=args.backend) as s,
    ):
        s.serve_smollm2(2)
        model, users = s.model["name"], ("mallory", "eve", "alice")
        limits = shell(
            s,
            "import json\nfrom django.conf import settings\nfrom django.contrib.auth import get_user_model\n"
            f"[get_user_model().objects.create_user(n, password={PASSWORD!r}) for n in {users!r}]\n"
            f"print(json.dumps({{k: getattr(settings, k) for k in {SETTINGS!r}}}))",
        )
        web = {name: AdminClient(s.base) for name in users}
        for name, c in web.items():
            c.login(name, PASSWORD)

        def api(key: str | None) -> Any:
            if key is None:
                raise RuntimeError("the keys page refused a key")
            return openai.OpenAI(base_url=s.base + "/v1", api_key=key, max_retries=0, timeout=300)

        alice = api(new_key(web["alice"], "alice"))
        heavy: list[Any] = []
        runs: dict[str, int] = {}

        def part(name: str) -> dict[str, Any]:
            if name == "web":
                print("web abuse (items 1, 2, 6)")
                return web_abuse(s, alice.api_key, model)
            if name == "slowloris":
                print("stalled clients on both hops (item 3)")
                return slowloris(s, alice, model, args)
            if name == "streams":
                print(f"{args.streams} streams of one user (item 5)")
                if not heavy:
                    heavy.extend(
                        api(k) for i in range(args.streams) if (k := new_key(web["eve"], f"eve-{i}"))
                    )
                streams = Streams(heavy, model, args.stream_tokens, args.retry_s)
                try:
                    cap = min(args.streams, limits["USER_MAX_STREAMS"])
                    return fairness(alice, streams, model, args.rounds, cap) | {"heavy_user_keys": len(heavy)}
                finally:
                    streams.close()
            if name == "keys":
                print(f"one user's many keys, {args.rate_s:.0f} s (item 5)")
                keys = [k for i in range(args.keys) if (k := new_key(web["mallory"], f"mallory-{i}"))]
                got = many_keys(s.base, keys, args.rate_s, args.rate_requests)
                return got | {
                    "user_limit_per_min": limits["API_USER_RATE_PER_MIN"],
                    "rate_keys_made": len(keys),
                }
            print("tracker poisoning (item 4)")
            return poisoning(s, args.honest_nodes, args.claims, Path(tmp) / f"stand-ins-{runs[name]}")

        for name in parts:
            runs[name] = runs.get(name, 0) + 1
            got = part(name)
            suffix = f"_{runs[name]}" if runs[name] > 1 else ""
            result |= {k + suffix: v for k, v in got.items()}
    print(json.dumps(result | {"targets": TARGETS, "limits": limits, "args": vars(args)}))


if __name__ == "__main__":
    main()
