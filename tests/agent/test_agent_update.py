"""Signed self-update, agent side: release signatures, the update messages, the launcher's trial and
rollback rules (with stand-in interpreters: scripts that crash, hang, or confirm)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from agent.node.update import EXIT_RESTART, Launcher, UpdateError, Updater, VersionStore
from agent.wire import release
from agent.wire.control import ControlError, Update, parse_agent_message, parse_server_message

SHA = "ab" * 32
WHEEL = "gguf_swarm_agent-2.0.0-py3-none-linux_x86_64.whl"


def update(**kw: object) -> dict[str, object]:
    return {
        "type": "update",
        "rollout_id": 1,
        "version": "2.0.0",
        "filename": WHEEL,
        "wheel_url": "/releases/1/wheel",
        "sha256": SHA,
        "size": 10,
        "signature": "x",
    } | kw


def test_a_release_signed_by_the_pinned_key_verifies() -> None:
    key = release.generate_key()
    sig = release.sign(key, "2.0.0", WHEEL, SHA)
    release.verify(release.public_key_b64(key), "2.0.0", WHEEL, SHA, sig)


def test_a_release_signed_by_another_key_is_refused_as_forged() -> None:
    pinned, attacker = release.generate_key(), release.generate_key()
    sig = release.sign(attacker, "2.0.0", WHEEL, SHA)
    with pytest.raises(release.ReleaseError, match="not signed by the pinned release key"):
        release.verify(release.public_key_b64(pinned), "2.0.0", WHEEL, SHA, sig)


@pytest.mark.parametrize(
    ("version", "filename", "sha256"),
    [("2.0.1", WHEEL, SHA), ("2.0.0", WHEEL.replace("linux", "win"), SHA), ("2.0.0", WHEEL, "cd" * 32)],
)
def test_a_signature_does_not_carry_over_to_another_version_file_or_hash(
    version: str, filename: str, sha256: str
) -> None:
    key = release.generate_key()
    sig = release.sign(key, "2.0.0", WHEEL, SHA)
    with pytest.raises(release.ReleaseError):
        release.verify(release.public_key_b64(key), version, filename, sha256, sig)


@pytest.mark.parametrize("signature", ["", "not base64!", "AAAA"])
def test_a_malformed_signature_is_refused_with_a_reason(signature: str) -> None:
    key = release.generate_key()
    with pytest.raises(release.ReleaseError, match="signature|signed"):
        release.verify(release.public_key_b64(key), "2.0.0", WHEEL, SHA, signature)


def test_a_node_that_pinned_no_release_key_accepts_no_release() -> None:
    sig = release.sign(release.generate_key(), "2.0.0", WHEEL, SHA)
    with pytest.raises(release.ReleaseError, match="no release key is pinned"):
        release.verify("", "2.0.0", WHEEL, SHA, sig)


@pytest.mark.parametrize("version", ["../../etc", "2.0/0", "", "v2"])
def test_a_version_that_could_be_a_path_is_refused(version: str) -> None:
    with pytest.raises(release.ReleaseError):
        release.statement(version, WHEEL, SHA)
    with pytest.raises(ControlError, match="version"):
        parse_server_message(update(version=version))


def test_an_update_command_parses_and_bad_fields_are_named() -> None:
    msg = parse_server_message(update())
    assert isinstance(msg, Update) and msg.version == "2.0.0"
    for bad, field in [
        ({"filename": "../x.whl"}, "filename"),
        ({"wheel_url": "http://elsewhere/x.whl"}, "wheel_url"),
        ({"sha256": "XYZ"}, "sha256"),
        ({"size": 0}, "size"),
        ({"rollout_id": "1"}, "rollout_id"),
    ]:
        with pytest.raises(ControlError, match=field):
            parse_server_message(update(**bad))


def test_an_update_status_parses_and_an_unknown_state_is_refused() -> None:
    ok = {"type": "update_status", "rollout_id": 3, "version": "2.0.0", "state": "rolled_back", "error": "x"}
    assert parse_agent_message(ok).to_wire() == ok
    with pytest.raises(ControlError, match="state"):
        parse_agent_message(ok | {"state": "installed-whatever"})


class _Host:
    def drain(self) -> None:
        pass

    def stats(self) -> dict[str, object]:
        return {"frames": 0}


def updater(tmp_path: Path, pinned: str) -> Updater:
    return Updater(tmp_path, pinned, "http://cp", {}, _Host(), lambda: None)


def test_an_agent_not_started_by_the_launcher_refuses_updates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GGUF_SWARM_LAUNCHER", raising=False)
    with pytest.raises(UpdateError, match="agent launch") as e:
        updater(tmp_path, "").check(Update.model_validate(update()))
    assert e.value.state == "refused"


def test_a_supervised_agent_refuses_a_forged_release_before_downloading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GGUF_SWARM_LAUNCHER", "1")
    pinned, attacker = release.generate_key(), release.generate_key()
    cmd = Update.model_validate(update(signature=release.sign(attacker, "2.0.0", WHEEL, SHA)))
    with pytest.raises(UpdateError, match="pinned release key") as e:
        updater(tmp_path, release.public_key_b64(pinned)).check(cmd)
    assert e.value.state == "refused"
    assert not (tmp_path / "versions").exists()  # nothing was fetched or installed


# --- the launcher, with stand-in interpreters --------------------------------------------------------


def script(path: Path, body: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def base_that_requests(tmp_path: Path, version: str) -> str:
    """The installed agent: the first time it asks for `version`, after that it exits 0."""
    store = VersionStore(tmp_path)
    req = json.dumps({"version": version, "python": str(store.python(version)), "rollout_id": 7})
    runs = tmp_path / "base-runs"
    return script(
        tmp_path / "base" / "python",
        f'echo run >> {runs}\n[ "$(wc -l < {runs})" -gt 1 ] && exit 0\n'
        f"echo '{req}' > {store.request_path}\nexit {EXIT_RESTART}",
    )


def launcher(tmp_path: Path, base: str, timeout_s: float = 5.0) -> Launcher:
    return Launcher(tmp_path, ["--config", "x"], confirm_timeout_s=timeout_s, poll_s=0.05, base_python=base)


def test_a_version_that_crashes_at_start_is_rolled_back_to_the_installed_agent(tmp_path: Path) -> None:
    base = base_that_requests(tmp_path, "3.0.0")
    script(VersionStore(tmp_path).python("3.0.0"), "echo boom >&2; exit 3")
    assert launcher(tmp_path, base).run() == 0
    state = VersionStore(tmp_path).read_state()
    assert state["current"] is None and state["trial"] is None
    assert state["last"]["state"] == "rolled_back" and "exited with status 3" in state["last"]["error"]
    assert (tmp_path / "base-runs").read_text().count("run") == 2  # back on the old version
    assert not (tmp_path / "versions" / "3.0.0").exists()  # the bad version is removed


def test_a_version_that_never_connects_is_stopped_and_rolled_back_after_the_timeout(tmp_path: Path) -> None:
    base = base_that_requests(tmp_path, "3.0.0")
    script(VersionStore(tmp_path).python("3.0.0"), "exec sleep 30")
    assert launcher(tmp_path, base, timeout_s=1.0).run() == 0
    last = VersionStore(tmp_path).read_state()["last"]
    assert last["state"] == "rolled_back" and "not connected within 1 s" in last["error"]


def test_a_version_that_connects_is_confirmed_and_becomes_current(tmp_path: Path) -> None:
    base = base_that_requests(tmp_path, "2.0.0")
    store = VersionStore(tmp_path)
    # The stand-in confirms as a welcomed agent would, then serves until stopped (exits 0 here).
    script(
        store.python("2.0.0"),
        f'[ "$GGUF_SWARM_TRIAL" = 2.0.0 ] && touch {store.confirm_path("2.0.0")}\nsleep 0.5',
    )
    assert launcher(tmp_path, base).run() == 0
    state = store.read_state()
    assert state["current"]["version"] == "2.0.0" and state["last"]["state"] == "updated"
    assert state["last"]["rollout_id"] == 7


def test_a_launcher_restarted_mid_trial_rolls_back_an_unconfirmed_version(tmp_path: Path) -> None:
    store = VersionStore(tmp_path)
    python = script(store.python("3.0.0"), "exit 0")
    store.write_state(
        store.read_state() | {"trial": {"version": "3.0.0", "python": python, "rollout_id": 2, "started": 0}}
    )
    runs = tmp_path / "runs"
    base = script(tmp_path / "base" / "python", f"echo run >> {runs}; exit 0")
    assert launcher(tmp_path, base).run() == 0
    assert store.read_state()["last"]["state"] == "rolled_back"
    assert runs.read_text() == "run\n"


def test_the_launcher_passes_the_run_options_and_marks_the_child_supervised(tmp_path: Path) -> None:
    out = tmp_path / "args"
    base = script(tmp_path / "base" / "python", f'echo "$GGUF_SWARM_LAUNCHER $*" > {out}; exit 4')
    assert launcher(tmp_path, base).run() == 4  # any other exit is the launcher's exit
    assert out.read_text().split() == ["1", "-m", "agent", "run", "--config", "x"]
    assert os.environ.get("GGUF_SWARM_LAUNCHER") is None and sys.executable


async def test_an_agent_without_an_updater_answers_update_with_a_refusal(tmp_path: Path) -> None:
    from agent.node.config import NodeConfig
    from agent.node.control import ControlAgent

    sent: list[dict[str, object]] = []
    agent = ControlAgent(NodeConfig("http://cp", "node-1", "s", "k"), _Host(), "http://n", tmp_path)

    async def send(msg: object) -> None:
        sent.append(msg.to_wire())

    agent._send = send
    await agent._execute(Update.model_validate(update()))
    assert sent == [
        {
            "type": "update_status",
            "rollout_id": 1,
            "version": "2.0.0",
            "state": "refused",
            "error": "this agent does not take updates",
        }
    ]
