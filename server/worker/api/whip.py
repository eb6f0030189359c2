"""WHIP (RFC 9725), an encoder, SFU or meeting bot pushing the speech of a new session,
and WHEP, viewers of a session through the standard exchange: SDP bodies, resources
ended with ``DELETE``, no trickle ICE (``PATCH`` is 405)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from server.http.bodies import body_text
from server.http.common import SDP
from server.http.errors import fail
from server.http.new_session import parse_whip_query
from server.session_spec import SessionKind
from server.worker.api.context import caller, held_session, live_session, state
from server.worker.api.create import make
from server.worker.api.offers import answer_viewer


def _require_sdp(request: web.Request) -> None:
    media_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if media_type != SDP:
        fail(415, "unsupported_media_type", f"an offer here is {SDP}, not "
             f"{media_type or 'untyped'}")


async def whip_publish(request: web.Request) -> web.Response:
    """A publisher's offer (``Content-Type: application/sdp``): its audio drives a new
    session, which viewers watch with the token (``POST /offer`` or the web page). The
    answer's ``Location`` is the session's WHIP resource; ``Link`` headers name the
    session and the viewer page. The publisher leaving, or ``DELETE``, ends it."""
    s = state(request)
    _require_sdp(request)
    owner = caller(request)
    spec = parse_whip_query(request.rel_url.query, s.settings)
    text = await body_text(request)
    return await make(s, spec, owner, {"sdp": text, "type": "offer"})


async def whip_end(request: web.Request) -> web.Response:
    session = held_session(request)
    if session.kind is not SessionKind.PUBLISHER:
        fail(404, "unknown_session", f"{session.id} is not a WHIP session")
    await session.close("publisher hung up")
    return web.Response(status=200)


async def whip_patch(request: web.Request) -> web.Response:
    """No trickle ICE or ICE restart: the offer carries its candidates (RFC 9725 4.3)."""
    held_session(request)
    raise web.HTTPMethodNotAllowed("PATCH", ["DELETE"])


async def whep_view(request: web.Request) -> web.Response:
    """A WHEP viewer: a receive-only SDP offer, the session's viewer token as its bearer
    token (or ``?token=``). 201 with the answer and ``Location``, this viewer's resource:
    ``DELETE`` it to leave."""
    session = live_session(request, request.match_info["session_id"])
    _require_sdp(request)
    scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
    token = bearer.strip() if scheme.lower() == "bearer" else request.rel_url.query.get("token")
    text = await body_text(request)
    answer, peer_id = await answer_viewer(state(request), session, token, text, "offer")
    return web.Response(status=201, text=answer, content_type=SDP,
                        headers={"Location": f"/sessions/{session.id}/whep/{peer_id}"})


async def whep_viewer(request: web.Request) -> web.Response:
    """``DELETE``: this viewer leaves (the session goes on). ``PATCH`` is 405: no trickle
    ICE. Knowing the resource's URL is the viewer's credential, as in WHEP."""
    pc = state(request).sessions.peer(request.match_info["session_id"],
                                      request.match_info["viewer_id"])
    if pc is None:
        fail(404, "unknown_viewer", "no such viewer of a live session")
    if request.method != "DELETE":
        raise web.HTTPMethodNotAllowed(request.method, ["DELETE"])
    await pc.close()
    return web.Response(status=200)


HANDLERS: dict[str, Any] = {"whip_publish": whip_publish, "whip_end": whip_end,
                            "whip_patch": whip_patch, "whep_view": whep_view,
                            "whep_leave": whep_viewer, "whep_patch": whep_viewer}
