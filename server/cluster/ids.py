"""Session ids that say where their session lives.

A host's workers begin their ids with ``{node}.{boot}.`` (``boot``: eight hex digits drawn
when the front door starts), then the worker's own ``w{index}-`` and a UUID's hex. Any
host can then tell from the id alone which host holds a session, and whether that host
is the same run of it: a session of a host that died and came back is gone (410), not
someone else's. A single host's ids have no node part."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

SESSION_ID = re.compile(r"(?:(?P<node>[a-z0-9][a-z0-9-]{0,39})\.(?P<boot>[0-9a-f]{8})\.)?"
                        r"(?P<local>w\d+-[0-9a-f]{32})")


@dataclass(frozen=True)
class SessionId:
    node: str | None  # None: a single host's
    boot: str | None
    local: str  # the worker's part: ``w{index}-`` and hex


def parse(value: object) -> SessionId | None:
    """The parts of a session id, or None for anything that is not one (nothing else is
    ever routed anywhere)."""
    if not isinstance(value, str):
        return None
    match = SESSION_ID.fullmatch(value)
    if match is None:
        return None
    return SessionId(match["node"], match["boot"], match["local"])


def new_boot() -> str:
    return secrets.token_hex(4)


def host_prefix(node: str, boot: str) -> str:
    """How every session id of this run of host ``node`` begins."""
    return f"{node}.{boot}."
