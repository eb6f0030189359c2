"""Serving an aiohttp application the way this server faces its clients: every error in
the API's JSON shape, even those aiohttp answers before any handler runs (a malformed
request line, a header over the size limits), and no connection held open by a client
that sends nothing, or its headers a byte at a time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from inference.child_process import run_event_loop
from server.config import HttpSettings

log = logging.getLogger(__name__)


def error_code(status: int) -> str:
    """The JSON ``error`` code for a status aiohttp chose: its reason phrase, snake-cased."""
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return "error"


class JsonErrorRequestHandler(RequestHandler):
    """aiohttp's connection handler, with its own error answers (text or HTML there) in the
    JSON shape: ``{"error": code, "message": why}``."""

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if already sending
        if status >= 500:
            message = "the server failed to answer this request; it has been logged"
        response = web.json_response(
            {"error": error_code(status), "message": message or HTTPStatus(status).phrase},
            status=status)
        response.force_close()
        return response


class JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorAppRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorServer  # same state, our connection handler
        return server


def runner_for(app: web.Application, settings: HttpSettings,
               **kwargs: object) -> JsonErrorAppRunner:
    """A runner whose connections answer errors in JSON and close after
    ``settings.idle_timeout_s`` without a request in progress. aiohttp's keep-alive timer
    starts when a connection opens and again after each answer, so it also bounds how long
    a request's headers may take to arrive."""
    return JsonErrorAppRunner(app, keepalive_timeout=settings.idle_timeout_s, **kwargs)


async def _serve(app: web.Application, settings: HttpSettings,
                 on_serving: Callable[[], None]) -> None:
    runner = runner_for(app, settings, handle_signals=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.host, settings.port).start()
        on_serving()
        await asyncio.Event().wait()  # until SIGINT or SIGTERM
    finally:
        await runner.cleanup()


def serve(app: web.Application, settings: HttpSettings,
          on_serving: Callable[[], None] = lambda: None) -> None:
    """Serve ``app`` on ``settings.host:port`` until SIGINT or SIGTERM, then clean it up."""
    try:
        run_event_loop(_serve(app, settings, on_serving))
    except (web.GracefulExit, KeyboardInterrupt):
        pass
