"""The node config file: written 0600, refused when readable by others, clear errors."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.node.config import ConfigError, NodeConfig, load_config, save_config

CFG = NodeConfig(
    server="http://127.0.0.1:8000", node_id="node-1", secret="sec_x", public_key="AAAA", name="n"
)


def test_the_config_is_written_0600_in_a_0700_directory_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "node.json"
    save_config(CFG, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_config(path) == CFG
    assert CFG.authorization() == "Node node-1:sec_x"


def test_a_config_readable_by_others_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    save_config(CFG, path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_config(path)


def test_a_missing_config_says_to_enroll_first(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="enroll --server"):
        load_config(tmp_path / "none.json")


def test_a_malformed_config_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b'{"version": 1, "server": "x"}')
    os.close(fd)
    with pytest.raises(ConfigError):
        load_config(path)
