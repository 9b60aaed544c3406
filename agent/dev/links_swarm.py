"""A torrent peer for the link harness: `python -m agent.dev.links_swarm seed|fetch ...`, a libtorrent session in a namespace.

The link harness (agent/dev/links.py) starts one in a namespace with `LinkLab.spawn`:

* `seed`: seeds a complete GGUF we trust (SwarmClient.seed, as the origin's copy) until SIGTERM;
* `fetch`: downloads the pieces of one layer range and verifies every tensor of it against the
  manifest (SwarmClient.fetch_verified, what an agent's load runs), then writes the result (the
  transfer's progress counters, its seconds and the file's path) as JSON to `--out` and exits;
  exit 1 with the error in `--out` when it fails.

Both listen on the given address inside their namespace and announce to the given tracker URL, both
reached through the harness's relays. Plain torrents: the harness has no swarm CA for SSL torrents
(tests/integration/test_swarm_ssl_torrents.py covers those on loopback), so the processes run with
GGSWARM_INSECURE_PLAIN_HTTP=1 set by their caller.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from agent.artifacts.manifest import Manifest
from agent.artifacts.torrent import SwarmClient, torrent_info


def command(action: str, torrent: Path, listen: str, tracker: str, *extra: str) -> list[str]:
    """A peer's command line: `seed` or `fetch` `torrent`, listening on `listen` (inside its namespace),
    announcing to `tracker`; `extra`: the action's own options."""
    module = [sys.executable, "-m", "agent.dev.links_swarm", action]
    return [*module, "--torrent", str(torrent), "--listen", listen, "--tracker", tracker, *extra]


def _seed(args: argparse.Namespace) -> int:
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    with SwarmClient(args.listen) as swarm:
        swarm.seed(Path(args.torrent).read_bytes(), args.file, trackers=[args.tracker])
        print(f"seeding on {args.listen}, port {swarm.listen_port}", flush=True)
        stopped.wait()  # the harness stops it (SIGTERM): the session then closes, stopping the announce
    return 0


def _fetch(args: argparse.Namespace) -> int:
    manifest = Manifest.from_json(Path(args.manifest).read_text())
    a, b = (int(x) for x in args.layers.split(":"))
    torrent = Path(args.torrent).read_bytes()
    out: dict[str, object] = {}
    with SwarmClient(args.listen) as swarm:
        t0 = time.monotonic()
        try:
            # no web seed: every byte has to come from the swarm's peers, across the links
            path = swarm.fetch_verified(
                torrent,
                args.dest,
                manifest,
                a,
                b,
                timeout=args.timeout,
                trackers=[args.tracker],
                web_seeds=[],
                web_seed_policy="never",
            )
        except Exception as e:  # noqa: BLE001 - whatever failed is the result the caller reads
            out = {"error": f"{type(e).__name__}: {e}"}
        else:
            d = swarm.get(str(torrent_info(torrent).info_hashes().v1))
            assert d is not None
            out = {
                "path": str(path),
                "seconds": time.monotonic() - t0,
                "progress": swarm.progress(d).to_dict(),
            }
    Path(args.out).write_text(json.dumps(out))
    return 1 if "error" in out else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agent.dev.links_swarm", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    seed, fetch = sub.add_parser("seed"), sub.add_parser("fetch")
    for p in (seed, fetch):
        p.add_argument("--torrent", required=True, help=".torrent file")
        p.add_argument("--listen", required=True, help="HOST:PORT of this peer, inside its namespace")
        p.add_argument("--tracker", required=True, help="announce URL (with this peer's passkey)")
    seed.add_argument("--file", required=True, help="the complete file to seed")
    fetch.add_argument("--dest", required=True, help="directory of the sparse file")
    fetch.add_argument("--manifest", required=True, help="manifest JSON (tensor hashes)")
    fetch.add_argument("--layers", required=True, help="A:B, the layer range to fetch")
    fetch.add_argument("--out", required=True, help="where the result JSON goes")
    fetch.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    return _seed(args) if args.command == "seed" else _fetch(args)


if __name__ == "__main__":
    sys.exit(main())
