"""The native executor's numbers do not depend on how many threads compute them: a replacement hop
with another --threads (failover) continues a session with the very numbers the first one gave."""

from __future__ import annotations

import time

import numpy as np

from agent.backends import load_backend
from agent.backends.base import ShardSpec, StepInput
from tests.helpers import CHAT_PROMPT
from tests.native.tiny_gguf import VOCAB, write_tiny_gguf


def run(be, threads: list[int], tag: int) -> list[np.ndarray]:  # noqa: ANN001 - a NativeBackend
    """Two sessions: a prefill each, then decode steps of both in one batch, each call on the next
    thread count of `threads` (cycled); every call's logits."""
    sids = [bytes([tag, i]) * 8 for i in range(2)]
    out: list[np.ndarray] = []
    toks, pos = [], []
    for k, s in enumerate(sids):
        be.model.set_threads(threads[k % len(threads)])
        be.open_session(s, 256)
        prompt = CHAT_PROMPT[: 20 + 7 * k]
        r = be.forward(StepInput(s, 0, token_ids=np.array(prompt, dtype=np.int32), want_logits=True))
        out.append(r.logits)
        toks.append(int(np.argmax(r.logits[-1])))
        pos.append(len(prompt))
    for step in range(6):
        be.model.set_threads(threads[step % len(threads)])
        steps = [
            StepInput(s, pos[i], token_ids=np.array([toks[i]], dtype=np.int32), want_logits=True)
            for i, s in enumerate(sids)
        ]
        for i, r in enumerate(be.forward_batch(steps)):
            assert not isinstance(r, Exception), r
            out.append(r.logits)
            toks[i] = int(np.argmax(r.logits[-1]))
            pos[i] += 1
    for s in sids:
        be.close_session(s)
    return out


def test_one_thread_two_threads_and_a_count_changing_every_call_give_identical_logits(
    native_lib: None, model_path: str, manifest
) -> None:  # noqa: ANN001
    be = load_backend("native", ShardSpec(model_path, 0, 30, manifest, n_threads=2))
    try:
        two = run(be, [2], 1)
        one = run(be, [1], 2)
        mixed = run(be, [1, 2], 3)
    finally:
        be.close()
    assert len(two) == 2 + 2 * 6
    for a, b, c in zip(two, one, mixed, strict=True):
        assert np.array_equal(a, b) and np.array_equal(a, c)


def _last_step(path, threads: int, flash: bool, n: int = 600) -> np.ndarray:  # noqa: ANN001
    """Logits of one decode step after n positions on a small window of `threads` threads."""
    from agent.backends.libggswarm import NativeModel

    ids = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, n + 1)]
    with NativeModel(str(path), 0, 3, n_threads=threads) as m:
        assert m.info.weight_bytes < 2 << 20  # below the size whose one-row steps run on one thread
        m.set_flash_attention(flash)
        sid = m.open_session(1024)
        m.forward(sid, 0, token_ids=ids[:n])
        return m.forward(sid, n, token_ids=ids[n:], want_logits=True)["logits"]


def test_a_small_window_on_two_threads_gives_the_one_thread_numbers_and_flash_steps_stay_on_two(
    native_lib: None, tmp_path
) -> None:  # noqa: ANN001
    """A one-row step of a window this small runs on the calling thread alone (graph.cpp
    compute_graph), which changes no number; except a flash-attention step over 512 or more positions,
    whose sum ggml splits among the threads: it keeps the handle's two, as llama.cpp's does. Below 512
    attended rows a flash step's bytes are the same on one thread and two, which lets it run on one."""
    path = write_tiny_gguf(tmp_path / "m.gguf", heads=(64, 4, 2), context=1024)
    assert np.array_equal(_last_step(path, 2, flash=False), _last_step(path, 1, flash=False))
    # below 512 attended rows (the span is padded: 100 positions attend 256) ggml's flash step does not
    # split them: one thread is as good as two there
    assert np.array_equal(_last_step(path, 2, flash=True, n=100), _last_step(path, 1, flash=True, n=100))
    two, one = _last_step(path, 2, flash=True), _last_step(path, 1, flash=True)
    assert not np.array_equal(two, one)  # run on one thread, the two-thread handle would give `one`


def _other_threads_switches() -> int:
    """Voluntary context switches of every thread of this process but the calling one (Linux)."""
    import threading
    from pathlib import Path

    me = threading.get_native_id()
    total = 0
    for task in Path("/proc/self/task").iterdir():
        if int(task.name) == me:
            continue
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        total += int(
            next(ln for ln in status.splitlines() if ln.startswith("voluntary_ctxt_switches")).split()[1]
        )
    return total


def test_a_small_windows_one_row_steps_leave_the_sleeping_worker_asleep(native_lib: None, tmp_path) -> None:  # noqa: ANN001
    """ggml's threadpool woke every worker for every graph, also one computed by the calling thread
    alone (native/patches/ggml-kickoff-one-thread.patch): a context switch per step on a core the
    route's next hop needs. A prompt on the same handle still wakes it (the count is live)."""
    from agent.backends.libggswarm import NativeModel

    path = write_tiny_gguf(tmp_path / "m.gguf", heads=(64, 4, 2), context=1024)
    ids = [int(t) for t in np.random.default_rng(5).integers(0, VOCAB, 300)]
    with NativeModel(str(path), 0, 3, n_threads=2) as m:
        sid = m.open_session(1024)
        before = _other_threads_switches()
        m.forward(sid, 0, token_ids=ids[:64])  # 64 rows: both threads
        # the worker counts a switch when it goes back to sleep, which may be just after the call returns
        deadline = time.monotonic() + 10
        while _other_threads_switches() == before and time.monotonic() < deadline:
            time.sleep(0.01)
        woken = _other_threads_switches() - before
        before = _other_threads_switches()
        for i in range(64, 264):
            m.forward(sid, i, token_ids=ids[i : i + 1])
        asleep = _other_threads_switches() - before
    assert woken >= 1
    assert asleep < 20, f"{asleep} context switches of other threads over 200 one-thread steps"
