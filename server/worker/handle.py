"""The front door's handle on a media worker: what it is started with, how its session
ids begin, and starting, stopping and asking it over HTTP on its Unix socket. The
worker's own code (``server.worker.main``) is named, not imported: it runs only in the
worker's process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from inference.child_process import ChildProcess
from server.config import Settings


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
    host_prefix: str = ""  # in a cluster, how this host's session ids begin (cluster.ids)


def worker_prefix(index: int) -> str:
    """How the session ids of worker ``index`` begin."""
    return f"w{index}-"


#: Short requests to one worker at once; more wait for a connection. Long-lived streams
#: (event streams, WebSockets, speech uploads) have connections of their own, unlimited
#: here (their callers are limited where they enter: ``http.max_streams_per_caller``), so
#: no number of them can hold the connections the control plane needs.
CONTROL_CONNECTIONS = 64


class WorkerProcess:
    """The front door's handle on one worker: start, stop, ask it over HTTP, hear it die."""

    def __init__(self, spec: WorkerSpec, *, on_exit: Callable[[WorkerProcess], None],
                 start_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.index = spec.index
        self.name = f"media worker {spec.index}"
        self.ready = False
        self.http: aiohttp.ClientSession | None = None  # short requests
        self.streams: aiohttp.ClientSession | None = None  # long-lived ones

        def exited(code: int | None) -> None:
            self.ready = False
            on_exit(self)

        self.child = ChildProcess(f"worker-{self.index}", "server.worker.main:serve", (spec,),
                                  on_exit=exited, start_timeout_s=start_timeout_s)

    @property
    def pid(self) -> int | None:
        return self.child.pid

    @property
    def exitcode(self) -> int | None:
        return self.child.exitcode

    async def start(self) -> None:
        await self.child.start()
        self.http = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.spec.socket_path,
                                            limit=CONTROL_CONNECTIONS),
            timeout=aiohttp.ClientTimeout(total=60))
        self.streams = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.spec.socket_path, limit=0),
            timeout=aiohttp.ClientTimeout(total=None))
        self.ready = True

    async def stop(self) -> None:
        """Ask it to close its sessions and exit (killed if it has not within 10 s)."""
        self.ready = False
        for session in (self.http, self.streams):
            if session is not None:
                await session.close()
        self.http = self.streams = None
        await self.child.stop()

    def kill(self) -> None:
        self.child.kill()

    @contextlib.asynccontextmanager
    async def stream(self, path: str, headers: dict[str, str]
                     ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A GET of the worker's API whose answer is read as it comes (an event stream)."""
        if self.streams is None:
            raise ConnectionError(f"worker {self.index} is not running")
        async with self.streams.get(f"http://worker{path}", headers=headers) as response:
            yield response

    @contextlib.asynccontextmanager
    async def websocket(self, path: str, headers: dict[str, str]
                        ) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
        """A WebSocket to the worker's API."""
        if self.streams is None:
            raise ConnectionError(f"worker {self.index} is not running")
        async with self.streams.ws_connect(f"http://worker{path}", autoping=True, headers=headers,
                                        max_msg_size=1 << 20,
                                        timeout=aiohttp.ClientWSTimeout(ws_close=5)) as ws:
            yield ws

    async def request(self, method: str, path: str, *, lasting: bool = False, **kwargs: Any
                      ) -> tuple[int, bytes, dict[str, str]]:
        """One request to the worker's API: status, body, headers. ``lasting``: one that
        may take as long as its client likes (a speech upload), on a connection of its own."""
        http = self.streams if lasting else self.http
        if http is None:
            raise ConnectionError(f"worker {self.index} is not running")
        async with http.request(method, f"http://worker{path}", **kwargs) as response:
            return response.status, await response.read(), dict(response.headers)
