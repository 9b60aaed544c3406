"""The web seed's Range handling: 200, 206, and clear 416s."""

from __future__ import annotations

from pathlib import Path

import pytest

from webapp.tracker.webseed import RangeNotSatisfiable, plan_range, read_range


def test_no_range_serves_the_whole_file_with_200() -> None:
    plan = plan_range(None, 1000)
    assert (plan.status, plan.start, plan.end) == (200, 0, 1000)
    assert plan.headers["Accept-Ranges"] == "bytes" and plan.headers["Content-Length"] == "1000"


@pytest.mark.parametrize(
    ("header", "start", "end"),
    [
        ("bytes=0-99", 0, 100),
        ("bytes=900-", 900, 1000),
        ("bytes=-10", 990, 1000),
        ("bytes=990-5000", 990, 1000),
        ("bytes=-5000", 0, 1000),
        ("Bytes = 5 - 5", 5, 6),
    ],
)
def test_one_satisfiable_range_is_served_with_206(header: str, start: int, end: int) -> None:
    plan = plan_range(header, 1000)
    assert (plan.status, plan.start, plan.end) == (206, start, end)
    assert plan.headers["Content-Range"] == f"bytes {start}-{end - 1}/1000"
    assert plan.headers["Content-Length"] == str(end - start)


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ("bytes=0-1,5-6", "multiple ranges are not supported"),
        ("bytes=1000-", "starts at or past the end"),
        ("bytes=10-5", "ends before it starts"),
        ("bytes=-0", "zero-length suffix"),
        ("bytes=abc", "malformed range"),
        ("bytes=-", "malformed range"),
        ("items=0-1", "unsupported range unit"),
    ],
)
def test_invalid_or_multiple_ranges_are_refused_with_416_and_a_reason(header: str, reason: str) -> None:
    with pytest.raises(RangeNotSatisfiable, match=reason) as e:
        plan_range(header, 1000)
    assert e.value.headers == {"Content-Range": "bytes */1000"}


def test_read_range_yields_exactly_the_planned_bytes(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(bytes(range(256)) * 10)
    plan = plan_range("bytes=250-1029", 2560)
    assert b"".join(read_range(f, plan.start, plan.end, chunk=100)) == (bytes(range(256)) * 10)[250:1030]
