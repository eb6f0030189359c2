"""Where a new session goes: which media worker (and so which GPU), or nowhere.

Only the decision lives here. The front door asks the workers for their loads, calls
``place``, and carries the choice out; placing workers and GPUs on other hosts changes
where the loads come from, not this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class Refused(RuntimeError):
    """No worker can take the session without degrading the ones already running."""


@dataclass(frozen=True)
class WorkerLoad:
    index: int
    gpu: int  # the inference process it feeds
    sessions: dict[int, int]  # its live and reserved sessions, by frame side
    capacity_fps: dict[int, float]  # its GPU's measured engine capacity, by frame side

    @property
    def count(self) -> int:
        return sum(self.sessions.values())

    @property
    def media_cost(self) -> float:
        """Sessions weighted by their media cost, which grows about with the frame side
        (measured per session: 0.27 cores at 256x256, 0.46 at 512x512)."""
        return sum(n * size / 256 for size, n in self.sessions.items())

    def frame_cost(self, size: int, fps: int) -> float:
        """Share of its GPU's engine one session of this side takes (0 before measured)."""
        capacity = self.capacity_fps.get(size, 0.0)
        return fps / capacity if capacity > 0 else 0.0


@dataclass(frozen=True)
class Limits:
    max_sessions: int  # the whole server
    worker_sessions: int  # one worker (its share of the frame ring)
    max_engine_load: float  # one GPU's engine, as a share of its measured capacity
    fps: int


def engine_loads(loads: Sequence[WorkerLoad], fps: int) -> dict[int, float]:
    """Each GPU's engine load: the share of its capacity its sessions need at full rate."""
    out: dict[int, float] = {}
    for load in loads:
        need = sum(n * load.frame_cost(size, fps) for size, n in load.sessions.items())
        out[load.gpu] = out.get(load.gpu, 0.0) + need
    return out


def place(loads: Sequence[WorkerLoad], size: int, limits: Limits) -> int:
    """The worker with the least media cost among those whose worker and GPU have room
    for one more session of ``size``; raises ``Refused`` naming the limit reached."""
    if not loads:
        raise Refused("no media worker is running")
    total = sum(load.count for load in loads)
    if total >= limits.max_sessions:
        raise Refused(f"server holds its maximum of {limits.max_sessions} sessions")
    gpus = engine_loads(loads, limits.fps)
    room = [load for load in loads if load.count < limits.worker_sessions]
    if not room:
        raise Refused(f"every media worker holds its maximum of {limits.worker_sessions} "
                      f"sessions")
    fits = [load for load in room
            if gpus[load.gpu] + load.frame_cost(size, limits.fps) <= limits.max_engine_load]
    if not fits:
        busiest = min(gpus[load.gpu] for load in room)
        raise Refused(f"the engine is at {busiest:.0%} of its measured capacity; another "
                      f"{size}x{size} session would pass session.max_engine_load="
                      f"{limits.max_engine_load}")
    return min(fits, key=lambda load: (load.media_cost, gpus[load.gpu], load.index)).index
