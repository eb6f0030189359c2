"""A media worker's handlers: the public API (``server.http.api``) by resource, and the
routes only the front door calls (``/internal/...``: the worker listens on a Unix socket
that only the front door reaches)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from server.http import common
from server.http.api import ROUTES
from server.worker.api import (
    avatars,
    create,
    events,
    health,
    offers,
    sessions,
    speech,
    whip,
)

HANDLERS: dict[str, Any] = {**common.HANDLERS, **health.HANDLERS, **offers.HANDLERS,
                            **sessions.HANDLERS, **speech.HANDLERS, **events.HANDLERS,
                            **whip.HANDLERS, **avatars.HANDLERS}
INTERNAL = [*health.INTERNAL, *create.INTERNAL]


def add_routes(app: web.Application, *, internal: bool) -> None:
    """Every route of the API, by its handler's name; with ``internal``, the front door's
    own routes too (a worker behind it; never a server serving alone)."""
    for route in ROUTES:
        app.router.add_route(route.method, route.path, HANDLERS[route.name])
    if internal:
        for method, path, handler in INTERNAL:
            app.router.add_route(method, path, handler)
