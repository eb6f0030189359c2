"""A session's events, to everyone following it: utterances started and ended (stamped
when their sound actually leaves for viewers), interruptions, and what viewers type.
Subscribers read them as server-sent events; viewers that open a data channel labelled
``events`` get them too, and may send ``{"type": "message", "text": ...}`` on it: the
application driving the session hears it as a ``viewer_message`` event (a chat box on the
page, asking the agent to speak)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Any

from aiortc import RTCDataChannel

log = logging.getLogger(__name__)

#: Events a subscriber may fall behind by before it is let go (its stream ends).
SUBSCRIBER_BACKLOG = 256
#: The longest text a viewer may send in one message, and how many it may send in a
#: window of seconds: a viewer must not flood the application's event stream.
MAX_MESSAGE_CHARS = 2000
MESSAGES_PER_WINDOW, MESSAGE_WINDOW_S = 10, 10.0


class EventStream:
    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
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
        sent: deque[float] = deque(maxlen=MESSAGES_PER_WINDOW)

        @channel.on("message")
        def on_message(message: str | bytes) -> None:
            now = time.monotonic()
            if len(sent) == MESSAGES_PER_WINDOW and now - sent[0] < MESSAGE_WINDOW_S:
                error = ("too_many_messages", f"at most {MESSAGES_PER_WINDOW} messages in "
                         f"{MESSAGE_WINDOW_S:g} s; this one was dropped")
            else:
                try:
                    event = {"session_id": self.session_id, **viewer_message(message)}
                except ValueError as bad:
                    error = ("bad_message", str(bad))
                else:
                    sent.append(now)
                    self.publish(event)
                    return
            channel.send(json.dumps({"type": "error", "error": error[0], "message": error[1]}))

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


def viewer_message(message: str | bytes) -> dict[str, Any]:
    """A viewer's data-channel message as the event the application hears, or ValueError
    saying what is wrong with it."""
    try:
        sent = json.loads(message) if isinstance(message, str) else None
    except ValueError:
        sent = None
    if not isinstance(sent, dict) or sent.get("type") != "message":
        raise ValueError('viewers send JSON text: {"type": "message", "text": "..."}')
    text = sent.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ValueError('"text" must be a non-empty string')
    if len(text) > MAX_MESSAGE_CHARS:
        raise ValueError(f'"text" is {len(text)} characters; at most {MAX_MESSAGE_CHARS}')
    return {"type": "viewer_message", "text": text, "wall_time": round(time.time(), 4)}


def server_sent(event: dict[str, Any]) -> bytes:
    """One event in the text/event-stream format."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
