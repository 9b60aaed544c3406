"""A stopped (SIGSTOP) middle hop is reported within its deadline, naming that hop (issue 33, item 7).

Three real native `serve` hops (SmolLM2, layers 0:10, 10:20, 20:30); the middle one is stopped after a
few tokens of an answer, in star mode and in chain mode (decode steps on the hops' native lanes), with
no replacement provider and with one that has no spare (the control plane's case when every copy of
the range is on the stopped node). The error comes within the step's deadline (docs/failover.md: max(2
s, 10 x p95)) plus one health check of the hops the step waits on (`probe_timeout_s`; in chain mode,
and without a provider, where a slow hop that still answers it is waited for), and names hop 1.
While the middle hop is stopped, the hop before it still answers its health check (its lane waits for
the stopped hop off its event loop).
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest

from agent.client.recovery import ReplicaProvider, minted_hops
from agent.client.route import RouteClient, RouteError
from agent.wire.routetoken import RouteHop
from agent.wire.sampling import SamplingParams

pytestmark = pytest.mark.slow
RANGES = [(0, 10), (10, 20), (20, 30)]
STOP_AT = 12  # tokens into the answer: enough measured steps for the deadline to apply
MARGIN_S = 1.5  # a loaded 2-core machine


@pytest.fixture(scope="module")
def hops(serve_factory):  # noqa: ANN001, ANN201
    from agent.backends import libggswarm as native

    if not native.is_available():
        pytest.skip("native library not built (bash native/build.sh)")
    from agent.procs import wait_http

    started = [serve_factory(f"{a}:{b}", backend="native", wait=False) for a, b in RANGES]
    for sp in started:
        wait_http(sp.url + "/v1/health", procs=[sp.proc])
    return started


def health_answers(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("provider", [False, True], ids=["no-provider", "no-spare"])
@pytest.mark.parametrize("mode", ["star", "chain"])
async def test_a_stopped_middle_hop_is_reported_within_its_deadline_naming_that_hop(
    hops,  # noqa: ANN001
    signing_key,  # noqa: ANN001
    manifest,  # noqa: ANN001
    mode: str,
    provider: bool,
) -> None:
    session = os.urandom(16)
    plan = [RouteHop(sp.node_id, sp.url, a, b) for sp, (a, b) in zip(hops, RANGES, strict=True)]
    route = minted_hops(signing_key, session, manifest.sha256, plan)
    # a provider that knows only the route's own nodes: the stopped one's range has no spare
    replicas = ReplicaProvider([sp.url for sp in hops], signing_key, session) if provider else None
    client = RouteClient(route, session_id=session, mode=mode, replacements=replicas)
    victim = hops[1]
    marks: dict[str, float] = {}
    n = 0
    try:
        with pytest.raises(RouteError) as err:
            async for _tok, _ in client.generate(list(range(1, 40)), SamplingParams(temperature=0.0), 200):
                n += 1
                if n == STOP_AT:
                    # the hop the client waits on: hop 1 itself in star mode, hop 0 (relaying) in chain
                    marks["deadline"] = client.failover.deadline(1 if mode == "star" else 0, 1)
                    marks["stopped"] = time.monotonic()
                    os.kill(victim.proc.pid, signal.SIGSTOP)
        took = time.monotonic() - marks["stopped"]
        if mode == "chain":
            assert health_answers(hops[0].url), "the hop before the stopped one stopped answering too"
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
        await client.close()
    # the documented deadline, then one health check of the hops the step waits on (chain mode, or
    # no provider: a slow hop that answers it is waited for), then (a provider) its own health check
    # of the candidates
    probed = mode == "chain" or replicas is None
    allowed = marks["deadline"] + (client.policy.probe_timeout_s if probed else 0.0)
    allowed += replicas.probe_timeout_s if replicas is not None else 0.0
    print(f"{mode}, provider={provider}: deadline {marks['deadline']:.2f} s, reported after {took:.2f} s")
    print(err.value)
    assert marks["deadline"] < client.link.timeout_s  # the hop's own deadline, not the client's 120 s
    assert took <= allowed + MARGIN_S, f"reported after {took:.1f} s: {err.value}"
    assert err.value.hop == 1, err.value
    assert str(err.value).startswith(f"hop 1 ({victim.url}") or f"after: hop 1 ({victim.url}" in str(
        err.value
    )
    assert n == STOP_AT  # no token after the stop
