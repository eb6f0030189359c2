"""The front door's routes, made from the one table of the API (``server.http.api``) by
each route's owner: new sessions placed on a worker, a session's routes sent to the
worker holding it, lists and uploads asked of every worker, what every worker knows
asked of any, and the front door's own answers."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from aiohttp import web

from server.cluster import ids
from server.cluster.host import HOP, RESERVATION
from server.cluster.member import Where
from server.cluster.records import DRAINING
from server.front_door import cluster, health
from server.front_door.door import FrontDoor, front_door_key
from server.front_door.placement import Refused
from server.front_door.relay import (
    Upstream,
    ask_every,
    credentials,
    forward,
    forward_events,
    forward_streamed,
    forward_websocket,
    outgoing,
    relayed,
    unavailable,
    worst,
)
from server.http import common
from server.http.api import ROUTES, Body, Owner, Route
from server.http.app_keys import access_key
from server.http.bodies import body_text, json_body
from server.http.common import SDP
from server.http.errors import ApiError, at_capacity, fail, shown
from server.http.new_session import new_session_kind, parse_new_session, parse_whip_query
from server.session_spec import NewSession, SessionKind
from server.worker.handle import WorkerProcess

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _door(request: web.Request) -> FrontDoor:
    return request.app[front_door_key]


async def _holder(request: web.Request, session_id: object) -> Upstream:
    """The worker holding the session ``session_id`` names, or in a cluster the host that
    does; 410 where that host is gone, else 404."""
    door = _door(request)
    worker = door.holder(session_id)
    if worker is not None:
        return worker
    session = ids.parse(session_id)
    if door.member is not None and session is not None:
        where, host = await door.member.where(session, hop=HOP in request.headers)
        if host is not None:
            return host
        if where is Where.LOST:
            fail(410, "host_lost", f"the host that held session {shown(session_id)} is gone, "
                 "and its sessions with it")
    fail(404, "unknown_session", f"no live session {shown(session_id)}")


def _any_worker(request: web.Request) -> WorkerProcess:
    live = _door(request).processes.live_workers()
    if not live:
        at_capacity("no media worker is running (one is being replaced)")
    return live[0]


# ---- PLACE: a new session, read once and placed by measured load -------------------------
async def place(request: web.Request, spec: NewSession, offer: dict[str, Any] | None
                ) -> web.Response:
    """The session ``spec`` asks for: in a cluster on the host with the most room, else
    (or when this host is the one) here."""
    async def here(reservation: str | None) -> web.Response:
        return await place_here(request, spec, offer, reservation)

    if cluster.clustered(request):
        return await cluster.place(request, spec, here)
    return await here(request.headers.get(RESERVATION))


async def place_here(request: web.Request, spec: NewSession, offer: dict[str, Any] | None,
                     reservation: str | None) -> web.Response:
    """The session made on the worker placement picks; 503 with ``Retry-After`` where no
    worker has room, or while the server calibrates or drains. Where a cluster reserved
    its place (``reservation``), the reservation is dropped once the host counts it."""
    door = _door(request)
    if door.member is not None and door.member.state == DRAINING:
        at_capacity("this host is draining: it takes no new sessions", error="draining")
    calibration_peer = door.calibration.running and door.calibration.is_own_peer(request)
    if door.calibration.running and not calibration_peer:
        at_capacity("the server is measuring what a session costs on this host before it "
                    "takes sessions; retry in a few seconds", error="calibrating")
    try:
        async with door.admission.placed(spec.size, spec.motion_only) as worker:
            try:
                response = relayed(*await worker.request(
                    "POST", "/internal/sessions", json={"session": spec.to_dict(),
                                                        "offer": offer,
                                                        "calibration": calibration_peer},
                    headers=credentials(request)))
            except OSError as exc:
                raise unavailable(worker, exc) from exc
    except Refused as exc:
        door.metrics.admissions.labels(decision="refused").inc()
        at_capacity(str(exc))
    placed = response.status in (200, 201)
    door.metrics.admissions.labels(decision="placed" if placed
                                   else f"worker_{response.status}").inc()
    if placed and reservation and door.member is not None:
        door.member.fulfilled(reservation)
    return response


async def offer(request: web.Request) -> web.StreamResponse:
    """A new session for the offering peer, or (``session_id`` and ``token``) a viewer of
    one, which its holder answers."""
    body = await json_body(request)
    if body.get("session_id") is not None:
        return await forward(await _holder(request, body["session_id"]), request)
    request.app[access_key].caller(request)  # no place is held for a caller without a key
    spec = parse_new_session(body, _door(request).settings, SessionKind.PEER)
    return await place(request, spec, {"sdp": body.get("sdp"), "type": body.get("type")})


async def create_session(request: web.Request) -> web.StreamResponse:
    """A session an application drives, or one in a Janus room; a name must be unique
    among every worker's live sessions."""
    request.app[access_key].caller(request)
    body = await json_body(request)
    door = _door(request)
    spec = parse_new_session(body, door.settings, new_session_kind(body))
    if spec.name is None:
        return await place(request, spec, None)
    answers = await ask_every(door.processes.live_workers(), "GET",
                              f"/names/{quote(spec.name, safe='')}")
    if any(status != 404 for _, status, _, _ in answers):
        fail(409, "name_taken", f"a live session is already called {shown(spec.name)}")
    member = cluster.clustered(request)
    if member is None:
        return await place(request, spec, None)
    token = await cluster.claim_name(door, member, spec.name)  # unique across the cluster
    response = web.Response(status=500)
    try:
        response = await place(request, spec, None)
    except ApiError as exc:
        response = exc.answer()
    finally:
        await cluster.settle_name(member, spec.name, token, response)
    return response


async def whip_publish(request: web.Request) -> web.StreamResponse:
    """A WHIP publisher's offer: its audio drives a new session."""
    media_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if media_type != SDP:
        fail(415, "unsupported_media_type", f"an offer here is {SDP}, not "
             f"{media_type or 'untyped'}")
    request.app[access_key].caller(request)
    spec = parse_whip_query(request.rel_url.query, _door(request).settings)
    text = await body_text(request)
    return await place(request, spec, {"sdp": text, "type": "offer"})


# ---- EVERY: asked of every worker, the answers merged ------------------------------------
async def list_sessions(request: web.Request) -> web.Response:
    request.app[access_key].caller(request)
    sessions = []
    for worker, status, body, _ in await ask_every(
            _door(request).processes.live_workers(), "GET", "/sessions",
            headers=credentials(request)):
        if status == 200:
            sessions += [{**s, "worker": worker.index} for s in json.loads(body)["sessions"]]
    if cluster.clustered(request):
        return await cluster.list_sessions(request, sessions)
    return web.json_response({"sessions": sessions})


async def find_name(request: web.Request) -> web.Response:
    """Whichever worker (in a cluster, host) holds the named session answers; a wrong
    token is 403."""
    if cluster.clustered(request):
        return await cluster.find_name(request, lambda: _find_name_here(request))
    return await _find_name_here(request)


async def _find_name_here(request: web.Request) -> web.Response:
    answers = await ask_every(_door(request).processes.live_workers(), "GET",
                              request.rel_url.raw_path_qs)
    for wanted in (200, 403):
        for _, status, body, headers in answers:
            if status == wanted:
                return relayed(status, body, headers)
    fail(404, "unknown_name", f"no live session is called {shown(request.match_info['name'])}")


async def upload_avatar(request: web.Request) -> web.Response:
    """Every worker prepares the portrait (its sessions need it in the engine); the id is
    the content's hash, so it is the same on each. Kept to teach a replaced worker."""
    door = _door(request)
    if not door.processes.live_workers():
        at_capacity("no media worker is running (one is being replaced)")
    upload = await outgoing(request)
    status, body, headers = worst(await ask_every(door.processes.live_workers(), "POST",
                                                  "/avatars", **upload))
    if status == 201:
        door.uploads.remember(json.loads(body)["avatar_id"], upload)
        if cluster.clustered(request):
            await cluster.to_others(request, "POST", "/avatars", upload)
    return relayed(status, body, headers)


async def delete_avatar(request: web.Request) -> web.Response:
    """Every worker forgets it, and a replaced worker is not taught it again."""
    door = _door(request)
    sent = await outgoing(request)
    status, body, headers = worst(await ask_every(
        door.processes.live_workers(), "DELETE", request.rel_url.raw_path, **sent))
    if status == 204:
        door.uploads.forget(request.match_info["avatar_id"])
        if cluster.clustered(request):
            await cluster.to_others(request, "DELETE", request.rel_url.raw_path, sent)
    return relayed(status, body, headers)


# ---- HOLDER and ANY: sent on as the route's body goes ------------------------------------
_FORWARD = {Body.WHOLE: forward, Body.STREAMED: forward_streamed, Body.EVENTS: forward_events,
            Body.WEBSOCKET: forward_websocket}


def _to_holder(route: Route) -> Handler:
    send = _FORWARD[route.body]

    async def handler(request: web.Request) -> web.StreamResponse:
        response = await send(await _holder(request, request.match_info["session_id"]),
                              request)
        member = _door(request).member
        if member is not None and request.method == "DELETE" and response.status < 300:
            member.changed()  # a session (or a viewer) ended: its room, published soon
        return response

    return handler


async def _to_any(request: web.Request) -> web.StreamResponse:
    return await forward(_any_worker(request), request)


OWN: dict[str, Handler] = {**common.HANDLERS, **health.HANDLERS, **cluster.HANDLERS,
                           "offer": offer,
                           "create_session": create_session, "whip_publish": whip_publish,
                           "list_sessions": list_sessions, "find_name": find_name,
                           "upload_avatar": upload_avatar, "delete_avatar": delete_avatar}


def handler_for(route: Route) -> Handler:
    """How the front door answers ``route``, by its owner."""
    if route.owner is Owner.HOLDER:
        return _to_holder(route)
    if route.owner is Owner.ANY:
        return _to_any
    return OWN[route.name]  # DOOR, PLACE and EVERY: each answered its own way


def add_routes(app: web.Application) -> None:
    for route in ROUTES:
        app.router.add_route(route.method, route.path, handler_for(route))
