"""A spawned child process with a control pipe, for the front door's inference processes
and media workers alike.

The parent starts it and waits for its ``Ready(value)``, hears its other messages,
asks it to stop with ``Stop`` (killing it if it does not within 10 s), and learns when it
dies unasked. The child runs an async ``main(control, *args)`` that ends on ``Stop`` or when
the parent goes away (``until_stopped``), so no child outlives its parent.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

T = TypeVar("T")

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
STOP_TIMEOUT_S = 10.0


class ChildProcessError(RuntimeError):
    """The child exited before it was ready."""


@dataclass(frozen=True, slots=True)
class Ready:
    """The child's first message: it serves now; ``value`` is what ``start`` returns."""

    value: Any


@dataclass(frozen=True, slots=True)
class Stop:
    """The parent asks the child to end in order."""


#: What a child runs: an async ``main(control, *args)``, or its name as
#: ``"package.module:function"``, imported only in the child (so the parent need not import
#: what the child runs).
Main = Callable[..., Awaitable[None]] | str


class ChildProcess:
    def __init__(self, name: str, main: Main, args: tuple[Any, ...],
                 *, on_message: Callable[[Any], None] | None = None,
                 on_exit: Callable[[int | None], None] | None = None,
                 start_timeout_s: float = 600.0) -> None:
        self.name = name
        self._main = main
        self._args = args
        self._on_message = on_message or (lambda message: None)
        self._on_exit = on_exit or (lambda code: None)
        self._start_timeout = start_timeout_s
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._ready: asyncio.Future[Any] | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode if self._process is not None else None

    async def start(self) -> Any:
        """Spawn it (no inherited threads or CUDA state) and wait until it says it is
        ready; returns what it said."""
        loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_run_child, name=self.name, daemon=True,
                                        args=(self._main, child, *self._args))
        self._stopping = False
        self._process.start()
        child.close()
        self._ready = loop.create_future()
        watch_connection(loop, self._conn, self._on_readable)
        try:
            return await asyncio.wait_for(self._ready, self._start_timeout)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Ask it to end; kill it if it has not within ``STOP_TIMEOUT_S``."""
        self._stopping = True
        if self._conn is not None:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            try:
                self._conn.send(Stop())
            except OSError:
                pass
        if self._process is not None:
            await asyncio.to_thread(self._process.join, STOP_TIMEOUT_S)
            if self._process.is_alive():
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ChildProcessError(f"{self.name} was stopped"))

    def kill(self) -> None:
        """End it at once, as a crash would."""
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)

    def _on_readable(self) -> None:
        conn = self._conn
        try:
            while conn is not None and conn.poll():
                match conn.recv():
                    case Ready(value):
                        if self._ready is not None and not self._ready.done():
                            self._ready.set_result(value)
                    case message:
                        self._on_message(message)
        except (EOFError, OSError):
            self._exited()

    def _exited(self) -> None:
        if self._conn is not None:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.join(1)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ChildProcessError(
                f"{self.name} exited while starting (exit code {self.exitcode})"))
        elif not self._stopping:
            self._on_exit(self.exitcode)


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` as ``asyncio.run`` would, on uvloop where it is installed: libuv's C
    loop does the timers, wake-ups and datagram sends of a media worker (a few thousand
    each second) for less CPU than asyncio's own loop in Python."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def watch_connection(loop: asyncio.AbstractEventLoop, conn: Connection,
                     callback: Callable[[], None]) -> None:
    """Call ``callback`` on ``loop`` whenever ``conn`` has something to read. uvloop's
    ``add_reader`` makes the descriptor non-blocking, and a ``Connection`` writes whole
    messages only on a blocking one (a portrait sent to the inference process would fail
    half-written), so it is made blocking again: the loop only waits for it to be
    readable, and the callback reads whole messages as before."""
    loop.add_reader(conn.fileno(), callback)
    os.set_blocking(conn.fileno(), True)


def _run_child(main: Main, control: Connection, *args: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to act on
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if isinstance(main, str):
        module, _, name = main.partition(":")
        main = getattr(importlib.import_module(module), name)
    run_event_loop(main(control, *args))


async def until_stopped(control: Connection) -> None:
    """Return when the parent says ``Stop`` or is gone, or on SIGTERM."""
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()

    def on_control() -> None:
        try:
            while control.poll():
                if isinstance(control.recv(), Stop):
                    stopped.set()
        except (EOFError, OSError):
            stopped.set()

    watch_connection(loop, control, on_control)
    loop.add_signal_handler(signal.SIGTERM, stopped.set)  # as an orderly stop
    try:
        await stopped.wait()
    finally:
        loop.remove_reader(control.fileno())
        loop.remove_signal_handler(signal.SIGTERM)
