"""Sessions as resources: made by an application (``POST /sessions``: pushed speech, or a
Janus room), listed, looked at, changed live, ended; and found by name (kiosks)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from server.http.access import same_secret
from server.http.app_keys import access_key
from server.http.bodies import json_body
from server.http.errors import fail, shown
from server.http.new_session import new_session_kind, parse_new_session
from server.session_spec import OptionsError
from server.worker.api.context import caller, held_session, state
from server.worker.api.create import make


async def create_session(request: web.Request) -> web.Response:
    """A session with no peer: an application pushes its speech, viewers attach. With
    ``"janus"``, the avatar joins a Janus VideoRoom instead and listens to a participant."""
    s = state(request)
    owner = caller(request)
    body = await json_body(request)
    return await make(s, parse_new_session(body, s.settings, new_session_kind(body)), owner)


async def list_sessions(request: web.Request) -> web.Response:
    who, access = caller(request), request.app[access_key]
    return web.json_response({"sessions": state(request).sessions.list(
        lambda session: access.sees(session.owner, who))})


async def get_session(request: web.Request) -> web.Response:
    return web.json_response(held_session(request).describe())


async def update_session(request: web.Request) -> web.Response:
    session = held_session(request)
    body = await json_body(request)
    try:
        session.options.update(body.get("options", body))
    except OptionsError as exc:
        fail(400, "invalid_options", str(exc))
    return web.json_response(session.describe())


async def delete_session(request: web.Request) -> web.Response:
    await held_session(request).close("hung up")
    return web.Response(status=204)


async def find_name(request: web.Request) -> web.Response:
    """The live session called ``name``, for whoever holds its viewer token (``?token=``):
    how a kiosk finds its session again after it was made anew."""
    session = state(request).sessions.named(request.match_info["name"])
    if session is None or session.token is None:
        fail(404, "unknown_name", f"no live session is called {shown(request.match_info['name'])}")
    if not same_secret(request.rel_url.query.get("token", ""), session.token):
        fail(403, "bad_token", "the session's viewer token is needed (?token=)")
    return web.json_response({"session_id": session.id, "name": session.name})


HANDLERS: dict[str, Any] = {"create_session": create_session, "list_sessions": list_sessions,
                            "get_session": get_session, "update_session": update_session,
                            "delete_session": delete_session, "find_name": find_name}
