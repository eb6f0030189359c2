"""A media worker's load, as the front door places sessions by it: a typed record the
worker answers on its internal route (``GET /internal/load``), not its public health."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class WorkerReport:
    sessions: dict[int, int]  # live video sessions by frame side
    answering: dict[int, int]  # ... of those, whose offer is still being answered
    motion: dict[int, int]  # live motion-only sessions by frame side
    motion_answering: dict[int, int]
    #: Its GPU's measured engine capacity in frames/s, by frame side (``NO_PICTURE``: the
    #: coefficients alone, what motion-only sessions take of it).
    capacity_fps: dict[int, float]
    loop_load: float  # share of each second its event loop's thread is on CPU
    #: The cost of its settled sessions (``server.costs``), which the front door's host
    #: model learns from, and what the loop's own model has learnt: idle, and per unit.
    settled_cost: float
    loop_idle: float
    loop_unit: float
    #: Its named sessions: name to session id (a cluster keeps their names taken).
    names: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerReport:
        data = json.loads(text)
        for name in ("sessions", "answering", "motion", "motion_answering", "capacity_fps"):
            data[name] = {int(size): value for size, value in data[name].items()}
        return cls(**data)
