"""The machine-wide core leases (agent/node/cores.py) and the scheduler computing under them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from agent.backends.base import ForwardResult, StepInput
from agent.node.cores import CoreLeaseError, CoreLeases, leases_from_env
from agent.node.scheduler import ShardScheduler
from tests.agent.test_scheduler import RecordingBackend, sid

HOLDER = """
import fcntl, os, sys, time
d = sys.argv[1]
fds = [os.open(os.path.join(d, f"core-{i}"), os.O_RDWR | os.O_CREAT, 0o600) for i in range(int(sys.argv[2]))]
for fd in fds:
    fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def leases_dir(tmp_path: Path) -> Path:
    d = tmp_path / "cores"
    d.mkdir(mode=0o700)
    return d


def hold_in_another_process(d: Path, n: int) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(d), str(n)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_leases_held_by_another_process_are_not_taken_and_come_back_when_it_is_killed(tmp_path: Path) -> None:
    d = leases_dir(tmp_path)
    holder = hold_in_another_process(d, 2)
    leases = CoreLeases(2, d)
    try:
        assert leases.try_take(2) == []
        holder.kill()  # not a clean exit: the kernel drops its locks all the same
        holder.wait(10)
        assert sorted(leases.try_take(2)) == [0, 1]
    finally:
        holder.kill()
        leases.close()


def test_two_handles_in_one_process_exclude_each_other(tmp_path: Path) -> None:
    d = leases_dir(tmp_path)
    a, b = CoreLeases(2, d), CoreLeases(2, d)
    try:
        got = a.try_take(1)
        assert len(got) == 1
        assert b.try_take(2) == [1 - got[0]]  # only the other one
        a.give(got)
        assert b.try_take(1) == [got[0]]
    finally:
        a.close()
        b.close()


async def test_a_waiting_take_leaves_the_event_loop_free_and_gets_the_lease_when_it_is_given(
    tmp_path: Path,
) -> None:
    d = leases_dir(tmp_path)
    a, b = CoreLeases(1, d), CoreLeases(1, d)
    try:
        held = a.try_take(1)
        waiter = asyncio.ensure_future(b.take(1))
        ticks = 0
        for _ in range(20):  # the loop keeps running while b waits
            await asyncio.sleep(0.005)
            ticks += 1
        assert not waiter.done() and ticks == 20
        a.give(held)
        assert await asyncio.wait_for(waiter, 10) == [0]
        assert a.try_take(1) == []  # b holds it now
    finally:
        a.close()
        b.close()


async def test_a_cancelled_waiter_gives_back_the_lease_its_thread_gets_later(tmp_path: Path) -> None:
    d = leases_dir(tmp_path)
    a, b = CoreLeases(1, d), CoreLeases(1, d)
    try:
        held = a.try_take(1)
        waiter = asyncio.ensure_future(b.take(1))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        a.give(held)
        deadline = time.monotonic() + 10
        while not (got := a.try_take(1)):  # b's thread took it, then gave it back
            assert time.monotonic() < deadline, "the cancelled waiter kept the lease"
            await asyncio.sleep(0.01)
        assert got == [0]
    finally:
        a.close()
        b.close()


def test_a_lease_directory_open_to_other_users_is_refused(tmp_path: Path) -> None:
    d = leases_dir(tmp_path)
    d.chmod(0o777)
    with pytest.raises(CoreLeaseError, match="open to other users"):
        CoreLeases(2, d)
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(CoreLeaseError, match="not a directory"):
        CoreLeases(2, f)


def test_leases_from_the_environment(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert leases_from_env({"GGSWARM_CORE_LEASES": "3"}) == 3
    assert leases_from_env({}) == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="GGSWARM_CORE_LEASES=-1 is outside 0..1024"):
        leases_from_env({"GGSWARM_CORE_LEASES": "-1"})
    assert CoreLeases.from_env({"GGSWARM_CORE_LEASES": "0"}) is None  # turned off
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    env = {"GGSWARM_CORE_LEASES": "2", "GGSWARM_CORE_DIR": str(open_dir)}
    assert CoreLeases.from_env(env) is None  # unusable: the hop computes as if alone, and says so
    assert "core leases off" in caplog.text
    leases = CoreLeases.from_env({"GGSWARM_CORE_LEASES": "2", "GGSWARM_CORE_DIR": str(tmp_path / "new")})
    assert leases is not None and (tmp_path / "new").stat().st_mode & 0o777 == 0o700
    leases.close()


def test_serving_with_a_bad_lease_count_fails_at_once_with_its_name(monkeypatch, capsys) -> None:  # noqa: ANN001
    from agent.cli import main

    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    monkeypatch.setenv("GGSWARM_CORE_LEASES", "many")
    argv = ["serve", "--model", "pkg:smollm2", "--port", "1", "--public-key", "unused"]
    assert main(argv) == 2
    assert "GGSWARM_CORE_LEASES='many' is not an integer" in capsys.readouterr().err


class ThreadedBackend(RecordingBackend):
    """A fake backend of two threads that records the thread count of every call and whether two
    backends ever computed at once."""

    running = 0  # class-wide: computing calls of every instance
    overlap = False
    guard = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        self.threads = 2
        self.calls: list[int] = []

    def thread_limit(self) -> int | None:
        return 2

    def set_compute_threads(self, n: int) -> None:
        assert 1 <= n <= 2
        self.threads = n

    def forward(self, sid, pos_start, token_ids=None, hidden=None, **kw: object) -> ForwardResult:  # noqa: ANN001
        with ThreadedBackend.guard:
            ThreadedBackend.running += 1
            ThreadedBackend.overlap |= ThreadedBackend.running > 1
        try:
            self.calls.append(self.threads)
            time.sleep(0.002)
            return super().forward(sid, pos_start, token_ids=token_ids, hidden=hidden, **kw)
        finally:
            with ThreadedBackend.guard:
                ThreadedBackend.running -= 1


async def test_two_shards_sharing_one_core_lease_compute_one_at_a_time_on_one_thread(tmp_path: Path) -> None:
    d = leases_dir(tmp_path)
    shards = []
    for _ in range(2):
        be = ThreadedBackend()
        shards.append((ShardScheduler(be, asyncio.Lock(), cores=CoreLeases(1, d)), be))
    ThreadedBackend.overlap = False

    async def decode(sched: ShardScheduler, be: ThreadedBackend, s: int) -> list[int]:
        be.open_session(sid(s), 64)
        out = []
        for k in range(12):  # 20 positions a step: computed in a worker thread, not on the event loop
            ids = np.ones(20, dtype=np.int64)
            r = await sched.submit(s, None, StepInput(sid(s), 20 * k, token_ids=ids))
            out.append(r.token)
        return out

    got = await asyncio.gather(*(decode(sched, be, i) for i, (sched, be) in enumerate(shards)))
    assert got == [[20 * (k + 1) for k in range(12)]] * 2
    assert not ThreadedBackend.overlap  # never both at once: one lease on this "machine"
    assert all(be.calls == [1] * 12 for _, be in shards)  # on as many threads as leases held
    for sched, _ in shards:
        sched.close()


async def test_a_shard_alone_on_the_machine_computes_on_all_its_threads(tmp_path: Path) -> None:
    be = ThreadedBackend()
    sched = ShardScheduler(be, asyncio.Lock(), cores=CoreLeases(4, leases_dir(tmp_path)))
    be.open_session(sid(1), 64)
    await sched.submit(1, None, StepInput(sid(1), 0, token_ids=np.array([5, 6], dtype=np.int64)))
    assert be.calls == [2]
    sched.close()
