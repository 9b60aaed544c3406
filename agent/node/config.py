"""The node's config file: control-plane URL, node id, secret and route-token public key (mode 0600)."""

from __future__ import annotations

import argparse
import json
import os
import stat
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent import defaults
from agent.wire.jsonlimits import loads_bounded

CONFIG_VERSION = 1
# The control plane's answer to enrollment: a small JSON object, read bounded in size and depth.
ANSWER_MAX = 1 << 20


class ConfigError(Exception):
    """The node config is missing, unreadable, malformed or readable by others."""


@dataclass(frozen=True)
class NodeConfig:
    """What `enroll` obtained and `run` needs."""

    server: str
    node_id: str
    secret: str
    public_key: str  # base64 raw Ed25519 key that verifies route tokens
    name: str = ""
    version: int = CONFIG_VERSION
    # base64 Ed25519 key pinned at enrollment; only releases it signed are installed ("": none are).
    release_public_key: str = ""

    def authorization(self) -> str:
        return f"Node {self.node_id}:{self.secret}"


def default_config_path() -> Path:
    env = os.environ.get("GGUF_SWARM_CONFIG")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "gguf-swarm" / "node.json"


def default_data_dir(create: bool = True) -> Path:
    """Where model files go: $GGUF_SWARM_DATA, else $XDG_DATA_HOME/gguf-swarm (~/.local/share/gguf-swarm);
    made unless `create` is False (`doctor` only looks)."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    d = Path(os.environ.get("GGUF_SWARM_DATA") or base / "gguf-swarm")
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


def save_config(cfg: NodeConfig, path: Path) -> None:
    """Write atomically; the file is created 0600 and its directory 0700, never briefly world-readable."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(cfg), f, indent=2)
            f.write("\n")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def load_config(path: Path) -> NodeConfig:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no node config; run `enroll --server URL --token TOKEN` first") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path}: holds a secret but is readable by others; run `chmod 600 {path}`")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read node config ({e})") from None
    if not isinstance(data, dict) or data.get("version") != CONFIG_VERSION:
        raise ConfigError(f"{path}: not a version {CONFIG_VERSION} node config")
    try:
        cfg = NodeConfig(**data)
    except TypeError as e:
        raise ConfigError(f"{path}: unexpected fields ({e})") from None
    for field in ("server", "node_id", "secret", "public_key"):
        if not isinstance(getattr(cfg, field), str) or not getattr(cfg, field):
            raise ConfigError(f"{path}: {field!r} is missing")
    return cfg


def post_json(
    url: str, body: dict[str, Any], refused: str, timeout_s: float, authorization: str | None = None
) -> dict[str, Any]:
    """POST `body` to the control plane and return its JSON object answer; ConfigError otherwise.

    `refused` opens the message when the control plane answers with an error status (its own `error`
    field follows); an unreachable server or a malformed answer says so with the server's address.
    """
    headers = {"Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            data = loads_bounded(r.read(ANSWER_MAX + 1), max_bytes=ANSWER_MAX)
    except urllib.error.HTTPError as e:
        try:
            reason = loads_bounded(e.read(ANSWER_MAX + 1), max_bytes=ANSWER_MAX).get("error", e.reason)
        except (ValueError, AttributeError):
            reason = e.reason
        raise ConfigError(f"{refused} (HTTP {e.code}): {reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ConfigError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{url} answered something other than a JSON object")
    return data


def add_native_arguments(parser: argparse.ArgumentParser) -> None:
    """The native shards' settings `agent serve` and `agent run` share: llama.cpp's cache type and
    flash-attention switch, with its defaults, and the MTP head."""
    parser.add_argument(
        "--cache-type",
        choices=defaults.CACHE_TYPES,
        default=defaults.CACHE_TYPE,
        help="native shards' attention caches, like llama.cpp's --cache-type-k/-v (f32: deepseek4 only;"
        " q8_0/q4_0 turn flash attention on)",
    )
    parser.add_argument(
        "--flash-attn",
        choices=defaults.FLASH_ATTN_MODES,
        default=defaults.FLASH_ATTN,
        help="like llama.cpp's -fa: auto (on for a GPU, off for a CPU), on, off",
    )
    parser.add_argument(
        "--mtp",
        action="store_true",
        help="a native last shard runs the model's MTP head (DeepSeek-V4's, GLM-5.x's nextn block, where the file"
        " has one) and sends its drafts to the sessions that ask (docs/speculative.md)",
    )
