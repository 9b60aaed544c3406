"""The link harness: `agent serve` hops (and other processes) each in a network namespace of its own, behind delaying relays and tbf-shaped veth links.

    with LinkLab(3, workdir) as lab:
        lab.start_hops(model, [(0, 10), (10, 20), (20, 30)], public_key_b64)
        lab.shape(100)            # Mbit/s each way on every hop's link (None: unshaped)
        lab.set_delay(5.0, 0.5)   # ms one way (+ jitter) on every relay
        client = RouteClient(minted_hops(key, session, sha, lab.plan()), ssl_context=lab.client_ssl())

Namespace i (`ggsl<pid>-<k>`, k counting this process's namespaces: parallel runs never collide, and
a later run removes what a killed one left) has a veth pair to the root namespace, a /30 of 10.201.0.0/16 (host side .1, namespace side
.2), loopback up and its default route through the host side. Its hop listens on the namespace
address; a relay in the root namespace (agent/dev/relay.py, one child process for all of them) listens
on the host-side address with the same ports, the data plane's and the decode lane's, and forwards
there after the one-way delay. The route's URLs name the relays, so every link carries the delay: the
client's to each hop, and a hop's to the next (chain mode: the hop dials the next hop's relay through
the root namespace). `tc ... tbf` on both ends of each veth limits the hop's link each way (the kernel
has no netem, so the delay cannot come from tc). Between hops and to the client: mutual TLS with
certificates from a CA of the lab's own, issued as enrollment issues them (agent/node/certs.py), or,
with tls=False, plain HTTP (GGSWARM_INSECURE_PLAIN_HTTP). The decode lane is the lane production has
(sealed frames over plain TCP).

Other processes live in the namespaces too (`spawn`: a torrent peer, agent/dev/links_swarm.py): a
service inside is reached at its namespace's host-side address through a relay of its own (`expose`),
and a service in the root namespace (a tracker on 127.0.0.1) is reached from inside through a relay
on the host-side address that dials it from that address (`reach`), so the service sees the namespace
where the others reach it, as a server on the internet sees a node's public address. An enrolled
`agent run` node is such a process (`node`): its control plane reached through `reach`, its data plane,
decode lane and libtorrent behind `expose` relays, the data plane's relay the URL it advertises.

Everything is torn down by `close()` (the context manager's exit, and atexit): hops and spawned
processes stopped, relays closed, namespaces deleted (their veths go with them). Needs root and `ip` /
`tc` (`unusable()` says why not). Standard library plus agent.wire.tls (certificates) and agent.procs.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import ssl
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.dev.cluster import ROOT, agent_env, serve_command
from agent.dev.relay import RelayProcess
from agent.procs import Process, free_port, spawn, stop, wait_port

PREFIX = "ggsl"
SUBNETS = ipaddress.ip_network("10.201.0.0/16")  # one /30 per namespace, the first free one
MAX_NAMESPACES = 16  # per lab: the harness never fills the machine with namespaces
LOCK = Path(tempfile.gettempdir()) / "ggsl-links.lock"  # address allocation across parallel runs
# tbf's bucket: one full frame (1500 + Ethernet header, rounded up). A bucket this small makes every
# packet but the first of a burst wait its serialization time, as on a real link of that rate
TBF_BURST_BYTES = 1600
TBF_LATENCY_MS = 500  # queue before tbf drops: a prompt's burst at 20 Mbit must never be dropped
CMD_TIMEOUT_S = 15.0
READY_S = 180.0  # a hop's start (loading the model) on a loaded 2-core machine
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)$")
_serial = itertools.count()  # namespaces this process made: names stay unique across its labs


class LinkError(RuntimeError):
    """An `ip` or `tc` command failed."""


def _run(*cmd: str, check: bool = True) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and r.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def unusable() -> str | None:
    """Why the harness cannot run here (not root, no `ip`/`tc`, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", probe)
    except (LinkError, OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` is refused: {e}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def namespaces() -> list[str]:
    """Every namespace of this harness now on the machine (any run's)."""
    names = (line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip())
    return [n for n in names if n.startswith(PREFIX)]


def host_links() -> list[str]:
    """Every veth of this harness now in the root namespace (any run's)."""
    out = _run("ip", "-o", "link", "show")
    names = (line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line)
    return [n for n in names if n.startswith(PREFIX)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces and veths of runs whose process is gone (a run killed before its cleanup)."""
    removed = []
    for name in namespaces():
        m = _NAME.match(name) or re.match(rf"^{PREFIX}(\d+)-probe$", name)
        if m and not _alive(int(m.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for link in host_links():
        m = re.match(rf"^{PREFIX}(\d+)h\d+$", link)
        if m and not _alive(int(m.group(1))):
            _run("ip", "link", "del", link, check=False)
            removed.append(link)
    return removed


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with LOCK.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _used_addresses() -> set[str]:
    out = _run("ip", "-o", "-4", "addr", "show")
    return {m.group(1) for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+)/", out)}


@dataclass(frozen=True)
class Link:
    """Namespace `name` and its veth: `host_if` (root namespace, `host_ip`) to `ns_if` (inside, `ns_ip`)."""

    index: int
    name: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str

    def ns(self, *cmd: str) -> list[str]:
        """`cmd` run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]


@dataclass
class NetnsHop:
    """An `agent serve` in `link`'s namespace; `url` is its relay's (what the route names)."""

    link: Link
    proc: Process
    layer_start: int
    layer_end: int
    node_id: str
    port: int
    lane_port: int
    url: str
    log: Path


@dataclass(frozen=True)
class LinkedNode:
    """How an `agent run` node in namespace `index` runs (`LinkLab.node`): the command under `prefix`,
    the control plane at `server` (a `reach` relay), its data plane advertised at `url` (an `expose`
    relay), libtorrent on `torrent_listen` (exposed at the same port), `args` and `env` for `agent run`."""

    index: int
    prefix: list[str]
    server: str
    url: str
    torrent_listen: str
    args: list[str]
    env: dict[str, str]


class _Pki:
    """A CA of the lab's own, issuing node and client certificates as enrollment does (key + CSR)."""

    def __init__(self, directory: Path) -> None:
        from agent.wire import tls

        self.tls = tls
        self.dir = directory
        self.ca_key, self.ca_cert = tls.load_or_create_ca(directory)
        self.ca = directory / "ca.crt"

    def issue(self, stem: str, identity: str, hosts: list[str]) -> tuple[Path, Path]:
        key = self.tls.make_key()
        key_path, cert_path = self.dir / f"{stem}.key", self.dir / f"{stem}.crt"
        self.tls.write_private(key_path, self.tls.key_pem(key))
        csr = self.tls.make_csr(key, stem)
        cert_path.write_bytes(self.tls.issue_cert(self.ca_key, self.ca_cert, csr, identity, hosts))
        return cert_path, key_path


class LinkLab:
    """`n` namespaces with their links, the hops started in them, and the relays in front of the hops."""

    def __init__(self, n: int, workdir: Path, *, tls: bool = True) -> None:
        if not 1 <= n <= MAX_NAMESPACES:
            raise ValueError(f"a lab has 1 to {MAX_NAMESPACES} namespaces, not {n}")
        self.n = n
        self.workdir = workdir
        self.tls = tls
        self.links: list[Link] = []
        self.hops: list[NetnsHop] = []
        self.procs: list[Process] = []  # spawn()'s, stopped with the hops
        self.relay: RelayProcess | None = None
        self._delay = (0.0, 0.0)  # ms one way, jitter: what a relay process started later begins with
        self.rate_mbit: float | None = None
        self._pki: _Pki | None = None
        self._client_ssl: ssl.SSLContext | None = None
        self._closed = False

    def __enter__(self) -> LinkLab:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- namespaces and links ------------------------------------------------------------------------
    def open(self) -> None:
        """Create the namespaces and their links (the first free /30s of SUBNETS)."""
        atexit.register(self.close)
        pid = os.getpid()
        with _locked():
            sweep_stale()
            used = _used_addresses()
            free = (s for s in SUBNETS.subnets(new_prefix=30) if str(s[1]) not in used)
            for i in range(self.n):
                net, k = next(free), next(_serial)  # veth names: 15 characters at most
                link = Link(
                    i,
                    f"{PREFIX}{pid}-{k}",
                    f"{PREFIX}{pid}h{k}",
                    f"{PREFIX}{pid}n{k}",
                    str(net[1]),
                    str(net[2]),
                )
                _run("ip", "netns", "add", link.name)
                self.links.append(link)
                _run(
                    "ip",
                    "link",
                    "add",
                    link.host_if,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    link.ns_if,
                    "netns",
                    link.name,
                )
                _run("ip", "addr", "add", f"{link.host_ip}/30", "dev", link.host_if)
                _run("ip", "link", "set", link.host_if, "up")
                _run("ip", "-n", link.name, "link", "set", "lo", "up")
                _run("ip", "-n", link.name, "addr", "add", f"{link.ns_ip}/30", "dev", link.ns_if)
                _run("ip", "-n", link.name, "link", "set", link.ns_if, "up")
                # a hop reaches the other hops' relays (root namespace addresses) through its own link
                _run("ip", "-n", link.name, "route", "add", "default", "via", link.host_ip)

    def shape(self, rate_mbit: float | None) -> None:
        """Limit every link to `rate_mbit` each way (tbf on both ends of each veth); None: unshaped."""
        for link in self.links:
            for cmd in (["tc"], link.ns("tc")):
                dev = link.host_if if cmd == ["tc"] else link.ns_if
                if rate_mbit is None:
                    _run(*cmd, "qdisc", "del", "dev", dev, "root", check=False)
                else:
                    _run(*cmd, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                         "burst", str(TBF_BURST_BYTES), "latency", f"{TBF_LATENCY_MS}ms")  # fmt: skip
        self.rate_mbit = rate_mbit

    def set_delay(self, delay_ms: float, jitter_ms: float = 0.0) -> None:
        """Every relay's one-way delay (and jitter, uniform in [0, jitter_ms)) from now on, the ones
        opened later included."""
        self._delay = (delay_ms, jitter_ms)
        if self.relay is not None:
            self.relay.set_delay(delay_ms, jitter_ms)

    # -- relays and other processes ------------------------------------------------------------------
    def _relays(self) -> RelayProcess:
        """The one relay process of the lab (every relay shares its delay), started on first use."""
        if self.relay is None:
            self.relay = RelayProcess([], self.workdir / "relay.log", delay_ms=self._delay[0])
            if self._delay[1]:
                self.relay.set_delay(*self._delay)
        return self.relay

    def port(self, index: int) -> int:
        """A port free on namespace `index`'s host-side address: a service inside listens on it (the
        namespace is fresh, so it is free there too), its relay outside (`expose`) on the same number."""
        return free_port(self.links[index].host_ip)

    def ports(self, index: int, k: int) -> list[int]:
        """`k` distinct `port(index)`s (free_port may hand out one number twice before it is taken)."""
        picked: list[int] = []
        while len(picked) < k:
            if (p := self.port(index)) not in picked:
                picked.append(p)
        return picked

    def expose(self, index: int, port: int) -> tuple[str, int]:
        """A relay from namespace `index`'s host-side address to the service listening inside on `port`
        (its namespace address), as each hop has: where the others reach that service, the delay and
        the namespace's link on the way."""
        link = self.links[index]
        return self._relays().add([((link.host_ip, port), (link.ns_ip, port))])[0]

    def reach(self, index: int, host: str, port: int) -> tuple[str, int]:
        """A relay through which namespace `index` reaches `host:port`, a service of the root namespace
        (127.0.0.1 included): it listens on the namespace's host-side address and dials the service from
        that address, so the service sees callers from inside at the address `expose` gives them (a
        tracker then hands out peers the others can reach). Where the namespace dials."""
        link = self.links[index]
        return self._relays().add([((link.host_ip, 0), (host, port))], source=link.host_ip)[0]

    def spawn(self, index: int, cmd: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Process:
        """`cmd` in namespace `index` (as an agent process: this checkout on PYTHONPATH, `env` on top),
        output into `log`; stopped by `close()`."""
        proc = spawn(self.links[index].ns(*cmd), log, env=agent_env(ROOT, env), cwd=ROOT)
        self.procs.append(proc)
        return proc

    def node(self, index: int, host: str, port: int) -> LinkedNode:
        """An enrolled `agent run` node in namespace `index`, its control plane the root namespace's
        `host:port` (web, tracker and web seed): reached through a `reach` relay, which the control plane
        sees as the node's address. Its data plane, decode lane and libtorrent listen on the namespace
        address and are exposed at the host-side address, the data plane's relay advertised
        (`--advertise-url`): the control plane's routes, its probe and the other nodes dial the relays,
        and the tracker hands out the torrent relay. Plain HTTP and plain torrents
        (GGSWARM_INSECURE_PLAIN_HTTP): the lab's addresses are not loopback."""
        link = self.links[index]
        dataplane, lane, torrent = self.ports(index, 3)
        for p in (dataplane, lane, torrent):
            self.expose(index, p)
        relay_host, relay_port = self.reach(index, host, port)
        url = f"http://{link.host_ip}:{dataplane}"
        args = ["--host", link.ns_ip, "--port", str(dataplane), "--advertise-url", url]
        env = {"GGSWARM_LANE_PORT": str(lane), "GGSWARM_INSECURE_PLAIN_HTTP": "1"}
        server = f"http://{relay_host}:{relay_port}"
        return LinkedNode(index, link.ns(), server, url, f"{link.ns_ip}:{torrent}", args, env)

    # -- hops ----------------------------------------------------------------------------------------
    def start_hops(
        self,
        model: str | Path,
        windows: Sequence[tuple[int, int]],
        public_key: str,
        *,
        backend: str | None = None,
        threads: int | None = 1,
        kv_budget_mb: int | None = None,
        timeout_s: float = READY_S,
    ) -> list[NetnsHop]:
        """`agent serve` for window i in namespace i (all loading at once), then the relays; the hops."""
        if self.hops or len(windows) > len(self.links):
            raise ValueError(f"{len(windows)} windows for a lab of {len(self.links)} namespaces (once)")
        scheme = "https" if self.tls else "http"
        if self.tls:
            self._pki = _Pki(self.workdir / "pki")
        for link, (a, b) in zip(self.links, windows, strict=False):
            # ports free on the host-side address: the relays listen there with the same numbers
            port, lane_port = self.ports(link.index, 2)
            node_id = f"links-{link.index}-{port}"
            extra = ["--host", link.ns_ip]
            env = {"GGSWARM_LANE_PORT": str(lane_port)}
            if self._pki is not None:
                from agent.wire.tls import node_identity

                cert, key = self._pki.issue(node_id, node_identity(node_id), [link.host_ip, link.ns_ip])
                extra += ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(self._pki.ca)]
            else:
                env["GGSWARM_INSECURE_PLAIN_HTTP"] = "1"  # not loopback, and no certificate
            cmd = serve_command(model, f"{a}:{b}", port=port, public_key=public_key, node_id=node_id,
                                backend=backend, threads=threads, kv_budget_mb=kv_budget_mb, extra=extra)  # fmt: skip
            log = self.workdir / f"serve-{link.name}.log"
            proc = spawn(link.ns(*cmd), log, env=agent_env(ROOT, env), cwd=ROOT)
            url = f"{scheme}://{link.host_ip}:{port}"
            self.hops.append(NetnsHop(link, proc, a, b, node_id, port, lane_port, url, log))
        procs = [h.proc for h in self.hops]
        for h in self.hops:
            wait_port(h.link.ns_ip, h.port, timeout_s, procs=procs, every_s=0.25)
        pairs = []
        for h in self.hops:
            for port in (h.port, h.lane_port):
                pairs.append(((h.link.host_ip, port), (h.link.ns_ip, port)))
        self._relays().add(pairs)
        return self.hops

    def plan(self) -> list[tuple[str, str, int, int]]:
        """The route as (node id, relay URL, layer start, layer end) per hop, in layer order: what
        agent.wire.routetoken.RouteHop takes."""
        return [(h.node_id, h.url, h.layer_start, h.layer_end) for h in self.hops]

    def client_ssl(self) -> ssl.SSLContext | None:
        """The route client's TLS context (a client certificate from the lab's CA), None without TLS."""
        if self._pki is None:
            return None
        if self._client_ssl is None:
            from agent.wire.tls import client_context, client_identity

            cert, key = self._pki.issue("client", client_identity("links"), [])
            self._client_ssl = client_context(cert, key, self._pki.ca)
        return self._client_ssl

    # -- teardown ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the hops, spawned processes and relays and delete the namespaces (with their veths);
        idempotent, and every step runs even when one before it failed."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            stop([h.proc for h in self.hops] + self.procs)
        if self.relay is not None:
            with contextlib.suppress(Exception):
                self.relay.close()
        for link in self.links:
            _run("ip", "netns", "del", link.name, check=False)
            if link.host_if in host_links():  # normally gone with its peer's namespace
                _run("ip", "link", "del", link.host_if, check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
