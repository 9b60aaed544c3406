"""`agent doctor`: what this host offers the swarm, and what would stop `agent run` from working.

Checks, each `ok`, `warn` or `FAIL` (a FAIL makes the exit code 1): the agent's version; the backends
that import (none: FAIL); the native library and the ggml devices it sees (free/total memory, the one
shards go on); NVIDIA GPUs through NVML; free host memory and disk; the node config (enrolled?); the
data-plane and torrent ports (free to bind, or already served); and the control plane, by an HTTP GET
of its /healthz with a short timeout (unreachable: FAIL). `--json` prints the same as one object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from agent import __version__, defaults

OK, WARN, FAIL = "ok", "warn", "FAIL"
HEALTH_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: str  # ok, warn, FAIL
    detail: str


def _mb(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def check_backends() -> list[Check]:
    from agent.backends import available_backends, ggswarm_lib

    names = available_backends()
    out = [
        Check(
            "backends",
            OK if names else FAIL,
            ", ".join(names) if names else "none imports (install the llamacpp extra)",
        )
    ]
    try:
        ggswarm_lib.load_library()
        out.append(Check("native library", OK, str(ggswarm_lib.library_path())))
    except OSError as e:
        out.append(Check("native library", WARN, f"{e} (the native backend is off)"))
    return out


def check_devices() -> list[Check]:
    from agent.node.gpu import compute_device, ggml_devices, nvml_gpus

    out = []
    try:
        devices = ggml_devices()
    except OSError:
        devices = []
    chosen = compute_device(devices) if devices else None
    for d in devices:
        mem = f", {_mb(d.free_bytes)} free of {_mb(d.total_bytes)}" if d.total_bytes else ""
        mark = " <- shards go here" if chosen is not None and d.name == chosen.name else ""
        out.append(Check(f"ggml device {d.name}", OK, f"{d.kind}: {d.description}{mem}{mark}"))
    gpus = nvml_gpus()
    for g in gpus:
        parts = [g.name, f"{_mb(g.memory_free_bytes or 0)} free of {_mb(g.memory_bytes)}"]
        if g.utilization_percent is not None:
            parts.append(f"{g.utilization_percent:.0f}% busy")
        if g.temperature_c is not None:
            parts.append(f"{g.temperature_c:.0f} C")
        if g.power_w is not None:
            parts.append(f"{g.power_w:.0f} W")
        out.append(Check(f"gpu {g.index}", OK, ", ".join(parts)))
    if not gpus:
        out.append(Check("gpus", OK, "no NVIDIA GPU seen through NVML (the gpu extra installs nvidia-ml-py)"))
    if chosen is not None and chosen.kind == "gpu" and not gpus:
        out.append(Check("gpu telemetry", WARN, f"shards run on {chosen.name} but NVML is missing"))
    return out


def check_memory(data_dir: Path) -> list[Check]:
    import psutil

    vm = psutil.virtual_memory()
    out = [
        Check(
            "memory", OK if vm.available > 256 << 20 else WARN, f"{_mb(vm.available)} free of {_mb(vm.total)}"
        )
    ]
    probe = data_dir if data_dir.exists() else next((p for p in data_dir.parents if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    writable = os.access(probe, os.W_OK)
    out.append(
        Check(
            "data dir",
            OK if writable else FAIL,
            f"{data_dir}: {_mb(free)} free" + ("" if writable else f" ({probe} is not writable)"),
        )
    )
    return out


def check_port(name: str, host: str, port: int) -> Check:
    """Free to bind (what `run` needs), or already answering (an agent is running)."""
    if port == 0:
        return Check(name, OK, f"{host}:0 (any free port)")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return Check(name, OK, f"{host}:{port} is free")
    except OSError as e:
        probe = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
        try:
            with socket.create_connection((probe, port), timeout=1.0):
                return Check(
                    name, WARN, f"{host}:{port} is in use and answers (is the agent already running?)"
                )
        except OSError:
            return Check(name, FAIL, f"{host}:{port} cannot be bound: {e.strerror or e}")


def check_control_plane(server: str, timeout_s: float = HEALTH_TIMEOUT_S) -> Check:
    url = server.rstrip("/") + "/healthz"
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            ms = (time.perf_counter() - t0) * 1000
            return Check("control plane", OK, f"{url}: HTTP {r.status} in {ms:.0f} ms")
    except urllib.error.HTTPError as e:
        return Check("control plane", FAIL, f"{url}: HTTP {e.code}")
    except (urllib.error.URLError, OSError, ValueError) as e:
        return Check("control plane", FAIL, f"{url}: {getattr(e, 'reason', e)}")


def run_checks(args: argparse.Namespace) -> list[Check]:
    from agent.node.config import ConfigError, default_config_path, default_data_dir, load_config

    checks = [Check("version", OK, f"gguf-swarm-agent {__version__}, Python {sys.version.split()[0]}")]
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir(create=False)
    for name, group in (
        ("backends", check_backends),
        ("devices", check_devices),
        ("memory", lambda: check_memory(data_dir)),
    ):
        try:
            checks += group()
        except Exception as e:  # noqa: BLE001 - a doctor reports a broken install instead of crashing on it
            checks.append(Check(name, FAIL, f"{type(e).__name__}: {e}"))
    server = args.server
    config = Path(args.config) if args.config else default_config_path()
    try:
        cfg = load_config(config)
        checks.append(Check("node config", OK, f"{config}: node {cfg.node_id} of {cfg.server}"))
        server = server or cfg.server
    except ConfigError as e:
        checks.append(Check("node config", FAIL if args.config else WARN, str(e)))
    checks.append(check_port("data plane port", args.host, args.port))
    if args.torrent_listen:
        host, _, port = args.torrent_listen.rpartition(":")
        checks.append(check_port("torrent port", host.strip("[]") or "0.0.0.0", int(port or 0)))
    if server:
        checks.append(check_control_plane(server, args.timeout))
    else:
        checks.append(Check("control plane", WARN, "no --server and no node config: not checked"))
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_checks(args)
    failed = [c for c in checks if c.status == FAIL]
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.status:<5} {c.name:<{width}}  {c.detail}")
        print(f"\n{len(failed)} problem(s)" if failed else "\nready")
    return 1 if failed else 0


def add_doctor_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `doctor` on the agent CLI's subparsers."""
    s = sub.add_parser("doctor", help="check this host: backends, devices, memory, ports, control plane")
    s.add_argument("--config", help="node config file (default: the one `enroll` wrote)")
    s.add_argument("--server", help="control plane URL to check (default: the node config's)")
    s.add_argument(
        "--data-dir", help="where model files go (default: $GGUF_SWARM_DATA or ~/.local/share/gguf-swarm)"
    )
    s.add_argument("--host", default=defaults.DATAPLANE_HOST, help="data plane bind address")
    s.add_argument("--port", type=int, default=0, help="data plane port `run` will use (0: any)")
    s.add_argument(
        "--torrent-listen", default=defaults.TORRENT_LISTEN, help="libtorrent listen interface ('' skips)"
    )
    s.add_argument(
        "--timeout", type=float, default=HEALTH_TIMEOUT_S, help="control plane /healthz timeout (s)"
    )
    s.add_argument("--json", action="store_true", help="print the checks as JSON")
    s.set_defaults(func=cmd_doctor)
