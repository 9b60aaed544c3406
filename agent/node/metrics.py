"""The data plane's Prometheus metrics (`GET /metrics`): tokens, step latency, queue wait, batches, KV,
downloads.

One `CollectorRegistry` per `DataPlane` (tests run several nodes in one process), never the global
one. Counters that the data plane already keeps (`DataPlane.counters`, the session table) are read at
scrape time by a collector, so the hot path pays nothing for them. The per-frame histograms (step
latency, queue wait, and steps, tokens and compute seconds per backend call, agent/node/scheduler.py:
five values per decode step) are counted into plain bucket lists (`_Buckets`, one `bisect` and two
additions each) and turned into Prometheus histograms at scrape time: prometheus_client's `observe`
takes a lock and walks the buckets in Python, microseconds each on every hop of every token, all of
it on the event loop that also reads the next frame. Errors by code and download bytes and rate
(rare) use prometheus_client's own metrics. The recent batches are also summed over a short window for
the stats the agent reports (batch_stats: the last minute, and each heartbeat's own interval).
Names start with `gguf_swarm_agent_`; docs/agent-install.md lists them.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from agent import __version__
from agent.wire.control import PROTOCOL_VERSION, Transfer

PREFIX = "gguf_swarm_agent"
# Step latency: a SmolLM2 decode hop takes ~1-10 ms on a CPU, a 512-token prefill ~0.1-1 s.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
BATCH_STEP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
WINDOW_S = 60.0  # batch_stats() averages over the batches of the last minute
_RECENT_MAX = 8192  # entries kept for that window, whatever the rate

# DataPlane.stats() keys exposed as counters / gauges: (key, metric name, help)
_COUNTERS = (
    ("tokens_out", "tokens_served", "Tokens sampled on this node (last-shard steps)"),
    ("tokens_in", "tokens_in", "Token positions this node computed (prefill and decode)"),
    ("frames", "frames", "Data-plane frames received"),
    ("bundles", "bundles", "Stream messages carrying several sessions' frames"),
    ("bytes_in", "bytes_in", "Frame bytes received"),
    ("bytes_out", "bytes_out", "Response bytes sent"),
    ("evictions", "kv_evictions", "Idle sessions evicted to admit another"),
    (
        "checkpoints_reclaimed_bytes",
        "checkpoints_reclaimed_bytes",
        "Checkpoint bytes given back to admit work",
    ),
    ("expirations", "kv_expirations", "Sessions closed after their idle TTL"),
    ("chunk_hold_s", "chunk_hold_seconds", "Time prefill chunks waited for decoding sessions to ride with"),
)
_GAUGES = (
    ("sessions", "sessions", "Open sessions"),
    ("kv_bytes", "kv_bytes", "Bytes of session state (KV and other layer state) held"),
    ("kv_budget_bytes", "kv_budget_bytes", "The node's KV budget"),
)


class _StatsCollector(Collector):
    """Reads the data plane's own counters and session table at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        # nothing read at registration: the data plane's stats include this object's own figures
        return iter(())

    def collect(self) -> Iterator[Metric]:
        st = self._stats()
        for key, name, help_text in _COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=float(st.get(key) or 0))
        for key, name, help_text in _GAUGES:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=float(st.get(key) or 0))
        yield GaugeMetricFamily(f"{PREFIX}_shards", "Shards loaded", value=float(len(st.get("shards") or [])))


class _Buckets:
    """One histogram's counts, as Prometheus defines them (le = upper bound), kept without locks: only
    the data plane's event loop records into it, and a scrape reads it on the same loop."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((_le(bound), float(total)))
        return out


def _when(at: float | None) -> float:
    """A figure's time on time.monotonic()'s clock: `at`, never later than now."""
    now = time.monotonic()
    return now if at is None else min(at, now)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile of `values` (0 for none): a value that was observed, so a p95 of a
    few waits is the slowest of them rather than a blend."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered))))
    return ordered[rank - 1]


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client writes it (its formatter is untyped)."""
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]  # prometheus_client ships no hints for it


Series = dict[tuple[str, ...], _Buckets]  # label values -> their counts


class _HistogramCollector(Collector):
    """Exposes `_Buckets` (by label values) as one Prometheus histogram at scrape time."""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...], series: Series) -> None:
        self.name, self.help_text, self.labels, self.series = name, help_text, labels, series

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.help_text, labels=list(self.labels))
        for values, b in list(self.series.items()):
            fam.add_metric(list(values), b.cumulative(), b.sum)
        yield fam


class NodeMetrics:
    """The metrics of one data plane, and the aiohttp view that serves them."""

    def __init__(
        self, stats: Callable[[], dict[str, Any]], before_read: Callable[[], None] | None = None
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._before_read = before_read  # brings in figures recorded elsewhere (the native lane's)
        r = self.registry
        self._step: Series = {("decode",): _Buckets(STEP_BUCKETS), ("prefill",): _Buckets(STEP_BUCKETS)}
        self._decode_step, self._prefill_step = self._step[("decode",)], self._step[("prefill",)]
        self._histogram(
            "step_seconds",
            "Time this hop spends on one forward frame (decoding, compute, encoding; not the next hops)",
            self._step,
            ("kind",),
        )
        self._wait = self._unlabelled(
            "queue_wait_seconds",
            "Time a frame waited for its shard (another session's step running on it)",
            WAIT_BUCKETS,
        )
        self._batch_steps = self._unlabelled(
            "batch_steps",
            "Steps (of distinct sessions) run together in one backend call on this hop",
            BATCH_STEP_BUCKETS,
        )
        self._batch_tokens = self._unlabelled(
            "batch_tokens",
            "Token positions in one backend call (decodes plus prefill chunks)",
            BATCH_TOKEN_BUCKETS,
        )
        self._batch_seconds = self._unlabelled(
            "batch_compute_seconds", "Compute time of one backend call (one batch)", STEP_BUCKETS
        )
        self.errors = Counter(
            f"{PREFIX}_errors", "Frames refused or failed, by error code", ["code"], registry=r
        )
        self.download_bytes = Counter(
            f"{PREFIX}_download_bytes",
            "Shard bytes downloaded, by source (swarm or http)",
            ["source"],
            registry=r,
        )
        self.download_rate = Gauge(
            f"{PREFIX}_download_rate_bytes_per_second", "Rate of the latest shard download report", registry=r
        )
        Info(f"{PREFIX}_build", "The agent's version and wire protocol", registry=r).info(
            {"version": __version__, "protocol": str(PROTOCOL_VERSION)}
        )
        r.register(_StatsCollector(stats))
        self._downloaded: dict[int, int] = {}
        # (monotonic time, steps, tokens, compute seconds) of recent batches; (time, seconds) of waits
        self._batches: deque[tuple[float, int, int, float]] = deque(maxlen=_RECENT_MAX)
        self._waits: deque[tuple[float, float]] = deque(maxlen=_RECENT_MAX)
        self.batches_total = 0

    def _histogram(self, name: str, help_text: str, series: Series, labels: tuple[str, ...] = ()) -> None:
        self.registry.register(_HistogramCollector(f"{PREFIX}_{name}", help_text, labels, series))

    def _unlabelled(self, name: str, help_text: str, bounds: tuple[float, ...]) -> _Buckets:
        b = _Buckets(bounds)
        self._histogram(name, help_text, {(): b})
        return b

    # -- hooks (the data plane and the control client call these) ------------------------------------
    def step(self, n_tokens: int, seconds: float) -> None:
        (self._decode_step if n_tokens == 1 else self._prefill_step).observe(seconds)

    def queue_wait(self, seconds: float, at: float | None = None) -> None:
        """A frame waited `seconds` for its shard; `at`: when (time.monotonic(); default now)."""
        self._wait.observe(seconds)
        self._waits.append((_when(at), seconds))

    def batch(self, steps: int, tokens: int, seconds: float, at: float | None = None) -> None:
        """One backend call of `steps` sessions' steps, `tokens` positions in all, computing `seconds`,
        done `at` (time.monotonic(); default now)."""
        self._batch_steps.observe(steps)
        self._batch_tokens.observe(tokens)
        self._batch_seconds.observe(seconds)
        self._batches.append((_when(at), steps, tokens, seconds))
        self.batches_total += 1

    def batch_stats(self, window_s: float = WINDOW_S) -> dict[str, float | int]:
        """Averages over the batches (and queue waits) of the last `window_s` seconds: what the agent
        reports in its heartbeats and /v1/health (0 when the hop was idle)."""
        since = time.monotonic() - window_s
        recent = [b for b in self._batches if b[0] >= since]
        waits = [w for t, w in self._waits if t >= since]
        n = len(recent)
        return {
            "window_s": window_s,
            "batches": n,
            "batches_total": self.batches_total,
            "avg_steps": round(sum(b[1] for b in recent) / n, 3) if n else 0.0,
            "max_steps": max((b[1] for b in recent), default=0),
            "avg_tokens": round(sum(b[2] for b in recent) / n, 3) if n else 0.0,
            "avg_compute_ms": round(1e3 * sum(b[3] for b in recent) / n, 3) if n else 0.0,
            "avg_queue_wait_ms": round(1e3 * sum(waits) / len(waits), 3) if waits else 0.0,
            "max_queue_wait_ms": round(1e3 * max(waits, default=0.0), 3),
            "p50_queue_wait_ms": round(1e3 * percentile(waits, 0.5), 3),
            "p95_queue_wait_ms": round(1e3 * percentile(waits, 0.95), 3),
        }

    def error(self, code: str) -> None:
        self.errors.labels(code[:40]).inc()

    def transfer(self, key: int, t: Transfer) -> None:
        """A shard download's progress report (`downloaded_bytes` is cumulative per assignment `key`)."""
        if t.downloaded_bytes is not None:
            before = self._downloaded.get(key, 0)
            if t.downloaded_bytes > before:
                self.download_bytes.labels(t.source or "http").inc(t.downloaded_bytes - before)
                self._downloaded[key] = t.downloaded_bytes
        if t.rate_bytes_per_s is not None:
            self.download_rate.set(t.rate_bytes_per_s)

    # -- exposition ---------------------------------------------------------------------------------
    def render(self) -> bytes:
        if self._before_read is not None:
            self._before_read()
        return generate_latest(self.registry)

    async def view(self, request: web.Request) -> web.Response:  # noqa: ARG002 - aiohttp's signature
        return web.Response(body=self.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
