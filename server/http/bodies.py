"""Reading a request's body: JSON objects only where JSON is declared, and never waiting
longer than ``http.body_timeout_s`` for it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web

from server.http.app_keys import settings_key
from server.http.errors import ApiError, fail

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


#: Where the guard leaves the most bytes a request's route takes (``server.http.guard``),
#: and where the body is kept once read (its handler and a relay may both need it).
BODY_LIMIT = "sonic.body_limit"
BODY = "sonic.body"


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


def too_large(request: web.Request, limit: int) -> ApiError:
    """413 for a body past ``limit``: the connection is closed after it, so the rest of the
    body is never read."""
    error = ApiError(413, "body_too_large", f"{request.method} {request.path} takes a body of "
                     f"at most {limit} bytes")
    error.force_close()
    return error


async def read_at_most(request: web.Request, limit: int | None = None) -> bytes:
    """The request's whole body, up to ``limit`` bytes (the route's, as the guard set it,
    by default), else 413: read a chunk at a time, the chunks let go before refusing."""
    if (body := request.get(BODY)) is not None:
        return body  # read before: a stream is read once
    if limit is None:
        limit = request.get(BODY_LIMIT, request.app[settings_key].http.max_request_bytes)
    if request.content_length is not None and request.content_length > limit:
        raise too_large(request, limit)
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            chunks.clear()
            raise too_large(request, limit)
        chunks.append(chunk)
    request[BODY] = body = b"".join(chunks)
    return body


async def body_bytes(request: web.Request) -> bytes:
    """The request's body (``read_at_most``) within ``http.body_timeout_s``."""
    return await read_body(request, read_at_most(request))


async def body_text(request: web.Request) -> str:
    """The request's body as text (UTF-8; what is not UTF-8 cannot be SDP either)."""
    return (await body_bytes(request)).decode("utf-8", "replace")


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body (415, 400, 408 or 413 otherwise)."""
    require_json(request)
    return parse_json_object(await body_bytes(request))
