"""Pure decisions about what to tell an agent: its load/unload commands, reconciliation, backend choice.

No database. The messages themselves (and their parsing, close codes, protocol version) are the shared
schema in `agent.wire.control`; docs/control-plane.md describes the flow.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agent import defaults
from agent.wire.control import Load, ShardRef, Unload


@dataclass(frozen=True)
class AssignmentView:
    """What reconciliation needs to know about one assignment."""

    id: int
    model_sha256: str
    layer_start: int
    layer_end: int
    state: str
    backend: str
    tracker_url: str = ""  # this node's passkey announce path; empty when the artifact has no .torrent
    web_seed_url: str = ""


def load_command(a: AssignmentView) -> Load:
    """The `load` command; with a .torrent it names the torrent, this node's tracker and web seed."""
    swarm = bool(a.tracker_url)
    return Load(
        assignment_id=a.id,
        model_sha256=a.model_sha256,
        layer_start=a.layer_start,
        layer_end=a.layer_end,
        backend=a.backend,
        manifest_url=f"/artifacts/{a.model_sha256}/manifest",
        file_url=f"/artifacts/{a.model_sha256}/file",
        torrent_url=f"/artifacts/{a.model_sha256}/torrent" if swarm else None,
        trackers=[a.tracker_url] if swarm else [],
        web_seeds=[a.web_seed_url] if swarm and a.web_seed_url else [],
    )


def unload_command(
    model_sha256: str, layer_start: int, layer_end: int, assignment_id: int | None = None
) -> Unload:
    return Unload(
        assignment_id=assignment_id,
        model_sha256=model_sha256,
        layer_start=layer_start,
        layer_end=layer_end,
    )


def reconcile(
    assignments: Iterable[AssignmentView], held: Iterable[ShardRef]
) -> tuple[list[int], list[Load | Unload]]:
    """After a hello: (assignment ids now ready, commands to send) so the node matches its assignments.

    Held shards that match an assignment are ready; assignments the node lacks are (re)sent as load
    commands; held shards nobody assigned are unloaded. Failed and draining assignments are left alone.
    """
    held_set = {s.key for s in held}
    ready: list[int] = []
    commands: list[Load | Unload] = []
    wanted: set[tuple[str, int, int]] = set()
    for a in assignments:
        key = (a.model_sha256, a.layer_start, a.layer_end)
        if a.state in ("failed", "draining"):
            if a.state == "draining" and key in held_set:
                wanted.add(key)
                commands.append(unload_command(*key, assignment_id=a.id))
            continue
        wanted.add(key)
        if key in held_set:
            ready.append(a.id)
        else:
            commands.append(load_command(a))
    for key in sorted(held_set - wanted):
        commands.append(unload_command(*key))
    return ready, commands


def choose_backend(node_backends: list[str], full_model: bool, preferred: str = "") -> str:
    """The backend a node should use for a shard: the preferred one if it has it, else its first.

    llama.cpp's full-model backend can only run a shard that holds every layer.
    """
    usable = [b for b in node_backends if full_model or b != "llamacpp"]
    if preferred and preferred in usable:
        return preferred
    return usable[0] if usable else (preferred or defaults.DEFAULT_BACKEND)
