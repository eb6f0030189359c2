"""What a request asks of a new session, read once from its body (or a WHIP URL's query)
into a ``NewSession`` (``server.session_spec``), or 400 naming the problem.

The front door reads it to place the session (its size and kind decide where it fits)
and hands the worker the typed request (``to_dict``), so the worker never reads the
client's body again; a server running alone (``workers.embedded``) reads it the same way.
The offer's SDP is the worker's to check: only the media path understands it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from server.config import Settings
from server.http.errors import fail, shown
from server.session_spec import (
    NewSession,
    OptionsError,
    RoomRequest,
    SessionKind,
    check_knobs,
)

SESSION_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
VIEWER_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,256}")


def _flags_and_options(raw: object, settings: Settings) -> tuple[bool, bool, dict[str, float],
                                                                 Any]:
    """``options``: the flags (motion-only, recorded), the knobs, and the size if given."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        fail(400, "invalid_options", f'"options" must be a JSON object, got {shown(raw)}')
    raw = dict(raw)
    motion_only, record = raw.pop("motion_only", False), raw.pop("record", False)
    for name, flag in (("motion_only", motion_only), ("record", record)):
        if not isinstance(flag, bool):
            fail(400, "invalid_options", f"options.{name}={shown(flag)} must be true or false")
    if record and not settings.session.recording_dir:
        fail(400, "recording_off", "this server records nothing: set session.recording_dir")
    if record and motion_only:
        fail(400, "invalid_options", "a motion-only session has no video to record")
    size = raw.pop("size", None)
    try:
        knobs = check_knobs(raw)
    except OptionsError as exc:
        fail(400, "invalid_options", str(exc))
    return motion_only, record, knobs, size


def parse_new_session(body: Mapping[str, Any], settings: Settings, kind: SessionKind
                      ) -> NewSession:
    """The new session ``body`` asks for (``POST /offer`` or ``POST /sessions``; the avatar,
    ``options`` with ``size`` among them or beside them, and for a session that viewers
    attach to, its ``name`` and ``token``), or 400 naming the problem."""
    motion_only, record, knobs, size = _flags_and_options(body.get("options"), settings)
    avatar = body.get("avatar")
    if avatar is not None and (not isinstance(avatar, str) or not avatar):
        fail(400, "invalid_avatar", f'"avatar" must be an avatar id (a string), got '
             f'{shown(avatar)}')
    if size is None:
        size = body.get("size", settings.video.size)
    if isinstance(size, bool) or size not in settings.video.allowed_sizes:
        fail(400, "invalid_options", f"size={shown(size)} must be one of "
             f"{settings.video.allowed_sizes}")
    name = token = room = None
    if kind in (SessionKind.HOSTED, SessionKind.ROOM):
        name, token = _naming(body)
    if kind is SessionKind.ROOM:
        room = _room_request(body.get("janus"), settings)
    return NewSession(kind, avatar, int(size), knobs, motion_only, record, name, token, room)


def new_session_kind(body: Mapping[str, Any]) -> SessionKind:
    """``POST /sessions`` makes a hosted session, or with ``"janus"`` a room's."""
    return SessionKind.ROOM if body.get("janus") is not None else SessionKind.HOSTED


def parse_whip_query(query: Mapping[str, str], settings: Settings) -> NewSession:
    """The new session a WHIP URL asks for: ``avatar`` and ``size`` and the knobs (each by
    name) as query parameters, since the body is the SDP."""
    options: dict[str, Any] = {}
    for name, value in query.items():
        if name in ("avatar", "size"):
            continue
        if name == "record":
            options[name] = value.lower() in ("1", "true", "yes")
            continue
        try:
            options[name] = float(value)
        except ValueError:
            fail(400, "invalid_options", f"{name}={shown(value)} must be a number")
    body: dict[str, Any] = {"avatar": query.get("avatar"), "options": options}
    if "size" in query:
        try:
            body["size"] = int(query["size"])
        except ValueError:
            fail(400, "invalid_options", f"size={shown(query['size'])} must be a whole number")
    return parse_new_session(body, settings, SessionKind.PUBLISHER)


def _naming(body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """A session's optional ``name`` and the viewer ``token`` its creator chose (both
    stable, so a kiosk's URL outlives the session and the server)."""
    name, token = body.get("name"), body.get("token")
    if name is not None and (not isinstance(name, str) or not SESSION_NAME.fullmatch(name)):
        fail(400, "invalid_name", f"name={shown(name)} must be 1-64 letters, digits, '.', '_' "
             "or '-'")
    if token is not None and (not isinstance(token, str) or
                              not VIEWER_TOKEN.fullmatch(token)):
        fail(400, "invalid_token", "token must be 16-256 URL-safe characters (letters, "
             "digits, '_' and '-'): it is the viewers' credential")
    return name, token


def _room_request(raw: object, settings: Settings) -> RoomRequest:
    if not settings.janus.url:
        fail(400, "janus_off", "this server joins no Janus rooms: set janus.url")
    if not isinstance(raw, dict):
        fail(400, "invalid_janus", '"janus" must be an object: {"room", "listen_to", '
             '"display"?, "pin"?}')
    unknown = set(raw) - {"room", "listen_to", "display", "pin"}
    if unknown:
        fail(400, "invalid_janus", f"unknown janus field(s) {sorted(unknown)}")
    room, listen_to = raw.get("room"), raw.get("listen_to")
    display, pin = raw.get("display", "Avatar"), raw.get("pin")
    if isinstance(room, bool) or not isinstance(room, int | str) or room == "":
        fail(400, "invalid_janus", f"janus.room must be the room's id, got {shown(room)}")
    for field_name, value in (("listen_to", listen_to), ("display", display)):
        if not isinstance(value, str) or not 0 < len(value) <= 256:
            fail(400, "invalid_janus", f"janus.{field_name} must be a participant's display "
                 f"name (1-256 characters), got {shown(value)}")
    if pin is not None and not isinstance(pin, str):
        fail(400, "invalid_janus", "janus.pin must be a string")
    return RoomRequest(room, listen_to, display, pin)
