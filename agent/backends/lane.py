"""A node's decode lane (libggswarm API v7, docs/lane.md): the listener, the sessions admitted to it and
the batches it computed."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass

import numpy as np

from agent.backends.ggswarm_abi import (
    ggswarm_lane_batch,
    ggswarm_lane_p,
    ggswarm_lane_session,
    ggswarm_lane_stats,
    ggswarm_sampling,
)
from agent.backends.ggswarm_lib import check_status, load_library
from agent.backends.libggswarm import NativeModel
from agent.wire.lane import KEY_BYTES

MAX_CONTEXT = 131072  # GGSWARM_MAX_CONTEXT

TYPE_F32, TYPE_F16 = 0, 1
BATCH_LOG = 16384  # GGSWARM_LANE_BATCH_LOG: batches the library keeps until taken


@dataclass(frozen=True)
class LaneStats:
    """A lane session's figures: steps run, the next step number it accepts, seconds idle, whether a
    step runs now, and (last window) the token ids its steps appended to the history."""

    steps: int
    next_step: int
    idle_s: float
    busy: bool
    appended: tuple[int, ...] = ()


@dataclass(frozen=True)
class LaneBatch:
    """One batch the lane computed on this hop (a lone step or a bundle): when it finished
    (time.monotonic()'s clock), its wait for the model handle and its compute in seconds, the sessions'
    steps that ran, their token positions, and the tokens sampled (last window only)."""

    t_done: float
    wait_s: float
    compute_s: float
    steps: int
    positions: int
    sampled: int


@dataclass(frozen=True)
class NextHop:
    """Where a window before the last sends its rows: the next hop's lane, its lane id and key."""

    host: str
    port: int
    lane_id: int
    key: bytes
    f16: bool = False


def _key(key: bytes) -> ctypes.Array[ctypes.c_uint8]:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a lane key is {KEY_BYTES} bytes, not {len(key)}")
    return (ctypes.c_uint8 * KEY_BYTES).from_buffer_copy(key)


class NativeLane:
    """Owns one ggswarm_lane: a listener whose connections libggswarm's threads serve."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lib = load_library()
        self._h = ggswarm_lane_p()
        check_status(
            self._lib.ggswarm_lane_open(host.encode(), int(port), ctypes.byref(self._h)),
            self._lib.ggswarm_last_error(),
        )
        self.host = host
        self.port = int(self._lib.ggswarm_lane_port(self._h))
        self._batch_buf: ctypes.Array[ggswarm_lane_batch] | None = None  # made on first take_batches

    def add(
        self,
        model: NativeModel,
        sid: int,
        lane_id: int,
        key: bytes,
        nxt: NextHop | None = None,
        sampling: ggswarm_sampling | None = None,
        history: list[int] | None = None,
        first_step: int = 1,
        direct: bool = False,
    ) -> None:
        """Admit session `sid` of `model` as `lane_id` (frames sealed with `key`); `nxt` for every
        window before the last. `direct`: rows go on without waiting, the last window answers the
        session's subscriber (docs/lane.md, "Direct mode")."""
        cfg = ggswarm_lane_session()
        cfg.lane_id = lane_id
        cfg.model = model._h.value  # noqa: SLF001 - the handle the lane runs steps on
        cfg.sid = sid
        cfg.key_in = _key(key)
        if nxt is not None:
            cfg.next_host = nxt.host.encode()
            cfg.next_port = nxt.port
            cfg.next_lane_id = nxt.lane_id
            cfg.key_out = _key(nxt.key)
            cfg.hidden_out_type = TYPE_F16 if nxt.f16 else TYPE_F32
        if sampling is not None:
            cfg.sampling = ctypes.pointer(sampling)
        hist = np.ascontiguousarray(history or [], dtype=np.int32)
        if hist.size:
            cfg.history = hist.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
            cfg.n_history = int(hist.size)
        cfg.first_step = first_step
        cfg.answer_direct = 1 if direct else 0
        check_status(
            self._lib.ggswarm_lane_add(self._handle(), ctypes.byref(cfg)), self._lib.ggswarm_last_error()
        )

    def stats(self, lane_id: int) -> LaneStats:
        out = ggswarm_lane_stats()
        check_status(
            self._lib.ggswarm_lane_stats_get(self._handle(), lane_id, ctypes.byref(out)),
            self._lib.ggswarm_last_error(),
        )
        return LaneStats(out.steps, out.next_step, out.idle_s, bool(out.busy))

    def activity(self, lane_id: int) -> tuple[float, bool]:
        """(seconds since the session's last step, whether one runs now), at once: `stats` waits for
        the session's step in flight, which in relay mode waits for the later hops."""
        idle, busy = ctypes.c_double(0.0), ctypes.c_int32(0)
        check_status(
            self._lib.ggswarm_lane_activity(self._handle(), lane_id, ctypes.byref(idle), ctypes.byref(busy)),
            self._lib.ggswarm_last_error(),
        )
        return idle.value, bool(busy.value)

    def remove(self, lane_id: int) -> LaneStats:
        """Take the session off the lane (after its step in flight) with the ids its steps appended."""
        cap = MAX_CONTEXT  # no session appends more ids than it has positions
        buf = (ctypes.c_int32 * cap)()
        out = ggswarm_lane_stats()
        check_status(
            self._lib.ggswarm_lane_remove(self._handle(), lane_id, ctypes.byref(out), buf, cap),
            self._lib.ggswarm_last_error(),
        )
        n = min(out.n_appended, cap)
        return LaneStats(out.steps, out.next_step, out.idle_s, bool(out.busy), tuple(buf[:n]))

    def wait_step(self, timeout_s: float) -> bool:
        """Block until a lane step finishes computing here (True), or `timeout_s` passes; False at
        once when none finished within the last `timeout_s` (the lane is quiet). Releases the GIL."""
        return bool(self._lib.ggswarm_lane_wait_step(self._handle(), max(1, int(timeout_s * 1e3))))

    def gate(self, timeout_s: float) -> bool:
        """Block until the lane's next step arrives here and hold it before its compute (True): the
        caller runs its own work on the window now, then must call `gate_release`. False on timeout,
        at once when the lane is quiet; nothing is held then. Releases the GIL."""
        return bool(self._lib.ggswarm_lane_gate(self._handle(), max(1, int(timeout_s * 1e3))))

    def gate_release(self) -> None:
        """Let the step `gate` held compute (a held step goes on by itself after GGSWARM_LANE_GATE_MAX_MS)."""
        self._lib.ggswarm_lane_gate_release(self._handle())

    def take_batches(self) -> tuple[list[LaneBatch], int]:
        """The batches computed since the last call, oldest first, and how many of them the library
        had to drop unread (its log holds BATCH_LOG)."""
        if self._batch_buf is None:
            self._batch_buf = (ggswarm_lane_batch * BATCH_LOG)()
        buf, dropped = self._batch_buf, ctypes.c_uint64(0)
        n = int(self._lib.ggswarm_lane_take_batches(self._handle(), buf, BATCH_LOG, ctypes.byref(dropped)))
        if n < 0:
            raise ValueError(self._lib.ggswarm_last_error().decode(errors="replace"))
        out = [LaneBatch(b.t_done, b.wait_s, b.compute_s, b.steps, b.positions, b.sampled) for b in buf[:n]]
        return out, int(dropped.value)

    def _handle(self) -> int | None:
        if not self._h:
            raise ValueError("lane is closed")
        return self._h.value

    def close(self) -> None:
        """Stop listening, close its connections and join its threads. Idempotent."""
        if self._h:
            self._lib.ggswarm_lane_free(self._h)
            self._h = ggswarm_lane_p()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()
