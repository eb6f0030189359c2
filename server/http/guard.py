"""What every request is held to before its handler reads a byte of its body, by its route
in the table (``server.http.api``):

- a route that needs an API key checks it first: a caller without one is refused before
  anything it sends is read;
- a body larger than its route allows (``Content-Length``) is refused with 413 unread, one
  without a length is read only up to that limit, and all the bodies a process reads at
  once share ``http.max_body_memory_mb`` (past it, 503 with ``Retry-After``): no mix of
  large requests, keyed or not, holds more memory than that;
- where requests enter the server (the front door, or a server alone): a request that
  changes something, or opens a WebSocket, from another site's page is refused, and so is
  a form post (multipart, text, url-encoded) that no page of this server sent; a caller
  holds at most ``http.max_streams_per_caller`` long-lived streams and an address at most
  ``http.max_offers_in_flight`` offers being answered (429 with ``Retry-After`` past either).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from server.config import HttpSettings
from server.http.api import ROUTES, Body, Caller, Route
from server.http.app_keys import access_key
from server.http.bodies import BODY_LIMIT
from server.http.errors import ApiError, at_capacity, fail, shown, too_many

ROUTES_BY_KEY = {route.key: route for route in ROUTES}
#: Methods that change something: another site's page must not send them unasked.
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: Bodies a page on any site may post without the browser asking first (no preflight).
FORM_TYPES = frozenset({"multipart/form-data", "text/plain",
                        "application/x-www-form-urlencoded"})


def route_of(request: web.Request) -> Route | None:
    """The table's route ``request`` matched (a HEAD is its GET), or None (a static file,
    an internal route, no route)."""
    resource = request.match_info.route.resource
    if resource is None:
        return None
    method = "GET" if request.method == "HEAD" else request.method
    return ROUTES_BY_KEY.get((method, resource.canonical))


class Holdings:
    """How many of something each holder has at once, each at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = collections.Counter[str]()

    @contextmanager
    def held(self, holder: str, refusal: Callable[[], ApiError]) -> Iterator[None]:
        if self._held[holder] >= self.limit:
            raise refusal()
        self._held[holder] += 1
        try:
            yield
        finally:
            self._held[holder] -= 1
            if not self._held[holder]:
                del self._held[holder]

    def __len__(self) -> int:
        return sum(self._held.values())


class BodyBudget:
    """The bytes of request bodies a process may be reading at once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.reserved = 0

    @contextmanager
    def reserve(self, nbytes: int) -> Iterator[None]:
        if nbytes and self.reserved + nbytes > self.capacity:
            at_capacity(f"the server is reading {self.reserved >> 20} MB of other requests' "
                        f"bodies (http.max_body_memory_mb); try again in a moment",
                        error="busy")
        self.reserved += nbytes
        try:
            yield
        finally:
            self.reserved -= nbytes


def same_origin(origin: str, request: web.Request) -> bool:
    """Whether ``origin`` is this server's own, as the request reached it (its Host)."""
    return urlsplit(origin).netloc.lower() == request.host.lower()


def check_origin(request: web.Request, route: Route | None, allowed: frozenset[str]) -> None:
    """A request that changes something, or opens a WebSocket, is taken from this server's
    own pages, from ``http.cors_origins``, or from a client that is no web page (no
    ``Origin``); a form post is taken only from this server's own pages (or allowed
    origins), since any site's page can send one unasked. (A route whose body no form can
    make, JSON, SDP or audio, refuses a form's body by its type, 415.)"""
    websocket = request.headers.get("Upgrade", "").lower() == "websocket"
    if request.method not in MUTATING and not websocket:
        return
    origin = request.headers.get("Origin")
    if origin is not None and ("*" in allowed or origin in allowed
                               or same_origin(origin, request)):
        return
    if origin is not None:
        fail(403, "cross_origin", f"{request.method} {request.path} from a page of "
             f"{shown(origin)} is not taken: only this server's own pages and "
             "http.cors_origins may send it")
    if request.content_type in FORM_TYPES and (route is None or route.takes in (None, "image")):
        fail(403, "cross_origin", f"{request.method} {request.path} as {request.content_type} "
             "is taken only from this server's own pages (their Origin): send JSON, or a "
             "portrait as the body itself (Content-Type: image/jpeg or image/png)")


def guard(settings: HttpSettings, *, entry: bool) -> Any:
    """The middleware; ``entry``: this process is where clients' requests enter (the front
    door, or a server alone), not a worker behind the front door."""
    allowed = frozenset(settings.cors_origins)
    budget = BodyBudget(settings.max_body_memory_mb << 20)
    streams = Holdings(settings.max_streams_per_caller)
    offers = Holdings(settings.max_offers_in_flight)

    def limit(route: Route | None) -> int | None:
        if route is None or route.body is Body.WHOLE:
            return settings.max_request_bytes
        return settings.max_body_bytes if route.body is Body.UPLOAD else None

    def admitted(request: web.Request, route: Route | None, most: int | None) -> str | None:
        """The caller's owner id where the route needs a key; raises what refuses it."""
        if entry:
            check_origin(request, route, allowed)
        access = request.app[access_key]
        owner = access.caller(request) if route is not None and route.caller is Caller.KEY \
            else None
        length = request.content_length
        if most is not None and length is not None and length > most:
            fail(413, "body_too_large", f"a body of {length} bytes is more than "
                 f"{request.method} {request.path} takes ({most})")
        return owner

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        route = route_of(request)
        most = limit(route)
        try:
            owner = admitted(request, route, most)
        except ApiError as refusal:
            if request.body_exists:  # refused unread: the connection cannot carry another
                refusal.force_close()
            raise
        length = request.content_length
        reading = 0 if most is None or not request.body_exists else \
            most if length is None else length  # what its body may take while it is read
        with budget.reserve(reading):
            address = request.remote or "?"
            if entry and route is not None and route.body.long_lived:
                tenant = owner or address  # a key, or where keys are off an address
                with streams.held(tenant, lambda: too_many("too_many_streams", (
                        f"this caller holds {streams.limit} long-lived streams already "
                        "(http.max_streams_per_caller); close one first"))):
                    return await handler(request)
            if entry and route is not None and route.offer:
                with offers.held(address, lambda: too_many("too_many_offers", (
                        f"{offers.limit} offers from this address are being answered "
                        "(http.max_offers_in_flight); send one when they are"), 1)):
                    return await handler(_limited(request, most))
            return await handler(_limited(request, most))

    return check


def _limited(request: web.Request, most: int | None) -> web.Request:
    """``request``, its body to be read up to ``most`` bytes (``bodies.read_at_most``; 413
    past it), with buffers sized for that, not for the largest body any route takes."""
    if most is None:
        return request
    limited = request.clone(client_max_size=most)
    limited[BODY_LIMIT] = most
    return limited
