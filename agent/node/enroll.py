"""`enroll` and `run`: the agent subcommands that talk to the control plane (added to agent.cli)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path

from agent import defaults, logsafe
from agent.eventloop import run_loop
from agent.node.config import (
    ConfigError,
    NodeConfig,
    add_native_arguments,
    default_config_path,
    default_data_dir,
    load_config,
    post_json,
    save_config,
)

log = logging.getLogger("agent.cli")


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def enroll(server: str, token: str, name: str, timeout_s: float = defaults.ENROLL_TIMEOUT_S) -> NodeConfig:
    """Exchange a one-time enrollment token for node credentials (raises ConfigError with the reason)."""
    server = server.rstrip("/")
    if not server.startswith(("http://", "https://")):
        raise ConfigError(f"--server must be an http(s) URL, not {server!r}")
    data = post_json(
        server + "/api/agent/enroll", {"token": token, "name": name}, "enrollment refused", timeout_s
    )
    return NodeConfig(
        server=server,
        node_id=data["node_id"],
        secret=data["secret"],
        public_key=data["public_key"],
        name=name,
        release_public_key=str(data.get("release_public_key") or ""),
    )


def cmd_enroll(args: argparse.Namespace) -> int:
    path = Path(args.config) if args.config else default_config_path()
    if path.exists() and not args.force:
        return _fail(f"{path} already exists (this node is enrolled); pass --force to enroll again")
    try:
        cfg = enroll(args.server, args.token, args.name or socket.gethostname())
    except ConfigError as e:
        return _fail(str(e))
    save_config(cfg, path)
    print(f"enrolled as {cfg.node_id}; credentials saved to {path} (0600)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from agent.node.control import AgentRejected, ControlAgent
    from agent.node.dataplane import DataPlane, start_dataplane
    from agent.node.update import EXIT_RESTART, Updater
    from agent.wire.routetoken import TokenError, load_public_key

    path = Path(args.config) if args.config else default_config_path()
    try:
        cfg = load_config(path)
        public_key = load_public_key(cfg.public_key)
    except (ConfigError, TokenError) as e:
        return _fail(str(e))
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    data_dir.mkdir(parents=True, exist_ok=True)
    node_tls = None
    if (args.advertise_url or "").startswith("https://"):  # mutual TLS with a certificate from the CA
        from agent.node.certs import obtain_certificate

        try:
            node_tls = obtain_certificate(cfg, path, args.advertise_url)
        except ConfigError as e:
            return _fail(str(e))
    dp = DataPlane(
        cfg.node_id,
        public_key,
        kv_budget_bytes=int(args.kv_budget_mb * (1 << 20)),
        cache_type=args.cache_type,
        flash_attn=args.flash_attn,
        mtp=args.mtp,
        client_ssl=node_tls.client() if node_tls else None,
    )

    async def main() -> int:
        runner = await start_dataplane(
            dp, args.host, args.port, ssl_context=node_tls.server() if node_tls else None
        )
        port = args.port or next(iter(runner.addresses))[1]
        url = args.advertise_url or f"http://{args.host}:{port}"
        agent = ControlAgent(
            cfg,
            dp,
            url,
            data_dir,
            n_threads=args.threads,
            torrent_listen=None if args.no_torrent else args.torrent_listen,
            torrent_cert=node_tls.torrent_certificate() if node_tls else None,
        )
        if args.speed:
            agent.speed = args.speed
        agent.updater = Updater(
            data_dir,
            cfg.release_public_key,
            cfg.server,
            {"Authorization": cfg.authorization()},
            dp,
            agent.request_restart,
        )
        print(f"node {cfg.node_id}: data plane on {url}, control plane {cfg.server}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await agent.run(stop)
        except AgentRejected as e:
            print(f"error: {e}; enroll again with a new token", file=sys.stderr)
            return 3
        finally:
            await runner.cleanup()
        return EXIT_RESTART if agent.restart_requested else 0

    return run_loop(main())


def add_control_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `enroll` and `run` on the agent CLI's subparsers."""
    s = sub.add_parser("enroll", help="exchange an enrollment token for node credentials")
    s.add_argument(
        "--server", required=True, help=f"control plane URL, e.g. http://10.0.0.5:{defaults.WEB_PORT}"
    )
    s.add_argument("--token", required=True, help="one-time enrollment token from the fleet page")
    s.add_argument("--name", help="node name shown in the dashboard (default: hostname)")
    s.add_argument("--config", help=f"node config file (default {default_config_path()})")
    s.add_argument("--force", action="store_true", help="overwrite an existing node config")
    s.set_defaults(func=cmd_enroll)

    s = sub.add_parser("run", help="serve the data plane and follow the control plane's commands")
    s.add_argument("--config", help=f"node config file (default {default_config_path()})")
    s.add_argument(
        "--data-dir", help="where model files go (default: $GGUF_SWARM_DATA or ~/.local/share/gguf-swarm)"
    )
    s.add_argument("--host", default=defaults.DATAPLANE_HOST, help="data plane bind address")
    s.add_argument("--port", type=int, default=0, help="data plane port (0: any free port)")
    s.add_argument("--advertise-url", help="data plane URL other nodes and the control plane use")
    s.add_argument("--threads", type=int, default=defaults.N_THREADS)
    s.add_argument("--kv-budget-mb", type=float, default=defaults.KV_BUDGET_BYTES / (1 << 20))
    add_native_arguments(s)
    s.add_argument(
        "--torrent-listen",
        default=defaults.TORRENT_LISTEN,
        help="libtorrent listen interface(s), e.g. 127.0.0.1:0 (port 0 or a taken port: any free port)",
    )
    s.add_argument(
        "--no-torrent", action="store_true", help="never use the swarm; fetch shards with HTTP range requests"
    )
    s.add_argument(
        "--speed", type=float, default=0.0, help="report this compute speed instead of measuring it (tests)"
    )
    s.set_defaults(func=cmd_run)

    from agent.node.update import add_update_commands

    add_update_commands(sub)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="gguf-swarm-agent", description="GGUF Swarm node agent (control commands)"
    )
    p.add_argument("-v", "--verbose", action="store_true")
    add_control_commands(p.add_subparsers(dest="cmd", required=True))
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logsafe.install()  # no passkey, token or secret reaches the agent's log (issue 17)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
