"""Layer-range downloads over a real libtorrent swarm on 127.0.0.1, with an aiohttp stand-in origin."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import libtorrent as lt
import pytest

from agent.artifacts.manifest import Manifest
from agent.artifacts.pieces import pieces_bytes, pieces_for_ranges
from agent.artifacts.torrent import (
    Progress,
    SwarmClient,
    TensorHashMismatch,
    create_torrent,
    shard_byte_ranges,
    verify_tensors,
)
from webapp.devcluster import Origin

THIRDS = [(0, 10), (10, 20), (20, 30)]


@pytest.fixture(scope="module")
def torrent(model_path: str, manifest: Manifest) -> tuple[bytes, str]:
    return create_torrent(model_path, smallest_layer_bytes=min(x.nbytes for x in manifest.layers))


@pytest.fixture
def origin(model_path: str, torrent: tuple[bytes, str]) -> Iterator[Origin]:
    with Origin(
        Path(model_path), infohashes={bytes.fromhex(torrent[1])}, passkeys={"a", "b", "c", "evil"}
    ) as o:
        yield o


def _client() -> SwarmClient:
    return SwarmClient("127.0.0.1:0", peer_wait_s=1.0, stall_s=0.5)


def _urls(origin: Origin, passkey: str) -> dict[str, list[str]]:
    return {"trackers": [origin.tracker_url(passkey)], "web_seeds": [origin.web_seed_url(passkey)]}


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.fixture(scope="module")
def thirds(
    tmp_path_factory: pytest.TempPathFactory, torrent: tuple[bytes, str], manifest: Manifest, model_path: str
) -> Iterator[tuple[list[Path], list[dict[str, object]]]]:
    """Three agents start together, each assigned a third of the layers; returns their files and figures."""
    tb, ih = torrent
    work = tmp_path_factory.mktemp("thirds")
    with Origin(Path(model_path), infohashes={bytes.fromhex(ih)}, passkeys={"a", "b", "c"}) as origin:
        clients = [_client() for _ in THIRDS]
        try:

            def run(i: int) -> Path:
                a, b = THIRDS[i]
                ranges = shard_byte_ranges(manifest, a, b)
                return clients[i].fetch(tb, work / f"n{i}", ranges, timeout=60, **_urls(origin, "abc"[i]))

            with ThreadPoolExecutor(3) as pool:
                paths = list(pool.map(run, range(3)))
            figures: list[dict[str, object]] = []
            for i, (a, b) in enumerate(THIRDS):
                p = clients[i].progress(clients[i].get(ih))
                needed = sum(e - s for s, e in shard_byte_ranges(manifest, a, b))  # header + range + role
                figures.append(
                    {
                        "layers": f"{a}:{b}",
                        "needed": needed,
                        "downloaded": p.downloaded_bytes,
                        "ratio": round(p.downloaded_bytes / needed, 4),
                        "ratio_vs_tensors_only": round(
                            p.downloaded_bytes / manifest.bytes_for_range(a, b), 4
                        ),
                        "peer_bytes": p.peer_bytes,
                        "web_seed_bytes": p.web_seed_bytes,
                        "origin_served": origin.served["abc"[i]],
                        "on_disk": _allocated(paths[i]),
                    }
                )
            print(json.dumps(figures))
        finally:
            for c in clients:
                c.close()
    yield paths, figures


@pytest.mark.slow
def test_three_agents_with_a_third_each_download_at_most_110_percent_of_what_they_need(
    thirds: tuple[list[Path], list[dict[str, object]]], manifest: Manifest, model_path: str
) -> None:
    paths, figures = thirds
    header = manifest.tensor_data_offset  # metadata + tensor table: the sparse file opens as a GGUF
    original_header = Path(model_path).read_bytes()[:header]
    for (a, b), path, f in zip(THIRDS, paths, figures, strict=True):
        verify_tensors(path, manifest, a, b)
        assert path.read_bytes()[:header] == original_header
        assert f["ratio"] <= 1.10, f  # type: ignore[operator]
        assert f["on_disk"] < 0.7 * manifest.file_size, f  # type: ignore[operator]  # sparse file


@pytest.mark.slow
def test_a_route_over_the_three_sparse_files_generates_what_the_whole_file_does(
    thirds: tuple[list[Path], list[dict[str, object]]], manifest: Manifest, model_path: str
) -> None:
    pytest.importorskip("torch")
    from agent.backends.base import ShardSpec
    from agent.backends.torch_llama import TorchLlamaBackend
    from tests.helpers import CHAT_PROMPT, greedy_through

    def greedy(parts: list[TorchLlamaBackend], n: int) -> list[int]:
        return greedy_through(parts, CHAT_PROMPT, n)

    paths, _ = thirds
    route = [
        TorchLlamaBackend(ShardSpec(str(p), a, b, manifest)) for p, (a, b) in zip(paths, THIRDS, strict=True)
    ]
    whole = TorchLlamaBackend(ShardSpec(model_path, 0, manifest.n_layers, manifest))
    expected = greedy([whole], 8)
    assert greedy(route, 8) == expected
    assert len(set(expected)) > 2


@pytest.mark.slow
def test_a_second_agent_with_an_overlapping_range_gets_pieces_from_the_first(
    tmp_path: Path, origin: Origin, torrent: tuple[bytes, str], manifest: Manifest
) -> None:
    tb, ih = torrent
    with _client() as first, _client() as second:
        first.fetch(tb, tmp_path / "a", shard_byte_ranges(manifest, 0, 20), timeout=60, **_urls(origin, "a"))
        reports: list[Progress] = []
        path = second.fetch(
            tb,
            tmp_path / "b",
            shard_byte_ranges(manifest, 10, 30),
            reports.append,
            timeout=60,
            **_urls(origin, "b"),
        )
        verify_tensors(path, manifest, 10, 30)
        p = second.progress(second.get(ih))
        print(
            json.dumps(
                {
                    "peer_bytes": p.peer_bytes,
                    "web_seed_bytes": p.web_seed_bytes,
                    "origin_served_b": origin.served["b"],
                    "downloaded": p.downloaded_bytes,
                }
            )
        )
        assert p.peer_bytes > 0
        assert origin.served["b"] < p.downloaded_bytes
        assert p.peer_bytes + p.web_seed_bytes == p.downloaded_bytes
        assert reports and reports[-1].done_bytes == reports[-1].wanted_bytes
        assert all(r.done_bytes <= r.wanted_bytes for r in reports)


def _start_corrupt_seeder(tb: bytes, src: Path, workdir: Path, tracker_url: str) -> lt.session:
    """A real libtorrent peer that claims every piece (resume data, no file check) but flips a byte in each."""
    workdir.mkdir()
    dst = workdir / src.name
    shutil.copyfile(src, dst)
    ti = lt.torrent_info(lt.bdecode(tb))
    with open(dst, "r+b") as f:
        for i in range(ti.num_pieces()):
            f.seek(i * ti.piece_length() + 7)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
    ses = lt.session(
        {
            "listen_interfaces": "127.0.0.1:0",
            "enable_dht": False,
            "enable_lsd": False,
            "enable_upnp": False,
            "enable_natpmp": False,
            "ssrf_mitigation": False,
            "allow_multiple_connections_per_ip": True,
            "enable_outgoing_utp": False,
            "enable_incoming_utp": False,
        }
    )
    atp = lt.add_torrent_params()
    atp.ti = ti
    atp.save_path = str(workdir)
    atp.have_pieces = [True] * ti.num_pieces()
    atp.trackers = [tracker_url]
    atp.flags = (atp.flags | lt.torrent_flags.no_verify_files | lt.torrent_flags.override_trackers) & ~(
        lt.torrent_flags.auto_managed | lt.torrent_flags.paused
    )
    h = ses.add_torrent(atp)
    deadline = time.monotonic() + 10
    while not h.status().is_seeding:
        assert time.monotonic() < deadline, f"corrupt seeder stuck in {h.status().state}"
        time.sleep(0.05)
    return ses


@pytest.mark.slow
def test_a_peer_serving_corrupt_data_is_caught_by_piece_hashes_and_the_piece_refetched_elsewhere(
    tmp_path: Path, origin: Origin, torrent: tuple[bytes, str], manifest: Manifest, model_path: str
) -> None:
    tb, ih = torrent
    evil = _start_corrupt_seeder(tb, Path(model_path), tmp_path / "evil", origin.tracker_url("evil"))
    deadline = time.monotonic() + 10
    while not any(k == "evil" for k, _ in origin.announces):
        assert time.monotonic() < deadline, "corrupt seeder never announced"
        time.sleep(0.05)
    try:
        with _client() as c:
            path = c.fetch(
                tb, tmp_path / "b", shard_byte_ranges(manifest, 10, 12), timeout=60, **_urls(origin, "b")
            )
            p = c.progress(c.get(ih))
            print(
                json.dumps(
                    {
                        "hash_failures": p.hash_failures,
                        "peer_bytes": p.peer_bytes,
                        "web_seed_bytes": p.web_seed_bytes,
                    }
                )
            )
            assert p.hash_failures >= 1
            assert p.web_seed_bytes > 0  # the failed pieces came again from the origin
            verify_tensors(path, manifest, 10, 12)
    finally:
        del evil


def test_a_file_tampered_on_disk_is_caught_before_loading_and_repaired(
    tmp_path: Path, origin: Origin, torrent: tuple[bytes, str], manifest: Manifest
) -> None:
    tb, ih = torrent
    with _client() as c:
        path = c.fetch(
            tb,
            tmp_path,
            shard_byte_ranges(manifest, 10, 12),
            timeout=60,
            trackers=[],
            web_seeds=[origin.web_seed_url("a")],
        )
        verify_tensors(path, manifest, 10, 12)
        victim = manifest.tensor("blk.11.ffn_down.weight")
        with open(path, "r+b") as f:
            f.seek(victim.offset + victim.nbytes // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 1]))
        with pytest.raises(TensorHashMismatch, match=r"blk\.11\.ffn_down\.weight") as e:
            verify_tensors(path, manifest, 10, 12)
        assert e.value.names == ["blk.11.ffn_down.weight"]
        before = c.progress(c.get(ih)).downloaded_bytes
        c.repair(ih, timeout=60)
        verify_tensors(path, manifest, 10, 12)
        refetched = c.progress(c.get(ih)).downloaded_bytes - before
        assert 0 < refetched <= 2 * lt.torrent_info(lt.bdecode(tb)).piece_length()


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))


def test_fetch_verified_refetches_a_tampered_tensor_instead_of_returning_it(
    tmp_path: Path, origin: Origin, torrent: tuple[bytes, str], manifest: Manifest
) -> None:
    tb, _ = torrent
    urls = {"trackers": [], "web_seeds": [origin.web_seed_url("a")]}
    with _client() as c:
        path = c.fetch_verified(tb, tmp_path, manifest, 12, 13, timeout=60, **urls)
        victim = manifest.tensor("blk.12.attn_q.weight")
        _flip_byte(path, victim.offset + 3)
        with pytest.raises(TensorHashMismatch):
            verify_tensors(path, manifest, 12, 13)
        assert c.fetch_verified(tb, tmp_path, manifest, 12, 13, timeout=60, **urls) == path
        verify_tensors(path, manifest, 12, 13)


def test_web_seed_only_mode_completes_without_any_peer(
    tmp_path: Path, origin: Origin, torrent: tuple[bytes, str], manifest: Manifest
) -> None:
    tb, ih = torrent
    with _client() as c:
        path = c.fetch(
            tb,
            tmp_path,
            shard_byte_ranges(manifest, 29, 30),
            timeout=60,
            trackers=[],
            web_seeds=[origin.web_seed_url("c")],
        )
        verify_tensors(path, manifest, 29, 30)
        p = c.progress(c.get(ih))
        assert p.peers == 0 and p.peer_bytes == 0
        assert p.web_seed_bytes == p.downloaded_bytes == origin.served["c"] == p.wanted_bytes


def test_a_tensor_never_downloaded_fails_verification(
    tmp_path: Path, origin: Origin, torrent: tuple[bytes, str], manifest: Manifest
) -> None:
    tb, _ = torrent
    with _client() as c:
        path = c.fetch(
            tb,
            tmp_path,
            shard_byte_ranges(manifest, 12, 13),
            timeout=60,
            trackers=[],
            web_seeds=[origin.web_seed_url("a")],
        )
        verify_tensors(path, manifest, 12, 13)
        with pytest.raises(TensorHashMismatch, match="blk.13") as e:
            verify_tensors(path, manifest, 12, 15)
        assert {t.name for t in manifest.tensors_for_range(14, 15)} <= set(e.value.names)
        assert not any(n.startswith("blk.12.") for n in e.value.names)


def test_moving_a_range_downloads_only_the_newly_needed_pieces(
    tmp_path: Path, origin: Origin, torrent: tuple[bytes, str], manifest: Manifest
) -> None:
    tb, ih = torrent
    ti = lt.torrent_info(lt.bdecode(tb))
    plen, total = ti.piece_length(), ti.total_size()
    old = pieces_for_ranges(shard_byte_ranges(manifest, 10, 12), plen, total)
    new = pieces_for_ranges(shard_byte_ranges(manifest, 11, 14), plen, total)
    with _client() as c:
        urls = {"trackers": [], "web_seeds": [origin.web_seed_url("a")]}
        c.fetch(tb, tmp_path, shard_byte_ranges(manifest, 10, 12), timeout=60, **urls)
        before = c.progress(c.get(ih)).downloaded_bytes
        path = c.fetch(tb, tmp_path, shard_byte_ranges(manifest, 11, 14), timeout=60, **urls)
        verify_tensors(path, manifest, 11, 14)
        assert c.progress(c.get(ih)).downloaded_bytes - before == pieces_bytes(new - old, plen, total)


def test_the_tracker_refuses_an_agent_with_an_unknown_passkey(
    tmp_path: Path, origin: Origin, torrent: tuple[bytes, str], manifest: Manifest
) -> None:
    tb, _ = torrent
    with _client() as c:
        d = c.add(
            tb,
            tmp_path,
            shard_byte_ranges(manifest, 10, 11),
            trackers=[origin.tracker_url("stranger")],
            web_seeds=[],
            web_seed_policy="never",
        )
        deadline = time.monotonic() + 10
        while not d.tracker_error:
            assert time.monotonic() < deadline, "no tracker error within 10 s"
            time.sleep(0.05)
        assert "unknown passkey" in d.tracker_error
        assert d.tracker_peers is None


def test_a_progress_report_renders_as_a_terminal_bar_and_a_json_dict() -> None:
    p = Progress(
        "ab" * 20, "downloading", 50_000_000, 100_000_000, 50_100_000, 2e6, 2, 30_000_000, 20_000_000, 1, True
    )
    line = p.line(width=10)
    assert line.startswith("abababab [#####.....]  50.0%")
    assert "50.0/100.0 MB" in line and "peers 2 (from peers 60%, web seed 40%)" in line
    assert "hash failures 1" in line
    d = p.to_dict()
    assert d["fraction"] == 0.5 and d["peer_bytes"] == 30_000_000
    json.dumps(d)
