"""Making a new session, however it was asked for: ``POST /offer``, ``POST /sessions``
(pushed speech, or a Janus room), ``POST /whip``, each read into a ``NewSession`` by the
front door (``POST /internal/sessions``) or, serving alone, by this worker's own route.

One sequence connects a WebRTC peer to a session, whoever it is (the offering peer, a
WHIP publisher, a viewer): ``connect_peer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiohttp import web
from aiortc import RTCPeerConnection

from server.http.bodies import json_body
from server.http.common import SDP
from server.http.errors import at_capacity, fail, shown, too_many
from server.integrations.janus import JanusError, RoomPresence
from server.media.avatars import UnknownAvatar
from server.media.peer import OfferError, PeerRole, answer_offer, check_offer
from server.media.session import Session
from server.media.sessions import AtCapacity, NameTaken, TooManyViewers
from server.session_spec import NewSession, SessionKind
from server.worker.api.context import caller, state
from server.worker.state import ServerState

log = logging.getLogger(__name__)


def viewer_page(session: Session) -> str:
    """The web page in viewer mode, watching ``session``."""
    return f"/?session={session.id}&token={session.token}"


async def make(s: ServerState, spec: NewSession, owner: str | None,
               offer: dict[str, Any] | None = None, *, calibration: bool = False
               ) -> web.Response:
    """The session ``spec`` asks for, answered as its route answers: the SDP answer for a
    peer or a publisher (whose ``offer`` is checked here first), 201 with its token and
    URLs for a hosted or room session. A ``calibration`` session is one of the front
    door's own, measuring what a session costs at start-up."""
    sdp = None
    if spec.kind in (SessionKind.PEER, SessionKind.PUBLISHER):
        offer = offer or {}
        try:
            sdp = check_offer(offer.get("sdp"), offer.get("type"), motion_only=spec.motion_only,
                              publisher=spec.kind is SessionKind.PUBLISHER)
        except OfferError as exc:
            fail(400, exc.code, str(exc))
    session = await _created(s, spec, owner, calibration)
    if spec.kind is SessionKind.ROOM:
        return await _join_room(s, session, spec)
    path = f"/sessions/{session.id}"
    if spec.kind is SessionKind.HOSTED:
        return web.json_response({"session_id": session.id, "name": session.name,
                                  "token": session.token,
                                  "urls": {"session": path, "speech": f"{path}/speech",
                                           "viewer_offer": "/offer",
                                           "viewer_page": viewer_page(session)}}, status=201)
    assert sdp is not None
    answer, _ = await connect_peer(s, session, sdp, PeerRole.PUBLISHER
                                   if spec.kind is SessionKind.PUBLISHER else PeerRole.PEER)
    if spec.kind is SessionKind.PEER:
        return web.json_response({"sdp": answer, "type": "answer", "session_id": session.id})
    return web.Response(status=201, text=answer, content_type=SDP,
                        headers={"Location": f"/whip/{session.id}",
                                 "Link": f'</sessions/{session.id}>; rel="related", '
                                         f'<{viewer_page(session)}>; rel="alternate"; '
                                         'title="viewer page"',
                                 "X-Session-Id": session.id,
                                 "X-Viewer-Token": session.token or ""})


async def placed(request: web.Request) -> web.Response:
    """A new session the front door placed here, as it read the request:
    ``{"session": NewSession, "offer": {"sdp", "type"} | null, "calibration": bool}``
    (internal)."""
    body = await json_body(request)
    return await make(state(request), NewSession.from_dict(body["session"]), caller(request),
                      body.get("offer"), calibration=body.get("calibration") is True)


async def _created(s: ServerState, spec: NewSession, owner: str | None,
                   calibration: bool) -> Session:
    try:
        return await s.sessions.create(spec, owner, calibration=calibration)
    except UnknownAvatar:
        fail(404, "unknown_avatar", f"no avatar {shown(spec.avatar)}; GET /avatars lists them")
    except AtCapacity as exc:
        at_capacity(str(exc))
    except NameTaken as exc:
        fail(409, "name_taken", str(exc))


async def _join_room(s: ServerState, session: Session, spec: NewSession) -> web.Response:
    """The avatar joins the room as a publisher and listens to ``listen_to``; 201 once it
    publishes, else the session is gone and the answer says why (404 for a room Janus does
    not have, 502 for a Janus that does not answer)."""
    assert spec.room is not None
    presence = RoomPresence(session, spec.room, s.settings.janus, s.settings.ice,
                            s.settings.video.codec)
    try:
        await presence.join()
    except JanusError as exc:
        await session.close(f"room not joined: {exc}")
        status = {"unknown_room": 404, "room_refused": 403}.get(exc.code, 502)
        fail(status, exc.code, str(exc))
    except BaseException:
        await session.close("room not joined")
        raise
    session.room = presence.describe
    path = f"/sessions/{session.id}"
    return web.json_response({"session_id": session.id, "name": session.name,
                              "token": session.token, "room": presence.describe(),
                              "urls": {"session": path, "viewer_offer": "/offer",
                                       "whep": f"{path}/whep",
                                       "viewer_page": viewer_page(session)}}, status=201)


async def connect_peer(s: ServerState, session: Session, sdp: str, role: PeerRole
                       ) -> tuple[str, str]:
    """Answer a WebRTC offer for ``session`` (``server.media.peer.answer_offer``) and keep
    the connection with the session: the answer, and the id the connection is known by.
    A peer that drives the session leaving ends it; a viewer leaving ends only its own
    connection. An offer that cannot be answered is 400, and a session made for a peer
    that drives it is closed."""
    viewer = not role.drives
    pc: RTCPeerConnection | None = None
    peer_id = ""

    def gone(reason: str) -> None:
        if not viewer:
            session.close_soon(reason)
            return
        log.info("viewer of session %s left: %s", session.id, reason)
        s.sessions.drop_peer(session.id, peer_id)
        if pc is not None:
            asyncio.get_running_loop().create_task(pc.close())

    with contextlib.ExitStack() as place:
        if viewer:
            try:
                place.enter_context(s.sessions.viewer_place(session.id, s.settings.viewer_cap))
            except TooManyViewers as exc:
                raise too_many("too_many_viewers", str(exc)) from None
        try:
            pc, answer = await answer_offer(
                session, sdp, ice=s.settings.ice, codec=s.settings.video.codec, on_gone=gone,
                role=role, audio_packet_ms=s.settings.session.audio_packet_ms)
        except Exception as exc:
            if not viewer:
                await session.close("offer rejected")
            log.info("%s offer rejected: %s", role.value, exc)
            fail(400, "bad_offer", f"the offer could not be answered: {exc}")
        peer_id = s.sessions.add_peer(session, pc, viewer=viewer)
    return answer, peer_id


INTERNAL = [("POST", "/internal/sessions", placed)]
