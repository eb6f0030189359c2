"""Speech an application pushes into a session it drives, and its barge-in: a streamed
HTTP body, or one WebSocket for both with the session's events back."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from server.http.errors import fail
from server.media.speech import SpeechDecoder, SpeechError
from server.worker.api.context import held_session, pushed_speech, state
from server.worker.api.events import KEEPALIVE_S
from server.worker.api.speech_socket import SpeechSocket


async def push_speech(request: web.Request) -> web.Response:
    """Speech for a hosted session, streamed as it is made: played in order at real time;
    a producer running more than ``session.speech_buffer_s`` ahead is read no faster."""
    s = state(request)
    session = held_session(request)
    speech = pushed_speech(session)
    try:
        decoder = SpeechDecoder(request.headers.get("Content-Type", ""))
    except SpeechError as exc:
        fail(exc.status, exc.code, str(exc))
    limit, received, queued = s.settings.http.max_body_bytes, 0, 0
    utterance, generation = speech.next_id(), speech.queue.generation
    try:
        while True:
            data = await asyncio.wait_for(request.content.readany(),
                                          s.settings.http.body_timeout_s)
            if not data:
                break
            received += len(data)
            if received > limit:
                fail(413, "body_too_large", f"speech over http.max_body_bytes={limit} bytes; "
                     "send a long text as several utterances")
            samples = decoder.feed(data)
            if decoder.rate and not queued:
                speech.sent_at(utterance, decoder.rate)
            queued += samples.size
            if not await speech.queue.put(samples, utterance, generation):
                if session.is_closed:
                    fail(410, "session_ended", f"session {session.id} ended while its "
                         "speech was arriving")
                return web.json_response({"utterance_id": utterance, "session_id": session.id,
                                          "interrupted": True})
        decoder.finish()
        speech.complete(utterance, queued)
    except SpeechError as exc:
        fail(exc.status, exc.code, str(exc))
    except TimeoutError:
        fail(408, "request_timeout", f"no speech arrived for "
             f"{s.settings.http.body_timeout_s} s")
    return web.json_response({"utterance_id": utterance, "session_id": session.id,
                              "interrupted": False,
                              "samples": decoder.samples_in, "rate": decoder.rate,
                              "duration_s": round(decoder.samples_in / decoder.rate, 3)
                              if decoder.rate else 0.0})


async def interrupt(request: web.Request) -> web.Response:
    """Barge-in: the avatar stops speaking now (``Session.interrupt``)."""
    session = held_session(request)
    pushed_speech(session)
    return web.json_response(session.interrupt())


async def session_socket(request: web.Request) -> web.WebSocketResponse:
    """Speech and barge-in over one connection, events back (``SpeechSocket``)."""
    session = held_session(request)
    speech = pushed_speech(session)
    ws = web.WebSocketResponse(heartbeat=KEEPALIVE_S, max_msg_size=1 << 20)
    await ws.prepare(request)
    await SpeechSocket(session, speech, ws, state(request).settings.http.max_body_bytes).serve()
    return ws


HANDLERS: dict[str, Any] = {"push_speech": push_speech, "interrupt": interrupt,
                            "session_socket": session_socket}
