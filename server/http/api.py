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
    """How a request's body and answer cross the front door."""

    WHOLE = "whole"  # read whole, then sent on; the answer likewise
    STREAMED = "streamed"  # sent on as it arrives, so backpressure reaches the producer
    EVENTS = "events"  # the answer is a server-sent event stream, relayed as it comes
    WEBSOCKET = "websocket"  # a WebSocket, joined to one with the holder


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    owner: Owner
    name: str  # the handler's name in every process, and the OpenAPI operationId
    summary: str
    body: Body = Body.WHOLE

    @property
    def key(self) -> tuple[str, str]:
        return self.method, self.path


D, P, H, E, A = Owner.DOOR, Owner.PLACE, Owner.HOLDER, Owner.EVERY, Owner.ANY

ROUTES: tuple[Route, ...] = (
    Route("GET", "/", D, "index", "the web page"),
    Route("GET", "/kiosk", D, "kiosk", "the kiosk page: one named session, full screen"),
    Route("GET", "/healthz", D, "healthz",
          "status, model and runtime, measured capacity and load (503 while calibrating)"),
    Route("GET", "/config", D, "config", "the settings in force and the session knobs"),
    Route("GET", "/metrics", D, "metrics", "Prometheus metrics of every process"),
    Route("GET", "/openapi.json", D, "openapi", "this API as an OpenAPI document"),
    Route("POST", "/offer", P, "offer",
          "a WebRTC offer: a new session driven by the peer's audio, or (with session_id "
          "and token) one more viewer of a session"),
    Route("POST", "/sessions", P, "create_session",
          "a session an application drives (pushed speech), or one in a Janus room"),
    Route("GET", "/sessions", E, "list_sessions", "live sessions with their stats"),
    Route("GET", "/sessions/{session_id}", H, "get_session", "one session"),
    Route("PATCH", "/sessions/{session_id}", H, "update_session", "change a session's knobs"),
    Route("DELETE", "/sessions/{session_id}", H, "delete_session", "end a session"),
    Route("POST", "/sessions/{session_id}/speech", H, "push_speech",
          "speech for a session (audio/wav or audio/L16), played as it streams in",
          Body.STREAMED),
    Route("POST", "/sessions/{session_id}/interrupt", H, "interrupt",
          "barge-in: the avatar stops speaking now"),
    Route("GET", "/sessions/{session_id}/ws", H, "session_socket",
          "speech and barge-in over one WebSocket, the session's events back",
          Body.WEBSOCKET),
    Route("GET", "/sessions/{session_id}/events", H, "session_events",
          "the session's events as server-sent events", Body.EVENTS),
    Route("GET", "/names/{name}", E, "find_name",
          "the live session called name, for whoever holds its viewer token"),
    Route("OPTIONS", "/whip", D, "whip_options", "what a WHIP client asks before offering"),
    Route("POST", "/whip", P, "whip_publish",
          "WHIP (RFC 9725): a publisher's SDP offer drives a new session"),
    Route("DELETE", "/whip/{session_id}", H, "whip_end", "the WHIP publisher hangs up"),
    Route("PATCH", "/whip/{session_id}", H, "whip_patch", "405: no trickle ICE"),
    Route("OPTIONS", "/sessions/{session_id}/whep", D, "whep_options",
          "what a WHEP client asks before offering"),
    Route("POST", "/sessions/{session_id}/whep", H, "whep_view",
          "WHEP: a viewer's receive-only SDP offer"),
    Route("DELETE", "/sessions/{session_id}/whep/{viewer_id}", H, "whep_leave",
          "a WHEP viewer leaves"),
    Route("PATCH", "/sessions/{session_id}/whep/{viewer_id}", H, "whep_patch",
          "405: no trickle ICE"),
    Route("GET", "/avatars", A, "list_avatars", "avatars this caller may use"),
    Route("POST", "/avatars", E, "upload_avatar", "upload a JPEG or PNG portrait"),
    Route("GET", "/avatars/{avatar_id}", A, "get_avatar", "one avatar and its face geometry"),
    Route("DELETE", "/avatars/{avatar_id}", E, "delete_avatar", "forget an uploaded portrait"),
    Route("GET", "/avatars/{avatar_id}/image", A, "avatar_image",
          "the cropped portrait, as PNG"),
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
