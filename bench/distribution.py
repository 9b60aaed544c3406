"""Distribution bench: 3 agents with overlapping layer ranges, torrent swarm vs plain HTTP from the origin.

Both modes run on 127.0.0.1 against the same stand-in origin (aiohttp web seed + passkey tracker, the
one the torrent tests use: webapp/devcluster.py). HTTP-only uses the agent's range fetcher (agent.artifacts.fetch.fetch_shard); torrent mode
uses agent.artifacts.torrent.SwarmClient with the default "fallback" web-seed policy. All three agents start
together in both modes. The last line printed is one JSON object.

With --control-plane both modes run against the real control plane instead (daphne + the Django
tracker and web seed, embedded mode, or real mode when DATABASE_URL / REDIS_URL are set): SmolLM2 is
registered through the admin UI (the Celery job builds the .torrent), one node per range is enrolled
over HTTP, and each node fetches with its own passkey URLs (torrent) or node credentials (HTTP).

    .venv/bin/python bench/distribution.py [--ranges 0:20,10:30,0:30] [--control-plane]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.artifacts.manifest import Manifest, build_manifest, merge_ranges  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.artifacts.torrent import (  # noqa: E402
    SwarmClient,
    create_torrent,
    shard_byte_ranges,
    torrent_info,
    verify_tensors,
)
from bench._common import cpu_kind  # noqa: E402
from webapp.devcluster import Origin  # noqa: E402  (the stand-in origin the torrent tests use)


def _needed(manifest: Manifest, a: int, b: int) -> int:
    return sum(e - s for s, e in shard_byte_ranges(manifest, a, b))


def run_torrent(
    model: Path, manifest: Manifest, ranges: list[tuple[int, int]], work: Path, rate: float | None
) -> dict[str, Any]:
    tb, ih = create_torrent(model, smallest_layer_bytes=min(x.nbytes for x in manifest.layers))
    keys = [f"agent{i}" for i in range(len(ranges))]
    with Origin(model, infohashes={bytes.fromhex(ih)}, passkeys=set(keys), total_rate_bps=rate) as origin:
        clients = [SwarmClient("127.0.0.1:0") for _ in ranges]
        try:

            def one(i: int) -> Path:
                a, b = ranges[i]
                path = clients[i].fetch(
                    tb,
                    work / f"torrent{i}",
                    shard_byte_ranges(manifest, a, b),
                    timeout=300,
                    trackers=[origin.tracker_url(keys[i])],
                    web_seeds=[origin.web_seed_url(keys[i])],
                )
                verify_tensors(path, manifest, a, b)
                return path

            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(ranges)) as pool:
                list(pool.map(one, range(len(ranges))))
            seconds = time.perf_counter() - t0
            agents = []
            for i, (a, b) in enumerate(ranges):
                p = clients[i].progress(clients[i].get(ih))
                agents.append(
                    {
                        "layers": f"{a}:{b}",
                        "needed": _needed(manifest, a, b),
                        "downloaded": p.downloaded_bytes,
                        "ratio": round(p.downloaded_bytes / _needed(manifest, a, b), 4),
                        "from_peers": p.peer_bytes,
                        "from_origin": origin.served[keys[i]],
                    }
                )
        finally:
            for c in clients:
                c.close()
        return {"seconds": seconds, "origin_bytes": origin.origin_bytes, "agents": agents}


def run_http(
    model: Path, manifest: Manifest, ranges: list[tuple[int, int]], work: Path, rate: float | None
) -> dict[str, Any]:
    from aiohttp import ClientSession

    from agent.artifacts.fetch import fetch_shard

    keys = [f"agent{i}" for i in range(len(ranges))]
    with Origin(model, passkeys=set(keys), total_rate_bps=rate) as origin:

        async def all_agents() -> list[int]:
            async with ClientSession() as http:
                return await asyncio.gather(
                    *(
                        fetch_shard(
                            http,
                            origin.web_seed_url(keys[i]),
                            {},
                            manifest,
                            a,
                            b,
                            work / f"http{i}" / model.name,
                        )
                        for i, (a, b) in enumerate(ranges)
                    )
                )

        t0 = time.perf_counter()
        got = asyncio.run(all_agents())
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "origin_bytes": origin.origin_bytes, "downloaded": got}


def run_control_plane(
    manifest: Manifest, ranges: list[tuple[int, int]], work: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(torrent, http-only) results against the real control plane; origin bytes are what its web seed
    (torrent) or artifact endpoint (HTTP) served, as counted by the nodes."""
    import urllib.request

    from aiohttp import ClientSession

    from agent.artifacts.fetch import fetch_shard
    from agent.node.config import NodeConfig
    from webapp.devcluster import control_plane
    from webapp.fleet.passkeys import derive_passkey

    secret = secrets.token_urlsafe(48)
    with control_plane(work / "cp", SECRET_KEY=secret) as s:
        sha = s.register_smollm2()["sha256"]
        nodes = [NodeConfig(**json.loads(s.enroll(f"bench-{i}")[0].read_text())) for i in range(len(ranges))]
        req = urllib.request.Request(
            f"{s.base}/artifacts/{sha}/torrent", headers={"Authorization": nodes[0].authorization()}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            tb = r.read()
        clients = [SwarmClient("127.0.0.1:0") for _ in ranges]
        try:

            def one(i: int) -> Path:
                a, b = ranges[i]
                key = derive_passkey(secret, nodes[i].node_id)
                return clients[i].fetch_verified(
                    tb,
                    work / f"cp-torrent{i}",
                    manifest,
                    a,
                    b,
                    timeout=300,
                    trackers=[f"{s.base}/tracker/{key}/announce"],
                    web_seeds=[f"{s.base}/webseed/{key}/{sha}"],
                )

            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(ranges)) as pool:
                list(pool.map(one, range(len(ranges))))
            seconds = time.perf_counter() - t0
            agents = []
            for i, (a, b) in enumerate(ranges):
                d = clients[i].get(str(torrent_info(tb).info_hashes().v1))
                assert d is not None
                p = clients[i].progress(d)
                agents.append(
                    {
                        "layers": f"{a}:{b}",
                        "needed": _needed(manifest, a, b),
                        "downloaded": p.downloaded_bytes,
                        "ratio": round(p.downloaded_bytes / _needed(manifest, a, b), 4),
                        "from_peers": p.peer_bytes,
                        "from_origin": p.web_seed_bytes,
                    }
                )
        finally:
            for c in clients:
                c.close()
        torrent = {
            "seconds": seconds,
            "origin_bytes": sum(a["from_origin"] for a in agents),
            "agents": agents,
        }

        async def all_agents() -> list[int]:
            async with ClientSession() as http:
                return await asyncio.gather(
                    *(
                        fetch_shard(
                            http,
                            f"{s.base}/artifacts/{sha}/file",
                            {"Authorization": nodes[i].authorization()},
                            manifest,
                            a,
                            b,
                            work / f"cp-http{i}" / f"{sha}.gguf",
                        )
                        for i, (a, b) in enumerate(ranges)
                    )
                )

        t0 = time.perf_counter()
        got = asyncio.run(all_agents())
        http = {"seconds": time.perf_counter() - t0, "origin_bytes": sum(got), "downloaded": got}
    return torrent, http


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--ranges", default="0:20,10:30,0:30", help="comma-separated layer ranges a:b, one per agent"
    )
    ap.add_argument(
        "--origin-mbit",
        type=float,
        default=400.0,
        help="also run both modes with the origin's uplink limited to this many Mbit/s (0: skip)",
    )
    ap.add_argument(
        "--control-plane",
        action="store_true",
        help="run against the real control plane (Django tracker + web seed) instead of the stand-in",
    )
    args = ap.parse_args()
    ranges = [tuple(int(x) for x in r.split(":")) for r in args.ranges.split(",")]
    model = packaged_model_path()
    t = time.perf_counter()
    manifest = build_manifest(model)
    print(f"manifest of {model.name} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-distribution-") as tmp:
        work = Path(tmp)
        limited: dict[str, Any] = {}
        if args.control_plane:
            torrent, http = run_control_plane(manifest, ranges, work)  # type: ignore[arg-type]
        else:
            http = run_http(model, manifest, ranges, work / "u", None)  # type: ignore[arg-type]
            torrent = run_torrent(model, manifest, ranges, work / "u", None)  # type: ignore[arg-type]
        if args.origin_mbit > 0 and not args.control_plane:
            rate = args.origin_mbit * 1e6 / 8
            lim_http = run_http(model, manifest, ranges, work / "l", rate)  # type: ignore[arg-type]
            lim_torrent = run_torrent(model, manifest, ranges, work / "l", rate)  # type: ignore[arg-type]
            limited = {
                "origin_mbit": args.origin_mbit,
                "seconds_torrent": round(lim_torrent["seconds"], 3),
                "seconds_http_only": round(lim_http["seconds"], 3),
                "origin_bytes_torrent": lim_torrent["origin_bytes"],
                "origin_bytes_http_only": lim_http["origin_bytes"],
            }
    needed_sum = sum(_needed(manifest, a, b) for a, b in ranges)
    union = sum(
        e - s for s, e in merge_ranges([r for a, b in ranges for r in shard_byte_ranges(manifest, a, b)])
    )
    for agent in torrent["agents"]:
        print(
            f"  agent {agent['layers']:>6}: needs {agent['needed'] / 1e6:6.1f} MB, downloaded "
            f"{agent['downloaded'] / 1e6:6.1f} MB ({agent['ratio']:.3f}x), from peers {agent['from_peers'] / 1e6:6.1f} MB,"
            f" from origin {agent['from_origin'] / 1e6:6.1f} MB"
        )
    result = {
        "cpu": cpu_kind(),
        "seconds_torrent": round(torrent["seconds"], 3),
        "seconds_http_only": round(http["seconds"], 3),
        "origin_bytes_torrent": torrent["origin_bytes"],
        "origin_bytes_http_only": http["origin_bytes"],
        "origin_ratio": round(torrent["origin_bytes"] / http["origin_bytes"], 4),
        "origin_ratio_ideal": round(union / needed_sum, 4),
        "max_download_ratio_vs_needed": max(a["ratio"] for a in torrent["agents"]),
        "ranges": [f"{a}:{b}" for a, b in ranges],
        "agents": torrent["agents"],
        "origin_limited": limited,
        "origin": "control plane" if args.control_plane else "stand-in",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
