"""Development tooling the tests and the benchmarks share (and `make up` can); the running node never imports it.

`cluster`: local agents as real processes (`agent serve` hops, enrolled `agent run` nodes), each polled
until it is ready. `chain`: a route's hops driven in one process, as the route client would drive them.
`links`: the link harness of issue 34 (hops in network namespaces behind delaying, tbf-shaped links;
docs/links.md), through `relay`, the delaying TCP relay bench/simulator.py uses on loopback too.
`hostile`: the hostile clients of issue 33 (bodies the web must not read, a /healthz probe, stalled hop
connections, announce queries), for its tests and bench/abuse.py. The control plane's side of a local
cluster (web server, Celery, the stand-in origin) is `webapp/devcluster.py`, which starts its agents
through `cluster`.
"""
