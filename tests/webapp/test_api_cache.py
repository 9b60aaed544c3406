"""The API's prefix cache: which entry a prompt continues, LRU and per-key bounds, idle and age limits."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from webapp.api.cache import Entry, PrefixCache
from webapp.routing.answer import LiveRoute


@dataclass
class Held:
    history: list[int] = field(default_factory=list)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def entry(key: int, history: list[int], model: int = 1) -> Entry:
    return Entry(key, LiveRoute(uuid.uuid4(), model, Held(history), [], 8192))


def test_a_prompt_extending_a_cached_history_takes_that_entry_and_marks_it_busy() -> None:
    c = PrefixCache(max_entries=8, max_per_key=4)
    e = entry(1, [1, 2, 3, 4])
    c.add_busy(e)
    c.put(e)
    got, n = c.take(1, 1, [1, 2, 3, 4, 5, 6])
    assert got is e and n == 4 and e.busy
    assert c.take(1, 1, [1, 2, 3, 4, 5, 6]) == (None, 0), "a busy entry is never shared"


def test_another_key_or_model_never_gets_the_entry() -> None:
    c = PrefixCache()
    e = entry(1, [1, 2, 3])
    c.put(e)
    assert c.take(2, 1, [1, 2, 3, 4])[0] is None
    assert c.take(1, 2, [1, 2, 3, 4])[0] is None


def test_a_prompt_sharing_only_a_short_system_prefix_opens_its_own_route() -> None:
    c = PrefixCache()
    c.put(entry(1, list(range(100))))
    assert c.take(1, 1, [*range(30), 999])[0] is None
    got, n = c.take(1, 1, [*range(90), 999])  # a regenerated last answer: cut back 10 of 100
    assert got is not None and n == 90


def test_the_longest_shared_prefix_wins() -> None:
    c = PrefixCache()
    a, b = entry(1, [1, 2, 3]), entry(1, [1, 2, 3, 4, 5])
    c.put(a)
    c.put(b)
    assert c.take(1, 1, [1, 2, 3, 4, 5, 6])[0] is b


def test_the_least_recently_used_idle_entries_go_first_per_key_and_in_all() -> None:
    c = PrefixCache(max_entries=3, max_per_key=2)
    k1 = [entry(1, [i]) for i in range(3)]
    evicted = [x for e in k1 for x in c.put(e)]
    assert evicted == [k1[0]]
    k2 = [entry(2, [10 + i]) for i in range(2)]
    evicted = [x for e in k2 for x in c.put(e)]
    assert evicted == [k1[1]] and len(c) == 3


def test_busy_entries_are_never_evicted() -> None:
    c = PrefixCache(max_entries=1, max_per_key=1)
    a, b = entry(1, [1]), entry(1, [2])
    c.add_busy(a)
    assert c.add_busy(b) == []
    assert c.put(a) == [a] and len(c) == 1


def test_idle_entries_expire_and_so_do_entries_near_their_route_tokens_expiry() -> None:
    clock = Clock()
    c = PrefixCache(idle_s=10, max_age_s=100, clock=clock)
    old = entry(1, [1])
    old.created = 0.0
    c.put(old)
    clock.t = 5
    assert c.expired() == []
    clock.t = 11
    assert c.expired() == [old]
    young = entry(1, [2])
    young.created = 0.0
    clock.t = 95
    c.put(young)
    clock.t = 101
    assert c.expired() == [young]


def test_a_revoked_keys_idle_entries_are_dropped() -> None:
    c = PrefixCache()
    a, b = entry(1, [1]), entry(2, [2])
    c.put(a)
    c.put(b)
    assert c.drop_key(1) == [a] and len(c) == 1


def test_an_entry_busy_far_longer_than_any_answer_is_given_up() -> None:
    clock = Clock()
    c = PrefixCache(idle_s=10, max_age_s=100, clock=clock)
    stuck = entry(1, [1])
    c.add_busy(stuck)
    clock.t = 50
    assert c.expired() == []
    clock.t = 101
    assert c.expired() == [stuck]
