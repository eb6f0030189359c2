"""Serving an aiohttp application the way this server faces its clients: every error in
the API's JSON shape, even those aiohttp answers before any handler runs (a malformed
request line, a header over the size limits), no connection held open by a client that
sends nothing, or its headers a byte at a time, and no access log line for each health
poll. The port is taken before anything starts: a port in use is one line, not a trace."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_log import AccessLogger
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


#: Routes polled by load balancers and monitors, logged only when they fail.
POLLED = frozenset({"/healthz", "/metrics"})


class PollsUnloggedAccessLogger(AccessLogger):
    """aiohttp's access log, less the health and metrics polls that succeed (one a second
    from a load balancer would drown everything else)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse,
            time: float) -> None:
        if request.path in POLLED and response.status < 400:
            return
        super().log(request, response, time)


def runner_for(app: web.Application, settings: HttpSettings,
               **kwargs: object) -> JsonErrorAppRunner:
    """A runner whose connections answer errors in JSON and close after
    ``settings.idle_timeout_s`` without a request in progress. aiohttp's keep-alive timer
    starts when a connection opens and again after each answer, so it also bounds how long
    a request's headers may take to arrive."""
    return JsonErrorAppRunner(app, keepalive_timeout=settings.idle_timeout_s,
                              access_log_class=PollsUnloggedAccessLogger, **kwargs)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound and listening on every address ``host`` names (``localhost`` may name
    two), as aiohttp would bind them; ``OSError`` if the port is taken."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


#: Where an application keeps what SIGTERM does instead of stopping at once: a coroutine
#: that returns once the server may stop (a cluster's host drains first).
on_sigterm_key: web.AppKey[Callable[[], Awaitable[None]]] = web.AppKey("on_sigterm")
#: Where an application keeps an event it sets to stop the server by itself.
stop_key: web.AppKey[asyncio.Event] = web.AppKey("stop")


async def _serve(app: web.Application, settings: HttpSettings, sockets: list[socket.socket],
                 on_serving: Callable[[], None]) -> None:
    runner = runner_for(app, settings, handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    ending: set[asyncio.Task[None]] = set()

    def terminate() -> None:
        on_sigterm = app.get(on_sigterm_key)
        if on_sigterm is None or ending:
            stop.set()
            return
        task = loop.create_task(on_sigterm())
        ending.add(task)
        task.add_done_callback(lambda _: stop.set())

    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, terminate)
    try:
        for sock in sockets:
            await web.SockSite(runner, sock).start()
        on_serving()
        stopping = [loop.create_task(stop.wait())]
        if stop_key in app:
            stopping.append(loop.create_task(app[stop_key].wait()))
        # until SIGINT, SIGTERM and what it does, or the application stops itself
        await asyncio.wait(stopping, return_when=asyncio.FIRST_COMPLETED)
        for task in stopping:
            task.cancel()
    finally:
        await runner.cleanup()


def serve(app: web.Application, settings: HttpSettings,
          on_serving: Callable[[], None] = lambda: None) -> None:
    """Serve ``app`` on ``settings.host:port`` until SIGINT or SIGTERM, then clean it up.
    The port is taken first: one that cannot be ends the process with a line saying so,
    before any worker or engine starts."""
    try:
        sockets = listening_sockets(settings.host, settings.port)
    except OSError as exc:
        log.error("cannot listen on %s port %d: %s (is another server there? choose "
                  "another with --port)", settings.host, settings.port, exc.strerror or exc)
        sys.exit(1)
    try:
        run_event_loop(_serve(app, settings, sockets, on_serving))
    except (web.GracefulExit, KeyboardInterrupt):
        pass
