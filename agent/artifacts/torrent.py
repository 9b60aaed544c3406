"""Model artifacts over a torrent swarm: build .torrents, fetch only a layer range's pieces, verify tensors."""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import libtorrent as lt

from agent.artifacts.fetch import FetchError, missing_tensors
from agent.artifacts.manifest import Manifest, merge_ranges
from agent.artifacts.pieces import (
    fit_piece_size,
    missing_available,
    pieces_for_ranges,
    priorities,
    web_seed_needed,
)
from agent.artifacts.swarm_tls import PeerCertificate

# The session itself (settings, listen sockets, alert counters) lives in torrent_session; its names
# stay importable from here, where callers have always taken them.
from agent.artifacts.torrent_session import BLOCK, Download, SwarmSession

__all__ = [
    "Download",
    "FetchError",
    "PeerCertificate",
    "Progress",
    "SwarmClient",
    "TensorHashMismatch",
    "create_torrent",
    "pieces_for_ranges",
    "priorities",
    "shard_byte_ranges",
    "verify_tensors",
]

log = logging.getLogger(__name__)

_POLL_S = 0.05


class TensorHashMismatch(ValueError):
    """Bytes on disk do not hash to the manifest's sha256 for these tensors; never load such a shard."""

    def __init__(self, path: Path, names: list[str]) -> None:
        self.path = path
        self.names = names
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(f"{path}: sha256 mismatch for tensor(s) {shown}; re-fetch before loading")


def create_torrent(
    path: str | Path,
    piece_size: int | None = None,
    web_seed_urls: Iterable[str] = (),
    tracker_urls: Iterable[str] = (),
    *,
    smallest_layer_bytes: int | None = None,
    private: bool = True,
    root_cert: str | None = None,
) -> tuple[bytes, str]:
    """Build a v1 single-file .torrent for `path`; returns (bencoded torrent, v1 infohash hex).

    v1 only: our tracker and web seed speak plain BEP 3/19 and a 20-byte infohash names the artifact.
    Private by default (BEP 27): peers come only from our passkey tracker, never DHT/PEX/LSD.
    With `root_cert` (the swarm CA, PEM) it is an SSL torrent: peers talk TLS and must present a
    certificate that CA signed (agent/artifacts/swarm_tls.py). The root is in the info dict, so it
    changes the infohash.
    """
    p = Path(path)
    size = p.stat().st_size
    piece = piece_size or fit_piece_size(size, smallest_layer_bytes)
    if piece % BLOCK:
        raise ValueError(f"piece size {piece} is not a multiple of {BLOCK}")
    ct = lt.create_torrent(lt.list_files(str(p)), piece, lt.create_torrent.v1_only)
    for url in web_seed_urls:
        ct.add_url_seed(url)
    for tier, url in enumerate(tracker_urls):
        ct.add_tracker(url, tier)
    ct.set_priv(private)
    if root_cert:
        ct.set_root_cert(root_cert)
    ct.set_creator("gguf-swarm")
    lt.set_piece_hashes(ct, str(p.parent))
    torrent = lt.bencode(ct.generate())
    info = lt.torrent_info(torrent)
    return torrent, str(info.info_hashes().v1)


def torrent_info(torrent_bytes: bytes) -> lt.torrent_info:
    return lt.torrent_info(torrent_bytes)


def shard_byte_ranges(manifest: Manifest, layer_start: int, layer_end: int) -> list[tuple[int, int]]:
    """What a node holding [layer_start, layer_end) downloads: the GGUF header (metadata, tokenizer,
    tensor table: backends open the sparse file as a GGUF) plus its layers' and role's tensors."""
    return merge_ranges([(0, manifest.header_end), *manifest.byte_ranges_for_range(layer_start, layer_end)])


def verify_tensors(path: str | Path, manifest: Manifest, layer_start: int, layer_end: int) -> None:
    """Check every tensor a shard [layer_start, layer_end) needs against the manifest's sha256.

    Raises TensorHashMismatch naming the bad tensors (holes of a sparse file read as zeros, so a
    tensor that was never downloaded fails too). The caller re-fetches; it never loads such a file.
    """
    p = Path(path)
    bad = [t.name for t in missing_tensors(p, manifest.tensors_for_range(layer_start, layer_end))]
    if bad:
        raise TensorHashMismatch(p, bad)


@dataclass(frozen=True)
class Progress:
    """One progress report of a download (what the agent sends to the control plane)."""

    infohash: str
    state: str
    done_bytes: int  # bytes of wanted pieces we have
    wanted_bytes: int  # bytes of wanted pieces (piece-aligned: what we must download)
    downloaded_bytes: int  # payload received so far, redundant and failed bytes included
    rate_bytes_per_s: float
    peers: int  # connected BitTorrent peers (web seeds not counted)
    peer_bytes: int
    web_seed_bytes: int
    hash_failures: int
    web_seed_active: bool

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.wanted_bytes if self.wanted_bytes else 1.0

    def to_dict(self) -> dict[str, object]:
        """JSON-ready report for the control plane's fleet page."""
        return {**asdict(self), "fraction": round(self.fraction, 4)}

    def line(self, width: int = 24) -> str:
        """One terminal line: a progress bar, MB done/needed, rate, peers, and where the bytes came from."""
        filled = round(self.fraction * width)
        src = self.peer_bytes + self.web_seed_bytes
        peer_pct = 100 * self.peer_bytes / src if src else 0.0
        return (
            f"{self.infohash[:8]} [{'#' * filled}{'.' * (width - filled)}] {self.fraction:6.1%} "
            f"{self.done_bytes / 1e6:7.1f}/{self.wanted_bytes / 1e6:.1f} MB {self.rate_bytes_per_s / 1e6:6.1f} MB/s "
            f"peers {self.peers} (from peers {peer_pct:.0f}%, web seed {100 - peer_pct if src else 0:.0f}%)"
            + (f" hash failures {self.hash_failures}" if self.hash_failures else "")
        )


def _url_endpoints(url: str) -> set[tuple[str, int]]:
    """The (ip, port) pairs a web seed URL connects to, so blocks from it are counted as web seed bytes."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        return {(str(ipaddress.ip_address(host)), port)}
    except ValueError:
        pass
    try:
        return {(str(ai[4][0]), port) for ai in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()  # libtorrent will report the failure; peer_info fills the endpoint in later


class SwarmClient(SwarmSession):
    """One libtorrent session for a node: downloads layer ranges, keeps seeding them, reports progress."""

    # ---------------------------------------------------------------- downloads
    def add(
        self,
        torrent_bytes: bytes,
        dest_dir: str | Path,
        byte_ranges: Iterable[tuple[int, int]],
        *,
        trackers: list[str] | None = None,
        web_seeds: list[str] | None = None,
        web_seed_policy: str | None = None,
    ) -> Download:
        """Start (or widen) a download of the pieces covering byte_ranges; returns at once.

        For a torrent already in the session the wanted set becomes the union with the new ranges and
        priorities are updated on the existing handle, so only newly needed pieces are fetched.
        trackers / web_seeds override the torrent's own (e.g. URLs carrying this node's passkey).
        """
        ti = torrent_info(torrent_bytes)
        ih = str(ti.info_hashes().v1)
        plen, total = ti.piece_length(), ti.total_size()
        wanted = pieces_for_ranges(byte_ranges, plen, total)
        with self._lock:
            d = self._downloads.get(ih)
            if d is not None:
                d.wanted |= wanted
                d.handle.prioritize_pieces(priorities(d.wanted, ti.num_pieces()))
                return d
        seeds = list(web_seeds) if web_seeds is not None else [w["url"] for w in ti.web_seeds()]
        tracker_urls = list(trackers) if trackers is not None else [t.url for t in ti.trackers()]
        self._check_transport(ti, [*tracker_urls, *seeds])
        atp = lt.add_torrent_params()
        atp.ti = ti
        atp.save_path = str(Path(dest_dir))
        atp.storage_mode = lt.storage_mode_t.storage_mode_sparse
        atp.piece_priorities = priorities(wanted, ti.num_pieces())
        atp.trackers = tracker_urls
        atp.url_seeds = []  # added by the policy once the origin is actually needed
        atp.flags = (
            atp.flags | lt.torrent_flags.override_trackers | lt.torrent_flags.override_web_seeds
        ) & ~(lt.torrent_flags.auto_managed | lt.torrent_flags.paused)
        d = Download(
            handle=lt.torrent_handle(),
            infohash=ih,
            path=Path(dest_dir) / ti.name(),
            piece_length=plen,
            total_size=total,
            wanted=wanted,
            web_seeds=seeds,
            policy=web_seed_policy or self.web_seed_policy,
            has_trackers=bool(tracker_urls),
        )
        with self._lock:
            self._downloads[ih] = d
            d.handle = self._session.add_torrent(atp)
        return d

    def seed(self, torrent_bytes: bytes, path: str | Path, *, trackers: list[str] | None = None) -> Download:
        """Seed a complete file we trust (the origin's copy) without hashing it first (seed mode)."""
        ti = torrent_info(torrent_bytes)
        ih = str(ti.info_hashes().v1)
        atp = lt.add_torrent_params()
        atp.ti = ti
        atp.save_path = str(Path(path).parent)
        atp.trackers = list(trackers) if trackers is not None else [t.url for t in ti.trackers()]
        self._check_transport(ti, atp.trackers)
        atp.url_seeds = []
        atp.flags = (
            atp.flags
            | lt.torrent_flags.seed_mode
            | lt.torrent_flags.override_trackers
            | lt.torrent_flags.override_web_seeds
        ) & ~(lt.torrent_flags.auto_managed | lt.torrent_flags.paused)
        d = Download(
            handle=lt.torrent_handle(),
            infohash=ih,
            path=Path(path),
            piece_length=ti.piece_length(),
            total_size=ti.total_size(),
            wanted=set(range(ti.num_pieces())),
            web_seeds=[],
            policy="never",
            has_trackers=bool(atp.trackers),
        )
        with self._lock:
            self._downloads[ih] = d
            d.handle = self._session.add_torrent(atp)
        return d

    def progress(self, d: Download) -> Progress:
        st = d.handle.status()
        web = 0
        peers = 0
        for p in d.handle.get_peer_info():
            if p.connection_type == lt.peer_info.standard_bittorrent:
                peers += 1
            else:
                web += 1
                with self._lock:
                    d.web_seed_endpoints.add((str(p.ip[0]), int(p.ip[1])))
        with self._lock:
            return Progress(
                infohash=d.infohash,
                state=str(st.state),
                done_bytes=int(st.total_wanted_done),
                wanted_bytes=int(st.total_wanted),
                downloaded_bytes=d.payload_before_recheck + int(st.total_payload_download),
                rate_bytes_per_s=float(st.download_payload_rate),
                peers=peers,
                peer_bytes=d.peer_bytes,
                web_seed_bytes=d.web_seed_bytes,
                hash_failures=d.hash_failures,
                web_seed_active=d.web_seed_active,
            )

    def _wanted_done(self, d: Download) -> bool:
        st = d.handle.status()
        if st.state in (lt.torrent_status.checking_files, lt.torrent_status.checking_resume_data):
            return False
        pieces = st.pieces
        return bool(pieces) and all(pieces[i] for i in d.wanted)

    def _flush(self, d: Download, deadline: float) -> None:
        """Wait until libtorrent has written every finished piece to the file (a piece counts as "have"
        once it hashes correctly, which can be before its blocks leave the write buffer)."""
        d.flushed.clear()
        d.handle.flush_cache()
        if not d.flushed.wait(max(deadline - time.monotonic(), 1.0)):
            raise FetchError(f"{d.infohash}: libtorrent did not confirm writing the pieces to {d.path}")

    def _disable_web_seeds(self, d: Download) -> None:
        with self._lock:
            if not d.web_seed_active:
                return
            d.web_seed_active = False
        for url in d.web_seeds:
            d.handle.remove_url_seed(url)

    def enable_web_seeds(self, d: Download) -> None:
        """Let this download pull from the origin's web seed(s) from now on."""
        with self._lock:
            if d.web_seed_active:
                return
            d.web_seed_active = True
            for url in d.web_seeds:
                d.web_seed_endpoints |= _url_endpoints(url)
        for url in d.web_seeds:
            d.handle.add_url_seed(url)

    def wait(
        self,
        d: Download,
        *,
        timeout: float = 300.0,
        on_progress: Callable[[Progress], None] | None = None,
        progress_every_s: float = 0.5,
    ) -> Path:
        """Block until every wanted piece is on disk (hash-checked by libtorrent); returns the file path."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        last_activity, last_progress_t, last_report = (-1, -1), t0, 0.0
        while True:
            now = time.monotonic()
            if d.error:
                raise FetchError(f"{d.infohash}: {d.error}")
            if self._wanted_done(d):
                self._flush(d, deadline)
                self._disable_web_seeds(d)  # a later add() on this torrent decides afresh
                if on_progress:
                    on_progress(self.progress(d))
                return d.path
            if now > deadline:
                p = self.progress(d)
                raise FetchError(
                    f"{d.infohash}: timed out after {timeout:.0f}s with {p.done_bytes}/{p.wanted_bytes} bytes "
                    f"({p.peers} peers, web seed {'on' if p.web_seed_active else 'off'}"
                    f"{', tracker: ' + d.tracker_error if d.tracker_error else ''})"
                )
            st = d.handle.status()
            peers = d.handle.get_peer_info()
            bt = [p for p in peers if p.connection_type == lt.peer_info.standard_bittorrent]
            # progress = ours or any peer's: a peer still gaining pieces may soon have what we lack
            activity = (st.total_wanted_done, sum(p.num_pieces for p in bt))
            if activity != last_activity:
                last_activity, last_progress_t = activity, now
            n_bt = len(bt)
            # a partial seed announces upload-only once it has all it wants; a seed has every piece
            n_busy = sum(1 for p in bt if not p.flags & (lt.peer_info.upload_only | lt.peer_info.seed))
            if n_bt < len(peers):
                with self._lock:
                    d.web_seed_endpoints.update(
                        (str(p.ip[0]), int(p.ip[1]))
                        for p in peers
                        if p.connection_type != lt.peer_info.standard_bittorrent
                    )
            if not d.web_seed_active and d.web_seeds:
                have = list(st.pieces)
                avail = d.handle.piece_availability() if st.num_peers else []
                if have and web_seed_needed(
                    d.policy,
                    elapsed_s=now - t0,
                    has_trackers=d.has_trackers,
                    arrival_rank=d.arrival_rank,
                    connected_peers=n_bt,
                    peers_still_downloading=n_busy,
                    seconds_since_progress=now - last_progress_t,
                    missing_available_from_peers=missing_available(d.wanted, have, avail),
                    peer_wait_s=self.peer_wait_s,
                    stall_s=self.stall_s,
                ):
                    log.info(
                        "%s: web seed on after %.2fs (peers %d, %d downloading, arrival rank %s, stalled %.2fs, done %d/%d)",
                        d.infohash[:8],
                        now - t0,
                        n_bt,
                        n_busy,
                        d.arrival_rank,
                        now - last_progress_t,
                        st.total_wanted_done,
                        st.total_wanted,
                    )
                    self.enable_web_seeds(d)
            if on_progress and now - last_report >= progress_every_s:
                last_report = now
                on_progress(self.progress(d))
            time.sleep(_POLL_S)

    def fetch(
        self,
        torrent_bytes: bytes,
        dest_dir: str | Path,
        byte_ranges: Iterable[tuple[int, int]],
        on_progress: Callable[[Progress], None] | None = None,
        *,
        timeout: float = 300.0,
        trackers: list[str] | None = None,
        web_seeds: list[str] | None = None,
        web_seed_policy: str | None = None,
    ) -> Path:
        """Download the pieces covering byte_ranges (sparse file) and keep seeding them; returns the path."""
        d = self.add(
            torrent_bytes,
            dest_dir,
            byte_ranges,
            trackers=trackers,
            web_seeds=web_seeds,
            web_seed_policy=web_seed_policy,
        )
        return self.wait(d, timeout=timeout, on_progress=on_progress)

    def repair(
        self,
        infohash: str,
        *,
        timeout: float = 300.0,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> Path:
        """Re-hash the file on disk and re-download every wanted piece that no longer matches."""
        d = self.get(infohash)
        if d is None:
            raise FetchError(f"{infohash}: not in this session")
        d.payload_before_recheck += int(d.handle.status().total_payload_download)
        d.handle.force_recheck()  # status() is answered after the recheck is queued, so wait sees it
        return self.wait(d, timeout=timeout, on_progress=on_progress)

    def fetch_verified(
        self,
        torrent_bytes: bytes,
        dest_dir: str | Path,
        manifest: Manifest,
        layer_start: int,
        layer_end: int,
        on_progress: Callable[[Progress], None] | None = None,
        *,
        timeout: float = 300.0,
        retries: int = 1,
        trackers: list[str] | None = None,
        web_seeds: list[str] | None = None,
        web_seed_policy: str | None = None,
    ) -> Path:
        """fetch + verify_tensors; on a mismatch, recheck and re-download, up to `retries` times."""
        ranges = shard_byte_ranges(manifest, layer_start, layer_end)
        path = self.fetch(
            torrent_bytes,
            dest_dir,
            ranges,
            on_progress,
            timeout=timeout,
            trackers=trackers,
            web_seeds=web_seeds,
            web_seed_policy=web_seed_policy,
        )
        ih = str(torrent_info(torrent_bytes).info_hashes().v1)
        for attempt in range(retries + 1):
            try:
                verify_tensors(path, manifest, layer_start, layer_end)
                return path
            except TensorHashMismatch as e:
                if attempt == retries:
                    raise
                log.warning("%s; re-fetching (attempt %d)", e, attempt + 1)
                path = self.repair(ih, timeout=timeout, on_progress=on_progress)
        return path


def needed_pieces(torrent_bytes: bytes, byte_ranges: Iterable[tuple[int, int]]) -> set[int]:
    """Pieces of this torrent a node holding byte_ranges must download."""
    ti = torrent_info(torrent_bytes)
    return pieces_for_ranges(byte_ranges, ti.piece_length(), ti.total_size())
