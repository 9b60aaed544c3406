"""The request limiter's sliding windows (webapp/core/throttle.WindowCounter), in this process and in
Redis: at most `limit` events in any `window_s` seconds, a burst across a clock minute's end included
(bench/abuse.py measured 240 answered requests a minute against a budget of 120 with clock windows)."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from webapp.core.throttle import WindowCounter

STORES = ["process", "redis"]


@pytest.fixture(params=STORES)
def counter(request: pytest.FixtureRequest, settings: Any) -> WindowCounter:
    settings.REDIS_URL = (
        os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0") if request.param == "redis" else ""
    )
    return WindowCounter(f"test-{uuid.uuid4().hex}")  # a namespace of this test's own


def _admitted(counter: WindowCounter, name: str, limit: int, times: list[float]) -> int:
    return sum(counter.hit(name, limit, 60, now=t) == 0.0 for t in times)


def test_a_burst_across_a_minutes_end_passes_the_limit_once_not_twice(counter: WindowCounter) -> None:
    assert _admitted(counter, "u", 20, [6059.0 + i / 100 for i in range(40)]) == 20
    assert _admitted(counter, "u", 20, [6061.0 + i / 100 for i in range(40)]) == 0, "the next clock minute"


def test_a_refused_event_says_when_the_oldest_admitted_one_leaves_the_window(counter: WindowCounter) -> None:
    assert _admitted(counter, "u", 3, [100.0, 110.0, 120.0]) == 3
    assert counter.hit("u", 3, 60, now=130.0) == pytest.approx(30.0)
    assert counter.hit("u", 3, 60, now=159.5) == 1.0, "never less than a second"
    assert counter.hit("u", 3, 60, now=160.0) == 0.0, "the first event has left the window"
    assert counter.hit("u", 3, 60, now=161.0) == pytest.approx(9.0)


def test_refused_events_do_not_extend_the_wait(counter: WindowCounter) -> None:
    assert _admitted(counter, "u", 2, [0.0, 1.0]) == 2
    assert _admitted(counter, "u", 2, [float(t) for t in range(2, 60)]) == 0
    assert counter.hit("u", 2, 60, now=60.0) == 0.0


def test_names_and_window_lengths_are_counted_apart(counter: WindowCounter) -> None:
    assert _admitted(counter, "a", 2, [0.0, 0.1, 0.2]) == 2
    assert _admitted(counter, "b", 2, [0.0, 0.1, 0.2]) == 2
    assert counter.hit("a", 2, 3600, now=0.3) == 0.0
    assert counter.hit("a", 0, 60, now=0.4) == 60.0, "a limit of 0 admits nothing"
