"""An agent is killed (SIGKILL) in the middle of a playground answer and the user's text does not change.

A real control plane with four agents as real processes (native backend, SmolLM2) places the model as two
replica chains of the same layer ranges. The playground's route client asks the control plane for a
replacement hop (webapp/routing/services.py `replacement_provider` / `replace_hop`); the spare re-prefills
the answer's history and the greedy answer goes on token for token, so the streamed text equals an
undisturbed answer to the same question and the answer's telemetry records the recovery.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from agent.backends import libggswarm
from agent.procs import wait_until
from tests.integration.swarm import Swarm, control_plane

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
KILL_AFTER_DELTAS = 4  # the first few deltas are on screen when the hop dies
ANSWER_TIMEOUT_S = 90.0
# a question with a long answer: the kill lands early in it, with most of the answer still to come
QUESTION = "Write a short story about a lighthouse keeper and a storm."


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[Swarm]:
    if not libggswarm.is_available():
        pytest.skip(f"libggswarm is not built ({libggswarm.library_path()}); run `bash native/build.sh`")
    tmp = tmp_path_factory.mktemp("failover-playground")
    # NODE_DEAD_AFTER_S: the killed agent's shard is not placed again while the test looks at the fleet
    with control_plane(tmp, DEFAULT_BACKEND="native", NODE_DEAD_AFTER_S="300") as s:
        for i in range(1, 5):
            config, _ = s.enroll(f"agent-{i}")
            # equal speeds: two chains of two nodes, the second with the first's boundaries
            s.run_agent(f"agent-{i}", config, "--speed", "1")
        s.online(list(s.agents))
        s.register_smollm2()
        code, body = s.admin.post(f"/models/{s.model['id']}/place", {"replicas": "2"})
        assert code == 200, body
        s.shards_ready(300)
        yield s


def _ranges(s: Swarm) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """{layer range: the online nodes holding it ready}."""
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for n in s.admin.status()["nodes"]:
        for sh in n["shards"]:
            if n["state"] == "online" and sh["state"] == "ready":
                out.setdefault((sh["layer_start"], sh["layer_end"]), []).append(n)
    return out


def test_two_agents_placed_per_range_give_every_hop_an_exact_spare(swarm: Swarm) -> None:
    ranges = _ranges(swarm)
    assert len(ranges) == 2, ranges
    (a0, b0), (a1, b1) = sorted(ranges)
    assert a0 == 0 and b0 == a1 and b1 == swarm.model["n_layers"], ranges
    holders = [n["id"] for nodes in ranges.values() for n in nodes]
    assert sorted(holders) == sorted(swarm.agents), "each agent holds one range, each range two agents"


async def _chat(s: Swarm, on_delta: Any = None) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(text, route the start event named, final telemetry) of a new conversation's greedy answer."""
    texts, route = await asyncio.wait_for(
        s.playground_chat([QUESTION], max_tokens=MAX_TOKENS, on_delta=on_delta), ANSWER_TIMEOUT_S
    )
    return texts[0], route, s.telemetry[-1]


async def test_killing_a_later_hop_mid_answer_leaves_the_playground_text_unchanged(swarm: Swarm) -> None:
    s = swarm
    reference, _, undisturbed = await _chat(s)  # the playground samples greedily by default
    assert not undisturbed["recoveries"], undisturbed["recoveries"]
    # the kill must come well before the answer ends, else nothing is left to recover
    assert undisturbed["n_generated"] > 4 * KILL_AFTER_DELTAS, undisturbed

    killed: dict[str, Any] = {}

    def kill_second_hop(n: int, route: list[dict[str, Any]]) -> None:
        if n != KILL_AFTER_DELTAS:
            return
        assert len(route) == 2, route
        victim = route[1]
        spares = [
            h for h in _ranges(s)[(victim["layer_start"], victim["layer_end"])] if h["id"] != victim["node"]
        ]
        assert spares, f"no exact spare for {victim}"
        proc = s.agents[victim["node"]]
        os.kill(proc.pid, signal.SIGKILL)
        killed.update(hop=victim, spares=[h["dataplane_url"] for h in spares], proc=proc)

    text, route, telemetry = await _chat(s, kill_second_hop)
    assert killed, "the answer ended before the hop was killed"
    wait_until("the killed agent to exit", lambda: killed["proc"].poll() is not None or None, 10)
    print("\nrecoveries:", telemetry["recoveries"])

    assert text == reference
    assert telemetry["n_generated"] == undisturbed["n_generated"]
    assert len(telemetry["recoveries"]) == 1, telemetry["recoveries"]
    assert telemetry["recoveries"][0]["hops"] == [1]
    # the answer finished on the spare the control plane handed out, on the same layers
    last = telemetry["hops"][1]
    assert last["layers"] == [killed["hop"]["layer_start"], killed["hop"]["layer_end"]]
    assert last["url"] in killed["spares"] and last["url"] != killed["hop"]["url"], (last, killed)
    assert telemetry["hops"][0]["url"] == route[0]["url"], "the first hop stayed where it was"
