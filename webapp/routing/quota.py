"""Per-user accounting of the route-session service (issue 33): what one user may hold at once.

* `streams`: answers running at once per user, API requests and playground answers together
  (`USER_MAX_STREAMS`); a lease per answer, in Redis when the web has it (every web process counts
  the same leases), renewed while the answer streams and lapsing STREAM_LEASE_S after its holder
  last renewed it (a response the server never started, a process that died).
* `routes`: the route sessions (KV on every hop) a user holds in this process, wherever they wait (the
  API's prefix cache, a playground socket, the parking of closed tabs). Past `USER_MAX_ROUTE_SESSIONS`
  the oldest idle ones are taken from where they wait (`add_reclaimer`) and closed on their hops.
* `prefills`: answers before their first token, `ROUTE_PREFILLS_AT_ONCE` at once per process; the
  others wait and are admitted round-robin by user, so one user's queue of prompts does not delay
  another user's first token by more than one prefill; and while a user prefills, the decode steps
  and new prompts of users running more answers than they do give way (`FairGate`).

Users are keyed by their primary key; anonymous callers are not counted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from redis.exceptions import RedisError

from agent.client.failover import PREFILL_CHUNK
from webapp.core.redisconn import bounded_redis
from webapp.routing.answer import LiveRoute

STREAM_LEASE_S = 120.0  # renewed every quarter of it while an answer streams
log = logging.getLogger(__name__)
# A user running other answers prefills in steps of this many positions (eight of them, then each
# twice the one before: a long prompt pays a few round trips more), giving way between two to a
# lighter user's prefill (Turn.prefill_steps): a prompt already on the hops when the lighter one
# arrives holds it for one such step, not the whole prompt
YIELDING_PREFILL_TOKENS = 16


def user_key(user: Any) -> int | None:
    """The key a user is counted under; None for nobody (anonymous)."""
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    pk = getattr(user, "pk", None)
    return int(pk) if pk is not None else None


# ---------------------------------------------------------------------------------------------- streams
class StreamsUnavailable(Exception):
    """The store of running answers (Redis) failed or did not answer; str(e) says so (the API answers
    503 with Retry-After)."""

    def __init__(self) -> None:
        super().__init__(
            "answers cannot start right now (the service's store is unavailable); try again shortly"
        )


class TooManyStreams(Exception):
    """The user has `limit` answers running already; str(e) says so (the API answers 429)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"{limit} answers of yours are running already, the most one user may run at once "
            "(API requests and playground answers count together); wait for one to finish"
        )
        self.limit = limit


class StreamSlots:
    """Leases per user: a Redis sorted set (lease id -> expiry) when REDIS_URL is set, else a dict here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[int, dict[str, float]] = {}
        self._redis: Any = None
        # leases given back whose removal from Redis is still on its way (give_back_soon): this
        # process's next take for their user removes them itself, so its count never includes them
        self._returning: dict[int, set[str]] = {}

    def _client(self) -> Any:
        if self._redis is None:
            self._redis = bounded_redis()
        return self._redis

    def _name(self, user: int) -> str:
        return f"{settings.TRACKER_REDIS_PREFIX.rsplit(':', 1)[0]}:streams:{user}"

    def take(self, user: int, limit: int, lease_s: float) -> str | None:
        """A new lease for `user` while fewer than `limit` are live, else None."""
        lease, now = uuid.uuid4().hex, time.time()
        if settings.REDIS_URL:
            name = self._name(user)
            with self._lock:
                returning = list(self._returning.get(user, ()))
            pipe = self._client().pipeline()
            pipe.zremrangebyscore(name, "-inf", now)
            if returning:
                pipe.zrem(name, *returning)
            pipe.zadd(name, {lease: now + lease_s})
            pipe.zcard(name)
            pipe.expire(name, int(lease_s) + 1)
            held = int(pipe.execute()[-2])
            if held > limit:  # two processes racing may both give theirs back: never both kept
                self._client().zrem(name, lease)
                return None
            return lease
        with self._lock:
            mine = {k: t for k, t in self._leases.get(user, {}).items() if t > now}
            if len(mine) >= limit:
                self._leases[user] = mine
                return None
            mine[lease] = now + lease_s
            self._leases[user] = mine
            return lease

    def renew(self, user: int, lease: str, lease_s: float) -> None:
        until = time.time() + lease_s
        if settings.REDIS_URL:
            self._client().zadd(self._name(user), {lease: until}, xx=True)
            return
        with self._lock:
            mine = self._leases.get(user, {})
            if lease in mine:
                mine[lease] = until

    def give_back(self, user: int, lease: str) -> None:
        if settings.REDIS_URL:
            self._client().zrem(self._name(user), lease)
            return
        with self._lock:
            self._leases.get(user, {}).pop(lease, None)

    def give_back_soon(self, user: int, lease: str) -> None:
        """give_back without waiting for Redis on an event loop: the lease counts as returned in this
        process at once (see `take`) and leaves Redis from a worker thread. A Redis that hangs once held
        the web's loop for the client's timeout at the end of every answer."""
        if not settings.REDIS_URL:
            self.give_back(user, lease)
            return
        with self._lock:
            self._returning.setdefault(user, set()).add(lease)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # synchronous code: nothing to hold up but its own thread
            self._give_back_returning(user, lease)
            return
        try:
            loop.run_in_executor(None, self._give_back_returning, user, lease)
        except RuntimeError:  # the loop's executor is shutting down (the process is stopping)
            self._give_back_returning(user, lease)

    def _give_back_returning(self, user: int, lease: str) -> None:
        try:
            self.give_back(user, lease)
        except RedisError as e:  # the lease lapses by itself, STREAM_LEASE_S after its last renewal
            log.warning("stream lease not given back: Redis %s", e.__class__.__name__)
        finally:
            with self._lock:
                left = self._returning.get(user, set())
                left.discard(lease)
                if not left:
                    self._returning.pop(user, None)

    def held(self, user: int) -> int:
        now = time.time()
        if settings.REDIS_URL:
            return int(self._client().zcount(self._name(user), now, "+inf"))
        with self._lock:
            return sum(1 for t in self._leases.get(user, {}).values() if t > now)


streams = StreamSlots()


@dataclass
class StreamLease:
    """One running answer's place in its user's `USER_MAX_STREAMS`: `keep` while it streams,
    `release` (idempotent) when it ends."""

    user: int | None
    lease: str | None
    renewed: float = field(default_factory=time.monotonic)

    async def keep(self) -> None:
        """Renew the lease when a quarter of it has passed (cheap to call for every piece)."""
        now = time.monotonic()
        if self.user is not None and self.lease is not None and now - self.renewed > STREAM_LEASE_S / 4:
            self.renewed = now
            try:
                await asyncio.to_thread(streams.renew, self.user, self.lease, STREAM_LEASE_S)
            except RedisError as e:  # the answer goes on; at worst its place lapses early
                log.warning("stream lease not renewed: Redis %s", e.__class__.__name__)

    def release(self) -> None:
        """The answer is over for its user at the moment its task ends: the next turn may start right
        after the last message (StreamSlots.give_back_soon: no wait for Redis on the event loop)."""
        user, lease, self.lease = self.user, self.lease, None
        if user is not None and lease is not None:
            streams.give_back_soon(user, lease)


async def hold_stream(user: Any) -> StreamLease:
    """A lease on one of the user's answers at once; raises TooManyStreams when they are all taken, and
    StreamsUnavailable when the leases' store (Redis) fails: an answer nobody counted is not started."""
    key = user_key(user)
    if key is None:
        return StreamLease(None, None)
    limit = int(settings.USER_MAX_STREAMS)
    try:
        lease = await asyncio.to_thread(streams.take, key, limit, STREAM_LEASE_S)
    except RedisError as e:
        log.warning("stream lease refused: Redis %s", e.__class__.__name__)
        raise StreamsUnavailable() from None
    if lease is None:
        raise TooManyStreams(limit)
    return StreamLease(key, lease)


# ---------------------------------------------------------------------------------------------- routes
Reclaimer = Callable[[LiveRoute], bool]


@dataclass
class _Held:
    user: int
    live: LiveRoute
    last_used: float


class UserRoutes:
    """The live routes each user holds in this process, oldest use first; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Any, _Held] = {}  # session id -> holding
        self._reclaimers: list[Reclaimer] = []

    def add_reclaimer(self, reclaim: Reclaimer) -> None:
        """`reclaim(live)` takes `live` out of where it waits and returns True when it is idle there
        (no answer running on it), else leaves it and returns False. Holders register one each."""
        if reclaim not in self._reclaimers:
            self._reclaimers.append(reclaim)

    def add(self, user: Any, live: LiveRoute) -> None:
        key = user_key(user)
        if key is not None:
            with self._lock:
                self._held[live.session_id] = _Held(key, live, time.monotonic())

    def touch(self, live: LiveRoute) -> None:
        with self._lock:
            h = self._held.get(live.session_id)
            if h is not None:
                h.last_used = time.monotonic()

    def remove(self, live: LiveRoute) -> None:
        with self._lock:
            self._held.pop(live.session_id, None)

    def count(self, user: Any) -> int:
        key = user_key(user)
        with self._lock:
            return sum(1 for h in self._held.values() if h.user == key)

    def over_cap(self, user: Any, keep: LiveRoute | None = None) -> list[LiveRoute]:
        """Take the user's oldest idle routes out of their holders until the user holds at most
        USER_MAX_ROUTE_SESSIONS; returns them for the caller to close (busy routes stay and count)."""
        key = user_key(user)
        if key is None:
            return []
        cap = int(settings.USER_MAX_ROUTE_SESSIONS)
        # A route unused this long has lost its KV to the hops' TTL: one nobody closed stops counting.
        stale = time.monotonic() - float(settings.ROUTE_SESSION_IDLE_S)
        with self._lock:
            for sid in [sid for sid, h in self._held.items() if h.last_used < stale]:
                del self._held[sid]
            mine = sorted((h for h in self._held.values() if h.user == key), key=lambda h: h.last_used)
        over = len(mine) - cap
        taken: list[LiveRoute] = []
        for h in mine:
            if over <= 0:
                break
            if keep is not None and h.live is keep:
                continue
            if any(reclaim(h.live) for reclaim in self._reclaimers):
                self.remove(h.live)
                taken.append(h.live)
                over -= 1
        return taken


routes = UserRoutes()


# ---------------------------------------------------------------------------------------------- prefills
class Turn:
    """One answer's passage through the gate: it holds a place until `prefilled` (its first piece),
    then calls `pace` before each further decode step."""

    def __init__(self, gate: FairGate, user: Any) -> None:
        self.gate, self.user, self.prefilling = gate, user, True

    def prefilled(self) -> None:
        """The prefill is over: give the place back (idempotent)."""
        if self.prefilling:
            self.prefilling = False
            self.gate._count(self.gate.prefilling, self.user, -1)
            self.gate.release()
            self.gate._notify()

    async def pace(self) -> None:
        await self.gate.give_way(self.user)

    def prefill_steps(self) -> tuple[int, Callable[[], Awaitable[None]] | None]:
        """How this answer sends its prompt: (positions a step, what to await between two steps).
        Whole (up to the route client's own limit) for a user running no other answer here; for one
        who does, steps of YIELDING_PREFILL_TOKENS (doubling after eight) that give way to lighter
        users' prefills between two."""
        if self.gate.running.get(self.user, 0) <= 1:
            return PREFILL_CHUNK, None
        return YIELDING_PREFILL_TOKENS, self.pace


class FairGate:
    """Fair admission between users, in one event loop (the web process's):

    * at most `capacity()` answers prefill at once; waiting ones are admitted round-robin by user,
      each user's own in arrival order;
    * a decode step of a user running more answers here than another user who is prefilling waits
      for that prefill (at most ROUTE_GIVE_WAY_MS a step), and so does a new answer's prefill of such
      a user before it takes a place: ten streams of one user then cost another user's first token
      little more than one would."""

    def __init__(self, capacity: Callable[[], int]) -> None:
        self.capacity = capacity
        self.active = 0
        self.running: dict[Any, int] = {}  # answers in the gate's hands, by user
        self.prefilling: dict[Any, int] = {}  # of which before their first piece
        self._waiting: dict[Any, deque[asyncio.Future[None]]] = {}
        self._turns: deque[Any] = deque()  # users with waiters, next to be admitted first
        self._watchers: set[asyncio.Future[None]] = set()  # decode steps giving way

    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def acquire(self, user: Any) -> None:
        if self.active < self.capacity() and not self._turns:
            self.active += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(user, deque()).append(fut)
        if user not in self._turns:
            self._turns.append(user)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # admitted just as it was cancelled: pass the place on
            else:
                self._forget(user, fut)
            raise

    def release(self) -> None:
        """Free one place: hand it to the next user in turn, else keep it free."""
        while self._turns:
            user = self._turns.popleft()
            queue = self._waiting[user]
            fut = queue.popleft()
            if queue:
                self._turns.append(user)  # back of the line: every other waiting user goes first
            else:
                del self._waiting[user]
            if not fut.done():
                fut.set_result(None)
                return
        self.active = max(0, self.active - 1)

    def _forget(self, user: Any, fut: asyncio.Future[None]) -> None:
        queue = self._waiting.get(user)
        if queue is None:
            return
        if fut in queue:
            queue.remove(fut)
        if not queue:
            del self._waiting[user]
            if user in self._turns:
                self._turns.remove(user)

    @staticmethod
    def _count(counts: dict[Any, int], user: Any, delta: int) -> None:
        n = counts.get(user, 0) + delta
        if n > 0:
            counts[user] = n
        else:
            counts.pop(user, None)

    def _notify(self) -> None:
        watchers, self._watchers = self._watchers, set()
        for fut in watchers:
            if not fut.done():
                fut.set_result(None)

    def lighter_prefill(self, user: Any, joining: int = 0) -> bool:
        """Whether a user running fewer answers than `user` (with `joining` more) is prefilling now."""
        mine = self.running.get(user, 0) + joining
        return any(u != user and self.running.get(u, 0) < mine for u in self.prefilling)

    async def give_way(self, user: Any, joining: int = 0) -> None:
        """Wait, at most ROUTE_GIVE_WAY_MS, while `lighter_prefill(user, joining)`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + int(settings.ROUTE_GIVE_WAY_MS) / 1000
        while self.lighter_prefill(user, joining):
            left = deadline - loop.time()
            if left <= 0:
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._watchers.add(fut)
            try:
                await asyncio.wait_for(fut, left)
            except TimeoutError:
                return
            finally:
                self._watchers.discard(fut)

    @asynccontextmanager
    async def turn(self, user: Any) -> AsyncIterator[Turn]:
        """An answer's passage: a place until `Turn.prefilled`, counted as running for the block.

        A new answer of a user who would then run more answers than a user prefilling now waits for
        that prefill first (at most ROUTE_GIVE_WAY_MS, holding no place meanwhile), as that user's
        decode steps do: the hops run the lighter user's prompt alone, not batched with the heavier
        user's next prompt."""
        await self.give_way(user, joining=1)
        await self.acquire(user)
        t = Turn(self, user)
        self._count(self.running, user, 1)
        self._count(self.prefilling, user, 1)
        try:
            yield t
        finally:
            t.prefilled()
            self._count(self.running, user, -1)
            self._notify()


_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FairGate] = weakref.WeakKeyDictionary()


def prefills() -> FairGate:
    """This event loop's gate (the web has one loop; tests run several in one process)."""
    loop = asyncio.get_running_loop()
    gate = _gates.get(loop)
    if gate is None:
        gate = _gates[loop] = FairGate(lambda: int(settings.ROUTE_PREFILLS_AT_ONCE))
    return gate
