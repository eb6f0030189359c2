"""Every message between a media worker and the inference process (on the Unix socket),
and from the inference process to the front door (on its control pipe): a frozen class
each, so a receiver dispatches with ``match`` on the type, and a misspelt kind fails where
it is written rather than being ignored where it lands.

They cross pickled, and a pickle names its class, so no enum of kinds stands beside them.
The per-frame messages (``Submit``, ``Done``) carry plain tuples, one a frame, gathered by
``outbox.Outbox``: a batch of frames costs one object more than its tuples, as before.
The control pipe's ``Ready`` and ``Stop`` are every spawned child's
(``inference.child_process``), media workers' too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.engine import FrameInput, PreparedPortrait
from inference.process.ring import RingLayout

#: A frame whose inputs are in the ring: (ring slot, portrait slot, deadline in loop time).
SubmitItem = tuple[int, int, float]
#: A frame answered in the ring: (ring slot, frame side, 0 for coefficients alone), or
#: (ring slot, None) for a frame dropped.
DoneItem = tuple[int, int | None]


# ---------------------------------------------------------------------- worker -> process
@dataclass(frozen=True, slots=True)
class Ring:
    """The worker's ring, created by the worker, for the process to attach to."""

    name: str
    layout: RingLayout


@dataclass(frozen=True, slots=True)
class Submit:
    """Frames to make, whose inputs are in their ring slots."""

    items: list[SubmitItem]


@dataclass(frozen=True, slots=True)
class Release:
    """A portrait the worker no longer needs leaves the engine."""

    slot: int


@dataclass(frozen=True, slots=True)
class Prepare:
    """Put a portrait into the engine; answered with its slot (``Reply``)."""

    call_id: int
    portrait: PreparedPortrait


@dataclass(frozen=True, slots=True)
class WarmUp:
    """Run a batch shape untimed, then into the capacity estimate; answered with the
    capacity figures (``Reply``)."""

    call_id: int
    batch: list[FrameInput]
    picture: bool


# ---------------------------------------------------------------------- process -> worker
@dataclass(frozen=True, slots=True)
class Hello:
    """The first message to a worker: the batch size its ring is sized for, and the
    capacity figures so far."""

    max_batch: int
    capacity: dict[int, float]


@dataclass(frozen=True, slots=True)
class Done:
    """Frames answered: their pictures and coefficients are in their ring slots."""

    items: list[DoneItem]


@dataclass(frozen=True, slots=True)
class Capacity:
    """Engine frames per second by frame size (``NO_PICTURE`` too), for admission."""

    figures: dict[int, float]


@dataclass(frozen=True, slots=True)
class Reply:
    """What a call (``Prepare``, ``WarmUp``) returned."""

    call_id: int
    value: Any


@dataclass(frozen=True, slots=True)
class Refused:
    """A call that failed, or a message the process does not take (``call_id`` None when
    it was no call): ``reason`` says why."""

    call_id: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class Stopping:
    """The process is stopping in order (the server shutting down): it did not die."""


# ---------------------------------------------------------------------- process -> front door
@dataclass(frozen=True, slots=True)
class Batch:
    """The engine ran a batch of ``size`` frames in ``seconds``."""

    size: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Drop:
    """The scheduler dropped a frame, for ``reason``."""

    reason: str


Call = Prepare | WarmUp
ToCore = Ring | Submit | Release | Prepare | WarmUp
ToWorker = Hello | Done | Capacity | Reply | Refused | Stopping
ToFrontDoor = Batch | Drop
