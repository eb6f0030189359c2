"""HTTP API: signalling, sessions, avatars, health and metrics.

Every error is JSON ``{"error": <code>, "message": <what is wrong>}`` with a 4xx status
(5xx only for the server's own faults), and a failed request leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import re
from collections.abc import Awaitable, Mapping
from typing import Any, NamedTuple, NoReturn, TypeVar

import cv2
from aiohttp import BodyPartReader, WSMsgType, web
from aiortc import RTCPeerConnection

from inference.engine import KNOBS, NO_PICTURE
from inference.images import PortraitError
from inference.runtimes import VERIFIED
from server.config import HttpSettings, Settings
from server.http.errors import ApiError, fail
from server.integrations.janus import JanusError, RoomPresence, RoomRequest
from server.media.avatars import DEFAULT_AVATAR, AvatarInUse, UnknownAvatar
from server.media.events import server_sent
from server.media.peer import OfferError, answer_offer, check_offer
from server.media.session import OptionsError, Session, SessionOptions
from server.media.sessions import AtCapacity, NameTaken
from server.media.speech import SpeechDecoder, SpeechError
from server.metrics import CONTENT_TYPE
from server.worker.state import ServerState, access_key, metrics_key, settings_key, state_key

log = logging.getLogger(__name__)
routes = web.RouteTableDef()
T = TypeVar("T")


#: An event stream with nothing to say sends a comment this often (proxies keep it open).
KEEPALIVE_S = 15.0
#: A session sending fewer fresh frames than this share of video.fps counts as degraded.
DEGRADED_BELOW = 0.96
#: Seconds a client refused for capacity is asked to wait before it tries again.
RETRY_AFTER_S = 5


def at_capacity(message: str, error: str = "at_capacity") -> NoReturn:
    """503 with ``Retry-After``: the server cannot take this now, and may later."""
    raise ApiError(503, error, message, headers={"Retry-After": str(RETRY_AFTER_S)})


LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


def allowed_hosts(settings: HttpSettings) -> frozenset[str] | None:
    """The Host names requests may carry, or None for any. A server on loopback answers
    loopback names only: a web page whose name an attacker re-points at 127.0.0.1 (DNS
    rebinding) would otherwise reach it as its own origin."""
    if settings.allowed_hosts:
        return frozenset(h.lower() for h in settings.allowed_hosts)
    try:
        loopback = ipaddress.ip_address(settings.host).is_loopback
    except ValueError:
        loopback = settings.host == "localhost"
    return LOOPBACK_NAMES if loopback else None


def host_check(allowed: frozenset[str] | None) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        host = (request.url.host or "").lower()
        if allowed is not None and host not in allowed:
            fail(403, "host_not_allowed", f"Host {host!r} is not served here (allowed: "
                 f"{', '.join(sorted(allowed))}; http.allowed_hosts)")
        return await handler(request)

    return check


#: Answer headers a page on another origin may read (WHIP's resource and links).
EXPOSED_HEADERS = "Location, Link, Accept-Post, X-Session-Id, X-Viewer-Token"


def cors(origins: list[str]) -> Any:
    """Pages of ``origins`` may call the API from a browser: preflights are answered and
    answers carry the CORS headers. Others get no CORS headers, so their pages cannot read
    an answer, and cannot send JSON at all."""
    allowed = frozenset(origins)

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if origin is None or not ({origin, "*"} & allowed):
            return await handler(request)
        headers = {"Access-Control-Allow-Origin": "*" if "*" in allowed else origin,
                   "Access-Control-Expose-Headers": EXPOSED_HEADERS, "Vary": "Origin"}
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers={
                **headers, "Access-Control-Allow-Methods": "GET, POST, PATCH, DELETE",
                "Access-Control-Allow-Headers": "Authorization, Content-Type",
                "Access-Control-Expose-Headers": EXPOSED_HEADERS,
                "Access-Control-Max-Age": "600"})
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            exc.headers.update(headers)
            raise
        response.headers.update(headers)
        return response

    return check


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn aiohttp's own errors (404, 405, 413) into the JSON error shape too."""
    metrics = request.app[metrics_key]
    try:
        return await handler(request)
    except ApiError as exc:
        metrics.http_errors.labels(status=str(exc.status_code), code=exc.code).inc()
        raise
    except web.HTTPRequestEntityTooLarge as exc:
        metrics.http_errors.labels(status="413", code="body_too_large").inc()
        raise ApiError(413, "body_too_large", f"request body exceeds the limit of "
                       f"{request.app[settings_key].http.max_body_bytes} bytes") from exc
    except web.HTTPException as exc:
        if exc.status_code < 400:
            raise
        code = exc.reason.lower().replace(" ", "_")
        metrics.http_errors.labels(status=str(exc.status_code), code=code).inc()
        raise ApiError(exc.status_code, code, f"{request.method} {request.path}: "
                       f"{exc.reason}") from exc


def _state(request: web.Request) -> ServerState:
    return request.app[state_key]


def parse_json_object(text: bytes | str) -> dict[str, Any]:
    """A request body as a JSON object, or 400 ``invalid_json`` saying why."""
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        fail(400, "invalid_json", "request body must be a JSON object")
    except RecursionError:
        fail(400, "invalid_json", "request body is nested too deeply")
    if not isinstance(body, dict):
        fail(400, "invalid_json", "request body must be a JSON object")
    return body


def require_json(request: web.Request) -> None:
    """415 unless the body is declared JSON. A web page on another origin can send text or
    form bodies without asking first (no CORS preflight), but not JSON."""
    if request.content_type != "application/json":
        fail(415, "unsupported_media_type", f"{request.method} {request.path} takes "
             f"Content-Type: application/json, not {request.content_type or 'none'}")


async def read_body(request: web.Request, read: Awaitable[T]) -> T:
    """``read`` (of the request's body), or 408 if the body has not arrived within
    ``http.body_timeout_s``: a client trickling its body holds a connection, and a
    handler, for as long as it likes otherwise."""
    timeout = request.app[settings_key].http.body_timeout_s
    try:
        return await asyncio.wait_for(read, timeout)
    except TimeoutError:
        fail(408, "request_timeout", f"the request body did not arrive within {timeout:g} s "
             "(http.body_timeout_s)")


async def _json_body(request: web.Request) -> dict[str, Any]:
    require_json(request)
    return parse_json_object(await read_body(request, request.read()))


@routes.get("/")
async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(_state(request).static_dir / "index.html")


@routes.get("/kiosk")
async def kiosk(request: web.Request) -> web.FileResponse:
    """Full screen, one named session, reconnecting by itself: ``/kiosk?name=N&token=T``."""
    return web.FileResponse(_state(request).static_dir / "kiosk.html")


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    state = _state(request)
    size = state.settings.video.size
    return web.json_response({
        "status": "ok",
        "sessions": len(state.sessions),
        "model": state.manifest.name,
        "runtime": state.runtime,
        # Whether this runtime's frames were ever checked against the reference on real
        # hardware (TensorRT has not been: see inference/runtimes/__init__.py).
        "runtime_verified": state.runtime in VERIFIED,
        "capacity_fps": round(state.inference.capacity_fps(size), 1),
        # Sessions of the default size this engine holds at full frame rate, within the
        # admission limit: what a load balancer needs.
        "session_capacity": int(state.inference.capacity_fps(size)
                                * state.settings.session.max_engine_load
                                // state.settings.video.fps),
        "engine_load": round(state.sessions.engine_load(), 3),
        "frame_size": size,
        # What the front door places sessions by.
        "sessions_by_size": state.sessions.count_by_size(),
        # Of those, sessions whose offer is still being answered: the front door counts
        # them as its own reservations until then.
        "answering_by_size": state.sessions.count_by_size(answering=True),
        "motion_sessions_by_size": state.sessions.count_by_size(motion_only=True),
        "motion_answering_by_size": state.sessions.count_by_size(answering=True,
                                                                 motion_only=True),
        "capacity_fps_by_size": {str(s): round(state.inference.capacity_fps(s), 1)
                                 for s in state.settings.video.allowed_sizes},
        # Frames per second of coefficients alone (motion-only sessions' engine work).
        "motion_capacity_fps": round(state.inference.capacity_fps(NO_PICTURE), 1),
        # Share of each second the event loop's thread is on CPU (server/load.py).
        "loop_load": round(state.loop_load.value, 3),
        # ... the loop cost of the settled sessions it holds, and what the loop's cost model
        # has learnt from the two (server/load.py): idle, and per 256x256 session.
        "loop_load_cost": round(state.sessions.settled_cost(loop=True), 3),
        # The settled sessions' cost in cores, which the front door's host model learns from.
        "settled_cost": round(state.sessions.settled_cost(), 3),
        "loop_idle": round(state.loop_load.model.idle, 4),
        "loop_unit": round(state.loop_load.model.unit, 4),
    })


@routes.get("/config")
async def config(request: web.Request) -> web.Response:
    """The settings in force (secrets withheld) and the session knobs with their ranges:
    what operators check after overriding, and what the page builds its controls from."""
    return web.json_response(config_body(request.app[settings_key]))


def config_body(settings: Settings) -> dict[str, Any]:
    defaults = settings.session.knob_defaults()
    knobs = [{**knob.describe(), "default": defaults[knob.name]} for knob in KNOBS]
    return {"settings": settings.effective(), "knobs": knobs}


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    _caller(request)
    state = _state(request)

    def refresh() -> None:
        state.metrics.engine_load.set(state.sessions.engine_load())
        state.metrics.sessions_degraded.set(
            state.sessions.degraded(DEGRADED_BELOW * state.settings.video.fps))
        for size in state.settings.video.allowed_sizes:
            state.metrics.capacity_fps.labels(size=str(size)).set(
                state.inference.capacity_fps(size))

    body = state.metrics.render(refresh)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


class NewSession(NamedTuple):
    """What a request asks of a new session."""

    avatar: str
    size: int
    options: SessionOptions
    motion_only: bool
    record: bool


def _new_session(state: ServerState, body: dict[str, Any]) -> NewSession:
    """The avatar, frame size, options and flags (motion-only, recorded) a request asks of
    a new session (``options.size``, or ``size`` beside them), or 400 naming the problem."""
    raw_options = body.get("options")
    if raw_options is None:
        raw_options = {}
    if not isinstance(raw_options, dict):
        fail(400, "invalid_options", f'"options" must be a JSON object, got '
             f'{json.dumps(raw_options)}')
    raw_options = dict(raw_options)
    motion_only, record = raw_options.pop("motion_only", False), raw_options.pop("record", False)
    for name, flag in (("motion_only", motion_only), ("record", record)):
        if not isinstance(flag, bool):
            fail(400, "invalid_options", f"options.{name}={flag!r} must be true or false")
    if record and not state.settings.session.recording_dir:
        fail(400, "recording_off", "this server records nothing: set session.recording_dir")
    if record and motion_only:
        fail(400, "invalid_options", "a motion-only session has no video to record")
    avatar_id = body.get("avatar")
    if avatar_id is None:
        avatar_id = DEFAULT_AVATAR
    if not isinstance(avatar_id, str) or not avatar_id:
        fail(400, "invalid_avatar", f'"avatar" must be an avatar id (a string), got '
             f'{json.dumps(avatar_id)}')
    size = raw_options.pop("size", body.get("size", state.settings.video.size))
    if size not in state.settings.video.allowed_sizes:
        fail(400, "invalid_options", f"size={size!r} must be one of "
             f"{state.settings.video.allowed_sizes}")
    options = SessionOptions(state.settings.session.knob_defaults())
    try:
        options.update(raw_options)
    except OptionsError as exc:
        fail(400, "invalid_options", str(exc))
    return NewSession(avatar_id, int(size), options, motion_only, record)


async def _created(state: ServerState, spec: NewSession, owner: str | None, *,
                   hosted: bool = False, published: bool = False,
                   name: str | None = None, token: str | None = None) -> Session:
    try:
        state.avatars.get(spec.avatar, owner)  # another key's private portrait is not there
        return await state.sessions.create(spec.avatar, spec.size, spec.options,
                                           motion_only=spec.motion_only, record=spec.record,
                                           hosted=hosted, published=published, owner=owner,
                                           name=name, token=token)
    except UnknownAvatar:
        fail(404, "unknown_avatar", f"no avatar {spec.avatar!r}; GET /avatars lists them")
    except AtCapacity as exc:
        at_capacity(str(exc))
    except NameTaken as exc:
        fail(409, "name_taken", str(exc))


SESSION_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
VIEWER_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,256}")


def _naming(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """A hosted session's optional ``name`` and the viewer ``token`` its creator chose
    (both stable, so a kiosk's URL outlives the session and the server)."""
    name, token = body.get("name"), body.get("token")
    if name is not None and (not isinstance(name, str) or not SESSION_NAME.fullmatch(name)):
        fail(400, "invalid_name", f"name={name!r} must be 1-64 letters, digits, '.', '_' "
             "or '-'")
    if token is not None and (not isinstance(token, str) or
                              not VIEWER_TOKEN.fullmatch(token)):
        fail(400, "invalid_token", "token must be 16-256 URL-safe characters (letters, "
             "digits, '_' and '-'): it is the viewers' credential")
    return name, token


@routes.post("/sessions")
async def create_session(request: web.Request) -> web.Response:
    """A session with no peer: an application pushes its speech, viewers attach. With
    ``"janus"``, the avatar joins a Janus VideoRoom instead and listens to a participant."""
    state = _state(request)
    owner = _caller(request)
    body = await _json_body(request)
    name, token = _naming(body)
    if body.get("janus") is not None:
        return await _join_janus_room(state, body, owner, name, token)
    session = await _created(state, _new_session(state, body), owner, hosted=True,
                             name=name, token=token)
    path = f"/sessions/{session.id}"
    return web.json_response({"session_id": session.id, "name": session.name,
                              "token": session.token,
                              "urls": {"session": path, "speech": f"{path}/speech",
                                       "viewer_offer": "/offer"}}, status=201)


@routes.get("/names/{name}")
async def find_name(request: web.Request) -> web.Response:
    """The live session called ``name``, for whoever holds its viewer token (``?token=``):
    how a kiosk finds its session again after it was made anew."""
    session = _state(request).sessions.named(request.match_info["name"])
    if session is None or session.token is None:
        fail(404, "unknown_name", f"no live session is called {request.match_info['name']!r}")
    if not hmac.compare_digest(request.rel_url.query.get("token", ""), session.token):
        fail(403, "bad_token", "the session's viewer token is needed (?token=)")
    return web.json_response({"session_id": session.id, "name": session.name})


def _room_request(state: ServerState, raw: object) -> RoomRequest:
    if not state.settings.janus.url:
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
        fail(400, "invalid_janus", f"janus.room must be the room's id, got {room!r}")
    for name, value in (("listen_to", listen_to), ("display", display)):
        if not isinstance(value, str) or not 0 < len(value) <= 256:
            fail(400, "invalid_janus", f"janus.{name} must be a participant's display "
                 f"name (1-256 characters), got {value!r}")
    if pin is not None and not isinstance(pin, str):
        fail(400, "invalid_janus", "janus.pin must be a string")
    return RoomRequest(room, listen_to, display, pin)


async def _join_janus_room(state: ServerState, body: dict[str, Any], owner: str | None,
                           name: str | None, token: str | None) -> web.Response:
    """The avatar joins the room as a publisher and listens to ``listen_to``; 201 once it
    publishes, else the session is gone and the answer says why (404 for a room Janus does
    not have, 502 for a Janus that does not answer)."""
    room = _room_request(state, body["janus"])
    session = await _created(state, _new_session(state, body), owner, published=True,
                             name=name, token=token)
    presence = RoomPresence(session, room, state.settings.janus, state.settings.ice,
                            state.settings.video.codec)
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
                                       "whep": f"{path}/whep"}}, status=201)


@routes.post("/offer")
async def offer(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _json_body(request)
    if body.get("session_id") is not None:
        return await _attach_viewer(state, body)
    owner = _caller(request)
    spec = _new_session(state, body)
    try:
        sdp = check_offer(body.get("sdp"), body.get("type"), motion_only=spec.motion_only)
    except OfferError as exc:
        fail(400, exc.code, str(exc))
    session = await _created(state, spec, owner)
    try:
        pc, answer = await answer_offer(
            session, sdp, ice=state.settings.ice, codec=state.settings.video.codec,
            on_gone=session.close_soon, audio_packet_ms=state.settings.session.audio_packet_ms)
    except Exception as exc:
        await session.close("offer rejected")
        log.info("offer rejected: %s", exc)
        fail(400, "bad_offer", f"the offer could not be answered: {exc}")
    state.sessions.add_peer(session, pc)
    return web.json_response({"sdp": answer, "type": "answer", "session_id": session.id})


async def _attach_viewer(state: ServerState, body: dict[str, Any]) -> web.Response:
    """A receive-only offer with ``session_id`` and ``token``: one more viewer of a session
    made by ``POST /sessions`` or ``POST /whip``. A viewer leaving ends nothing but its own
    connection."""
    session_id = body.get("session_id")
    session = state.sessions.get(session_id) if isinstance(session_id, str) else None
    if session is None:
        fail(404, "unknown_session", f"no live session {session_id!r}")
    answer, _ = await _viewer(state, session, body.get("token"), body.get("sdp"),
                              body.get("type"))
    return web.json_response({"sdp": answer, "type": "answer", "session_id": session.id})


async def _viewer(state: ServerState, session: Session, token: object, sdp: object,
                  kind: object) -> tuple[str, str]:
    """Answer a viewer's offer, if ``token`` is the session's: the answer and the
    connection's id."""
    if not isinstance(token, str) or session.token is None or \
            not hmac.compare_digest(token, session.token):
        fail(403, "bad_token", "a viewer needs the token POST /sessions (or POST /whip) gave "
             "for this session")
    try:
        offer = check_offer(sdp, kind, motion_only=session.motion_only, viewer=True)
    except OfferError as exc:
        fail(400, exc.code, str(exc))
    pc: RTCPeerConnection | None = None
    peer_id = ""

    def gone(reason: str) -> None:
        log.info("viewer of session %s left: %s", session.id, reason)
        state.sessions.drop_peer(session.id, peer_id)
        if pc is not None:
            asyncio.get_running_loop().create_task(pc.close())

    try:
        pc, answer = await answer_offer(
            session, offer, ice=state.settings.ice, codec=state.settings.video.codec,
            on_gone=gone, audio_packet_ms=state.settings.session.audio_packet_ms)
    except Exception as exc:
        log.info("viewer offer rejected: %s", exc)
        fail(400, "bad_offer", f"the offer could not be answered: {exc}")
    peer_id = state.sessions.add_peer(session, pc)
    return answer, peer_id


# ---- WHIP (RFC 9725): an encoder or SFU pushes the speech, viewers attach ---------------

WHIP_SDP = "application/sdp"


def _require_sdp(request: web.Request) -> None:
    media_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if media_type != WHIP_SDP:
        fail(415, "unsupported_media_type", f"an offer here is {WHIP_SDP}, not "
             f"{media_type or 'untyped'}")


def _whip_spec(state: ServerState, query: Mapping[str, str]) -> NewSession:
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
            fail(400, "invalid_options", f"{name}={value!r} must be a number")
    body: dict[str, Any] = {"avatar": query.get("avatar"), "options": options}
    if "size" in query:
        try:
            body["size"] = int(query["size"])
        except ValueError:
            fail(400, "invalid_options", f"size={query['size']!r} must be a whole number")
    return _new_session(state, body)


@routes.options("/whip")
@routes.options("/sessions/{session_id}/whep")
async def sdp_endpoint_options(request: web.Request) -> web.Response:
    """What WHIP and WHEP clients ask before offering."""
    return web.Response(status=204, headers={"Accept-Post": WHIP_SDP,
                                             "Allow": "OPTIONS, POST"})


@routes.post("/whip")
async def whip_publish(request: web.Request) -> web.Response:
    """A publisher's offer (``Content-Type: application/sdp``): its audio drives a new
    session, which viewers watch with the token (``POST /offer`` or the web page). The
    answer's ``Location`` is the session's WHIP resource; ``Link`` headers name the
    session and the viewer page. The publisher leaving, or ``DELETE``, ends it."""
    state = _state(request)
    _require_sdp(request)
    owner = _caller(request)
    spec = _whip_spec(state, request.rel_url.query)
    text = await read_body(request, request.text())
    try:
        sdp = check_offer(text, "offer", publisher=True)
    except OfferError as exc:
        fail(400, exc.code, str(exc))
    session = await _created(state, spec, owner, published=True)
    try:
        pc, answer = await answer_offer(
            session, sdp, ice=state.settings.ice, codec=state.settings.video.codec,
            on_gone=session.close_soon, publisher=True,
            audio_packet_ms=state.settings.session.audio_packet_ms)
    except Exception as exc:
        await session.close("offer rejected")
        log.info("WHIP offer rejected: %s", exc)
        fail(400, "bad_offer", f"the offer could not be answered: {exc}")
    state.sessions.add_peer(session, pc)
    viewer = f"/?session={session.id}&token={session.token}"
    return web.Response(status=201, text=answer, content_type=WHIP_SDP,
                        headers={"Location": f"/whip/{session.id}",
                                 "Link": f'</sessions/{session.id}>; rel="related", '
                                         f'<{viewer}>; rel="alternate"; title="viewer page"',
                                 "X-Session-Id": session.id,
                                 "X-Viewer-Token": session.token or ""})


@routes.delete("/whip/{session_id}")
async def whip_end(request: web.Request) -> web.Response:
    session = _session(request)
    if not session.published:
        fail(404, "unknown_session", f"{session.id} is not a WHIP session")
    await session.close("publisher hung up")
    return web.Response(status=200)


@routes.route("PATCH", "/whip/{session_id}")
async def whip_patch(request: web.Request) -> web.Response:
    """No trickle ICE or ICE restart: the offer carries its candidates (RFC 9725 4.3)."""
    _session(request)
    raise web.HTTPMethodNotAllowed("PATCH", ["DELETE"])


# ---- WHEP: viewers of a session through the standard exchange ---------------------------

@routes.post("/sessions/{session_id}/whep")
async def whep_view(request: web.Request) -> web.Response:
    """A WHEP viewer: a receive-only SDP offer, the session's viewer token as its bearer
    token (or ``?token=``). 201 with the answer and ``Location``, this viewer's resource:
    ``DELETE`` it to leave."""
    state = _state(request)
    session_id = request.match_info["session_id"]
    session = state.sessions.get(session_id)
    if session is None:
        fail(404, "unknown_session", f"no live session {session_id!r}")
    _require_sdp(request)
    scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
    token = bearer.strip() if scheme.lower() == "bearer" else request.rel_url.query.get("token")
    text = await read_body(request, request.text())
    answer, peer_id = await _viewer(state, session, token, text, "offer")
    return web.Response(status=201, text=answer, content_type=WHIP_SDP,
                        headers={"Location": f"/sessions/{session.id}/whep/{peer_id}"})


@routes.route("*", "/sessions/{session_id}/whep/{viewer_id}")
async def whep_viewer(request: web.Request) -> web.Response:
    """``DELETE``: this viewer leaves (the session goes on). ``PATCH`` is 405: no trickle
    ICE. Knowing the resource's URL is the viewer's credential, as in WHEP."""
    state = _state(request)
    pc = state.sessions.peer(request.match_info["session_id"], request.match_info["viewer_id"])
    if pc is None:
        fail(404, "unknown_viewer", "no such viewer of a live session")
    if request.method != "DELETE":
        raise web.HTTPMethodNotAllowed(request.method, ["DELETE"])
    await pc.close()
    return web.Response(status=200)


@routes.post("/sessions/{session_id}/speech")
async def push_speech(request: web.Request) -> web.Response:
    """Speech for a hosted session, streamed as it is made: played in order at real time;
    a producer running more than ``session.speech_buffer_s`` ahead is read no faster."""
    state = _state(request)
    session = _session(request)
    if not session.hosted:
        fail(409, "not_hosted", "speech is pushed only into a session made by POST "
             "/sessions; this one speaks with its peer's microphone")
    try:
        decoder = SpeechDecoder(request.headers.get("Content-Type", ""))
    except SpeechError as exc:
        fail(exc.status, exc.code, str(exc))
    limit, received, queued = state.settings.http.max_body_bytes, 0, 0
    utterance, generation = session.speech.next_id(), session.speech.queue.generation
    try:
        while True:
            data = await asyncio.wait_for(request.content.readany(),
                                          state.settings.http.body_timeout_s)
            if not data:
                break
            received += len(data)
            if received > limit:
                fail(413, "body_too_large", f"speech over http.max_body_bytes={limit} bytes; "
                     "send a long text as several utterances")
            samples = decoder.feed(data)
            queued += samples.size
            if not await session.speech.queue.put(samples, utterance, generation):
                if session.is_closed:
                    fail(410, "session_ended", f"session {session.id} ended while its "
                         "speech was arriving")
                return web.json_response({"utterance_id": utterance, "session_id": session.id,
                                          "interrupted": True})
        decoder.finish()
        session.speech.complete(utterance, queued)
    except SpeechError as exc:
        fail(exc.status, exc.code, str(exc))
    except TimeoutError:
        fail(408, "request_timeout", f"no speech arrived for "
             f"{state.settings.http.body_timeout_s} s")
    return web.json_response({"utterance_id": utterance, "session_id": session.id,
                              "interrupted": False,
                              "samples": decoder.samples_in, "rate": decoder.rate,
                              "duration_s": round(decoder.samples_in / decoder.rate, 3)
                              if decoder.rate else 0.0})


@routes.post("/sessions/{session_id}/interrupt")
async def interrupt(request: web.Request) -> web.Response:
    """Barge-in: the avatar stops speaking now (``Session.interrupt``)."""
    session = _session(request)
    if not session.hosted:
        fail(409, "not_hosted", "only a session made by POST /sessions speaks pushed speech")
    return web.json_response(session.interrupt())


@routes.get("/sessions/{session_id}/ws")
async def session_socket(request: web.Request) -> web.WebSocketResponse:
    """Speech and barge-in over one connection, events back (``SpeechSocket``)."""
    session = _session(request)
    if not session.hosted:
        fail(409, "not_hosted", "speech is pushed only into a session made by POST /sessions")
    ws = web.WebSocketResponse(heartbeat=KEEPALIVE_S, max_msg_size=1 << 20)
    await ws.prepare(request)
    await SpeechSocket(session, ws, _state(request).settings.http.max_body_bytes).serve()
    return ws


class SpeechSocket:
    """One application's WebSocket to a hosted session. Text messages are JSON commands:
    ``{"type": "speech", "content_type": ...}`` opens an utterance, whose audio follows
    as binary messages, ``{"type": "end"}`` closes it, ``{"type": "interrupt"}`` barges
    in. The session's events come back as JSON text, with ``utterance_opened``,
    ``utterance_queued`` and ``error`` answers. Audio is read no faster than the speech
    queue takes it, so a producer far ahead is held back by TCP."""

    def __init__(self, session: Session, ws: web.WebSocketResponse, limit: int) -> None:
        self.session, self.ws, self.limit = session, ws, limit
        self.decoder: SpeechDecoder | None = None
        self.utterance, self.generation, self.queued, self.received = "", 0, 0, 0
        self.cut = False  # the open utterance was interrupted: its audio is let go

    async def serve(self) -> None:
        events = self.session.events.subscribe()
        forward = asyncio.get_running_loop().create_task(self._forward(events))
        try:
            async for message in self.ws:
                if message.type == WSMsgType.BINARY:
                    await self._audio(message.data)
                elif message.type == WSMsgType.TEXT:
                    await self._command(message.data)
        finally:
            if self.decoder is not None and not self.cut:  # gone mid-utterance: what
                self.session.speech.complete(self.utterance, self.queued)  # came plays
            forward.cancel()
            self.session.events.unsubscribe(events)

    async def _forward(self, events: asyncio.Queue[dict[str, Any] | None]) -> None:
        while (event := await events.get()) is not None:
            await self.ws.send_json(event)
        await self.ws.close()  # the session ended

    async def _error(self, code: str, message: str) -> None:
        await self.ws.send_json({"type": "error", "error": code, "message": message})

    async def _command(self, text: str) -> None:
        try:
            command = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            command = None
        kind = command.get("type") if isinstance(command, dict) else None
        if kind == "speech":
            if self.decoder is not None:
                return await self._error("utterance_open", 'send {"type": "end"} first')
            try:
                self.decoder = SpeechDecoder(str(command.get("content_type", "")))
            except SpeechError as exc:
                return await self._error(exc.code, str(exc))
            self.utterance = self.session.speech.next_id()
            self.generation, self.queued, self.received = self.session.speech.queue.generation, 0, 0
            self.cut = False
            await self.ws.send_json({"type": "utterance_opened",
                                     "utterance_id": self.utterance})
        elif kind == "end":
            if self.decoder is None:
                return await self._error("no_utterance", "no utterance is open")
            decoder, self.decoder = self.decoder, None
            if not self.cut:
                try:
                    decoder.finish()
                except SpeechError as exc:
                    await self._error(exc.code, str(exc))
                self.session.speech.complete(self.utterance, self.queued)
            await self.ws.send_json({"type": "utterance_queued", "utterance_id": self.utterance,
                                     "interrupted": self.cut,
                                     "samples": decoder.samples_in,
                                     "duration_s": round(decoder.samples_in / decoder.rate, 3)
                                     if decoder.rate else 0.0})
        elif kind == "interrupt":
            self.session.interrupt()  # its event reaches this socket with everyone else
        else:
            await self._error("bad_message", 'text messages are JSON objects with "type": '
                              '"speech", "end" or "interrupt"')

    async def _audio(self, data: bytes) -> None:
        if self.decoder is None:
            return await self._error("no_utterance", 'audio before {"type": "speech", ...}')
        if self.cut:
            return
        self.received += len(data)
        if self.received > self.limit:
            self.decoder = None
            return await self._error("body_too_large", f"an utterance over "
                                     f"http.max_body_bytes={self.limit} bytes; split it")
        try:
            samples = self.decoder.feed(data)
        except SpeechError as exc:
            self.decoder = None
            return await self._error(exc.code, str(exc))
        self.queued += samples.size
        if not await self.session.speech.queue.put(samples, self.utterance, self.generation):
            self.cut = True  # interrupted: the rest of this utterance is not played


@routes.get("/sessions/{session_id}/events")
async def session_events(request: web.Request) -> web.StreamResponse:
    """The session's events as server-sent events, until it ends (``server.media.events``)."""
    session = _session(request)
    queue = session.events.subscribe()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
        await response.write(b": following session events\n\n")
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except TimeoutError:
                await response.write(b": keep-alive\n\n")
                continue
            if event is None:
                break
            await response.write(server_sent(event))
    except ConnectionResetError:
        pass
    finally:
        session.events.unsubscribe(queue)
    return response


@routes.get("/sessions")
async def list_sessions(request: web.Request) -> web.Response:
    caller, access = _caller(request), request.app[access_key]
    return web.json_response({"sessions": _state(request).sessions.list(
        lambda session: access.sees(session.owner, caller))})


def _caller(request: web.Request) -> str | None:
    """The caller's API key, as an owner id (None with keys off); 401 without one."""
    return request.app[access_key].caller(request)


def _session(request: web.Request) -> Session:
    """The session the path names, if the caller may drive it; another key's is 404."""
    session_id = request.match_info["session_id"]
    session = _state(request).sessions.get(session_id)
    if session is None or not request.app[access_key].sees(session.owner, _caller(request)):
        fail(404, "unknown_session", f"no live session {session_id!r}")
    return session


@routes.get("/sessions/{session_id}")
async def get_session(request: web.Request) -> web.Response:
    return web.json_response(_session(request).describe())


@routes.patch("/sessions/{session_id}")
async def update_session(request: web.Request) -> web.Response:
    session = _session(request)
    body = await _json_body(request)
    try:
        session.options.update(body.get("options", body))
    except OptionsError as exc:
        fail(400, "invalid_options", str(exc))
    return web.json_response(session.describe())


@routes.delete("/sessions/{session_id}")
async def delete_session(request: web.Request) -> web.Response:
    await _session(request).close("hung up")
    return web.Response(status=204)


@routes.get("/avatars")
async def list_avatars(request: web.Request) -> web.Response:
    return web.json_response({"avatars": _state(request).avatars.list(
        request.app[access_key].viewer(request)), "default": DEFAULT_AVATAR})


async def _read_part(part: BodyPartReader, limit: int) -> bytes:
    """A multipart part, refused past ``limit`` bytes (aiohttp's body limit does not apply
    to streamed multipart reads)."""
    data = bytearray()
    while chunk := await part.read_chunk(64 * 1024):
        data += chunk
        if len(data) > limit:
            fail(413, "body_too_large", f"request body exceeds the limit of {limit} bytes")
    return bytes(data)


async def _upload_bytes(request: web.Request) -> tuple[bytes, str | None]:
    limit = _state(request).settings.http.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        fail(413, "body_too_large", f"request body exceeds the limit of {limit} bytes")
    if request.content_type.startswith("multipart/"):
        reader = await request.multipart()
        async for part in reader:
            if isinstance(part, BodyPartReader) and (
                    part.filename or part.name in ("image", "file", "portrait")):
                return await _read_part(part, limit), part.filename
        fail(400, "missing_image", 'multipart upload needs a file part named "image"')
    data = await request.read()
    if not data:
        fail(400, "missing_image", "request body is empty: send a JPEG or PNG")
    return data, request.query.get("name")


@routes.post("/avatars")
async def upload_avatar(request: web.Request) -> web.Response:
    """With API keys on, the portrait is the uploading key's alone unless ``?public=true``."""
    owner = _caller(request)
    data, name = await read_body(request, _upload_bytes(request))
    public = request.query.get("public", "").lower() in ("1", "true", "yes")
    try:
        avatar = await _state(request).avatars.add_upload(data, name, owner=owner,
                                                          public=public)
    except PortraitError as exc:
        status = {"image_too_large": 413, "no_face": 422}.get(exc.code, 400)
        fail(status, exc.code, str(exc))
    return web.json_response(avatar.describe(), status=201)


@routes.get("/avatars/{avatar_id}")
async def get_avatar(request: web.Request) -> web.Response:
    try:
        return web.json_response(_state(request).avatars.get(
            request.match_info["avatar_id"], request.app[access_key].viewer(request)
        ).describe())
    except UnknownAvatar:
        fail(404, "unknown_avatar", f"no avatar {request.match_info['avatar_id']!r}")


@routes.delete("/avatars/{avatar_id}")
async def delete_avatar(request: web.Request) -> web.Response:
    """An uploaded portrait forgotten (with API keys on, by a key that uploaded it)."""
    avatar_id = request.match_info["avatar_id"]
    try:
        _state(request).avatars.remove(avatar_id, _caller(request))
    except UnknownAvatar:
        fail(404, "unknown_avatar", f"no avatar {avatar_id!r}")
    except PermissionError:
        fail(403, "shipped_avatar", f"{avatar_id} ships with the server and stays")
    except AvatarInUse:
        fail(409, "avatar_in_use", f"{avatar_id} is in use by a live session; end it first")
    return web.Response(status=204)


@routes.get("/avatars/{avatar_id}/image")
async def avatar_image(request: web.Request) -> web.Response:
    """The portrait as the engine sees it (cropped around the face), as PNG."""
    state = _state(request)
    try:
        avatar = state.avatars.get(request.match_info["avatar_id"],
                                   request.app[access_key].viewer(request))
    except UnknownAvatar:
        fail(404, "unknown_avatar", f"no avatar {request.match_info['avatar_id']!r}")
    portrait = next(iter(avatar.prepared.values()))
    ok, png = cv2.imencode(".png", cv2.cvtColor(portrait.image, cv2.COLOR_RGB2BGR))
    return web.Response(body=png.tobytes(), content_type="image/png")
