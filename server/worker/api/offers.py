"""``POST /offer``: a WebRTC offer that starts a session driven by the offering peer's
microphone, or, with ``session_id`` and ``token``, one more viewer of a session."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from server.http.access import same_secret
from server.http.bodies import json_body
from server.http.errors import fail
from server.http.new_session import parse_new_session
from server.media.peer import OfferError, PeerRole, check_offer
from server.media.session import Session
from server.session_spec import SessionKind
from server.worker.api.context import caller, live_session, state
from server.worker.api.create import connect_peer, make
from server.worker.state import ServerState


async def offer(request: web.Request) -> web.Response:
    s = state(request)
    body = await json_body(request)
    if body.get("session_id") is not None:
        session = live_session(request, body["session_id"])
        answer, _ = await answer_viewer(s, session, body.get("token"), body.get("sdp"),
                                        body.get("type"))
        return web.json_response({"sdp": answer, "type": "answer", "session_id": session.id})
    owner = caller(request)
    return await make(s, parse_new_session(body, s.settings, SessionKind.PEER), owner, body)


async def answer_viewer(s: ServerState, session: Session, token: object, sdp: object,
                        kind: object) -> tuple[str, str]:
    """A viewer's receive-only offer answered, if ``token`` is the session's (a session an
    application drives, or a WHIP publisher's): the answer and the viewer's connection id.
    A viewer leaving ends nothing but its own connection."""
    if session.token is None or not same_secret(token, session.token):
        fail(403, "bad_token", "a viewer needs the token POST /sessions (or POST /whip) gave "
             "for this session")
    try:
        checked = check_offer(sdp, kind, motion_only=session.motion_only, viewer=True)
    except OfferError as exc:
        fail(400, exc.code, str(exc))
    return await connect_peer(s, session, checked, PeerRole.VIEWER)


HANDLERS: dict[str, Any] = {"offer": offer}
