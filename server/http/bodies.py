"""Reading a request's body: JSON objects only where JSON is declared, and never waiting
longer than ``http.body_timeout_s`` for it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web

from server.http.app_keys import settings_key
from server.http.errors import fail

T = TypeVar("T")


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


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body (415, 400 or 408 otherwise)."""
    require_json(request)
    return parse_json_object(await read_body(request, request.read()))
