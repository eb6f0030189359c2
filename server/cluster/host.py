"""Another host's front door as an upstream (``server.front_door.relay.Upstream``): a
request for a session it holds, a placement it was chosen for, or its part of a list.

Every request carries ``X-Sonic-Hop`` (the sending host's id). A host answers a hop from
what it holds itself and never sends it on, so no request goes round the cluster."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

HOP = "X-Sonic-Hop"
#: The place a placing host reserved for the session it sends on (``registry.reserve``):
#: the host that makes it drops the reservation when its record counts the session.
RESERVATION = "X-Sonic-Reservation"
#: Short requests to one other host at once; streams have connections of their own.
CONTROL_CONNECTIONS = 64
#: How long a host that is missing from Redis is given to show it is alive.
PROBE_S = 1.0


class Host:
    def __init__(self, node: str, url: str, me: str, timeout_s: float) -> None:
        self.node = node
        self.name = f"host {node}"
        self.url = url
        self.me = me
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CONTROL_CONNECTIONS),
            timeout=aiohttp.ClientTimeout(total=timeout_s))
        self.streams = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s))

    async def close(self) -> None:
        await self.http.close()
        await self.streams.close()

    async def answers(self) -> bool:
        """Whether its front door answers at all, within a second."""
        try:
            async with self.http.get(self.url + "/healthz", headers=self._headers(None),
                                     timeout=aiohttp.ClientTimeout(total=PROBE_S)):
                return True
        except (OSError, aiohttp.ClientError):
            return False

    def _headers(self, headers: dict[str, str] | None) -> dict[str, str]:
        return {**(headers or {}), HOP: self.me}

    async def request(self, method: str, path: str, *, lasting: bool = False, **kwargs: Any
                      ) -> tuple[int, bytes, dict[str, str]]:
        http = self.streams if lasting else self.http
        kwargs["headers"] = self._headers(kwargs.get("headers"))
        async with http.request(method, self.url + path, allow_redirects=False,
                                **kwargs) as response:
            return response.status, await response.read(), dict(response.headers)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, headers: dict[str, str]
                     ) -> AsyncIterator[aiohttp.ClientResponse]:
        async with self.streams.get(self.url + path, headers=self._headers(headers)) as answer:
            yield answer

    @contextlib.asynccontextmanager
    async def websocket(self, path: str, headers: dict[str, str]
                        ) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
        async with self.streams.ws_connect(self.url + path, autoping=True,
                                           headers=self._headers(headers),
                                           max_msg_size=1 << 20,
                                           timeout=aiohttp.ClientWSTimeout(ws_close=5)) as ws:
            yield ws
