"""What a host publishes of itself in Redis each second, and what ``GET /cluster`` shows."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

SERVING, DRAINING = "serving", "draining"
#: The room a host publishes is counted per kind of session: video by frame side
#: (``"256"``), and motion-only sessions (``"motion"``).
MOTION = "motion"


def kind_of(size: int, motion_only: bool) -> str:
    return MOTION if motion_only else str(size)


@dataclass(frozen=True)
class NodeRecord:
    id: str
    url: str  # its advertised URL: the only address any host ever forwards to
    boot: str  # this run of it (``ids``)
    state: str  # SERVING or DRAINING
    sessions: int
    motion_sessions: int
    load: float  # its processes' busy cores as a share of its cores
    session_capacity: int  # sessions of the default size its engines hold
    started: float  # Unix time it joined
    #: Sessions of each kind its own admission would take now, one kind at a time.
    room: dict[str, int] = field(default_factory=dict)
    engine_load: float = 0.0  # its busiest GPU's share of its measured capacity
    cores_per_session: float = 0.0  # a 256x256 session's cost in cores, as it has learnt

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeRecord:
        return cls(**json.loads(text))

    def shown(self) -> dict[str, object]:
        """As ``GET /cluster`` lists it."""
        return {"id": self.id, "url": self.url, "state": self.state,
                "sessions": self.sessions, "motion_sessions": self.motion_sessions,
                "load": round(self.load, 3), "engine_load": round(self.engine_load, 3),
                "cores_per_session": self.cores_per_session,
                "session_capacity": self.session_capacity,
                "room": self.room, "age_s": round(max(0.0, time.time() - self.started), 1)}
