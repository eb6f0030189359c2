"""Bad networks made at a client's own sockets: loss, delay and jitter, for the soak
and the tests of recovery."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiortc import RTCPeerConnection


@dataclass(frozen=True)
class Impairment:
    """A bad network between this client and the server, both ways: each datagram is lost
    with probability ``loss``, else held ``delay_s`` plus up to ``jitter_s``."""

    loss: float = 0.0
    delay_s: float = 0.0
    jitter_s: float = 0.0
    seed: int = 0


def impair(pc: RTCPeerConnection, impairment: Impairment) -> None:
    """Put ``impairment`` on every UDP socket ``pc`` gathered (call after
    setLocalDescription). Where netem is not available (no kernel module, no privileges)
    this is the same in user space, at the client's sockets: the server is untouched."""
    rng = np.random.default_rng(impairment.seed)
    loop = asyncio.get_running_loop()

    def held(deliver: Any, transport: asyncio.DatagramTransport) -> Any:
        def late(*args: Any) -> None:
            if not transport.is_closing():  # the socket closed while the datagram was held
                deliver(*args)

        def impaired(*args: Any) -> None:
            if rng.random() < impairment.loss:
                return
            delay = impairment.delay_s + impairment.jitter_s * rng.random()
            if delay > 0:
                loop.call_later(delay, late, *args)
            else:
                deliver(*args)
        return impaired

    for transceiver in pc.getTransceivers():
        connection = transceiver.sender.transport.transport._connection  # aioice's
        for protocol in connection._protocols:
            transport = protocol.transport
            protocol.datagram_received = held(protocol.datagram_received, transport)
            transport.sendto = held(transport.sendto, transport)
