"""`GET /metrics` of the control plane (Prometheus text): generations, tokens, errors by code, nodes by
state, versions, and each node's latest telemetry.

What the database holds (generation records, nodes and their heartbeats) is read at scrape time, so
every web process answers the same totals whichever process served a chat; HTTP error responses are
counted by the process that sent them (`ErrorCodeMiddleware`), one counter per scraped instance as
Prometheus expects. A project-level module (beside `urls.py`, outside the app layers) because it reads
several apps. With `SWARM_METRICS_TOKEN` set, a scrape must send `Authorization: Bearer <token>`.
Names start with `gguf_swarm_`; docs/agent-install.md lists them.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.db.models import Count, Sum
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from agent import __version__

PREFIX = "gguf_swarm"
# Process-wide: Django builds the middleware once per process, and tests reuse the process.
HTTP_REGISTRY = CollectorRegistry()
HTTP_ERRORS = Counter(
    f"{PREFIX}_http_errors",
    "HTTP responses with a 4xx or 5xx status sent by this web process, by status code",
    ["code"],
    registry=HTTP_REGISTRY,
)


def error_code(text: str) -> str:
    """A short label for a generation's error text: its exception-like prefix, else `error`."""
    head = text.split(":", 1)[0].strip()
    if head and len(head) <= 40 and head.replace("_", "").replace(".", "").isalnum():
        return head.rsplit(".", 1)[-1]
    return "error"


class FleetCollector(Collector):
    """Reads generation records and nodes at scrape time."""

    def collect(self) -> Iterator[Metric]:
        from webapp.fleet.models import Node
        from webapp.telemetry.models import GenerationRecord

        yield InfoMetricFamily(f"{PREFIX}_web", "The control plane's version", value={"version": __version__})

        gens = CounterMetricFamily(
            f"{PREFIX}_generations",
            "Answers generated (playground and API), by model and outcome",
            labels=["model", "outcome"],
        )
        tokens = CounterMetricFamily(
            f"{PREFIX}_tokens_served", "Tokens generated, by model", labels=["model"]
        )
        prompt = CounterMetricFamily(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of generations, by model", labels=["model"]
        )
        rows = (
            GenerationRecord.objects.values("artifact__name", "error")
            .annotate(n=Count("id"), out=Sum("n_generated"), inp=Sum("n_prompt"))
            .order_by()
        )
        by_model: dict[str, list[int]] = {}
        outcomes: dict[tuple[str, str], int] = {}
        codes: dict[str, int] = {}
        for r in rows:
            model = r["artifact__name"] or ""
            acc = by_model.setdefault(model, [0, 0])
            acc[0] += int(r["out"] or 0)
            acc[1] += int(r["inp"] or 0)
            key = (model, "error" if r["error"] else "ok")
            outcomes[key] = outcomes.get(key, 0) + int(r["n"])
            if r["error"]:
                code = error_code(r["error"])
                codes[code] = codes.get(code, 0) + int(r["n"])
        for (model, outcome), n in sorted(outcomes.items()):
            gens.add_metric([model, outcome], n)
        for model, (out, inp) in sorted(by_model.items()):
            tokens.add_metric([model], out)
            prompt.add_metric([model], inp)
        errors = CounterMetricFamily(
            f"{PREFIX}_generation_errors", "Failed generations, by error code", labels=["code"]
        )
        for code, n in sorted(codes.items()):
            errors.add_metric([code], n)
        yield from (gens, tokens, prompt, errors)

        states = GaugeMetricFamily(f"{PREFIX}_nodes", "Enrolled nodes, by state", labels=["state"])
        counts = dict(Node.objects.values_list("state").annotate(n=Count("id")).order_by())
        for state in Node.State.values:
            states.add_metric([state], counts.get(state, 0))
        versions = GaugeMetricFamily(
            f"{PREFIX}_node_versions", "Online nodes, by the agent version they run", labels=["version"]
        )
        for version, n in (
            Node.objects.filter(state=Node.State.ONLINE)
            .values_list("version")
            .annotate(n=Count("id"))
            .order_by()
        ):
            versions.add_metric([version or "unknown"], n)
        yield from (states, versions)
        yield from _node_telemetry(
            Node.objects.filter(state=Node.State.ONLINE).values_list("id", "telemetry")
        )


def _node_telemetry(nodes: Any) -> Iterator[Metric]:
    """Each online node's latest heartbeat, GPUs included."""
    gauges = {
        key: GaugeMetricFamily(f"{PREFIX}_node_{key}", help_text, labels=["node"])
        for key, help_text in (
            ("sessions", "Open sessions on the node (latest heartbeat)"),
            ("kv_bytes", "Session state bytes the node holds (latest heartbeat)"),
            ("tok_s", "Tokens per second the node served (latest heartbeat)"),
            ("free_memory_bytes", "Host memory free on the node (latest heartbeat)"),
        )
    }
    gpu = {
        key: GaugeMetricFamily(f"{PREFIX}_node_gpu_{key}", help_text, labels=["node", "gpu"])
        for key, help_text in (
            ("memory_free_bytes", "GPU memory free (NVML, latest heartbeat)"),
            ("memory_used_bytes", "GPU memory used (NVML, latest heartbeat)"),
            ("utilization_percent", "GPU utilisation (NVML, latest heartbeat)"),
            ("temperature_c", "GPU temperature in Celsius (NVML, latest heartbeat)"),
            ("power_w", "GPU power draw in watts (NVML, latest heartbeat)"),
        )
    }
    for node_id, telemetry in nodes:
        t = telemetry if isinstance(telemetry, dict) else {}
        for key, fam in gauges.items():
            if isinstance(t.get(key), int | float):
                fam.add_metric([node_id], float(t[key]))
        for g in t.get("gpus") or []:
            if not isinstance(g, dict):
                continue
            for key, fam in gpu.items():
                if isinstance(g.get(key), int | float):
                    fam.add_metric([node_id, str(g.get("index", 0))], float(g[key]))
    yield from gauges.values()
    yield from gpu.values()


_REGISTRY = CollectorRegistry()
_REGISTRY.register(FleetCollector())


def render() -> bytes:
    """The whole scrape: the database's figures, then this process's HTTP error counter."""
    return generate_latest(_REGISTRY) + generate_latest(HTTP_REGISTRY)


def _authorised(request: HttpRequest) -> bool:
    token = getattr(settings, "METRICS_TOKEN", "")
    if not token:
        return True
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus scrape endpoint."""
    if not _authorised(request):
        return HttpResponse("metrics token required\n", status=401, content_type="text/plain")
    return HttpResponse(render(), content_type=CONTENT_TYPE_LATEST)


class ErrorCodeMiddleware:
    """Counts every 4xx/5xx response by status code (sync or async stack, whichever Django runs)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        response = self.get_response(request)
        self._count(response)
        return response

    async def _acall(self, request: HttpRequest) -> Any:
        response = await self.get_response(request)
        self._count(response)
        return response

    @staticmethod
    def _count(response: HttpResponse) -> None:
        status = int(getattr(response, "status_code", 200))
        if status >= 400:
            HTTP_ERRORS.labels(str(status)).inc()
