"""What a worker's handlers look up on every request: the server's state, the caller (its
API key as an owner id) and the session a path names, if the caller may drive it."""

from __future__ import annotations

from aiohttp import web

from server.http.app_keys import access_key
from server.http.errors import fail, shown
from server.media.session import Session
from server.media.speech import Utterances
from server.worker.state import ServerState, state_key


def state(request: web.Request) -> ServerState:
    return request.app[state_key]


def caller(request: web.Request) -> str | None:
    """The caller's API key, as an owner id (None with keys off); 401 without one."""
    return request.app[access_key].caller(request)


def held_session(request: web.Request) -> Session:
    """The session the path names, if the caller may drive it; another key's is 404."""
    session_id = request.match_info["session_id"]
    session = state(request).sessions.get(session_id)
    if session is None or not request.app[access_key].sees(session.owner, caller(request)):
        fail(404, "unknown_session", f"no live session {shown(session_id)}")
    return session


def live_session(request: web.Request, session_id: object) -> Session:
    """The live session ``session_id`` names, whoever made it (viewers hold its token,
    not a key), or 404."""
    session = state(request).sessions.get(session_id) if isinstance(session_id, str) \
        else None
    if session is None:
        fail(404, "unknown_session", f"no live session {shown(session_id)}")
    return session


def pushed_speech(session: Session) -> Utterances:
    """The speech queue of a session an application drives; 409 for one whose speech comes
    from a peer (its microphone, a WHIP publisher, a room's participant)."""
    speech = session.pushed
    if speech is None:
        fail(409, "not_hosted", "speech is pushed only into a session made by POST /sessions; "
             "this one speaks with its peer's audio")
    return speech.utterances
