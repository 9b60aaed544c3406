"""Signed auto-update end to end, with real processes on 127.0.0.1 and real wheels built during the test.

Agent A runs under the update launcher from a v1 wheel installed in a venv of its own (no checkout on
its path); agent B, from the checkout, serves SmolLM2. Pushed from the releases page: v2 while a chat
streams on B (the answer completes, A reports v2); a forged release (signed by another key, put in the
database as an attacker holding the web host could) is refused by A and reported; a v3 that crashes
at start is rolled back by A's launcher, A back on v2 within the stated time; finally the admin rolls
back the v2 rollout and A returns to v1. docs/control-plane.md ("Agent updates") has the rules.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession

from agent.node.update import install_wheel
from agent.procs import spawn
from agent.wire import release
from tests.integration.swarm import QUESTION, REPO, Swarm, control_plane

pytestmark = pytest.mark.slow

CONFIRM_S = 60  # the launcher's stated time for a new version to reconnect
V1, V2, V3, FORGED = "1.0.0", "2.0.0", "3.0.0", "4.0.0"


def _build_wheel(out: Path, version: str) -> Path:
    spec = importlib.util.spec_from_file_location(
        "build_agent_wheel", REPO / "scripts" / "build_agent_wheel.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return Path(mod.build_wheel(out, version=version))


def _with_crash_at_start(wheel: Path, out_dir: Path) -> Path:
    """The same wheel (same name) whose `python -m agent` raises at start; RECORD says the new hash."""
    member = "agent/__main__.py"
    out_dir.mkdir(parents=True)
    dest = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
        text = b'raise SystemExit("test release: deliberate crash at start")\n' + zin.read(member)
        digest = base64.urlsafe_b64encode(hashlib.sha256(text).digest()).rstrip(b"=").decode()
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == member:
                data = text
            elif item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = (
                    "\n".join(
                        f"{member},sha256={digest},{len(text)}" if ln.startswith(member + ",") else ln
                        for ln in lines
                    )
                    + "\n"
                ).encode()
            zout.writestr(item, data)
    return dest


def _post_wheel(s: Swarm, wheel: Path, signature: str) -> tuple[int, str]:
    """Publish through the releases page's form (multipart, CSRF), as a browser would."""
    b = uuid.uuid4().hex
    parts = [
        f'--{b}\r\nContent-Disposition: form-data; name="signature"\r\n\r\n{signature}\r\n'.encode(),
        f'--{b}\r\nContent-Disposition: form-data; name="wheel"; filename="{wheel.name}"\r\n'.encode()
        + b"Content-Type: application/octet-stream\r\n\r\n"
        + wheel.read_bytes()
        + b"\r\n",
        f"--{b}--\r\n".encode(),
    ]
    req = urllib.request.Request(
        s.base + "/releases/publish",
        data=b"".join(parts),
        method="POST",
        headers={
            "Content-Type": f"multipart/form-data; boundary={b}",
            "X-CSRFToken": s.admin.cookie("csrftoken"),
            "Referer": s.base + "/",
            "HX-Request": "true",
        },
    )
    try:
        with s.admin.opener.open(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _releases(s: Swarm) -> dict[str, Any]:
    code, body = s.admin.get("/releases/status.json")
    assert code == 200, body
    return dict(json.loads(body))


def _release_id(s: Swarm, version: str) -> int:
    return int(next(r["id"] for r in _releases(s)["releases"] if r["version"] == version))


def _roll_out(s: Swarm, version: str, node_id: str) -> int:
    code, body = s.admin.post(f"/releases/{_release_id(s, version)}/rollout", {"nodes": node_id})
    assert code == 200, body
    return int(next(ro["id"] for ro in _releases(s)["rollouts"] if ro["version"] == version))


def _wait_rollout(s: Swarm, rollout_id: int, states: tuple[str, ...], timeout_s: float) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        ro = next(ro for ro in _releases(s)["rollouts"] if ro["id"] == rollout_id)
        return ro if ro["state"] in states else None

    from agent.procs import wait_until

    return dict(wait_until(f"rollout {rollout_id} to be {states}", check, timeout_s, every_s=0.5))


def _node(s: Swarm, node_id: str) -> dict[str, Any]:
    return dict(next(n for n in _releases(s)["nodes"] if n["id"] == node_id))


def _wait_version(s: Swarm, node_id: str, version: str, timeout_s: float) -> None:
    from agent.procs import wait_until

    wait_until(
        f"{node_id} online on {version}",
        lambda: (n := _node(s, node_id))["state"] == "online" and n["version"] == version,
        timeout_s,
        every_s=0.5,
    )


async def _chat(s: Swarm, started: asyncio.Event, max_tokens: int) -> str:
    """One playground answer; `started` is set at its first streamed piece."""
    headers = {"Origin": s.base, "Cookie": f"sessionid={s.admin.cookie('sessionid')}"}
    parts: list[str] = []
    async with (
        ClientSession() as http,
        http.ws_connect(s.base + "/ws/chat/?format=json", headers=headers) as ws,
    ):
        await ws.send_json(
            {"type": "chat", "model": s.model["id"], "message": QUESTION, "max_tokens": max_tokens}
        )
        while True:
            ev = await ws.receive_json(timeout=180)
            if ev["type"] == "delta":
                parts.append(ev["text"])
                started.set()
            elif ev["type"] == "error":
                raise AssertionError(ev["error"])
            elif ev["type"] == "done":
                assert ev["text"] == "".join(parts)
                return str(ev["text"])


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    # three `pip wheel` runs of separate staged copies: side by side, not one after another
    with ThreadPoolExecutor(3) as pool:
        futures = {v: pool.submit(_build_wheel, out / v, v) for v in (V1, V2, V3)}
        built = {v: f.result() for v, f in futures.items()}
    built[V3] = _with_crash_at_start(built[V3], out / "v3-crash")
    return built


@pytest.fixture(scope="module")
def release_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A release key made with the admin's CLI: (private key file, public key)."""
    path = tmp_path_factory.mktemp("admin") / "release_key.pem"
    r = subprocess.run(
        [sys.executable, "-m", "agent", "release", "keygen", "--out", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert path.stat().st_mode & 0o077 == 0
    return path, r.stdout.strip()


def _sign(key: Path, wheel: Path) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "agent", "release", "sign", "--key", str(key), str(wheel)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return r.stdout.strip()


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: str, release_key: tuple[Path, str]
) -> Iterator[Swarm]:
    with control_plane(tmp_path_factory.mktemp("update-plane"), RELEASE_PUBLIC_KEY=release_key[1]) as s:
        yield s


def test_a_node_updates_is_refused_a_forged_release_and_rolls_back_a_crashing_one(
    swarm: Swarm, wheels: dict[str, Path], release_key: tuple[Path, str], tmp_path: Path
) -> None:
    s, (key, public) = swarm, release_key

    # B serves the model from the checkout; A runs under the launcher from a v1 venv of its own. A's
    # venv is made while B loads its shards; A starts only once they are placed (A holds none).
    with ThreadPoolExecutor(1) as pool:
        v1_install = pool.submit(install_wheel, wheels[V1], tmp_path / "installed-v1", V1)
        config_b, _ = s.enroll("agent-b")
        node_b = s.run_agent("agent-b", config_b)
        s.online([node_b])
        s.register_smollm2()
        code, body = s.admin.post(f"/models/{s.model['id']}/place", {"replicas": "1"})
        assert code == 200, body
        s.shards_ready()
        v1_python = v1_install.result()

    config_a, _ = s.enroll("agent-a")
    assert json.loads(config_a.read_text())["release_public_key"] == public  # pinned at enrollment
    env = {k: v for k, v in s.env.items() if k != "PYTHONPATH"}
    (tmp_path / "cwd").mkdir()
    agent_a = spawn(
        [str(v1_python), "-m", "agent", "launch", "--confirm-timeout-s", str(CONFIRM_S), "--"]
        + ["--config", str(config_a), "--data-dir", str(config_a.parent / "data"), "--threads", "1"]
        + ["--torrent-listen", "127.0.0.1:0", "--speed", "1"],
        s.logs / "agent-a.log",
        env=env,
        cwd=tmp_path / "cwd",
    )
    s.procs.append(agent_a)
    node_a = str(json.loads(config_a.read_text())["node_id"])
    _wait_version(s, node_a, V1, 120)

    # Publishing: a wheel signed by another key is refused by the page; v1 and v2 signed on the
    # admin's machine are published.
    code, body = _post_wheel(
        s, wheels[V2], release.sign(release.generate_key(), V2, wheels[V2].name, "0" * 64)
    )
    assert code == 400 and "not signed by the pinned release key" in body
    for v in (V1, V2, V3):
        code, body = _post_wheel(s, wheels[v], _sign(key, wheels[v]))
        assert code == 200 and f"published {v}" in body, body

    # v1 -> v2 on A while a chat streams on B: the answer completes, A reports v2.
    async def update_while_chatting() -> tuple[str, int]:
        started = asyncio.Event()
        chat = asyncio.create_task(_chat(s, started, max_tokens=64))
        await asyncio.wait_for(started.wait(), 180)
        rollout = await asyncio.to_thread(_roll_out, s, V2, node_a)
        return await chat, rollout

    answer, rollout = asyncio.run(update_while_chatting())
    assert answer.strip()
    ro = _wait_rollout(s, rollout, ("done", "failed"), 300)
    assert ro["state"] == "done" and ro["nodes"][0]["state"] == "updated", ro
    _wait_version(s, node_a, V2, 60)
    assert agent_a.poll() is None  # the same launcher, now running v2

    # A forged release (what an attacker holding the web host or its database could insert): refused
    # by the agent before anything is installed, reported, the rollout stopped, A still on v2.
    forged = wheels[V1].with_name(wheels[V1].name.replace(V1, FORGED))
    shutil.copy(wheels[V1], forged)
    sha = release.file_sha256(forged)
    dest = s.data_dir / "releases" / sha / forged.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(forged, dest)
    bad_sig = release.sign(release.generate_key(), FORGED, forged.name, sha)
    s.manage(
        "shell",
        "-c",
        "from webapp.releases.models import Release; Release.objects.create("
        f"version={FORGED!r}, filename={forged.name!r}, sha256={sha!r}, size={forged.stat().st_size}, "
        f"signature={bad_sig!r})",
    )
    ro = _wait_rollout(s, _roll_out(s, FORGED, node_a), ("done", "failed"), 120)
    assert ro["state"] == "failed" and ro["nodes"][0]["state"] == "refused", ro
    assert "not signed by the pinned release key" in ro["nodes"][0]["error"]
    assert not (config_a.parent / "data" / "versions" / FORGED / "venv").exists()
    assert _node(s, node_a)["version"] == V2

    # A release that crashes at start: the launcher rolls it back; A is back on v2 in the stated time.
    t0 = time.monotonic()
    ro = _wait_rollout(s, _roll_out(s, V3, node_a), ("done", "failed"), 300)
    assert ro["state"] == "failed" and ro["nodes"][0]["state"] == "rolled_back", ro
    assert "exited with status 1" in ro["nodes"][0]["error"] and "back on 2.0.0" in ro["nodes"][0]["error"]
    _wait_version(s, node_a, V2, CONFIRM_S)
    assert time.monotonic() - t0 < CONFIRM_S + 120  # install + drain + the stated time, with margin
    assert agent_a.poll() is None

    # The admin rolls back the v2 rollout: A goes back to v1 (a published release).
    code, body = s.admin.post(f"/rollouts/{rollout}/rollback", {})
    assert code == 200 and "going back to 1.0.0" in body, body
    back = next(r for r in _releases(s)["rollouts"] if r["rollback_of"] == rollout)
    ro = _wait_rollout(s, back["id"], ("done", "failed"), 300)
    assert ro["state"] == "done", ro
    _wait_version(s, node_a, V1, 60)
