"""The installable agent: a wheel built from this checkout, installed into a clean venv (no repository on
the path, run from a temporary directory), enrolls with a live control plane, loads a shard with the
native backend and serves a playground chat.

The clean venv gets llama-cpp-python from pip's wheel cache (the wheel `make setup` compiled once; never
rebuilt here), the agent wheel, and the agent's other dependencies from the package index pip is
configured with, installed by this checkout's pip (`pip --python <venv>`; the venv has no pip of its
own). No --system-site-packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from agent.procs import spawn
from scripts.build_agent_wheel import build_wheel
from tests.integration.swarm import QUESTION, control_plane

pytestmark = pytest.mark.slow

LLAMA_CPP = "llama_cpp_python-0.3.36-*.whl"


def cached_llama_cpp_wheel() -> Path | None:
    """The llama-cpp-python wheel pip built and cached when the checkout's venv was set up."""
    cache = Path(os.environ.get("PIP_CACHE_DIR") or Path.home() / ".cache" / "pip") / "wheels"
    found = sorted(cache.rglob(LLAMA_CPP), key=lambda p: p.stat().st_mtime) if cache.is_dir() else []
    return found[-1] if found else None


def clean_env(venv: Path) -> dict[str, str]:
    """The environment of a host that never saw the repository: no PYTHONPATH, the venv first on PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE")
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("GGSWARM_NATIVE_LIB", None)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv with the agent wheel installed; returns its interpreter."""
    llama = cached_llama_cpp_wheel()
    if llama is None:
        pytest.skip(f"no {LLAMA_CPP} in pip's wheel cache (run `make setup` once)")
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp / "dist")
    venv = tmp / "venv"
    # No pip inside the venv (ensurepip cost ~3 s of CPU): this checkout's pip installs into it with
    # --python, resolving against the venv's own interpreter and site-packages as its own pip would.
    # --no-compile: the byte code of every dependency is not needed; what runs compiles on import.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--disable-pip-version-check",
            "--no-compile",
            "-q",
            str(llama),
            f"{wheel}[llamacpp]",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp,
        env=clean_env(venv),
    )
    if proc.returncode != 0:
        pytest.fail(f"installing the wheel failed:\n{proc.stdout}\n{proc.stderr}")
    return python


def test_the_wheel_carries_the_native_library_and_imports_from_the_venv_only(
    installed: Path, tmp_path: Path
) -> None:
    venv = installed.parent.parent
    code = (
        "import json, agent, sys; from agent.backends import libggswarm, available_backends;"
        "libggswarm.load_library();"
        "print(json.dumps({'agent': agent.__file__, 'lib': str(libggswarm.library_path()),"
        " 'backends': available_backends(), 'path': sys.path}))"
    )
    out = subprocess.run(
        [str(installed), "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(venv),
        check=True,
    ).stdout
    info = json.loads(out)
    repo = str(Path(__file__).resolve().parents[2])
    assert info["agent"].startswith(str(venv)) and info["lib"].startswith(str(venv))
    assert info["lib"].endswith("agent/_native/libggswarm.so")
    assert "native" in info["backends"]
    assert not any(p.startswith(repo) for p in info["path"])
    # the console script and `doctor` work from the install too
    doctor = subprocess.run(
        [
            str(venv / "bin" / "gguf-swarm-agent"),
            "doctor",
            "--json",
            "--torrent-listen",
            "",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(venv),
    )
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["native library"]["status"] == "ok" and "native" in checks["backends"]["detail"]


async def test_an_installed_agent_enrolls_loads_a_native_shard_and_serves_a_chat(
    installed: Path, tmp_path: Path
) -> None:
    venv = installed.parent.parent
    env = clean_env(venv)
    home = tmp_path / "node"
    home.mkdir()
    with control_plane(tmp_path / "cp", DEFAULT_BACKEND="native") as s:
        token = s.admin.create_enrollment_token("wheel-node")
        config = home / "node.json"
        subprocess.run(
            [str(installed), "-m", "agent", "enroll", "--server", s.base, "--token", token]
            + ["--name", "wheel-node", "--config", str(config)],
            cwd=home,
            env=env,
            check=True,
            timeout=60,
        )
        node_id = json.loads(config.read_text())["node_id"]
        agent = spawn(
            [
                str(venv / "bin" / "gguf-swarm-agent"),
                "run",
                "--config",
                str(config),
                "--data-dir",
                str(home / "data"),
            ]
            + ["--threads", "1", "--no-torrent"],
            s.logs / "wheel-agent.log",
            env=env,
            cwd=home,
        )
        s.procs.append(agent)
        s.agents[node_id] = agent
        s.online([node_id])
        status = s.admin.status()
        node = next(n for n in status["nodes"] if n["id"] == node_id)
        assert "native" in node["backends"]

        s.register_smollm2()
        code, body = s.admin.post(f"/models/{s.model['id']}/place", {"replicas": "1"})
        assert code == 200, body
        s.shards_ready()
        with urllib.request.urlopen(node["dataplane_url"] + "/v1/health", timeout=10) as r:
            health = json.loads(r.read())
        assert [sh["backend"] for sh in health["shards"]] == ["native"]
        assert health["event_loop"] == "uvloop"  # a dependency of the wheel (agent/eventloop.py)

        texts, route = await s.playground_chat([QUESTION], max_tokens=16)
        assert "Paris" in texts[0], texts
        assert route
