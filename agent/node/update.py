"""Signed self-update: install a release into a side environment, restart into it, roll back by itself.

Two processes share the work (docs/control-plane.md, "Agent updates"):

* **The launcher** (`agent launch [run options]`, standard library only, never imports a release) runs
  `python -m agent run ...` as its child with the interpreter of the current version, and is what a
  service manager starts. It alone writes `<data>/versions/state.json`.
* **The running agent** (`Updater`, driven by the control client's `update` command) checks the
  signature against the release key pinned at enrollment, downloads the wheel from the control plane,
  checks its size and sha256, installs it into a fresh `<data>/versions/<version>/venv` (no pip, no
  network: the wheel is installed with `--no-deps` and a .pth file lends the dependencies of the
  environment it runs in), drains (new sessions are refused; answers in flight finish, up to
  `drain_timeout_s`), writes `versions/request.json` and exits with `EXIT_RESTART`.

The launcher then starts the requested version on trial. The trial is confirmed when the new agent's
control socket is welcomed (it writes `versions/confirmed-<version>`); if the child exits first, or
`confirm_timeout_s` passes, the launcher stops it and starts the previous version again, recording
the rollback. A launcher that dies mid-trial finds the unconfirmed trial in state.json when restarted
and rolls back then, so a release that crashes at start can never strand a node. Whichever version
runs next reports the outcome (`update_status`) once connected.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import site
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from agent import __version__
from agent.wire import release
from agent.wire.control import MAX_STR, Update, UpdateStatus

log = logging.getLogger("agent.node.update")

DIST_NAME = "gguf-swarm-agent"
EXIT_RESTART = 75  # the agent asks its launcher to start the requested version
ENV_SUPERVISED = "GGUF_SWARM_LAUNCHER"  # set by the launcher: an agent without it cannot restart itself
ENV_TRIAL = "GGUF_SWARM_TRIAL"  # the version on trial, when the child is one
CONFIRM_TIMEOUT_S = 60.0  # a new version must be welcomed by the control plane within this long
DRAIN_TIMEOUT_S = 60.0  # the longest an update waits for answers in flight
QUIET_S = 2.0  # no data-plane frame for this long: no answer is in flight
STATE_VERSION = 1


class UpdateError(Exception):
    """An update that cannot go on; `state` is what the control plane is told (refused or failed)."""

    def __init__(self, text: str, state: str = "failed") -> None:
        super().__init__(text)
        self.state = state


def running_version() -> str:
    """The version of the agent code that is running (the installed wheel's, else the source tree's)."""
    with contextlib.suppress(metadata.PackageNotFoundError):
        dist = metadata.distribution(DIST_NAME)
        top = Path(str(dist.locate_file("agent")))
        if top.resolve() == Path(__file__).resolve().parents[1]:
            return str(dist.version)
    return __version__


# --- the versions directory (shared by the launcher and the agent) -------------------------------------


class VersionStore:
    """`<data>/versions/`: one folder per installed version, the launcher's state and the hand-offs."""

    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir / "versions"

    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    @property
    def request_path(self) -> Path:
        return self.root / "request.json"

    def version_dir(self, version: str) -> Path:
        release.statement(version, "x.whl", "0" * 64)  # refuses a version that could be a path
        return self.root / version

    def python(self, version: str) -> Path:
        return self.version_dir(version) / "venv" / "bin" / "python"

    def confirm_path(self, version: str) -> Path:
        return self.root / f"confirmed-{version}"

    def read_state(self) -> dict[str, Any]:
        try:
            data = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            data = {}
        return {
            "version": STATE_VERSION,
            "current": None,
            "previous": None,
            "trial": None,
            "last": None,
        } | data

    def write_state(self, state: dict[str, Any]) -> None:
        _write_json(self.state_path, state)

    def confirm(self, version: str) -> None:
        _write_json(self.confirm_path(version), {"version": version, "at": time.time()})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically (a reader sees the old file or the new one, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# --- installing a wheel into a side environment ----------------------------------------------------------


def base_site_packages() -> list[str]:
    """Where the running agent finds its dependencies: the new version borrows them.

    Every site-packages on sys.path (a release's venv reaches its base environment through our .pth,
    so this follows the chain) except the one holding the running `agent`, whose code is replaced.
    """
    own = Path(__file__).resolve().parents[2]
    paths = [*sys.path, *site.getsitepackages(), site.getusersitepackages()]
    return [
        p
        for p in dict.fromkeys(paths)
        if p
        and Path(p).name in ("site-packages", "dist-packages")
        and Path(p).is_dir()
        and Path(p).resolve() != own
    ]


def install_wheel(wheel: Path, dest: Path, expect_version: str, timeout_s: float = 300.0) -> Path:
    """A fresh venv at dest/venv holding `wheel` (no deps, no index); returns its interpreter.

    Raises UpdateError when creating, installing or importing fails, or the wheel is another version.
    """
    shutil.rmtree(dest / "venv", ignore_errors=True)  # never reuse a half-made environment
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    venv = dest / "venv"

    def run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> str:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=dest)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UpdateError(f"{what}: {e}") from None
        if r.returncode != 0:
            raise UpdateError(f"{what} failed: {(r.stderr or r.stdout).strip()[-1500:]}")
        return r.stdout

    # The interpreter that runs this environment (not a venv's shim): the new venv gets the same one.
    base_python = getattr(sys, "_base_executable", sys.executable)
    run([base_python, "-m", "venv", "--without-pip", str(venv)], "creating the side environment")
    python = venv / "bin" / "python"
    lib = Path(
        run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], "venv").strip()
    )
    # Plain path lines: appended after the venv's own site-packages, so the wheel's `agent` wins.
    (lib / "_gguf_swarm_base.pth").write_text("".join(p + "\n" for p in base_site_packages()))
    run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index"]
        + ["--disable-pip-version-check", "--no-warn-script-location", str(wheel)],
        "installing the wheel",
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    probe = (
        "import agent.node.update as u, agent.wire.control, aiohttp, cryptography; print(u.running_version())"
    )
    got = run([str(python), "-c", probe], "importing the new version", env=clean).strip()
    if got != expect_version:
        raise UpdateError(f"the wheel installs version {got!r}, not {expect_version!r}")
    return python


# --- the running agent's side ----------------------------------------------------------------------------


class Host(Protocol):
    """What an update needs from the data plane: stop admitting sessions, and its counters."""

    def drain(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


Send = Callable[[UpdateStatus], Awaitable[None]]


@dataclass
class Updater:
    """Carries out `update` commands for one agent process (see the module docstring)."""

    data_dir: Path
    release_public_key: str  # pinned at enrollment
    server: str
    headers: dict[str, str]
    host: Host
    request_restart: Callable[[], None]
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    quiet_s: float = QUIET_S
    busy: bool = False

    @property
    def store(self) -> VersionStore:
        return VersionStore(self.data_dir)

    @staticmethod
    def supervised() -> bool:
        return os.environ.get(ENV_SUPERVISED) == "1"

    async def on_welcome(self, send: Send) -> None:
        """Connected and accepted: confirm a trial version, report the last update's outcome."""
        trial = os.environ.get(ENV_TRIAL, "")
        if trial and trial == running_version():
            with contextlib.suppress(OSError):
                self.store.confirm(trial)
        last = self.store.read_state().get("last")
        if isinstance(last, dict):  # again on every welcome: the control plane ignores repeats
            with contextlib.suppress(ValueError, KeyError):
                await send(
                    UpdateStatus(
                        rollout_id=int(last["rollout_id"]),
                        version=str(last["version"]),
                        state=last["state"],
                        error=str(last.get("error", ""))[:MAX_STR],
                    )
                )

    async def apply(self, cmd: Update, http: aiohttp.ClientSession, send: Send) -> None:
        """Verify, download, install, drain, then ask the launcher to restart into the release."""

        async def status(state: str, error: str = "") -> None:
            await send(
                UpdateStatus.model_validate(
                    {
                        "rollout_id": cmd.rollout_id,
                        "version": cmd.version,
                        "state": state,
                        "error": error[:MAX_STR],
                    }
                )
            )

        if self.busy:
            return  # the same command again (a reconnect): the first one is under way
        self.busy = True
        restarting = False
        try:
            if cmd.version == running_version():
                await status("updated")
                return
            self.check(cmd)
            await status("downloading")
            wheel = await self.download(cmd, http)
            await status("installing")
            python = await asyncio.to_thread(
                install_wheel, wheel, self.store.version_dir(cmd.version), cmd.version
            )
            await status("draining")
            await self.drain()
            _write_json(
                self.store.request_path,
                {"version": cmd.version, "python": str(python), "rollout_id": cmd.rollout_id},
            )
            await status("restarting")
            log.warning("update to %s installed; restarting into it", cmd.version)
            restarting = True
            self.request_restart()
        except UpdateError as e:
            log.warning("update to %s %s: %s", cmd.version, e.state, e)
            await status(e.state, str(e))
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.warning("update to %s failed: %s", cmd.version, e)
            await status("failed", f"{type(e).__name__}: {e}")
        finally:
            self.busy = restarting

    def check(self, cmd: Update) -> None:
        """Everything that needs no download: supervision and the signature (raises UpdateError)."""
        if not self.supervised():
            raise UpdateError(
                "this agent was not started by `agent launch`, so it cannot restart itself", "refused"
            )
        try:
            release.verify(self.release_public_key, cmd.version, cmd.filename, cmd.sha256, cmd.signature)
        except release.ReleaseError as e:
            raise UpdateError(str(e), "refused") from None

    async def download(self, cmd: Update, http: aiohttp.ClientSession) -> Path:
        """The wheel, from the control plane, size- and sha256-checked (raises UpdateError)."""
        dest = self.store.version_dir(cmd.version)
        dest.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = dest / cmd.filename
        part = path.with_name(path.name + ".part")
        got = 0
        async with http.get(self.server.rstrip("/") + cmd.wheel_url, headers=self.headers) as r:
            if r.status != 200:
                raise UpdateError(f"downloading the wheel: HTTP {r.status}")
            with part.open("wb") as f:
                async for block in r.content.iter_chunked(1 << 20):
                    got += len(block)
                    if got > cmd.size:
                        raise UpdateError(f"the wheel is larger than the {cmd.size} bytes announced")
                    f.write(block)
        if got != cmd.size:
            raise UpdateError(f"the wheel has {got} bytes, {cmd.size} were announced")
        digest = await asyncio.to_thread(release.file_sha256, part)
        if digest != cmd.sha256:
            part.unlink(missing_ok=True)
            raise UpdateError("the wheel's sha256 does not match the signed release", "refused")
        os.replace(part, path)
        return path

    async def drain(self) -> None:
        """Refuse new sessions, then wait until no frame has arrived for `quiet_s` (answers finished)."""
        self.host.drain()
        deadline = time.monotonic() + self.drain_timeout_s
        last = (self.host.stats().get("frames"), time.monotonic())
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            frames = self.host.stats().get("frames")
            if frames != last[0]:
                last = (frames, time.monotonic())
            elif time.monotonic() - last[1] >= self.quiet_s:
                return
        log.warning(
            "answers still in flight after %.0f s of draining; restarting anyway", self.drain_timeout_s
        )


# --- the launcher ----------------------------------------------------------------------------------------


@dataclass
class Launcher:
    """Runs `agent run` as a child in the current version; trials new versions and rolls them back."""

    data_dir: Path
    run_args: list[str]
    confirm_timeout_s: float = CONFIRM_TIMEOUT_S
    poll_s: float = 0.2
    base_python: str = sys.executable  # the interpreter of the installed agent (the launcher's own)
    child: subprocess.Popen[bytes] | None = None
    stopping: bool = False

    @property
    def store(self) -> VersionStore:
        return VersionStore(self.data_dir)

    def _command(
        self, entry: dict[str, Any] | None, trial: bool
    ) -> tuple[list[str], dict[str, str], Path | None]:
        env = dict(os.environ)
        env[ENV_SUPERVISED] = "1"
        env.pop(ENV_TRIAL, None)
        args = ["-m", "agent", "run", *self.run_args]
        if entry is None or not Path(entry["python"]).exists():
            return [self.base_python, *args], env, None  # the environment the launcher itself runs in
        # A release runs from its own venv only: no source tree on the path, not even the cwd's.
        env.pop("PYTHONPATH", None)
        if trial:
            env[ENV_TRIAL] = entry["version"]
        return [entry["python"], *args], env, Path(entry["python"]).parents[2]

    def _start(self, entry: dict[str, Any] | None, trial: bool) -> subprocess.Popen[bytes]:
        cmd, env, cwd = self._command(entry, trial)
        log.info("launcher: starting %s (%s)", entry["version"] if entry else "the installed agent", cmd[0])
        return subprocess.Popen(cmd, env=env, cwd=cwd)

    def _finish_trial(self, state: dict[str, Any], ok: bool, reason: str = "") -> dict[str, Any]:
        trial = state["trial"]
        if ok:
            state["previous"], state["current"] = state["current"], trial
            state["last"] = {
                "rollout_id": trial["rollout_id"],
                "version": trial["version"],
                "state": "updated",
            }
        else:
            log.warning("launcher: version %s rolled back: %s", trial["version"], reason)
            current = state["current"]["version"] if state["current"] else "the installed agent"
            state["last"] = {
                "rollout_id": trial["rollout_id"],
                "version": trial["version"],
                "state": "rolled_back",
                "error": f"{reason}; back on {current}",
            }
        state["trial"] = None
        self.store.write_state(state)
        self.store.confirm_path(trial["version"]).unlink(missing_ok=True)
        self._prune(state)
        return state

    def _prune(self, state: dict[str, Any]) -> None:
        """Keep the current and previous versions' folders; older ones go."""
        keep = {e["version"] for e in (state["current"], state["previous"]) if e}
        for d in self.store.root.iterdir() if self.store.root.is_dir() else []:
            if d.is_dir() and d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)

    def _take_request(self, state: dict[str, Any]) -> dict[str, Any]:
        try:
            req = json.loads(self.store.request_path.read_text())
        except (OSError, ValueError):
            return state
        self.store.request_path.unlink(missing_ok=True)
        if isinstance(req, dict) and {"version", "python", "rollout_id"} <= req.keys():
            self.store.confirm_path(str(req["version"])).unlink(missing_ok=True)
            state["trial"] = {**req, "started": time.time()}
            self.store.write_state(state)
        return state

    def _stop_child(self) -> None:
        p = self.child
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def run(self) -> int:
        """Supervise until the child exits for a reason other than an update (its code is returned)."""
        self.store.root.mkdir(parents=True, exist_ok=True, mode=0o700)

        def on_signal(signum: int, _frame: Any) -> None:
            self.stopping = True
            if self.child is not None and self.child.poll() is None:
                self.child.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        state = self.store.read_state()
        if state["trial"]:  # the launcher itself stopped during a trial
            confirmed = self.store.confirm_path(state["trial"]["version"]).exists()
            state = self._finish_trial(state, confirmed, "the launcher restarted before it was confirmed")
        while True:
            trial = state["trial"]
            self.child = self._start(trial or state["current"], trial is not None)
            deadline = time.monotonic() + self.confirm_timeout_s
            while True:
                code = self.child.poll()
                if trial and self.store.confirm_path(trial["version"]).exists():
                    state = self._finish_trial(state, True)
                    trial = None
                if code is not None:
                    break
                if trial and time.monotonic() > deadline:
                    self._stop_child()
                    code = -1
                    break
                time.sleep(self.poll_s)
            if trial:
                why = (
                    f"not connected within {self.confirm_timeout_s:.0f} s"
                    if code == -1
                    else f"it exited with status {code} before connecting"
                )
                state = self._finish_trial(state, False, why)
                if self.stopping:
                    return 0
                continue
            if code == EXIT_RESTART and not self.stopping:
                state = self._take_request(state)
                continue
            return int(code)


# --- command line --------------------------------------------------------------------------------------


def cmd_launch(args: argparse.Namespace) -> int:
    from agent.node.config import default_data_dir

    run_args = list(args.run_args)
    if run_args[:1] == ["--"]:
        run_args = run_args[1:]
    if "--data-dir" in run_args:
        data_dir = Path(run_args[run_args.index("--data-dir") + 1])
    else:
        data_dir = default_data_dir()
        run_args += ["--data-dir", str(data_dir)]
    return Launcher(data_dir, run_args, confirm_timeout_s=args.confirm_timeout_s).run()


def cmd_release_keygen(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists():
        print(f"error: {out} exists; not overwriting a release key", file=sys.stderr)
        return 2
    key = release.generate_key()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(release.private_key_pem(key))
    print(release.public_key_b64(key))
    print(f"private key written to {out} (0600); set RELEASE_PUBLIC_KEY to the line above", file=sys.stderr)
    return 0


def _wheel_version(wheel: Path) -> str:
    parts = wheel.name.split("-")
    return parts[1] if len(parts) >= 5 else ""


def cmd_release_sign(args: argparse.Namespace) -> int:
    wheel = Path(args.wheel)
    try:
        key = release.load_private_key(Path(args.key))
        version = args.version or _wheel_version(wheel)
        print(release.sign(key, version, wheel.name, release.file_sha256(wheel)))
    except (release.ReleaseError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_release_verify(args: argparse.Namespace) -> int:
    wheel = Path(args.wheel)
    try:
        version = args.version or _wheel_version(wheel)
        release.verify(args.public_key, version, wheel.name, release.file_sha256(wheel), args.signature)
    except (release.ReleaseError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"ok: {wheel.name} {version} is signed by this key")
    return 0


def add_update_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `launch` and `release {keygen,sign,verify}` on the agent CLI."""
    s = sub.add_parser("launch", help="run the agent under the update launcher (what a service starts)")
    s.add_argument(
        "--confirm-timeout-s",
        type=float,
        default=CONFIRM_TIMEOUT_S,
        help="a new version must reconnect within this long, else it is rolled back",
    )
    s.add_argument("run_args", nargs=argparse.REMAINDER, help="options for `agent run` (after --)")
    s.set_defaults(func=cmd_launch)

    r = sub.add_parser("release", help="release keys and signatures (on the admin's machine)")
    rs = r.add_subparsers(dest="release_cmd", required=True)
    s = rs.add_parser("keygen", help="create a release signing key; prints its public half")
    s.add_argument("--out", required=True, help="private key file to create (0600)")
    s.set_defaults(func=cmd_release_keygen)
    s = rs.add_parser("sign", help="print the detached signature of a wheel")
    s.add_argument("--key", required=True, help="the release private key (PEM)")
    s.add_argument("--version", help="release version (default: from the wheel's file name)")
    s.add_argument("wheel")
    s.set_defaults(func=cmd_release_sign)
    s = rs.add_parser("verify", help="check a wheel's signature against a public key")
    s.add_argument("--public-key", required=True)
    s.add_argument("--signature", required=True)
    s.add_argument("--version")
    s.add_argument("wheel")
    s.set_defaults(func=cmd_release_verify)
