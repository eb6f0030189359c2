"""A session's events, to everyone following it: utterances started and ended (stamped
when their sound actually leaves for viewers) and interruptions. Subscribers read them as
server-sent events; viewers that open a data channel labelled ``events`` get them too."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiortc import RTCDataChannel

log = logging.getLogger(__name__)

#: Events a subscriber may fall behind by before it is let go (its stream ends).
SUBSCRIBER_BACKLOG = 256


class EventStream:
    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._channels: list[RTCDataChannel] = []

    def subscribe(self) -> asyncio.Queue[dict[str, Any] | None]:
        """A queue of the events from now on; ``None`` ends it (the session ended, or this
        subscriber fell too far behind)."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(SUBSCRIBER_BACKLOG + 1)
        self._queues.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        self._queues.discard(queue)

    def add_channel(self, channel: RTCDataChannel) -> None:
        self._channels.append(channel)

    def publish(self, event: dict[str, Any]) -> None:
        for queue in list(self._queues):
            if queue.qsize() >= SUBSCRIBER_BACKLOG:
                log.info("an event subscriber fell %d events behind; its stream ends",
                         SUBSCRIBER_BACKLOG)
                self._queues.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait(event)
        self._channels = [c for c in self._channels if c.readyState in ("connecting", "open")]
        if self._channels:
            message = json.dumps(event)
            for channel in self._channels:
                if channel.readyState == "open":
                    channel.send(message)

    def close(self) -> None:
        for queue in self._queues:
            queue.put_nowait(None)
        self._queues.clear()
        self._channels.clear()


def server_sent(event: dict[str, Any]) -> bytes:
    """One event in the text/event-stream format."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
