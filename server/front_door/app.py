"""The front door's aiohttp application: its routes (``routes``), the middleware every
process shares, and the life of its processes (``door.FrontDoor``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from server.config import Settings
from server.front_door.door import FrontDoor, front_door_key
from server.front_door.routes import add_routes
from server.http.access import Access
from server.http.app_keys import access_key, metrics_key, settings_key
from server.http.common import STATIC_DIR
from server.http.middleware import middlewares
from server.http.serving import on_sigterm_key, stop_key


def create_front_door(settings: Settings) -> web.Application:
    app = web.Application(client_max_size=settings.http.max_body_bytes,
                          middlewares=middlewares(settings.http))
    add_routes(app)
    app.router.add_static("/static/", STATIC_DIR)
    door = FrontDoor(settings)
    app[front_door_key] = door
    app[settings_key] = settings
    app[metrics_key] = door.metrics
    app[access_key] = Access(settings.http)
    if door.member is not None:  # in a cluster, SIGTERM drains first; so does the route
        app[on_sigterm_key] = door.drain
        app[stop_key] = door.member.left

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        try:
            await door.start()
            yield
        finally:
            await door.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
