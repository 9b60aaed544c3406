"""The control plane with real processes on 127.0.0.1: web (daphne) + Celery worker + two enrolled agents.

Uses PostgreSQL and Redis when DATABASE_URL / REDIS_URL are set (CI), else the embedded SQLite +
eager mode. Every wait polls a readiness condition; nothing sleeps a guessed time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from agent.client.route import Hop, RouteClient
from agent.client.tokenizer import ChatTokenizer
from agent.procs import stop
from agent.wire.routetoken import load_private_key, mint
from agent.wire.sampling import SamplingParams
from tests.integration.swarm import PASSWORD, QUESTION, REPO, Swarm, control_plane

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[Swarm]:
    with control_plane(tmp_path_factory.mktemp("control-plane")) as s:
        yield s


def test_two_agents_enroll_with_admin_tokens_and_smollm2_is_placed_across_both(swarm: Swarm) -> None:
    s = swarm
    for i in (1, 2):
        config, token = s.enroll(f"agent-{i}")
        again = subprocess.run(
            [sys.executable, "-m", "agent", "enroll", "--server", s.base, "--token", token]
            + ["--config", str(config.with_name("reuse.json"))],
            cwd=REPO,
            env=s.env,
            capture_output=True,
            text=True,
        )
        assert again.returncode != 0 and "already used" in again.stderr
        s.run_agent(f"agent-{i}", config)
    s.online(list(s.agents))

    s.register_smollm2()
    code, body = s.admin.post(f"/models/{s.model['id']}/place", {"replicas": "1"})
    assert code == 200, body
    shards = s.shards_ready()
    by_node = {n["id"]: n["shards"] for n in s.admin.status()["nodes"]}
    assert all(len(by_node[nid]) == 1 for nid in s.agents), by_node
    ranges = sorted((sh["layer_start"], sh["layer_end"]) for sh in shards)
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 30


async def test_a_playground_chat_matches_the_route_client_on_the_same_hops(
    swarm: Swarm, model_path: str
) -> None:
    s = swarm
    texts, route = await s.playground_chat([QUESTION])
    assert texts[0].strip()
    assert len(route) == 2 and {h["node"] for h in route} == set(s.agents)

    key = load_private_key(s.data_dir / "route_key.pem")
    session = os.urandom(16)
    hops = [
        Hop(
            h["url"],
            h["layer_start"],
            h["layer_end"],
            mint(key, session, s.model["sha256"], h["layer_start"], h["layer_end"], h["node"], 600),
        )
        for h in route
    ]
    client = RouteClient(hops, ChatTokenizer(model_path), session_id=session)
    try:
        parts = [
            ev.text async for ev in client.chat([{"role": "user", "content": QUESTION}], SamplingParams(), 24)
        ]
    finally:
        await client.close()
    assert "".join(parts) == texts[0]


def test_the_agents_heartbeats_take_pooled_database_connections_instead_of_opening_new_ones(
    swarm: Swarm,
) -> None:
    """A heartbeat is a database call every few seconds per agent; the web process's pool (DB_POOL_MAX)
    hands it a kept connection, so a fleet's heartbeats open none (PostgreSQL's pg_stat_database counts
    every connection opened to the swarm's database)."""
    s = swarm
    url = s.env["DATABASE_URL"]
    if not url.startswith("postgres"):
        pytest.skip("the pool is PostgreSQL's; without DATABASE_URL the control plane runs on SQLite")
    import psycopg

    with psycopg.connect(url, autocommit=True) as watch:

        def opened() -> int:
            row = watch.execute(
                "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
            ).fetchone()
            assert row is not None
            return int(row[0])

        def seen() -> dict[str, Any]:
            return dict(watch.execute("SELECT id, last_seen FROM fleet_node").fetchall())

        before, last = opened(), seen()
        beats = dict.fromkeys(last, 0)
        deadline = time.monotonic() + 60
        while min(beats.values()) < 3:
            assert time.monotonic() < deadline, f"heartbeats seen per agent: {beats}"
            for node, at in seen().items():
                if at != last.get(node):
                    beats[node], last[node] = beats.get(node, 0) + 1, at
            time.sleep(0.1)  # the poll's interval, not a guess at readiness
        # a burst can grow the pool by a connection or two; unpooled, every beat opened one
        assert opened() - before <= 2, (
            f"{opened() - before} connections opened for {sum(beats.values())} heartbeats"
        )


async def test_agents_reconnect_after_the_control_plane_restarts_keeping_their_shards(swarm: Swarm) -> None:
    s = swarm
    assert s.web is not None
    stop([s.web], grace_s=30)
    s.start_web(int(s.base.rsplit(":", 1)[1]))
    s.admin.login("admin", PASSWORD)
    s.online(list(s.agents))
    s.shards_ready()
    logs = "".join((s.logs / f"agent-{i}.log").read_text() for i in (1, 2))
    assert logs.count("loaded ") == 2, "no shard was loaded a second time"
    texts, _ = await s.playground_chat([QUESTION, "Now name a famous museum there."])
    assert all(t.strip() for t in texts)
    first, second = s.telemetry[-2:]
    assert second["n_reused"] > first["n_prompt"], "turn 2 reuses the hops' KV and sends only the new tokens"
    assert second["n_prefilled"] == second["n_prompt"] - second["n_reused"] < first["n_prompt"]


def test_a_hung_agent_that_stops_heartbeating_shows_offline_within_ten_seconds(swarm: Swarm) -> None:
    s = swarm
    victim, proc = list(s.agents.items())[1]
    proc.send_signal(signal.SIGSTOP)  # the socket stays open; only the heartbeats stop
    try:
        t0 = time.monotonic()
        s.admin.wait_for(
            "the hung agent offline",
            lambda st: any(n["id"] == victim and n["state"] == "offline" for n in st["nodes"]),
            10,
            every_s=0.2,
        )
        assert time.monotonic() - t0 < 10
    finally:
        proc.send_signal(signal.SIGCONT)
    s.admin.wait_for(
        "the resumed agent online again",
        lambda st: any(n["id"] == victim and n["state"] == "online" for n in st["nodes"]),
        30,
    )


def test_the_web_server_answers_on_uvloop_as_the_agents_do(swarm: Swarm) -> None:
    # webapp.serve puts daphne's reactor on uvloop before daphne creates its loop: the web's per-token
    # work is mostly loop turns (docs/benchmarks.md, "where the API's gap to the playground is")
    with urllib.request.urlopen(swarm.base + "/healthz", timeout=10) as r:
        assert json.load(r) == {"ok": True, "loop": "uvloop"}


def test_a_killed_agent_shows_offline_within_ten_seconds(swarm: Swarm) -> None:
    s = swarm
    victim, proc = next(iter(s.agents.items()))
    proc.kill()
    t0 = time.monotonic()
    s.admin.wait_for(
        "the killed agent offline",
        lambda st: any(n["id"] == victim and n["state"] == "offline" for n in st["nodes"]),
        10,
        every_s=0.2,
    )
    assert time.monotonic() - t0 < 10


async def test_the_layers_of_a_lost_agent_are_placed_on_the_survivor_and_chat_works_again(
    swarm: Swarm,
) -> None:
    s = swarm
    survivor = list(s.agents)[1]

    def covered(st: dict[str, Any]) -> bool:
        node = next(n for n in st["nodes"] if n["id"] == survivor)
        ready = sorted(
            (sh["layer_start"], sh["layer_end"]) for sh in node["shards"] if sh["state"] == "ready"
        )
        pos = 0
        for a, b in ready:
            if a == pos:
                pos = b
        return pos == 30

    s.admin.wait_for("the survivor to hold every layer", covered, 300, every_s=0.5)
    texts, route = await s.playground_chat([QUESTION])
    assert texts[0].strip() and {h["node"] for h in route} == {survivor}
