"""The data plane's /metrics: Prometheus text that prometheus_client parses, and counters that move."""

from __future__ import annotations

import os
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent import __version__
from agent.backends import available_backends
from agent.client.route import Hop, RouteClient
from agent.node.dataplane import DataPlane, start_dataplane
from agent.node.metrics import NodeMetrics
from agent.wire.control import Transfer
from agent.wire.routetoken import mint
from agent.wire.sampling import SamplingParams
from tests.conftest import free_port

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 504, 3575, 282, 4649, 314]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, keyed by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        return samples(await r.text())


async def test_a_chat_moves_the_token_step_and_kv_metrics_and_a_bad_frame_counts_an_error(
    model_path, manifest, signing_key
) -> None:  # noqa: ANN001
    backend = "native" if "native" in available_backends() else "torch"
    dp = DataPlane("node-m", signing_key.public_key())
    dp.load_shard(model_path, manifest, 0, 15, backend=backend, n_threads=2)
    dp.load_shard(model_path, manifest, 15, 30, backend=backend, n_threads=2)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    session = os.urandom(16)
    hops = [
        Hop(url, a, b, mint(signing_key, session, manifest.sha256, a, b, "node-m"))
        for a, b in ((0, 15), (15, 30))
    ]
    client = RouteClient(hops, session_id=session)
    try:
        before = await scrape(url)
        assert before[("gguf_swarm_agent_tokens_served_total", ())] == 0
        assert before[("gguf_swarm_agent_build_info", (("protocol", "1"), ("version", __version__)))] == 1
        assert before[("gguf_swarm_agent_shards", ())] == 2
        got = [t async for t, _ in client.generate(PROMPT, SamplingParams(), 6)]
        during = await scrape(url)  # the session is still open: its KV is held
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/frame", data=b"not a frame") as r:
            assert r.status == 400
        after = await scrape(url)
    finally:
        await client.close()
        await runner.cleanup()

    assert len(got) == 6
    assert during[("gguf_swarm_agent_tokens_served_total", ())] == 6
    assert during[("gguf_swarm_agent_sessions", ())] == 2
    assert during[("gguf_swarm_agent_kv_bytes", ())] > 0
    # one prefill and five decode steps on each of the two hops
    assert during[("gguf_swarm_agent_step_seconds_count", (("kind", "prefill"),))] == 2
    assert during[("gguf_swarm_agent_step_seconds_count", (("kind", "decode"),))] == 10
    assert during[("gguf_swarm_agent_step_seconds_sum", (("kind", "decode"),))] > 0
    assert during[("gguf_swarm_agent_queue_wait_seconds_count", ())] == 12
    assert during[("gguf_swarm_agent_tokens_in_total", ())] == 2 * (len(PROMPT) + 5)
    assert during[("gguf_swarm_agent_chunk_hold_seconds_total", ())] == 0  # nobody decoded beside it
    codes = {labels: v for (name, labels), v in after.items() if name == "gguf_swarm_agent_errors_total"}
    assert codes == {(("code", "bad_frame"),): 1}


def test_download_reports_add_only_new_bytes_per_assignment_and_set_the_rate() -> None:
    m = NodeMetrics(lambda: {})
    m.transfer(7, Transfer(source="swarm", downloaded_bytes=1000, rate_bytes_per_s=50.0))
    m.transfer(7, Transfer(source="swarm", downloaded_bytes=1500, rate_bytes_per_s=80.0))
    m.transfer(7, Transfer(source="swarm", downloaded_bytes=1500))  # a repeated report adds nothing
    m.transfer(8, Transfer(source="http", downloaded_bytes=300))
    got = samples(m.render().decode())
    assert got[("gguf_swarm_agent_download_bytes_total", (("source", "swarm"),))] == 1500
    assert got[("gguf_swarm_agent_download_bytes_total", (("source", "http"),))] == 300
    assert got[("gguf_swarm_agent_download_rate_bytes_per_second", ())] == 80.0


@pytest.mark.parametrize("code", ["kv_budget", "internal"])
def test_errors_are_counted_by_code(code: str) -> None:
    m = NodeMetrics(lambda: {"tokens_out": 3})
    m.error(code)
    m.error(code)
    got = samples(m.render().decode())
    assert got[("gguf_swarm_agent_errors_total", (("code", code),))] == 2
    assert got[("gguf_swarm_agent_tokens_served_total", ())] == 3


def test_batches_recorded_elsewhere_are_taken_in_before_a_scrape_and_kept_at_their_own_time() -> None:
    # the native lane's batches, say: they ran off the event loop, and are counted when figures are read
    pending = [(3, 3, 0.004, time.monotonic() - 120.0), (8, 8, 0.006, None)]

    def take_in() -> None:
        while pending:
            steps, tokens, seconds, at = pending.pop(0)
            m.batch(steps, tokens, seconds, at=at)

    m = NodeMetrics(lambda: {}, before_read=take_in)
    got = samples(m.render().decode())
    assert got[("gguf_swarm_agent_batch_steps_count", ())] == 2
    assert got[("gguf_swarm_agent_batch_steps_sum", ())] == 11
    stats = m.batch_stats()  # the last minute's: the batch done two minutes ago is not in it
    assert stats["batches"] == 1 and stats["avg_steps"] == 8 and stats["batches_total"] == 2
    m.batch(1, 1, 0.001, at=time.monotonic() + 3600.0)  # a time ahead of the clock counts as now
    assert m.batch_stats()["batches"] == 2
