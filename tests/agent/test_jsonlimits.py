"""agent.wire.jsonlimits: the depth scan agrees with the parsed document, refuses before parsing, and
costs a fraction of json.loads (issue 33, item 6; docs/security.md, "Hostile JSON")."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import pytest

from agent.wire.jsonlimits import JsonLimitError, check_depth, loads_bounded

# strings that look like structure: brackets, escaped quotes and backslashes inside string literals
TRICKY = ["[[[", "]]]", '"', "\\", '\\"[', "{x", "}", "", "é", "\u2222"]


def depth(o: Any) -> int:
    if isinstance(o, list | dict):
        children = o.values() if isinstance(o, dict) else o
        return 1 + max((depth(c) for c in children), default=0)
    return 0


def document(rng: random.Random, levels: int) -> Any:
    r = rng.random()
    if levels and r < 0.35:
        return [document(rng, levels - 1) for _ in range(rng.randint(0, 3))]
    if levels and r < 0.7:
        return {rng.choice(TRICKY): document(rng, levels - 1) for _ in range(rng.randint(0, 3))}
    return rng.choice([*TRICKY, 1, 2.5, None, True])


def test_the_depth_found_is_the_documents_own_whatever_its_strings_hold() -> None:
    rng = random.Random(33)
    for _ in range(3000):
        doc = document(rng, rng.randint(0, 8))
        d = depth(doc)
        for text in (json.dumps(doc), json.dumps(doc, ensure_ascii=False, indent=1)):
            assert loads_bounded(text, max_depth=d) == doc
            assert loads_bounded(text.encode("utf-16"), max_depth=d) == doc  # json.loads' encodings too
            if d:
                with pytest.raises(JsonLimitError):
                    check_depth(text, d - 1)


@pytest.mark.parametrize("deep", ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000])
def test_json_nested_100k_deep_is_refused_quickly_with_a_clear_error(deep: str) -> None:
    with pytest.raises(RecursionError):
        json.loads(deep)  # what every entry point did before
    t = time.perf_counter()
    with pytest.raises(JsonLimitError, match="nested more than 64 levels"):
        loads_bounded(deep)
    assert time.perf_counter() - t < 1.0


def test_size_is_checked_first_in_utf8_bytes_and_malformed_json_stays_a_value_error() -> None:
    with pytest.raises(JsonLimitError, match="102 bytes; the limit is 100"):
        loads_bounded(b'"' + b"x" * 100 + b'"', max_bytes=100)
    with pytest.raises(JsonLimitError, match="bytes"):
        loads_bounded('"' + "é" * 60 + '"', max_bytes=100)  # 60 characters, 122 bytes
    assert loads_bounded('"' + "é" * 40 + '"', max_bytes=100) == "é" * 40
    for bad in ("[[[[", '"[[[[', "]]]]", "{", ""):
        with pytest.raises(ValueError) as e:
            loads_bounded(bad, max_depth=2)
        assert not isinstance(e.value, JsonLimitError) or "nested" in str(e.value)


def test_the_scan_costs_less_than_parsing_a_wide_8_mb_body() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x[y]"}] * 200_000}).encode()

    def cpu_s(work: Callable[[], object]) -> float:
        # this thread's CPU time, the least of three: other processes on the machine (the suite runs
        # three workers on two cores) preempt it between the clock reads, and wall time would count that
        best = float("inf")
        for _ in range(3):
            t = time.thread_time()
            work()
            best = min(best, time.thread_time() - t)
        return best

    scan = cpu_s(lambda: check_depth(body, 4))
    parse = cpu_s(lambda: json.loads(body))
    assert scan < max(parse, 0.05), (scan, parse)


def containers(o: Any) -> int:
    if isinstance(o, list | dict):
        children = o.values() if isinstance(o, dict) else o
        return 1 + sum(containers(c) for c in children)
    return 0


def test_the_objects_and_arrays_counted_are_the_documents_own_whatever_its_strings_hold() -> None:
    rng = random.Random(34)
    for _ in range(2000):
        doc = document(rng, rng.randint(0, 6))
        n = containers(doc)
        text = json.dumps(doc)
        assert loads_bounded(text, max_containers=n) == doc
        if n:
            with pytest.raises(JsonLimitError, match=f"holds {n} objects and arrays; the limit is {n - 1}"):
                loads_bounded(text, max_containers=n - 1)


def test_a_body_of_250_000_messages_is_refused_without_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "{[x]}"}] * 250_000}).encode()

    def no_parse(*a: Any, **k: Any) -> Any:
        raise AssertionError("json.loads ran")

    monkeypatch.setattr(json, "loads", no_parse)
    with pytest.raises(JsonLimitError, match="holds 250002 objects and arrays; the limit is 17408"):
        loads_bounded(body, max_containers=17_408)


def test_a_scan_in_slices_finds_what_one_pass_over_the_whole_body_finds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Big bodies are scanned a slice at a time (no C call holds the GIL over all of an 8.5 MB body):
    slices of a few bytes cut escapes, backslash runs and strings anywhere, and the depth and count
    found are still the document's own."""
    from agent.wire import jsonlimits

    rng = random.Random(35)
    for size in (2, 3, 5, 16):
        monkeypatch.setattr(jsonlimits, "SLICE_BYTES", size)
        for _ in range(300):
            doc = document(rng, rng.randint(1, 6))
            d, n = depth(doc), containers(doc)
            text = json.dumps(doc)
            assert loads_bounded(text, max_depth=d, max_containers=n) == doc
            if d:
                with pytest.raises(JsonLimitError, match="nested"):
                    check_depth(text, d - 1)
            if n:
                with pytest.raises(JsonLimitError, match=f"holds {n} objects"):
                    loads_bounded(text, max_containers=n - 1)


def test_the_depth_check_is_linear_not_a_pass_per_level() -> None:
    # one removal of matched pairs per level took 47 ms for 100,000 levels (64 passes), on the event
    # loop of the playground's socket; a running count of open brackets takes one pass
    deep = "[" * 1_000_000 + "]" * 1_000_000
    best = float("inf")
    for _ in range(3):
        t = time.thread_time()
        with pytest.raises(JsonLimitError, match="nested more than 64 levels"):
            check_depth(deep)
        best = min(best, time.thread_time() - t)
    assert best < 0.2, best
