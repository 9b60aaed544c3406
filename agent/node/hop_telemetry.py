"""Per-hop figures a heartbeat carries for the fleet page's plots: batching since the last beat, prefills."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Mapping
from typing import Any, Protocol

from agent.wire.control import MAX_PREFILLS, MAX_WINDOW_S, BatchWindow, Prefill

# What a shard's scheduler lists (agent/node/scheduler.py ShardScheduler.prefills): per queued step,
# (session key, the step's first position, positions of it computed so far, positions in the step)
PrefillRow = tuple[Hashable, int, int, int]


class PrefillSource(Protocol):
    """A scheduler that can say how far its queued steps have got."""

    def prefills(self) -> Iterable[PrefillRow]: ...


def batch_window(metrics: Any, seconds: float) -> BatchWindow | None:
    """The data plane's backend calls of the last `seconds` (since the previous heartbeat) from its
    NodeMetrics (agent/node/metrics.py); None for a host without them."""
    stats = getattr(metrics, "batch_stats", None)
    if not callable(stats):
        return None
    seconds = min(max(float(seconds), 0.001), MAX_WINDOW_S)
    d = stats(window_s=seconds)
    if not isinstance(d, dict):
        return None

    def fig(key: str) -> float:
        return max(0.0, float(d.get(key) or 0.0))

    return BatchWindow(
        seconds=round(seconds, 3),
        batches=max(0, int(d.get("batches") or 0)),
        steps=fig("avg_steps"),
        tokens=fig("avg_tokens"),
        wait_p50_ms=fig("p50_queue_wait_ms"),
        wait_p95_ms=fig("p95_queue_wait_ms"),
    )


def session_tag(key: Hashable) -> str:
    """Eight hex digits naming a session on the fleet page: its id hashed (a name is all the page needs,
    so the id stays on the data plane), the same on every hop, so one prompt can be followed along a
    route."""
    sid = key[0] if isinstance(key, tuple) and key else key
    return hashlib.blake2b(str(sid).encode(), digest_size=4).hexdigest()


def prefill_progress(shards: Mapping[Any, Any] | None, limit: int = MAX_PREFILLS) -> list[Prefill]:
    """Up to `limit` prompts (steps of more than one position) queued or part-run on `shards` (the data
    plane's Shards), oldest first per shard: the session's positions done here and its positions once
    the step is done. A scheduler without `prefills()` reports none."""
    out: list[Prefill] = []
    for shard in list((shards or {}).values()):
        source = getattr(getattr(shard, "scheduler", None), "prefills", None)
        if not callable(source):
            continue
        try:
            rows = list(source())
        except RuntimeError:
            # the queue changed while it was read: it belongs to the event loop this runs on, but a
            # caller on another thread must lose one beat's list, not its heartbeat
            continue
        spec = shard.spec
        for key, start, done, n in rows:
            if n <= 1:
                continue  # a decode step, not a prompt
            first = max(0, int(start))
            out.append(
                Prefill(
                    session=session_tag(key),
                    layer_start=spec.layer_start,
                    layer_end=spec.layer_end,
                    done=first + min(max(0, int(done)), int(n)),
                    total=first + int(n),
                )
            )
            if len(out) >= limit:
                return out
    return out
