"""A session's events as server-sent events, until it ends (``server.media.events``)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from server.media.events import server_sent
from server.worker.api.context import held_session

#: An event stream with nothing to say sends a comment this often (proxies keep it open).
KEEPALIVE_S = 15.0


async def session_events(request: web.Request) -> web.StreamResponse:
    session = held_session(request)
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


HANDLERS: dict[str, Any] = {"session_events": session_events}
