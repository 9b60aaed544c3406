"""bench/abuse.py's tracker poisoning (item 4): stand-in nodes announce, one of them claims made-up peers."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path
from typing import Any

from agent.dev import hostile as h
from agent.procs import free_port
from bench._abuse_common import LoopThread, shell


class NoShards:
    """The stand-ins' shard host: nothing loaded, nothing to load."""

    def load_shard(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a tracker stand-in holds no shards")

    def unload_shard(self, model_sha256: str, layer_start: int, layer_end: int) -> bool:
        return False

    def drain(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"shards": []}


class StandIns(LoopThread):
    """Enrolled nodes that hold no shards: the real control connection each, and a data plane answering
    its health check only (the control plane probes it before it lists the node online)."""

    def __init__(self, configs: list[Any], data_dir: Path) -> None:
        super().__init__()
        self.configs, self.data_dir = configs, data_dir

    async def main(self, quit: asyncio.Event) -> None:
        from aiohttp import web

        from agent.node.control import ControlAgent

        def health_app(node_id: str) -> web.Application:
            async def health(_: web.Request) -> web.Response:
                return web.json_response({"node_id": node_id})

            app = web.Application()
            app.router.add_get("/v1/health", health)
            return app

        runners, agents = [], []
        for cfg in self.configs:
            port = free_port()
            runners.append(web.AppRunner(health_app(cfg.node_id), access_log=None))
            await runners[-1].setup()
            await web.TCPSite(runners[-1], "127.0.0.1", port).start()
            url = f"http://127.0.0.1:{port}"
            agents.append(
                ControlAgent(
                    config=cfg,
                    host=NoShards(),
                    dataplane_url=url,
                    data_dir=self.data_dir,
                    backends=lambda: ["torch"],
                    speed=1.0,
                    torrent_listen=None,
                )
            )
        await asyncio.gather(*(a.run(quit) for a in agents), return_exceptions=True)
        for r in runners:
            await r.cleanup()


def poisoning(s: Any, honest_nodes: int, claims: int, tmp: Path) -> dict[str, Any]:
    from agent.node.enroll import enroll
    from webapp.tracker.logic import bdecode

    names = [f"honest-{i}" for i in range(honest_nodes)] + ["asker", "poisoner"]
    configs = [enroll(s.base, s.admin.create_enrollment_token(n), n) for n in names]
    ids = [c.node_id for c in configs]
    stand_ins = StandIns(configs, tmp)
    stand_ins.start()
    try:
        s.online(ids)
        got = shell(
            s,
            "import json\nfrom webapp.fleet.passkeys import node_passkey\n"
            "from webapp.catalog.models import ModelArtifact\n"
            f"a = ModelArtifact.objects.get(sha256={s.model['sha256']!r})\n"
            f"print(json.dumps({{'infohash': a.infohash, 'passkeys': [node_passkey(n) for n in {ids!r}]}}))",
        )
        ih, passkeys = bytes.fromhex(got["infohash"]), got["passkeys"]

        def announce(passkey: str, peer_id: bytes, port: int, numwant: int = 50) -> Any:
            url = f"{s.base}/tracker/{passkey}/announce?{h.announce_query(ih, peer_id, port, numwant)}"
            with urllib.request.urlopen(url, timeout=30) as r:
                return bdecode(r.read())

        for i, pk in enumerate(passkeys[:honest_nodes]):
            announce(pk, b"-GS0001-" + b"h%011d" % i, 6881 + i)
        fake_ports = range(40000, 40000 + claims)
        t = time.perf_counter()
        accepted = sum(
            b"failure reason" not in announce(passkeys[-1], b"-FAKE00-" + b"%012d" % p, p) for p in fake_ports
        )
        claim_s = time.perf_counter() - t
        peers = h.compact_peers(announce(passkeys[-2], b"-GS0001-asker0000000", 6999, 200))
    finally:
        stand_ins.stop()
    fake = [p for p in peers if p[1] in fake_ports]
    return {
        "honest_peer_share_after_poisoning": round(1 - len(fake) / len(peers), 3) if peers else None,
        "tracker_peers_returned": len(peers),
        "tracker_fake_peers_returned": len(fake),
        "poison_announces_accepted": accepted,
        "poison_announce_s": round(claim_s, 2),
    }
