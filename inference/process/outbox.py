"""Per-frame items sent as one message a round of the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Message = TypeVar("Message")


class Outbox(Generic[Item, Message]):
    """Items of one kind for a connection, sent together (as ``message(items)``) at the
    end of the loop's current round: the frames of every session due at one instant of the
    media grid (``server.media.clock.on_grid``) cross the socket as one message, and so do
    the frames of one batch coming back, rather than a message, a write and a wake-up of
    the other process each."""

    def __init__(self, message: Callable[[list[Item]], Message],
                 send: Callable[[Message], None]) -> None:
        self._message = message
        self._send = send
        self._items: list[Item] = []

    def put(self, item: Item) -> None:
        if not self._items:
            asyncio.get_running_loop().call_soon(self._flush)
        self._items.append(item)

    def _flush(self) -> None:
        items, self._items = self._items, []
        self._send(self._message(items))
