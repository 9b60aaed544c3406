"""What a heartbeat carries for the fleet page's per-hop plots: batching since the previous beat (batch
size, queue wait p50/p95) and the prompts being prefilled now, bounded and hashed."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Hashable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from agent.backends.base import StepInput
from agent.node.config import NodeConfig
from agent.node.control import ControlAgent
from agent.node.hop_telemetry import batch_window, prefill_progress, session_tag
from agent.node.metrics import NodeMetrics, percentile
from agent.node.scheduler import ShardScheduler
from agent.wire.control import MAX_PREFILLS, Heartbeat, parse_agent_message
from agent.wire.ids import SessionId
from tests.agent.test_scheduler import RecordingBackend


def test_percentiles_are_nearest_rank_and_zero_without_values() -> None:
    assert percentile([], 0.95) == 0.0
    assert percentile([7.0], 0.5) == 7.0 and percentile([7.0], 0.95) == 7.0
    values = [float(i) for i in range(100, 0, -1)]  # unsorted on purpose
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.95) == 95.0
    assert percentile([1.0, 2.0, 30.0], 0.95) == 30.0, "a p95 of a few waits is the slowest of them"


def test_the_window_holds_only_the_batches_and_waits_since_the_previous_beat() -> None:
    m = NodeMetrics(lambda: {})
    now = time.monotonic()
    m.batch(8, 300, 0.05, at=now - 10.0)  # before the previous beat: out of a 2-s window
    m.queue_wait(0.5, at=now - 10.0)
    for steps, wait in ((2, 0.001), (4, 0.002), (6, 0.010)):
        m.batch(steps, steps * 2, 0.01, at=now - 0.5)
        m.queue_wait(wait, at=now - 0.5)
    w = batch_window(m, 2.0)
    assert w is not None and w.seconds == 2.0 and w.batches == 3
    assert (w.steps, w.tokens) == (4.0, 8.0)
    assert (w.wait_p50_ms, w.wait_p95_ms) == (2.0, 10.0)
    minute = m.batch_stats()
    assert minute["batches"] == 4 and minute["p95_queue_wait_ms"] == 500.0, "the minute still has it"


def test_an_idle_hop_reports_a_window_of_zeros_and_a_host_without_metrics_none() -> None:
    w = batch_window(NodeMetrics(lambda: {}), 2.0)
    assert w is not None and (w.batches, w.steps, w.tokens, w.wait_p50_ms, w.wait_p95_ms) == (0, 0, 0, 0, 0)
    assert batch_window(None, 2.0) is None and batch_window(object(), 2.0) is None
    # a clock that jumped: the window is bounded to what the wire accepts
    huge = batch_window(NodeMetrics(lambda: {}), 1e9)
    assert huge is not None and huge.seconds == 3600.0


class Scheduler:
    """The accessor a shard's scheduler offers: (session key, first position, done, positions)."""

    def __init__(self, rows: list[tuple[Hashable, int, int, int]] | Exception) -> None:
        self.rows = rows

    def prefills(self) -> Iterable[tuple[Hashable, int, int, int]]:
        if isinstance(self.rows, Exception):
            raise self.rows
        return self.rows


def shard(a: int, b: int, sched: Any) -> Any:
    return SimpleNamespace(spec=SimpleNamespace(layer_start=a, layer_end=b), scheduler=sched)


SID = SessionId(b"\x07" * 16)


def test_prompts_are_listed_with_their_positions_and_a_hashed_session() -> None:
    shards = {
        "k0": shard(0, 10, Scheduler([((SID, "k0"), 512, 100, 512), (("other", "k0"), 40, 0, 1)])),
        "k1": shard(10, 20, Scheduler([((SID, "k1"), 0, 700, 512)])),  # done beyond the step: clamped
    }
    got = prefill_progress(shards)
    assert [(p.layer_start, p.layer_end, p.done, p.total) for p in got] == [
        (0, 10, 612, 1024),
        (10, 20, 512, 512),
    ]
    tag = got[0].session
    assert tag == got[1].session == session_tag((SID, "whatever")), "one session: one tag on every hop"
    assert len(tag) == 8 and all(c in "0123456789abcdef" for c in tag)
    assert SID.hex()[:8] not in tag and str(SID) not in tag, "the id itself is not sent"


def test_the_list_is_bounded_and_a_scheduler_without_the_hook_or_mid_change_reports_none() -> None:
    many = Scheduler([((f"s{i}", "k"), 0, i, 100) for i in range(40)])
    assert len(prefill_progress({"k": shard(0, 4, many)})) == MAX_PREFILLS
    assert len(prefill_progress({"k": shard(0, 4, many)}, limit=3)) == 3
    assert prefill_progress({"k": shard(0, 4, object())}) == []
    changing = Scheduler(RuntimeError("dictionary changed size during iteration"))
    ok = Scheduler([(("s", "k"), 0, 5, 20)])
    assert [p.done for p in prefill_progress({"a": shard(0, 4, changing), "b": shard(4, 8, ok)})] == [5]
    assert prefill_progress(None) == [] and prefill_progress({}) == []


class Host:
    """A data plane as the control client sees it: stats(), and the metrics and shards it reads."""

    def __init__(self) -> None:
        self.metrics = NodeMetrics(lambda: {})
        self.shards = {"k": shard(0, 10, Scheduler([((SID, "k"), 0, 256, 2000)]))}

    def stats(self) -> dict[str, Any]:
        return {"sessions": 2, "tokens_out": 3, "shards": [], "batching": self.metrics.batch_stats()}


def test_the_heartbeat_carries_the_window_and_the_prefills_over_the_wire(tmp_path: Path) -> None:
    host = Host()
    host.metrics.batch(3, 40, 0.02)
    host.metrics.queue_wait(0.004)
    agent = ControlAgent(
        NodeConfig(server="http://127.0.0.1:1", node_id="n", secret="s", public_key="x"),
        host,  # type: ignore[arg-type]  # the fake has what telemetry() reads
        "http://127.0.0.1:2",
        tmp_path,
        heartbeat_s=2.0,
    )
    beat = parse_agent_message(Heartbeat(telemetry=agent.telemetry()).model_dump_json())
    assert isinstance(beat, Heartbeat)
    t = beat.telemetry
    assert t.window is not None and t.window.seconds == 2.0, "the first beat's window: the interval"
    assert (t.window.batches, t.window.steps, t.window.tokens, t.window.wait_p95_ms) == (1, 3.0, 40.0, 4.0)
    assert [(p.done, p.total) for p in t.prefills] == [(256, 2000)]
    assert t.raw["prefills"][0]["session"] == session_tag(SID)


class SteppedBackend(RecordingBackend):
    """Each backend call waits for the test to let it go: the test reads the progress between chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Semaphore(0)

    def _start(self, steps: list[tuple[SessionId, int, int]]) -> None:
        self.batches.append(steps)
        assert self.go.acquire(timeout=10)


async def _until(cond: Any) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


async def test_a_real_scheduler_reports_a_chunked_prefill_chunk_by_chunk() -> None:
    # chunks of 20 (> INLINE_TOKENS): each computes in a worker thread, so holding it holds no loop
    be = SteppedBackend()
    sched = ShardScheduler(be, asyncio.Lock(), chunk_tokens=20, busy_chunk_tokens=20)
    be.open_session(SID, 64)
    task = asyncio.create_task(sched.submit((SID, "k"), None, StepInput(SID, 0, np.arange(1, 61))))
    shards = {"k": shard(0, 10, sched)}
    seen = []
    for k in range(1, 4):
        await _until(lambda k=k: len(be.batches) == k)
        seen.append([(p.done, p.total) for p in prefill_progress(shards)])
        be.go.release()
    await task
    assert seen == [[(0, 60)], [(20, 60)], [(40, 60)]]
    assert prefill_progress(shards) == [], "done: nothing left to report"
