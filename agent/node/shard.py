"""A loaded layer range of the node (Shard) and the registry of them that the data plane's parts share."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from agent.backends.base import Backend, ShardSpec
from agent.node.scheduler import ShardScheduler
from agent.node.sessions import SessionState, ShardKey
from agent.wire.frames import CONTEXT_CAP


@dataclass
class Shard:
    """A loaded layer range, the lock that serialises calls into its backend, and its step scheduler."""

    spec: ShardSpec
    backend_name: str
    backend: Backend
    lock: asyncio.Lock
    scheduler: ShardScheduler
    draining: bool = False

    @property
    def key(self) -> ShardKey:
        return (self.spec.manifest.sha256, self.spec.layer_start, self.spec.layer_end)

    @property
    def max_positions(self) -> int:
        model_ctx = self.spec.manifest.context_length or CONTEXT_CAP
        return min(CONTEXT_CAP, model_ctx)


# The node's shards by key: the data plane owns it and hands the same dict to the parts that look
# shards up (hand-offs), so a shard loaded or unloaded is seen by all of them at once.
Shards = dict[ShardKey, Shard]


def evictable(shards: Shards, s: SessionState, holding: Shard | None = None) -> bool:
    """Whether `s` may be closed now, by a caller holding `holding`'s lock: its shard is idle."""
    shard = shards.get(s.shard_key)
    return shard is None or shard is holding or not shard.lock.locked()
