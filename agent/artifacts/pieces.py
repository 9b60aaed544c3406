"""Pure piece arithmetic for layer-range downloads: piece size, ranges -> pieces, priorities, web-seed policy."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

KIB = 1024
MIN_PIECE = 16 * KIB  # libtorrent's block size; a piece must be a multiple of it
MAX_PIECE = 16 * KIB * KIB
# Each contiguous byte run a shard needs can drag in at most one partial piece at each end, so the
# over-download of a run is < 2 pieces. With a piece of at most 1/8 of the smallest layer, a shard
# holding a single layer downloads at most 1.25x its bytes and any realistic shard (several layers, or
# one layer plus the role tensors) far less; see docs/torrent.md.
PIECES_PER_LAYER = 8
# Without a layer size, aim for about this many pieces (the .torrent carries 20 bytes per piece).
TARGET_PIECES = 1024

PRIORITY_SKIP = 0  # libtorrent: never download this piece (the file stays sparse there)
PRIORITY_WANT = 4  # libtorrent's default priority

WEB_SEED_ALWAYS = "always"
WEB_SEED_FALLBACK = "fallback"
WEB_SEED_NEVER = "never"
WEB_SEED_POLICIES = (WEB_SEED_ALWAYS, WEB_SEED_FALLBACK, WEB_SEED_NEVER)
MAX_RANK = 3  # later arrivals wait at most (1 + 2 x MAX_RANK) x stall_s of swarm silence


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def fit_piece_size(file_size: int, smallest_layer_bytes: int | None = None) -> int:
    """Piece size for a file: a power of two in [16 KiB, 16 MiB].

    With the size of the smallest layer, the piece is the largest power of two that still fits
    PIECES_PER_LAYER times in it (SmolLM2: 2.2 MB layers -> 256 KiB pieces). Without it, the file is cut
    into about TARGET_PIECES pieces.
    """
    if file_size <= 0:
        raise ValueError(f"file size must be positive, got {file_size}")
    if smallest_layer_bytes is not None and smallest_layer_bytes > 0:
        size = _pow2_floor(smallest_layer_bytes // PIECES_PER_LAYER)
    else:
        size = _pow2_ceil(-(-file_size // TARGET_PIECES))
    return min(max(size, MIN_PIECE), MAX_PIECE)


def num_pieces(piece_length: int, total_size: int) -> int:
    return -(-total_size // piece_length)


def piece_size(index: int, piece_length: int, total_size: int) -> int:
    """Bytes in piece `index` (the last piece is usually short)."""
    return min(piece_length, total_size - index * piece_length)


def pieces_for_ranges(byte_ranges: Iterable[tuple[int, int]], piece_length: int, total_size: int) -> set[int]:
    """Indexes of the pieces that overlap any [start, end) byte range; empty ranges select nothing."""
    if piece_length <= 0:
        raise ValueError(f"piece length must be positive, got {piece_length}")
    out: set[int] = set()
    for start, end in byte_ranges:
        if not (0 <= start <= end <= total_size):
            raise ValueError(f"byte range [{start}, {end}) is outside the file's 0..{total_size} bytes")
        if start == end:
            continue
        out.update(range(start // piece_length, (end - 1) // piece_length + 1))
    return out


def priorities(wanted: Iterable[int], n_pieces: int) -> list[int]:
    """One libtorrent priority per piece: PRIORITY_WANT for wanted pieces, 0 (skip) for every other."""
    prio = [PRIORITY_SKIP] * n_pieces
    for i in wanted:
        if not 0 <= i < n_pieces:
            raise ValueError(f"piece {i} is outside 0..{n_pieces - 1}")
        prio[i] = PRIORITY_WANT
    return prio


def pieces_bytes(pieces: Iterable[int], piece_length: int, total_size: int) -> int:
    """Total bytes of a set of pieces."""
    return sum(piece_size(i, piece_length, total_size) for i in set(pieces))


def missing_available(wanted: Iterable[int], have: Sequence[bool], availability: Sequence[int]) -> int:
    """How many wanted pieces we lack that at least one connected peer has."""
    return sum(1 for i in wanted if not have[i] and i < len(availability) and availability[i] > 0)


def web_seed_needed(
    policy: str,
    *,
    elapsed_s: float,
    has_trackers: bool,
    arrival_rank: int | None,
    connected_peers: int,
    peers_still_downloading: int,
    seconds_since_progress: float,
    missing_available_from_peers: int,
    peer_wait_s: float,
    stall_s: float,
) -> bool:
    """Whether a download should (now) also pull from the origin's web seed.

    "fallback" keeps the origin as the last resort and lets only one of several agents that start
    together go to it at a time. arrival_rank is how many peers the tracker listed in its first reply
    (0: we are the first in the swarm; None: no reply yet). The first agent uses the web seed at once;
    the k-th waits until neither it nor its peers made progress for (1 + 2k) x stall_s (k capped at
    MAX_RANK) with nothing left that a connected peer could give it, so later agents take from earlier
    ones what those fetched from the origin. There is nothing to wait for when no connected peer has a piece we
    lack and none is still downloading (all are partial or full seeds). Without a tracker, or when no
    peer shows up within peer_wait_s, the web seed is used; a peer that has pieces but does not send
    them delays it to 4x the patience.
    """
    if policy not in WEB_SEED_POLICIES:
        raise ValueError(f"unknown web seed policy {policy!r}; expected one of {WEB_SEED_POLICIES}")
    if policy == WEB_SEED_ALWAYS:
        return True
    if policy == WEB_SEED_NEVER:
        return False
    if not has_trackers or arrival_rank == 0:
        return True
    if arrival_rank is None or connected_peers == 0:
        return elapsed_s >= peer_wait_s
    if missing_available_from_peers == 0 and peers_still_downloading == 0:
        return True
    # Ranks are 2 x stall_s apart: more than libtorrent needs to open a web seed connection (it does so
    # on its once-a-second tick), so the next agent sees the previous one's new pieces before its turn.
    patience = stall_s * (1 + 2 * min(arrival_rank, MAX_RANK))
    if seconds_since_progress < patience:
        return False
    return missing_available_from_peers == 0 or seconds_since_progress >= 4 * patience
