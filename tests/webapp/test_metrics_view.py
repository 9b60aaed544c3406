"""The control plane's /metrics: Prometheus text that prometheus_client parses; counters move."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from agent import __version__
from webapp.fleet.models import Node
from webapp.metrics import error_code
from webapp.telemetry.services import record_generation

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(client: Client, **headers: str) -> Samples:
    r = client.get("/metrics", headers=headers)
    assert r.status_code == 200 and r["Content-Type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.content.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.django_db
def test_generations_tokens_errors_nodes_and_versions_show_and_move(artifact: Any) -> None:
    client = Client()
    Node.objects.create(
        name="a", state=Node.State.ONLINE, version="0.1.0", telemetry={"sessions": 2, "kv_bytes": 9}
    )
    Node.objects.create(name="b", state=Node.State.OFFLINE, version="0.0.9")
    before = scrape(client)
    assert before[("gguf_swarm_web_info", (("version", __version__),))] == 1
    assert before[("gguf_swarm_nodes", (("state", "online"),))] == 1
    assert before[("gguf_swarm_nodes", (("state", "offline"),))] == 1
    assert before[("gguf_swarm_node_versions", (("version", "0.1.0"),))] == 1
    assert ("gguf_swarm_tokens_served_total", (("model", "SmolLM2"),)) not in before

    record_generation(None, artifact.pk, None, {"n_generated": 12, "n_prompt": 30})
    record_generation(None, artifact.pk, None, {"n_generated": 8, "n_prompt": 5})
    record_generation(None, artifact.pk, None, {}, error="RouteFailed: no replacement for layers 0:15")
    after = scrape(client)
    assert after[("gguf_swarm_tokens_served_total", (("model", "SmolLM2"),))] == 20
    assert after[("gguf_swarm_prompt_tokens_total", (("model", "SmolLM2"),))] == 35
    assert after[("gguf_swarm_generations_total", (("model", "SmolLM2"), ("outcome", "ok")))] == 2
    assert after[("gguf_swarm_generations_total", (("model", "SmolLM2"), ("outcome", "error")))] == 1
    assert after[("gguf_swarm_generation_errors_total", (("code", "RouteFailed"),))] == 1
    node_a = Node.objects.get(name="a").pk
    assert after[("gguf_swarm_node_sessions", (("node", node_a),))] == 2


@pytest.mark.django_db
def test_error_responses_are_counted_by_status_code() -> None:
    client = Client()
    key = ("gguf_swarm_http_errors_total", (("code", "404"),))
    before = scrape(client).get(key, 0.0)
    assert client.get("/no/such/page/").status_code == 404
    assert client.get("/no/such/page/").status_code == 404
    assert scrape(client)[key] == before + 2


@pytest.mark.django_db
def test_a_metrics_token_keeps_strangers_out(settings: Any) -> None:
    settings.METRICS_TOKEN = "s3cret"
    client = Client()
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert ("gguf_swarm_nodes", (("state", "online"),)) in scrape(client, Authorization="Bearer s3cret")


def test_error_codes_are_short_labels_from_the_error_text() -> None:
    assert error_code("RouteFailed: no replacement") == "RouteFailed"
    assert error_code("agent.client.route.RouteError: boom") == "RouteError"
    assert error_code("the hop at http://x:1 died: reset") == "error"
