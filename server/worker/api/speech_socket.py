"""One application's WebSocket to a hosted session: its speech and barge-in in, the
session's events out (``GET /sessions/{id}/ws``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import WSMsgType, web

from server.media.session import Session
from server.media.speech import SpeechDecoder, SpeechError, Utterances


class SpeechSocket:
    """One application's WebSocket to a hosted session. Text messages are JSON commands:
    ``{"type": "speech", "content_type": ...}`` opens an utterance, whose audio follows
    as binary messages, ``{"type": "end"}`` closes it, ``{"type": "interrupt"}`` barges
    in. The session's events come back as JSON text, with ``utterance_opened``,
    ``utterance_queued`` and ``error`` answers. Audio is read no faster than the speech
    queue takes it, so a producer far ahead is held back by TCP."""

    def __init__(self, session: Session, speech: Utterances, ws: web.WebSocketResponse,
                 limit: int) -> None:
        self.session, self.speech, self.ws, self.limit = session, speech, ws, limit
        self.decoder: SpeechDecoder | None = None
        self.utterance, self.generation, self.queued, self.received = "", 0, 0, 0
        self.cut = False  # the open utterance was interrupted: its audio is let go

    async def serve(self) -> None:
        events = self.session.events.subscribe()
        forward = asyncio.get_running_loop().create_task(self._forward(events))
        try:
            async for message in self.ws:
                if message.type == WSMsgType.BINARY:
                    await self._audio(message.data)
                elif message.type == WSMsgType.TEXT:
                    await self._command(message.data)
        finally:
            if self.decoder is not None and not self.cut:  # gone mid-utterance: what
                self.speech.complete(self.utterance, self.queued)  # came plays
            forward.cancel()
            self.session.events.unsubscribe(events)

    async def _forward(self, events: asyncio.Queue[dict[str, Any] | None]) -> None:
        while (event := await events.get()) is not None:
            await self.ws.send_json(event)
        await self.ws.close()  # the session ended

    async def _error(self, code: str, message: str) -> None:
        await self.ws.send_json({"type": "error", "error": code, "message": message})

    async def _command(self, text: str) -> None:
        try:
            command = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            command = None
        kind = command.get("type") if isinstance(command, dict) else None
        if kind == "speech":
            if self.decoder is not None:
                return await self._error("utterance_open", 'send {"type": "end"} first')
            try:
                self.decoder = SpeechDecoder(str(command.get("content_type", "")))
            except SpeechError as exc:
                return await self._error(exc.code, str(exc))
            self.utterance = self.speech.next_id()
            self.generation, self.queued, self.received = self.speech.queue.generation, 0, 0
            self.cut = False
            await self.ws.send_json({"type": "utterance_opened",
                                     "utterance_id": self.utterance})
        elif kind == "end":
            if self.decoder is None:
                return await self._error("no_utterance", "no utterance is open")
            decoder, self.decoder = self.decoder, None
            if not self.cut:
                try:
                    decoder.finish()
                except SpeechError as exc:
                    await self._error(exc.code, str(exc))
                self.speech.complete(self.utterance, self.queued)
            await self.ws.send_json({"type": "utterance_queued", "utterance_id": self.utterance,
                                     "interrupted": self.cut,
                                     "samples": decoder.samples_in,
                                     "duration_s": round(decoder.samples_in / decoder.rate, 3)
                                     if decoder.rate else 0.0})
        elif kind == "interrupt":
            self.session.interrupt()  # its event reaches this socket with everyone else
        else:
            await self._error("bad_message", 'text messages are JSON objects with "type": '
                              '"speech", "end" or "interrupt"')

    async def _audio(self, data: bytes) -> None:
        if self.decoder is None:
            return await self._error("no_utterance", 'audio before {"type": "speech", ...}')
        if self.cut:
            return
        self.received += len(data)
        if self.received > self.limit:
            self.decoder = None
            return await self._error("body_too_large", f"an utterance over "
                                     f"http.max_body_bytes={self.limit} bytes; split it")
        try:
            samples = self.decoder.feed(data)
        except SpeechError as exc:
            self.decoder = None
            return await self._error(exc.code, str(exc))
        if self.decoder.rate and not self.queued:
            self.speech.sent_at(self.utterance, self.decoder.rate)
        self.queued += samples.size
        if not await self.speech.queue.put(samples, self.utterance, self.generation):
            self.cut = True  # interrupted: the rest of this utterance is not played
