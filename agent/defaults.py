"""Defaults shared by the agent and the control plane, each defined once here; imports nothing of ours.

The agent's command line, its runtime classes and the webapp's settings read these, so a default
changes in one place. Settings may still override the control plane's values from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# --- backends ----------------------------------------------------------------------------------------
# Every backend name, best first: the ggml executor, the torch reference, llama.cpp (whole models only).
BACKENDS = ("native", "torch", "llamacpp")
# What a shard runs on when nothing else is asked for (nodes without it fall back to their first).
DEFAULT_BACKEND = BACKENDS[0]
# Compute threads per shard.
N_THREADS = 2

# --- data plane --------------------------------------------------------------------------------------
DATAPLANE_HOST = "127.0.0.1"
# A node's KV cache budget, shared by all its shards.
KV_BUDGET_BYTES = 1 << 30
# The attention caches' type on native shards, like llama.cpp's --cache-type-k/-v: "f16" (its default),
# "f32" where the architecture keeps it (deepseek4), "q8_0" / "q4_0" where it keeps them (with flash
# attention, as llama.cpp's quantized V requires).
CACHE_TYPES = ("f16", "f32", "q8_0", "q4_0")
CACHE_TYPE = "f16"
# Flash attention on native shards, like llama.cpp's -fa: "auto" (on for a GPU, off for a CPU, where
# llama.cpp's default non-flash path runs; on wherever the cache is quantized), "on" or "off".
FLASH_ATTN_MODES = ("auto", "on", "off")
FLASH_ATTN = "auto"
# An idle session's KV is freed after this long (a route that stopped talking).
SESSION_TTL_S = 1800.0
# Positions a route client asks its hops to hold for a session when the model does not say (its capacity).
SESSION_CAPACITY = 8192
# How a route client drives its hops: "star" (it sends every hop its input and reads every output) or
# "chain" (hop 1 gets the ids, each hop pushes its output to the next, the last one's token comes back).
ROUTE_MODES = ("star", "chain")
# The control plane's playground and API route in chain mode: hidden states then travel only between
# hops, never through the web process (issue 13; docs/protocol.md, "Star vs chain").
CONTROL_PLANE_ROUTE_MODE = "chain"
# A hop closes a connection that has not sent a whole request's headers this long after it opened or
# after its last answer (and cuts a frame whose header and token take longer: agent/node/admission.py);
# route clients and chain hops drop their idle pooled connections sooner, so they never send a request
# on a connection the hop is closing.
HOP_HEAD_TIMEOUT_S = 5.0
HOP_CLIENT_IDLE_S = 3.0

# --- control channel ---------------------------------------------------------------------------------
# The control plane's web port (`make up`, SITE_URL).
WEB_PORT = 8000
# The agent's telemetry period until the control plane's welcome says otherwise.
HEARTBEAT_INTERVAL_S = 2
# A control connection the server accepted but never welcomed within this many seconds is closed and made
# again: the server's side of it is stuck (seen when the web's channel layer restarted during the accept),
# and heartbeats into it would never be read while the socket itself stays up. Well under the silence
# after which the control plane places a node's layers elsewhere (NODE_LOST_AFTER_S, 15 s in the test
# clusters): at 15 s the node was declared lost just before it reconnected. A welcome takes well under
# a second normally; a slower one costs a reconnect, not the node.
WELCOME_TIMEOUT_S = 5.0
# Reconnects back off from 1 s, doubling up to this.
RECONNECT_MAX_S = 30.0
# Enrollment request timeout.
ENROLL_TIMEOUT_S = 30.0
# One shard's download (swarm or HTTP) gives up after this long.
FETCH_TIMEOUT_S = 900.0
# libtorrent's listen interface on a node (port taken: libtorrent picks a free one).
TORRENT_LISTEN = "0.0.0.0:6881"

# --- route tokens ------------------------------------------------------------------------------------
ROUTE_TOKEN_TTL_S = 3600


# --- operator overrides ------------------------------------------------------------------------------
def env_int(name: str, lo: int, hi: int, env: Mapping[str, str] | None = None) -> int | None:
    """The integer an operator set in `name` (None when unset or blank); ValueError naming it when it is
    not an integer in lo..hi."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw[:40]!r} is not an integer") from None
    if not lo <= n <= hi:
        raise ValueError(f"{name}={n} is outside {lo}..{hi}")
    return n


def env_float(name: str, lo: float, hi: float, env: Mapping[str, str] | None = None) -> float | None:
    """The number an operator set in `name` (None when unset or blank); ValueError naming it when it is
    not a finite number in lo..hi."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw[:40]!r} is not a number") from None
    if not lo <= v <= hi:  # NaN fails this too
        raise ValueError(f"{name}={raw[:40]} is outside {lo}..{hi}")
    return v
