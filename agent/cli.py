"""Command line of the node agent: inspect, tiny, keygen, serve, chat, doctor, install-service (and
enroll/run when present)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agent import __version__, defaults, logsafe
from agent.eventloop import run_loop
from agent.node.config import add_native_arguments
from agent.wire import frames
from agent.wire.ids import SessionId

if TYPE_CHECKING:
    from agent.client.route import Hop


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _parse_layers(text: str) -> tuple[int, int]:
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"layers must look like A:B, not {text!r}") from None


def _read_key_arg(value: str) -> str:
    """A key given inline, or as @path to a file holding it."""
    return Path(value[1:]).read_text() if value.startswith("@") else value


# -- inspect ----------------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    from agent.artifacts.manifest import ManifestError, build_manifest, format_manifest
    from agent.backends.check import with_executor_check

    try:
        m = with_executor_check(build_manifest(args.model), args.model)
    except ManifestError as e:
        return _fail(str(e))
    print(m.to_json() if args.json else format_manifest(m))
    if args.json and m.servable_problem:
        # the text form says it in its "servable" line; JSON readers get it on stderr
        print(m.servable_problem, file=sys.stderr)
    return 0


# -- tiny -------------------------------------------------------------------------------------------
def cmd_tiny(args: argparse.Namespace) -> int:
    from agent.artifacts import tiny

    return tiny.run(args)


# -- keygen -----------------------------------------------------------------------------------------
def cmd_keygen(args: argparse.Namespace) -> int:
    from agent.wire.routetoken import generate_key, private_key_pem, public_key_b64

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key = generate_key()
    priv = out / "route_key.pem"
    fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_key_pem(key))
    (out / "route_key.pub").write_text(public_key_b64(key.public_key()) + "\n")
    print(f"private key: {priv} (0600)\npublic key:  {out / 'route_key.pub'}")
    return 0


# -- serve ------------------------------------------------------------------------------------------
# Commands that compute for a route. libgomp (OpenMP: llama-cpp-python's ggml is built with it, and
# torch) keeps a finished graph's worker threads spinning (its default GOMP_SPINCOUNT of 300,000)
# before they sleep. A hop that has just answered would spin on the core the route's next hop needs
# (bench/archive/idle_threads.py), so serving processes cap the spin at 10,000 iterations (tens of us): idle
# workers sleep almost at once. Not OMP_WAIT_POLICY=PASSIVE: ggml's barrier between the ops of a
# graph is an OpenMP barrier, and passive waits put every thread to sleep at every op (llama.cpp
# decode 126 -> 44 tok/s on SmolLM2, docs/benchmarks-log.md "Quiet re-run and a correction"). An
# operator's setting wins.
SERVING_COMMANDS = ("serve", "run", "launch")
IDLE_THREADS_ENV = {"GOMP_SPINCOUNT": "10000"}


def sleep_idle_threads(env: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """Set IDLE_THREADS_ENV in `env` unless the wait policy or spin count is set already; returns what
    was set. libgomp reads these once, when it loads: call this before any backend library."""
    if any(k in env for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
        return {}
    env.update(IDLE_THREADS_ENV)
    return dict(IDLE_THREADS_ENV)


def cmd_serve(args: argparse.Namespace) -> int:
    from agent.artifacts.manifest import ManifestError, build_manifest
    from agent.artifacts.packaged import ModelNotFound, packaged_model_path
    from agent.backends import available_backends
    from agent.backends.base import BackendError
    from agent.node.dataplane import DataPlane, start_dataplane
    from agent.wire.routetoken import TokenError, load_public_key

    try:
        path = str(packaged_model_path(args.model[4:])) if args.model.startswith("pkg:") else args.model
        manifest = build_manifest(path, hash_tensors=False)
        public_key = load_public_key(_read_key_arg(args.public_key))
    except (ManifestError, TokenError, ModelNotFound, OSError) as e:
        return _fail(str(e))
    a, b = args.layers if args.layers else (0, manifest.n_layers)
    backend = args.backend or (available_backends() or [defaults.DEFAULT_BACKEND])[0]
    if args.threads < 1:
        return _fail("--threads must be at least 1")
    node_id = args.node_id or f"node-{args.port}"
    tls_files = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(tls_files) and not all(tls_files):
        return _fail("--tls-cert, --tls-key and --tls-ca go together")
    server_ssl = client_ssl = None
    if all(tls_files):
        from agent.wire import tls

        try:
            cert, key, ca = (Path(f) for f in tls_files)
            server_ssl = tls.server_context(cert, key, ca)
            client_ssl = tls.client_context(cert, key, ca)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            return _fail(f"TLS files: {e}")
    dp = DataPlane(
        node_id,
        public_key,
        kv_budget_bytes=int(args.kv_budget_mb * (1 << 20)),
        cache_type=args.cache_type,
        flash_attn=args.flash_attn,
        mtp=args.mtp,
        session_ttl_s=args.session_ttl,
        client_ssl=client_ssl,
    )
    try:
        dp.load_shard(path, manifest, a, b, backend=backend, n_threads=args.threads)
    except (BackendError, ManifestError) as e:
        return _fail(str(e))

    async def main() -> None:
        runner = await start_dataplane(dp, args.host, args.port, ssl_context=server_ssl)
        scheme = "https" if server_ssl is not None else "http"
        print(
            f"serving {manifest.name} layers {a}:{b} ({backend}) as {node_id} on {scheme}://{args.host}:{args.port}",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    run_loop(main())
    return 0


# -- chat -------------------------------------------------------------------------------------------
async def _discover_hops(urls: list[str], key_path: str, session: SessionId, ttl_s: int) -> list[Hop]:
    """Development route: ask each hop what it holds and mint its token with a local signing key."""
    from aiohttp import ClientSession

    from agent.client.recovery import minted_hops
    from agent.wire.httpjson import read_json
    from agent.wire.routetoken import RouteHop, load_private_key

    key = load_private_key(key_path)
    plan: list[RouteHop] = []
    model_sha: str | None = None
    async with ClientSession() as http:
        for url in urls:
            async with http.get(url.rstrip("/") + "/v1/health") as r:
                info = await read_json(r)
            shard = next(
                (
                    s
                    for s in info["shards"]
                    if model_sha in (None, s["model_sha256"])
                    and s["layer_start"] == (plan[-1].layer_end if plan else 0)
                ),
                None,
            )
            if shard is None:
                raise RuntimeError(f"{url} holds no shard continuing the route")
            model_sha = shard["model_sha256"]
            plan.append(RouteHop(info["node_id"], url, shard["layer_start"], shard["layer_end"]))
    if model_sha is None:
        raise RuntimeError("a route needs at least one hop")
    # each token names the next hop: chain mode forwards only there
    return minted_hops(key, session, model_sha, plan, ttl_s)


def cmd_chat(args: argparse.Namespace) -> int:
    from agent.artifacts.packaged import packaged_model_path
    from agent.client.route import RouteClient, RouteError
    from agent.client.tokenizer import ChatTokenizer
    from agent.wire.sampling import SamplingParams

    model = str(packaged_model_path(args.model[4:])) if args.model.startswith("pkg:") else args.model
    tok = ChatTokenizer(model)
    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )

    async def main() -> int:
        session = SessionId(os.urandom(16))
        hops = await _discover_hops(
            args.route.split(","), args.signing_key, session, defaults.ROUTE_TOKEN_TTL_S
        )
        provider = None
        if args.replicas:  # failover: a failed hop's layers move to one of these (issue 14)
            from agent.client.recovery import ReplicaProvider
            from agent.wire.routetoken import load_private_key

            urls = args.route.split(",") + args.replicas.split(",")
            provider = ReplicaProvider(urls, load_private_key(args.signing_key), session)
        client = RouteClient(
            hops,
            tok,
            session_id=session,
            mode=args.mode,
            hidden_dtype=args.hidden_dtype,
            capacity=args.capacity,
            replacements=provider,
        )
        try:
            async for ev in client.chat(
                [{"role": "user", "content": args.prompt}], sampling, args.max_tokens
            ):
                if ev.done:
                    print("\n" + json.dumps(ev.telemetry, indent=None if args.json else 2), file=sys.stderr)
                else:
                    print(ev.text, end="", flush=True)
        except RouteError as e:
            print(f"\nerror: {e}", file=sys.stderr)
            return 1
        finally:
            await client.close()
        return 0

    return run_loop(main())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gguf-swarm-agent", description="GGUF Swarm node agent")
    p.add_argument("--version", action="version", version=__version__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("inspect", help="print a GGUF's manifest")
    s.add_argument("model")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("tiny", help="write a tiny random-weight GGUF of an architecture (tests, bench)")
    from agent.artifacts.tiny import add_arguments

    add_arguments(s)
    s.set_defaults(func=cmd_tiny)

    s = sub.add_parser("keygen", help="create a development route-token signing key")
    s.add_argument("--out", default=".")
    s.set_defaults(func=cmd_keygen)

    s = sub.add_parser("serve", help="serve a layer range over the binary data plane")
    s.add_argument("--model", required=True, help="GGUF path, or pkg:smollm2")
    s.add_argument("--layers", type=_parse_layers, help="A:B (default: all layers)")
    s.add_argument("--backend", choices=defaults.BACKENDS, help="default: the first this host has")
    s.add_argument("--host", default=defaults.DATAPLANE_HOST)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--public-key", required=True, help="route-token public key (base64 or PEM), or @file")
    s.add_argument("--node-id")
    s.add_argument("--threads", type=int, default=defaults.N_THREADS)
    s.add_argument("--kv-budget-mb", type=float, default=defaults.KV_BUDGET_BYTES / (1 << 20))
    add_native_arguments(s)
    s.add_argument("--session-ttl", type=float, default=defaults.SESSION_TTL_S)
    # mutual TLS as an enrolled node has it (agent/node/certs.py), from files a swarm CA issued; the
    # link harness (agent/dev/links.py) serves this way across its network namespaces
    s.add_argument("--tls-cert", help="this hop's certificate (PEM); with --tls-key and --tls-ca")
    s.add_argument("--tls-key", help="its private key (PEM)")
    s.add_argument("--tls-ca", help="the swarm CA (PEM) that clients and next hops must be signed by")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("chat", help="chat through a route of serving hops")
    s.add_argument("prompt")
    s.add_argument("--route", required=True, help="comma-separated hop URLs in layer order")
    s.add_argument("--replicas", default="", help="node URLs that may replace a failed hop")
    s.add_argument("--model", default="pkg:smollm2", help="GGUF path for the tokenizer, or pkg:NAME")
    s.add_argument("--signing-key", required=True, help="route-token private key (PEM) from keygen")
    s.add_argument("--mode", choices=list(defaults.ROUTE_MODES), default="star")
    s.add_argument("--hidden-dtype", choices=frames.HIDDEN_DTYPES, default=frames.DEFAULT_HIDDEN_DTYPE)
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument(
        "--capacity",
        type=int,
        default=defaults.SESSION_CAPACITY,
        help="positions the session may hold (prompt + completion)",
    )
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repeat-penalty", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true", help="print telemetry as one JSON line")
    s.set_defaults(func=cmd_chat)

    try:
        from agent.node.enroll import add_control_commands
    except ImportError:
        pass
    else:
        add_control_commands(sub)
    from agent.node.doctor import add_doctor_command
    from agent.node.service import add_service_command

    add_doctor_command(sub)
    add_service_command(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd in SERVING_COMMANDS:
        sleep_idle_threads()  # before the backend's libraries load (nothing above loads them)
        from agent.backends.libggswarm import check_barrier_env
        from agent.node.prefill_budget import budget_from_env
        from agent.node.prefixes import cache_bytes_from_env
        from agent.node.scheduler import busy_chunk_from_env, gather_gap_from_env

        try:
            busy_chunk_from_env()  # a bad override is a clear error now, not at the first shard
            gather_gap_from_env()
            budget_from_env()
            cache_bytes_from_env(0)
            check_barrier_env()
        except ValueError as e:
            print(f"agent: error: {e}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logsafe.install()  # no passkey, token or secret reaches the agent's log (issue 17)
    t0 = time.perf_counter()
    rc = int(args.func(args))
    logging.getLogger("agent.cli").debug("%s took %.2fs", args.cmd, time.perf_counter() - t0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
