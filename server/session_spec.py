"""What a session is asked to be, whichever process reads the request (``NewSession``): its
kind (where its driving speech comes from), its avatar and size, and its knobs (the
engine contract's ``KNOBS``, checked against their ranges, changed live on the session).
The front door reads a request into one (``server.http.new_session``) and hands it to
the worker that makes the session (``to_dict``), which never reads the client's body
again."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from inference.engine import KNOB_NAMES, KNOBS, KNOBS_BY_NAME


class SessionKind(enum.Enum):
    """Where a session's driving speech comes from, which its route decides."""

    PEER = "peer"  # POST /offer: the offering peer's microphone
    HOSTED = "hosted"  # POST /sessions: speech an application pushes
    ROOM = "room"  # POST /sessions with "janus": a participant in an SFU's room
    PUBLISHER = "publisher"  # POST /whip: a WHIP publisher's audio

    @property
    def watched_with_token(self) -> bool:
        """Whether viewers attach to it with its token (all but a peer's own session)."""
        return self is not SessionKind.PEER


class OptionsError(ValueError):
    """A session option is unknown or out of range."""


def check_knobs(raw: object) -> dict[str, float]:
    """A JSON object of knobs, each checked against its range; all or nothing, naming the
    offending field."""
    if not isinstance(raw, dict):
        raise OptionsError("options must be a JSON object")
    checked = {}
    for key, value in raw.items():
        if key not in KNOBS_BY_NAME:
            raise OptionsError(f"unknown option {repr(key)[:64]}; known: {', '.join(KNOB_NAMES)}")
        try:
            checked[key] = KNOBS_BY_NAME[key].check(value)
        except ValueError as exc:
            raise OptionsError(f"option {exc}") from None
    return checked


class SessionOptions:
    """A session's knobs, changed live."""

    def __init__(self, defaults: Mapping[str, float]) -> None:
        self.values = {knob.name: float(defaults.get(knob.name, knob.default))
                       for knob in KNOBS}

    def update(self, raw: object) -> None:
        """Apply a JSON object of knobs (``check_knobs``)."""
        self.values.update(check_knobs(raw))


@dataclass(frozen=True)
class RoomRequest:
    """What a session asks of its room: which, whom to listen to, how to appear."""

    room: int | str
    listen_to: str
    display: str = "Avatar"
    pin: str | None = None


@dataclass(frozen=True)
class NewSession:
    kind: SessionKind
    avatar: str | None  # None: the default avatar
    size: int
    options: dict[str, float]  # the knobs asked for; the settings' defaults fill the rest
    motion_only: bool = False
    record: bool = False
    #: A hosted or room session's stable name and viewer token, chosen by its creator so a
    #: kiosk's URL outlives the session.
    name: str | None = None
    token: str | None = None
    room: RoomRequest | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NewSession:
        room = data["room"]
        return cls(**{**data, "kind": SessionKind(data["kind"]),
                      "room": RoomRequest(**room) if room is not None else None})
