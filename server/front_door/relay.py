"""Requests sent on to the process that answers them, and its answers back: whole, as a
streamed body, as a server-sent event stream, or as a WebSocket joined to another.

An ``Upstream`` is whatever answers the API on the front door's behalf: a media worker
(``server.worker.handle.WorkerProcess``) today, another host's front door in a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import aiohttp
from aiohttp import web

from server.http.bodies import body_bytes
from server.http.errors import ApiError, fail

#: An upstream's answer headers that the front door passes on.
RELAYED_HEADERS = frozenset({"content-type", "retry-after", "www-authenticate", "location",
                             "link", "allow", "accept-post", "x-session-id", "x-viewer-token"})

Answer = tuple[int, bytes, dict[str, str]]


class Upstream(Protocol):
    name: str  # as messages name it: "media worker 1"

    async def request(self, method: str, path: str, *, lasting: bool = False, **kwargs: Any
                      ) -> Answer: ...

    def stream(self, path: str, headers: dict[str, str]
               ) -> contextlib.AbstractAsyncContextManager[aiohttp.ClientResponse]: ...

    def websocket(self, path: str, headers: dict[str, str]
                  ) -> contextlib.AbstractAsyncContextManager[
                      aiohttp.ClientWebSocketResponse]: ...


U = TypeVar("U", bound=Upstream)


def relayed(status: int, body: bytes, headers: dict[str, str]) -> web.Response:
    kept = {k: v for k, v in headers.items() if k.lower() in RELAYED_HEADERS}
    return web.Response(status=status, body=body, headers=kept)


def credentials(request: web.Request) -> dict[str, str]:
    """The caller's API key, for the upstream to check and to know whose sessions to show."""
    key = request.headers.get("Authorization")
    return {"Authorization": key} if key else {}


async def outgoing(request: web.Request) -> dict[str, Any]:
    """The request's body, query and content type, to send on."""
    return {"data": await body_bytes(request),
            "params": dict(request.rel_url.query),
            "headers": {"Content-Type": request.headers.get("Content-Type",
                                                            "application/octet-stream"),
                        **credentials(request)}}


def unavailable(upstream: Upstream, exc: BaseException) -> ApiError:
    """502 where the upstream could not be reached or hung up, 504 where it was too slow."""
    if isinstance(exc, TimeoutError):
        return ApiError(504, "upstream_timeout", f"{upstream.name} did not answer in time")
    return ApiError(502, "worker_unavailable", f"{upstream.name} did not answer: {exc}")


async def forward(upstream: Upstream, request: web.Request) -> web.Response:
    """The request, read whole, answered by ``upstream``."""
    try:
        return relayed(*await upstream.request(request.method, request.rel_url.raw_path,
                                               **await outgoing(request)))
    except (OSError, aiohttp.ClientError) as exc:
        raise unavailable(upstream, exc) from exc


async def forward_streamed(upstream: Upstream, request: web.Request) -> web.Response:
    """The request's body sent on as it arrives, so backpressure reaches the producer."""
    try:
        return relayed(*await upstream.request(
            request.method, request.rel_url.raw_path, lasting=True, data=request.content,
            headers={"Content-Type": request.headers.get("Content-Type", ""),
                     **credentials(request)}))
    except (OSError, aiohttp.ClientError) as exc:
        raise unavailable(upstream, exc) from exc


async def forward_events(upstream: Upstream, request: web.Request) -> web.StreamResponse:
    """The upstream's event stream, relayed as it comes, until it ends (the session did,
    or the upstream went)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    try:
        async with upstream.stream(request.rel_url.raw_path, credentials(request)) as source:
            if source.status != 200:
                return relayed(source.status, await source.read(), dict(source.headers))
            await response.prepare(request)
            async for chunk in source.content.iter_any():
                await response.write(chunk)
    except (OSError, aiohttp.ClientError) as exc:
        if not response.prepared:
            raise unavailable(upstream, exc) from exc
    return response


async def forward_websocket(upstream: Upstream, request: web.Request) -> web.StreamResponse:
    """The client's WebSocket joined to one with the upstream, message for message."""
    async with contextlib.AsyncExitStack() as stack:
        try:
            source = await stack.enter_async_context(
                upstream.websocket(request.rel_url.raw_path, credentials(request)))
        except aiohttp.WSServerHandshakeError as exc:
            fail(exc.status, "websocket_refused", f"the session's worker refused: "
                 f"{exc.message}")
        except (OSError, aiohttp.ClientError) as exc:
            raise unavailable(upstream, exc) from exc
        ws = web.WebSocketResponse(max_msg_size=1 << 20)
        await ws.prepare(request)

        async def pump(origin: Any, sink: Any) -> None:
            async for message in origin:
                if message.type == aiohttp.WSMsgType.TEXT:
                    await sink.send_str(message.data)
                elif message.type == aiohttp.WSMsgType.BINARY:
                    await sink.send_bytes(message.data)
            await sink.close()

        tasks = [asyncio.create_task(pump(ws, source)), asyncio.create_task(pump(source, ws))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return ws


async def ask_every(upstreams: Sequence[U], method: str, path: str, **kwargs: Any
                    ) -> list[tuple[U, int, bytes, dict[str, str]]]:
    """The same request to every upstream; one that fails to answer is left out."""
    answers = await asyncio.gather(*(u.request(method, path, **kwargs) for u in upstreams),
                                   return_exceptions=True)
    return [(u, *a) for u, a in zip(upstreams, answers, strict=True)
            if not isinstance(a, BaseException)]


def worst(answers: Sequence[tuple[Any, int, bytes, dict[str, str]]]) -> Answer:
    """Of the same request to every upstream, the answer with the highest status: each
    must have succeeded for the whole to have (an avatar is needed on every worker)."""
    if not answers:
        fail(502, "worker_unavailable", "no media worker answered")
    return max(answers, key=lambda a: a[1])[1:]
