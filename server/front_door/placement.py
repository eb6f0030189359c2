"""Where a new session goes: which media worker (and so which GPU), or nowhere.

Only the decision lives here. The front door asks the workers for their loads, calls
``place``, and carries the choice out; placing workers and GPUs on other hosts changes
where the loads come from, not this.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

from inference.engine import NO_PICTURE
from server.costs import media_cost, session_cost


class Refused(RuntimeError):
    """No worker can take the session without degrading the ones already running."""


@dataclass(frozen=True)
class WorkerLoad:
    index: int
    gpu: int  # the inference process it feeds
    sessions: dict[int, int]  # its live and reserved video sessions, by frame side
    #: Its GPU's measured engine capacity, by frame side (NO_PICTURE: coefficients alone).
    capacity_fps: dict[int, float]
    motion: dict[int, int] = field(default_factory=dict)  # motion-only sessions, by side
    #: Its event loop's measured CPU share, and the cost in cores of the settled sessions it
    #: carried then (which the host's cost model learns from).
    loop_load: float = 0.0
    settled_cost: float = 0.0
    #: What its sessions cost its loop, as its own cost model has learnt (``CostModel``):
    #: the idle loop's share, and the share per unit of loop cost.
    loop_idle: float = 0.0
    loop_unit: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.sessions.values())

    @property
    def motion_count(self) -> int:
        return sum(self.motion.values())

    @property
    def media_cost(self) -> float:
        """Its sessions' cost in cores."""
        return media_cost(self.sessions, self.motion)

    def loop_load_with(self, cost: float) -> float:
        """Its loop's load once a session of loop ``cost`` is added: the model's figure for
        all its sessions (reserved offers included, so a burst is charged before its load
        shows), or, if more, what is measured now plus the newcomer's share."""
        total = media_cost(self.sessions, self.motion, loop=True)
        return max(self.loop_idle + self.loop_unit * (total + cost),
                   self.loop_load + self.loop_unit * cost)

    def frames(self) -> dict[int, int]:
        """Sessions the engine runs for: video by frame side, motion-only as NO_PICTURE."""
        return {**self.sessions, NO_PICTURE: self.motion_count}

    def frame_cost(self, size: int, fps: int) -> float:
        """Share of its GPU's engine one session of this side (NO_PICTURE: motion-only)
        takes (0 before measured)."""
        capacity = self.capacity_fps.get(size, 0.0)
        return fps / capacity if capacity > 0 else 0.0


@dataclass(frozen=True)
class HostLoad:
    """The server's cores: how many, how many its processes keep busy (measured each
    second), how many they keep busy with no session, and the cores one unit of media
    cost (a 256x256 video session) takes, as last measured in a steady state."""

    cores: float
    busy: float
    idle: float
    unit: float

    def busy_with(self, total_cost: float, cost: float) -> float:
        """Busy cores with every session placed (``total_cost``, reserved offers included)
        and one more of ``cost``: the model's figure, so that offers arriving in a burst
        are charged before their load shows, or, if more, what is measured now plus it."""
        return max(self.idle + self.unit * (total_cost + cost), self.busy + self.unit * cost)


@dataclass(frozen=True)
class Limits:
    max_sessions: int  # the whole server
    worker_sessions: int  # one worker (its share of the frame ring)
    max_engine_load: float  # one GPU's engine, as a share of its measured capacity
    fps: int
    max_motion_sessions: int = 0  # motion-only sessions, the whole server
    worker_motion_sessions: int = 0  # ... and one worker
    max_worker_load: float = 1.0  # one worker's event loop, as a share of its thread's time
    max_host_load: float = 1.0  # the server's processes, as a share of its cores


def one_more(load: WorkerLoad, size: int, motion_only: bool) -> WorkerLoad:
    """``load`` with one more session of this kind placed on it."""
    counts = dict(load.motion if motion_only else load.sessions)
    counts[size] = counts.get(size, 0) + 1
    return dataclasses.replace(load, **{"motion" if motion_only else "sessions": counts})


def engine_loads(loads: Sequence[WorkerLoad], fps: int) -> dict[int, float]:
    """Each GPU's engine load: the share of its capacity its sessions need at full rate."""
    out: dict[int, float] = {}
    for load in loads:
        need = sum(n * load.frame_cost(size, fps) for size, n in load.frames().items())
        out[load.gpu] = out.get(load.gpu, 0.0) + need
    return out


def gpu_capacity_fps(loads: Sequence[WorkerLoad], size: int) -> dict[int, float]:
    """Each GPU's measured engine capacity at this frame side (NO_PICTURE: motion-only),
    once per GPU however many workers feed it."""
    return {load.gpu: load.capacity_fps.get(size, 0.0) for load in loads}


def place(loads: Sequence[WorkerLoad], size: int, limits: Limits, *,
          motion_only: bool = False, host: HostLoad | None = None) -> int:
    """The worker with the least media cost among those whose worker and GPU have room
    for one more session of ``size`` (video, or ``motion_only``); raises ``Refused``
    naming the limit reached."""
    if not loads:
        raise Refused("no media worker is running")
    if motion_only:
        kind, most, per_worker = ("motion-only ", limits.max_motion_sessions,
                                  limits.worker_motion_sessions)
    else:
        kind, most, per_worker = "", limits.max_sessions, limits.worker_sessions
    count = operator.attrgetter("motion_count" if motion_only else "count")
    if sum(map(count, loads)) >= most:
        raise Refused(f"server holds its maximum of {most} {kind}sessions")
    gpus = engine_loads(loads, limits.fps)
    room = [load for load in loads if count(load) < per_worker]
    if not room:
        raise Refused(f"every media worker holds its maximum of {per_worker} {kind}sessions")
    cost = session_cost(size, motion_only)
    if host is not None:
        busy = host.busy_with(sum(load.media_cost for load in loads), cost)
        if busy > limits.max_host_load * host.cores:
            raise Refused(f"the server's {host.cores:g} cores would be {busy:.1f} busy with "
                          f"another {kind}{size}x{size} session, past "
                          f"session.max_host_load={limits.max_host_load} ({host.busy:.1f} "
                          f"busy now; {host.idle:.1f} idle and {host.unit:.3f} a 256x256 "
                          f"session, as learnt)")
    loop_cost = session_cost(size, motion_only, loop=True)
    room = [load for load in room if load.loop_load_with(loop_cost) <= limits.max_worker_load]
    if not room:
        raise Refused(f"every media worker's event loop would pass session.max_worker_load="
                      f"{limits.max_worker_load} with another {kind}{size}x{size} session")
    frames = NO_PICTURE if motion_only else size
    fits = [load for load in room
            if gpus[load.gpu] + load.frame_cost(frames, limits.fps) <= limits.max_engine_load]
    if not fits:
        busiest = min(gpus[load.gpu] for load in room)
        raise Refused(f"the engine is at {busiest:.0%} of its measured capacity; another "
                      f"{size}x{size} session would pass session.max_engine_load="
                      f"{limits.max_engine_load}")
    return min(fits, key=lambda load: (load.media_cost, gpus[load.gpu], load.index)).index
