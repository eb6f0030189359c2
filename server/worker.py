"""A media worker: the WebRTC peers, audio, features and video encoding of its sessions.

The front door starts one per few cores. Each serves the same HTTP API as a single server,
on a Unix socket only the front door talks to, and sends its frames to the inference
process of its GPU through a shared ring (``inference.inference_process``): the sessions
of every worker on that GPU share one scheduler and so one batch.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
from aiohttp import web

from inference.engine import Manifest
from inference.inference_process import RemoteInference
from inference.service import Inference
from server.config import Settings
from server.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with (sent to the spawned process, so plain data)."""

    index: int
    gpu: int  # which inference process it uses
    settings: Settings
    runtime: str
    socket_path: str
    inference_address: str
    authkey: bytes
    ring_name: str
    ring_pending: int  # frames of its sessions that may wait or run at once


class WorkerProcess:
    """The front door's handle on one worker: start, stop, ask it over HTTP, hear it die."""

    def __init__(self, spec: WorkerSpec, *, on_exit: Callable[[WorkerProcess], None],
                 start_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.index = spec.index
        self._on_exit = on_exit
        self._start_timeout = start_timeout_s
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._ready: asyncio.Future[None] | None = None
        self._stopping = False
        self.ready = False
        self.http: aiohttp.ClientSession | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode if self._process is not None else None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=worker_main, name=f"worker-{self.index}",
                                        args=(self.spec, child), daemon=True)
        self._stopping = False
        self._process.start()
        child.close()
        self._ready = loop.create_future()
        loop.add_reader(self._conn.fileno(), self._on_readable)
        try:
            await asyncio.wait_for(self._ready, self._start_timeout)
        except BaseException:
            await self.stop()
            raise
        self.http = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.spec.socket_path),
            timeout=aiohttp.ClientTimeout(total=60))
        self.ready = True

    async def stop(self) -> None:
        """Ask it to close its sessions and exit; kill it if it does not within 10 s."""
        self._stopping = True
        self.ready = False
        if self.http is not None:
            await self.http.close()
            self.http = None
        if self._conn is not None:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def kill(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)

    async def request(self, method: str, path: str, **kwargs: Any
                      ) -> tuple[int, bytes, dict[str, str]]:
        """One request to the worker's API: status, body, headers."""
        if self.http is None:
            raise ConnectionError(f"worker {self.index} is not running")
        async with self.http.request(method, f"http://worker{path}", **kwargs) as response:
            return response.status, await response.read(), dict(response.headers)

    def _on_readable(self) -> None:
        conn = self._conn
        try:
            while conn is not None and conn.poll():
                message = conn.recv()
                if message[0] == "ready" and self._ready is not None and \
                        not self._ready.done():
                    self._ready.set_result(None)
        except (EOFError, OSError):
            self._exited()

    def _exited(self) -> None:
        if self._conn is not None:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None
        self.ready = False
        if self._process is not None:
            self._process.join(1)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(
                f"worker {self.index} exited while starting (exit code {self.exitcode})"))
        elif not self._stopping:
            self._on_exit(self)


# ---------------------------------------------------------------------- the process itself
def worker_main(spec: WorkerSpec, control: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front door decides when to stop
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    for noisy in ("aioice", "aiortc"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    asyncio.run(_serve(spec, control))


async def _serve(spec: WorkerSpec, control: Connection) -> None:
    from server.app import create_app  # the worker's whole server, imported in the worker

    async def connect(settings: Settings, metrics: Metrics) -> Inference:
        inference = RemoteInference(
            Manifest.load(settings.manifest_path), spec.inference_address, spec.authkey,
            pending=spec.ring_pending, max_side=max(settings.video.allowed_sizes),
            ring_name=spec.ring_name, on_drop=metrics.on_drop)
        await inference.start()
        return inference

    loop = asyncio.get_running_loop()
    app = create_app(spec.settings, connect=connect, runtime=spec.runtime)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()  # loads, warms up and prepares the default avatar
    if os.path.exists(spec.socket_path):
        os.unlink(spec.socket_path)  # left by a predecessor that died
    await web.UnixSite(runner, spec.socket_path).start()
    stop = asyncio.Event()

    def on_control() -> None:
        try:
            while control.poll():
                if control.recv()[0] == "stop":
                    stop.set()
        except (EOFError, OSError):  # the front door is gone: so are we
            stop.set()

    loop.add_reader(control.fileno(), on_control)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    control.send(("ready", os.getpid()))
    log.info("worker %d ready on GPU %d", spec.index, spec.gpu)
    await stop.wait()
    loop.remove_reader(control.fileno())
    await runner.cleanup()  # closes its sessions and disconnects from the inference process
