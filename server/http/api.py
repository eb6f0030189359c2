"""The public HTTP API in one table: every route, what it does, and who answers it.

A media worker (or the embedded server) serves every route here but the front door's own,
each by the handler of the same ``name``; the front door routes each by its ``owner``
(``server.front_door.routes``). So one table says what the API is, in both processes,
and ``GET /openapi.json`` is made from it. ``docs/api.md`` describes each route in full.

Owners, as the front door sees them:

- ``DOOR``: the front door answers itself (the pages, health, configuration, metrics).
- ``PLACE``: a new session; placed on a media worker by measured load, or refused (503).
- ``HOLDER``: the media worker holding the session the path (or a viewer's offer) names;
  a session's id says which (``server.worker.handle.worker_prefix``), so a holder could
  as well be another host.
- ``EVERY``: every media worker; their answers merged (lists; uploads each worker keeps).
- ``ANY``: any one media worker (what every worker knows alike).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any


class Owner(enum.Enum):
    DOOR = "door"
    PLACE = "place"
    HOLDER = "holder"
    EVERY = "every"
    ANY = "any"


class Body(enum.Enum):
    """How a request's body and answer cross the front door, and how large it may be."""

    WHOLE = "whole"  # read whole (http.max_request_bytes), then sent on; the answer too
    UPLOAD = "upload"  # read whole, up to http.max_body_bytes: a portrait
    STREAMED = "streamed"  # sent on as it arrives, so backpressure reaches the producer
    EVENTS = "events"  # the answer is a server-sent event stream, relayed as it comes
    WEBSOCKET = "websocket"  # a WebSocket, joined to one with the holder

    @property
    def long_lived(self) -> bool:
        """It holds its connection for as long as the client likes."""
        return self in (Body.STREAMED, Body.EVENTS, Body.WEBSOCKET)


class Caller(enum.Enum):
    """Who may call a route where ``http.api_keys`` are set."""

    ANYONE = "anyone"  # what is public
    KEY = "key"  # an API key, checked before the body is read
    VIEWER = "viewer"  # a session's viewer token, which its handler checks
    KEY_OR_VIEWER = "key or viewer"  # a key for a new session, a token for a viewer of one


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    owner: Owner
    name: str  # the handler's name in every process, and the OpenAPI operationId
    summary: str
    caller: Caller
    body: Body = Body.WHOLE
    #: A WebRTC offer: answering it binds a port and takes the worker's loop for a moment,
    #: so an address has at most ``http.max_offers_in_flight`` of them at once.
    offer: bool = False
    #: What its body is (none, where it takes none): ``json``, ``sdp``, ``audio`` or
    #: ``image``. A body no web form can make (JSON, SDP, audio) keeps other sites' pages
    #: out by itself; the others are held to the request's origin (``server.http.guard``).
    takes: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.method, self.path


D, P, H, E, A = Owner.DOOR, Owner.PLACE, Owner.HOLDER, Owner.EVERY, Owner.ANY
ANYONE, KEY, VIEWER = Caller.ANYONE, Caller.KEY, Caller.VIEWER

ROUTES: tuple[Route, ...] = (
    Route("GET", "/", D, "index", "the web page", ANYONE),
    Route("GET", "/kiosk", D, "kiosk", "the kiosk page: one named session, full screen",
          ANYONE),
    Route("GET", "/healthz", D, "healthz",
          "status, model and runtime, measured capacity and load (503 while calibrating)",
          ANYONE),
    Route("GET", "/config", D, "config", "the settings in force and the session knobs",
          ANYONE),
    Route("GET", "/metrics", D, "metrics", "Prometheus metrics of every process", KEY),
    Route("GET", "/openapi.json", D, "openapi", "this API as an OpenAPI document", ANYONE),
    Route("GET", "/cluster", D, "cluster",
          "the cluster's live hosts with their load and room, and which one answered", KEY),
    Route("POST", "/cluster/drain", D, "drain",
          "this host takes no new sessions, lets its own end, then leaves the cluster", KEY),
    Route("POST", "/offer", P, "offer",
          "a WebRTC offer: a new session driven by the peer's audio, or (with session_id "
          "and token) one more viewer of a session", Caller.KEY_OR_VIEWER, offer=True,
          takes="json"),
    Route("POST", "/sessions", P, "create_session",
          "a session an application drives (pushed speech), or one in a Janus room", KEY,
          takes="json"),
    Route("GET", "/sessions", E, "list_sessions", "live sessions with their stats", KEY),
    Route("GET", "/sessions/{session_id}", H, "get_session", "one session", KEY),
    Route("PATCH", "/sessions/{session_id}", H, "update_session", "change a session's knobs",
          KEY, takes="json"),
    Route("DELETE", "/sessions/{session_id}", H, "delete_session", "end a session", KEY),
    Route("POST", "/sessions/{session_id}/speech", H, "push_speech",
          "speech for a session (audio/wav or audio/L16), played as it streams in", KEY,
          Body.STREAMED, takes="audio"),
    Route("POST", "/sessions/{session_id}/interrupt", H, "interrupt",
          "barge-in: the avatar stops speaking now", KEY),
    Route("GET", "/sessions/{session_id}/ws", H, "session_socket",
          "speech and barge-in over one WebSocket, the session's events back", KEY,
          Body.WEBSOCKET),
    Route("GET", "/sessions/{session_id}/events", H, "session_events",
          "the session's events as server-sent events", KEY, Body.EVENTS),
    Route("GET", "/names/{name}", E, "find_name",
          "the live session called name, for whoever holds its viewer token", VIEWER),
    Route("OPTIONS", "/whip", D, "whip_options", "what a WHIP client asks before offering",
          ANYONE),
    Route("POST", "/whip", P, "whip_publish",
          "WHIP (RFC 9725): a publisher's SDP offer drives a new session", KEY, offer=True,
          takes="sdp"),
    Route("DELETE", "/whip/{session_id}", H, "whip_end", "the WHIP publisher hangs up", KEY),
    Route("PATCH", "/whip/{session_id}", H, "whip_patch", "405: no trickle ICE", KEY),
    Route("OPTIONS", "/sessions/{session_id}/whep", D, "whep_options",
          "what a WHEP client asks before offering", ANYONE),
    Route("POST", "/sessions/{session_id}/whep", H, "whep_view",
          "WHEP: a viewer's receive-only SDP offer", VIEWER, offer=True, takes="sdp"),
    Route("DELETE", "/sessions/{session_id}/whep/{viewer_id}", H, "whep_leave",
          "a WHEP viewer leaves", VIEWER),
    Route("PATCH", "/sessions/{session_id}/whep/{viewer_id}", H, "whep_patch",
          "405: no trickle ICE", VIEWER),
    Route("GET", "/avatars", A, "list_avatars", "avatars this caller may use", ANYONE),
    Route("POST", "/avatars", E, "upload_avatar", "upload a JPEG or PNG portrait", KEY,
          Body.UPLOAD, takes="image"),
    Route("GET", "/avatars/{avatar_id}", A, "get_avatar", "one avatar and its face geometry",
          ANYONE),
    Route("DELETE", "/avatars/{avatar_id}", E, "delete_avatar", "forget an uploaded portrait",
          KEY),
    Route("GET", "/avatars/{avatar_id}/image", A, "avatar_image",
          "the cropped portrait, as PNG", ANYONE),
)

def openapi(version: str) -> dict[str, Any]:
    """The table as an OpenAPI 3.1 document: each route's path, method, summary and path
    parameters (the bodies and answers are described in ``docs/api.md``)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        parameters = [{"name": name, "in": "path", "required": True,
                       "schema": {"type": "string"}}
                      for name in re.findall(r"{(\w+)}", route.path)]
        operation: dict[str, Any] = {"operationId": route.name, "summary": route.summary,
                                     "responses": {"default": {"description": "JSON, or "
                                                               "as docs/api.md says"}}}
        if parameters:
            operation["parameters"] = parameters
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {"openapi": "3.1.0",
            "info": {"title": "Sonic media server", "version": version,
                     "description": "Speech in, a talking portrait out, over WebRTC. "
                                    "Each route in full: docs/api.md."},
            "paths": paths}
