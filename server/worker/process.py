"""A media worker: the WebRTC peers, audio, features and video encoding of its sessions.

The front door starts one per few cores. Each serves the same HTTP API as a single server,
on a Unix socket only the front door talks to, and sends its frames to the inference
process of its GPU through a shared ring (``inference.process``): the sessions
of every worker on that GPU share one scheduler and so one batch.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
from aiohttp import web

from inference.child_process import ChildProcess, Ready, until_stopped
from inference.engine import Manifest
from inference.process.client import RemoteInference
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
    ring_motion_pending: int = 0  # ... of its motion-only sessions (slots without a picture)


def worker_prefix(index: int) -> str:
    """How the session ids of worker ``index`` begin."""
    return f"w{index}-"


class WorkerProcess:
    """The front door's handle on one worker: start, stop, ask it over HTTP, hear it die."""

    def __init__(self, spec: WorkerSpec, *, on_exit: Callable[[WorkerProcess], None],
                 start_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.index = spec.index
        self.ready = False
        self.http: aiohttp.ClientSession | None = None

        def exited(code: int | None) -> None:
            self.ready = False
            on_exit(self)

        self.child = ChildProcess(f"worker-{self.index}", _serve, (spec,), on_exit=exited,
                                  start_timeout_s=start_timeout_s)

    @property
    def pid(self) -> int | None:
        return self.child.pid

    @property
    def exitcode(self) -> int | None:
        return self.child.exitcode

    async def start(self) -> None:
        await self.child.start()
        self.http = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.spec.socket_path),
            timeout=aiohttp.ClientTimeout(total=60))
        self.ready = True

    async def stop(self) -> None:
        """Ask it to close its sessions and exit (killed if it has not within 10 s)."""
        self.ready = False
        if self.http is not None:
            await self.http.close()
            self.http = None
        await self.child.stop()

    def kill(self) -> None:
        self.child.kill()

    @contextlib.asynccontextmanager
    async def stream(self, path: str, headers: dict[str, str]
                     ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A GET of the worker's API whose answer is read as it comes (an event stream)."""
        if self.http is None:
            raise ConnectionError(f"worker {self.index} is not running")
        async with self.http.get(f"http://worker{path}", headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=None)) as response:
            yield response

    @contextlib.asynccontextmanager
    async def websocket(self, path: str, headers: dict[str, str]
                        ) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
        """A WebSocket to the worker's API."""
        if self.http is None:
            raise ConnectionError(f"worker {self.index} is not running")
        async with self.http.ws_connect(f"http://worker{path}", autoping=True, headers=headers,
                                        max_msg_size=1 << 20,
                                        timeout=aiohttp.ClientWSTimeout(ws_close=5)) as ws:
            yield ws

    async def request(self, method: str, path: str, **kwargs: Any
                      ) -> tuple[int, bytes, dict[str, str]]:
        """One request to the worker's API: status, body, headers."""
        if self.http is None:
            raise ConnectionError(f"worker {self.index} is not running")
        async with self.http.request(method, f"http://worker{path}", **kwargs) as response:
            return response.status, await response.read(), dict(response.headers)


# ---------------------------------------------------------------------- the process itself
async def _serve(control: Connection, spec: WorkerSpec) -> None:
    from server.worker.app import create_app  # the worker's whole server, imported in the worker

    for noisy in ("aioice", "aiortc"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    async def connect(settings: Settings, metrics: Metrics) -> Inference:
        inference = RemoteInference(
            Manifest.load(settings.manifest_path), spec.inference_address, spec.authkey,
            pending=spec.ring_pending, max_side=max(settings.video.allowed_sizes),
            motion_pending=spec.ring_motion_pending,
            ring_name=spec.ring_name, on_drop=metrics.on_drop)
        await inference.start()
        return inference

    app = create_app(spec.settings, connect=connect, runtime=spec.runtime,
                     id_prefix=worker_prefix(spec.index))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()  # loads, warms up and prepares the default avatar
    if os.path.exists(spec.socket_path):
        os.unlink(spec.socket_path)  # left by a predecessor that died
    await web.UnixSite(runner, spec.socket_path).start()
    control.send(Ready(os.getpid()))
    log.info("worker %d ready on GPU %d", spec.index, spec.gpu)
    await until_stopped(control)
    await runner.cleanup()  # closes its sessions and disconnects from the inference process
