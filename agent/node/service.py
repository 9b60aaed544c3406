"""`agent install-service`: a systemd unit that runs this agent as a dedicated user, and how to enable it.

The unit runs the interpreter of the environment the agent is installed in (`sys.executable`, so
the wheel's venv), as a system user with no login and no home of its own; its data (model files, the
self-update's side environments) lives in `StateDirectory=` (/var/lib/gguf-swarm, 0700) and its node
config (a secret: 0600, owned by that user) in /etc/gguf-swarm. It restarts on failure; an update
asks its launcher, not systemd, to restart it (agent/node/update.py). Hardening keeps the rest of
the file system read-only to it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

DEFAULT_UNIT = Path("/etc/systemd/system/gguf-swarm-agent.service")
DEFAULT_USER = "gguf-swarm"
DEFAULT_CONFIG = Path("/etc/gguf-swarm/node.json")
STATE_DIR = "gguf-swarm"  # StateDirectory=: /var/lib/gguf-swarm


def unit_text(
    python: str,
    user: str = DEFAULT_USER,
    config: Path = DEFAULT_CONFIG,
    command: str = "run",
    run_args: list[str] | None = None,
    environment: dict[str, str] | None = None,
) -> str:
    """The unit file's text."""
    data_dir = f"/var/lib/{STATE_DIR}"
    run = ["--config", str(config), "--data-dir", data_dir, *(run_args or [])]
    # `launch` supervises `run` (self-update, rollback) and passes it everything after `--`
    argv = [python, "-m", "agent", *(["launch", "--"] if command == "launch" else ["run"]), *run]
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "PYTHONUNBUFFERED": "1", **(environment or {})}
    env_lines = "".join(f"Environment={shlex.quote(f'{k}={v}')}\n" for k, v in sorted(env.items()))
    venv = str(Path(python).parent.parent)
    return f"""\
# GGUF Swarm node agent (written by `agent install-service`; docs/agent-install.md)
[Unit]
Description=GGUF Swarm node agent
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
User={user}
Group={user}
ExecStart={shlex.join(argv)}
Restart=on-failure
RestartSec=5
# a long drain (answers in flight) finishes before systemd kills the agent
TimeoutStopSec=120
{env_lines}StateDirectory={STATE_DIR}
StateDirectoryMode=0700
UMask=0077
NoNewPrivileges=yes
PrivateTmp=yes
ProtectSystem=full
ProtectHome=read-only
ProtectKernelTunables=yes
ProtectControlGroups=yes
RestrictSUIDSGID=yes
ReadWritePaths={config.parent} {data_dir}
ReadOnlyPaths={venv}
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
"""


def instructions(unit: Path, user: str, config: Path, python: str) -> str:
    """What an admin runs next (as root)."""
    q = shlex.quote
    name = unit.name
    return f"""\
wrote {unit}

As root, once:
  useradd --system --home-dir /var/lib/{STATE_DIR} --no-create-home --shell /usr/sbin/nologin {q(user)}
  install -d -m 0700 -o {q(user)} -g {q(user)} {q(str(config.parent))}
  runuser -u {q(user)} -- {q(python)} -m agent enroll --config {q(str(config))} --server URL --token TOKEN
  chmod 0600 {q(str(config))}
  systemctl daemon-reload
  systemctl enable --now {q(name)}

Then: systemctl status {q(name)}; journalctl -u {q(name)} -f; {q(python)} -m agent doctor --config {q(str(config))}
"""


def cmd_install_service(args: argparse.Namespace) -> int:
    python = args.python or sys.executable
    command = args.command or ("launch" if "launch" in args.available_commands else "run")
    env: dict[str, str] = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"error: --env wants K=V, not {item!r}", file=sys.stderr)
            return 2
        env[key] = value
    text = unit_text(python, args.user, Path(args.config), command, args.run_arg, env)
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o644)  # systemd warns about world-writable units; the unit holds no secret
        os.replace(tmp, out)
    except OSError as e:
        print(f"error: cannot write {out}: {e.strerror or e} (run as root, or pass --out)", file=sys.stderr)
        return 2
    print(instructions(out, args.user, Path(args.config), python))
    return 0


def add_service_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `install-service` on the agent CLI's subparsers."""
    s = sub.add_parser("install-service", help="write a systemd unit for this agent and say how to enable it")
    s.add_argument("--out", default=str(DEFAULT_UNIT), help=f"unit file to write (default {DEFAULT_UNIT})")
    s.add_argument("--user", default=DEFAULT_USER, help="the dedicated system user it runs as")
    s.add_argument("--config", default=str(DEFAULT_CONFIG), help="node config file (0600, owned by --user)")
    s.add_argument("--python", help="interpreter of the agent's venv (default: this one)")
    s.add_argument(
        "--command", choices=["run", "launch"], help="default: launch (self-update) when present, else run"
    )
    s.add_argument("--run-arg", action="append", default=[], help="extra argument for `run` (repeatable)")
    s.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="extra Environment= (repeatable)"
    )
    # the subparsers' own table: at parse time it holds every command, `launch` too when it exists
    s.set_defaults(func=cmd_install_service, available_commands=sub.choices)
