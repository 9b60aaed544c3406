"""`agent doctor` (its checks and exit code) and `agent install-service` (the unit it writes)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.cli import main

UNIT_NAME = "gguf-swarm-agent.service"


@pytest.fixture
def healthz() -> Iterator[str]:
    """A stand-in control plane answering GET /healthz (the doctor only reads its status)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, dict[str, str]]]:
    rc = main(["doctor", "--json", "--torrent-listen", "", *args])
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] == (rc == 0)
    return rc, {c["name"]: c for c in report["checks"]}


def test_doctor_reaches_the_control_plane_and_fails_when_it_is_down(
    healthz: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, checks = doctor(capsys, "--server", healthz, "--data-dir", str(tmp_path))
    assert checks["control plane"]["status"] == "ok" and "HTTP 200" in checks["control plane"]["detail"]
    assert checks["memory"]["status"] in ("ok", "warn") and "free of" in checks["memory"]["detail"]
    assert checks["data dir"]["status"] == "ok"
    assert "backends" in checks
    assert rc == (1 if any(c["status"] == "FAIL" for c in checks.values()) else 0)

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    rc, checks = doctor(capsys, "--server", dead, "--timeout", "1", "--data-dir", str(tmp_path))
    assert rc == 1 and checks["control plane"]["status"] == "FAIL"


def test_doctor_says_whether_the_data_plane_port_is_free_or_already_served(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _, checks = doctor(capsys, "--port", str(port), "--data-dir", str(tmp_path))
        assert (
            checks["data plane port"]["status"] == "warn" and "in use" in checks["data plane port"]["detail"]
        )
    _, checks = doctor(capsys, "--port", str(port), "--data-dir", str(tmp_path))
    assert checks["data plane port"]["status"] == "ok" and "free" in checks["data plane port"]["detail"]


def test_doctor_text_report_lists_every_check_with_its_status(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = main(["doctor", "--torrent-listen", "", "--data-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert all(name in out for name in ("version", "backends", "memory", "data plane port", "control plane"))
    assert out.rstrip().endswith("ready") == (rc == 0)


def write_unit(tmp_path: Path, *args: str) -> tuple[str, str]:
    out = tmp_path / UNIT_NAME
    rc = main(["install-service", "--out", str(out), *args])
    assert rc == 0
    return out.read_text(), str(out)


def test_install_service_writes_a_unit_for_a_dedicated_user_restarting_on_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, path = write_unit(
        tmp_path, "--user", "swarm", "--config", "/etc/gguf-swarm/node.json", "--command", "run"
    )
    printed = capsys.readouterr().out
    lines = text.splitlines()
    assert "User=swarm" in lines and "Group=swarm" in lines
    assert "Restart=on-failure" in lines
    exec_start = next(line for line in lines if line.startswith("ExecStart="))
    assert exec_start == (
        f"ExecStart={sys.executable} -m agent run --config /etc/gguf-swarm/node.json --data-dir /var/lib/gguf-swarm"
    )
    assert "StateDirectory=gguf-swarm" in lines and "UMask=0077" in lines
    assert "NoNewPrivileges=yes" in lines and "WantedBy=multi-user.target" in lines
    assert oct(Path(path).stat().st_mode & 0o777) == "0o644"  # the unit holds no secret
    # how to enable it, and the config file kept 0600 for the user
    assert "systemctl enable --now gguf-swarm-agent.service" in printed
    assert "chmod 0600 /etc/gguf-swarm/node.json" in printed and "useradd --system" in printed


def test_install_service_runs_under_the_update_launcher_when_the_agent_has_one(tmp_path: Path) -> None:
    from agent.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    text, _ = write_unit(tmp_path, "--env", "GGSWARM_DEVICE=CUDA0")
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    if "launch" in sub.choices:  # type: ignore[operator]  # argparse's _SubParsersAction.choices is a dict
        assert " -m agent launch -- --config " in exec_start
    else:
        assert " -m agent run --config " in exec_start
    assert "Environment=GGSWARM_DEVICE=CUDA0" in text and "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID" in text


def test_systemd_analyze_verifies_the_generated_unit(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed on this host")
    _, path = write_unit(tmp_path, "--command", "run")
    proc = subprocess.run([tool, "verify", path], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # the unit's own lines raise no complaint (systemd may still mention unrelated host units)
    assert UNIT_NAME not in proc.stderr, proc.stderr


def test_install_service_explains_a_path_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["install-service", "--out", str(blocker / UNIT_NAME)]) == 2
    assert "cannot write" in capsys.readouterr().err
