"""UDP ports for media, within a configured range, so a firewall or a container can open
exactly those (``ice.udp_ports``).

aiortc has no such option, and aioice binds each host candidate's socket through the
event loop's public ``create_datagram_endpoint`` with port 0 ("any"). So the worker's loop
gets a ``create_datagram_endpoint`` that turns a request for any port into the first free
one of the range, starting at a random place in it (sessions spread over the range, and a
port just freed is not at once reused). Requests for a named port, or for none (a socket
that only sends, such as TURN's), are passed through unchanged.
"""

from __future__ import annotations

import asyncio
import errno
import random
from typing import Any


class NoFreePort(OSError):
    """Every port of the range is taken: one more ICE socket cannot be bound."""


def bind_udp_in_range(loop: asyncio.AbstractEventLoop, low: int, high: int) -> None:
    """From now on, datagram endpoints on ``loop`` that ask for port 0 get one in
    [``low``, ``high``]."""
    create = loop.create_datagram_endpoint
    ports = high - low + 1

    async def in_range(protocol_factory: Any, local_addr: Any = None, **kwargs: Any) -> Any:
        if local_addr is None or local_addr[1] != 0:
            return await create(protocol_factory, local_addr=local_addr, **kwargs)
        start = random.randrange(ports)
        for step in range(ports):
            port = low + (start + step) % ports
            try:
                return await create(protocol_factory, local_addr=(local_addr[0], port),
                                    **kwargs)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        raise NoFreePort(errno.EADDRINUSE, f"every UDP port in {low}-{high} is in use "
                         "(ice.udp_ports)")

    loop.create_datagram_endpoint = in_range  # type: ignore[method-assign]
