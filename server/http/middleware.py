"""What every request passes through, at the front door and in a media worker alike: the
Host check (against DNS rebinding), CORS for the configured origins, and errors in the
API's JSON shape, aiohttp's own (404, 405, 413) included."""

from __future__ import annotations

import ipaddress
from typing import Any

from aiohttp import web

from server.config import HttpSettings
from server.http.app_keys import metrics_key, settings_key
from server.http.errors import ApiError, fail, shown
from server.http.guard import guard

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
#: Answer headers a page on another origin may read (WHIP's resource and links).
EXPOSED_HEADERS = "Location, Link, Accept-Post, X-Session-Id, X-Viewer-Token"


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
            fail(403, "host_not_allowed", f"Host {shown(host)} is not served here (allowed: "
                 f"{', '.join(sorted(allowed))}; http.allowed_hosts)")
        return await handler(request)

    return check


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
    """Every error answered in the JSON shape, aiohttp's own (404, 405, 413) too, as a plain
    response: the exception, its traceback, and the request and buffers its frames hold go
    as soon as it is answered (a raised one lived on in a reference cycle until the
    collector came, holding each refused body's buffers)."""
    metrics = request.app[metrics_key]
    try:
        return await handler(request)
    except ApiError as exc:
        error = exc
    except web.HTTPRequestEntityTooLarge:
        error = ApiError(413, "body_too_large", f"request body exceeds the limit of "
                         f"{request.app[settings_key].http.max_body_bytes} bytes")
    except web.HTTPException as exc:
        if exc.status_code < 400:
            raise
        error = ApiError(exc.status_code, exc.reason.lower().replace(" ", "_"),
                         f"{request.method} {request.path}: {exc.reason}")
        error.headers.update({k: v for k, v in exc.headers.items() if k == "Allow"})
    metrics.http_errors.labels(status=str(error.status_code), code=error.code).inc()
    return error.answer()


def middlewares(settings: HttpSettings, *, entry: bool = True) -> list[Any]:
    """Every application's, in order: CORS outermost (so its headers reach errors too),
    then errors in JSON, the Host check, and what a request is held to before its body is
    read (``server.http.guard``; ``entry``: where clients' requests enter the server)."""
    return [cors(settings.cors_origins), json_errors, host_check(allowed_hosts(settings)),
            guard(settings, entry=entry)]
