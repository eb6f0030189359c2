"""A session's knobs (the engine contract's ``KNOBS``): checked against their ranges where
a request names them, whichever process reads it, and changed live on the session."""

from __future__ import annotations

from collections.abc import Mapping

from inference.engine import KNOB_NAMES, KNOBS, KNOBS_BY_NAME


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
            raise OptionsError(f"unknown option {key!r}; known: {', '.join(KNOB_NAMES)}")
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
