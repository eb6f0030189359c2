"""Pipecat integration: a pipeline's TTS speaks through a hosted session of this server.

Install with ``pip install 'sonic-media-server[pipecat]'`` (pipecat-ai, BSD-2-Clause). The
server never imports this module; only an agent built on pipecat does.

:class:`SonicAvatar` goes after the TTS service, before the output transport. At setup it
makes a session (``POST /sessions``) or joins one it is given, and opens the session's
WebSocket (``/sessions/{id}/ws``). Each TTS response (``TTSStartedFrame`` ...
``TTSStoppedFrame``) becomes one utterance, its ``TTSAudioRawFrame`` PCM streamed as it
arrives; an ``InterruptionFrame`` is the session's barge-in (``POST .../interrupt``),
so the avatar's sound stops and its mouth closes with the bot's. Every frame goes on
downstream unchanged: the transport still plays the audio, and the avatar's viewers hear
the same speech, delayed to match its lips. At ``EndFrame`` it lets the avatar finish
speaking, then ends the session it made; at ``CancelFrame`` it ends it at once.

The viewer URL (the web page in viewer mode; also a WHEP URL and the token) is
:attr:`SonicAvatar.session`, handed to ``on_session_ready`` handlers and, when the pipeline
starts, pushed downstream as an ``OutputTransportMessageUrgentFrame`` that the transport
sends to its client (``type: "sonic-avatar-session"``). A client that connects later can
be sent :meth:`SonicAvatar.session_message` again.

:class:`EspeakTTSService` is a TTS service on the ``espeak-ng`` binary: offline, no keys,
for trying a pipeline out and for the tests.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
from loguru import logger
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    OutputTransportMessageUrgentFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.processors.frame_processor import (
    FrameDirection,
    FrameProcessor,
    FrameProcessorSetup,
)
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TTSService

#: The type of the transport message that carries the session's viewer URL.
MESSAGE_TYPE = "sonic-avatar-session"
#: Largest WebSocket message sent (the server takes up to 1 MiB): a TTS that sends long
#: frames is split.
MAX_MESSAGE_BYTES = 64 * 1024
#: An utterance longer than this (4 MiB: 87 s at 24 kHz) goes on as the next one,
#: seamlessly, within the server's ``http.max_body_bytes`` (8 MiB by default).
MAX_UTTERANCE_BYTES = 4 * 1024 * 1024
#: Sample rates the server takes (``server.media.speech.RATES``).
MIN_RATE, MAX_RATE = 8000, 96000


class SonicAvatarError(RuntimeError):
    """The server could not be reached, or refused what the avatar asked of it."""


@dataclass(frozen=True)
class SonicSession:
    """A hosted session as viewers reach it: ``viewer_url`` is the web page in viewer
    mode, ``whep_url`` takes a standard WHEP offer with ``token`` as its bearer token."""

    session_id: str
    token: str
    viewer_url: str
    whep_url: str

    def as_message(self) -> dict[str, str]:
        return {"type": MESSAGE_TYPE, "session_id": self.session_id, "token": self.token,
                "viewer_url": self.viewer_url, "whep_url": self.whep_url}


class SonicAvatar(FrameProcessor):
    """Streams the pipeline's TTS audio into a hosted session and barges in on
    interruptions. Place it after the TTS service.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8080``.
        api_key: the server's API key, where it has keys (``http.api_keys``).
        avatar: the avatar to speak as (default: the server's).
        size: 256 or 512 (default: the server's ``video.size``).
        options: session knobs, as ``POST /sessions`` takes them.
        session_id, token: drive a session made elsewhere instead of making one; it is
            then left running at the end.
        send_session_message: push the session's viewer URL downstream when the pipeline
            starts, for the transport to send to its client.
        request_timeout_s: bound on each HTTP request and on connecting.
        finish_timeout_s: at ``EndFrame``, the longest wait for the avatar to finish
            speaking what it was given before the session is ended.

    Events: ``on_session_ready(avatar, session: SonicSession)`` once the session is
    there; ``on_interrupted(avatar, answer)`` with the server's answer to a barge-in
    (which utterances were cut, ``heard_s`` of each); ``on_session_event(avatar,
    event)`` for every message the session's WebSocket sends (``utterance_started``,
    ``utterance_ended``, ``interrupted``, ``viewer_message`` ...).
    """

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 avatar: str | None = None, size: int | None = None,
                 options: dict[str, Any] | None = None, session_id: str | None = None,
                 token: str | None = None, send_session_message: bool = True,
                 request_timeout_s: float = 10.0, finish_timeout_s: float = 35.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if (session_id is None) != (token is None):
            raise ValueError("give both session_id and token to join a session, or neither")
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._create = {k: v for k, v in (("avatar", avatar), ("size", size),
                                          ("options", options)) if v}
        self._given = (session_id, token) if session_id and token else None
        self._send_session_message = send_session_message
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._finish_timeout_s = finish_timeout_s
        self.session: SonicSession | None = None
        #: The server's answer to the latest barge-in.
        self.last_interrupt: dict[str, Any] | None = None
        self._created = False
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # What the sender task still has to send, in order: ("open", content_type),
        # ("audio", bytes), ("end",).
        self._outbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._open: str | None = None  # content type of the utterance open here
        self._open_bytes = 0  # and how much of it was sent
        self._busy = False  # the sender is sending an item
        self._interrupting: asyncio.Task[None] | None = None
        # Utterances the server has not finished with: opened (sent) and replied to, by
        # id; those resolved (ended, cut, empty) before their id came back.
        self._opened = self._replies = 0
        self._pending: set[str] = set()
        self._resolved_early: set[str] = set()
        self._progress = asyncio.Condition()
        self._failed = False  # the session is gone: further audio is let go
        self._closed = False
        self._register_event_handler("on_session_ready")
        self._register_event_handler("on_interrupted")
        self._register_event_handler("on_session_event")

    # ---- the session's lifetime --------------------------------------------------------

    async def setup(self, setup: FrameProcessorSetup) -> None:
        """Make (or join) the session and open its WebSocket, as pipecat's processors
        connect: while the pipeline sets up. An unreachable server raises
        :class:`SonicAvatarError`, which pipecat reports as this processor's permanent
        error (``on_pipeline_error``); the pipeline then runs on without the avatar
        unless its ``processor_unusable_policy`` says otherwise."""
        await super().setup(setup)
        self._http = aiohttp.ClientSession(headers=self._headers)
        try:
            if self._given is None:
                answer = await self._request("POST", "/sessions", 201, json=self._create)
                session_id, token = str(answer["session_id"]), str(answer["token"])
                self._created = True
            else:
                session_id, token = self._given
            self.session = SonicSession(
                session_id, token, f"{self.base_url}/?session={session_id}&token={token}",
                f"{self.base_url}/sessions/{session_id}/whep")
            try:
                self._ws = await asyncio.wait_for(self._http.ws_connect(
                    f"{self.base_url}/sessions/{session_id}/ws", timeout=aiohttp.ClientWSTimeout(
                        ws_receive=None, ws_close=self._timeout.total),
                    max_msg_size=1 << 20), self._timeout.total)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                raise SonicAvatarError(f"could not open the WebSocket of session "
                                       f"{session_id} at {self.base_url} "
                                       f"({type(exc).__name__}: {exc})") from exc
        except BaseException:
            await self._close()
            self.session = None
            raise
        self._tasks = [self.create_task(self._send(), f"{self}::send"),
                       self.create_task(self._receive(), f"{self}::receive")]
        logger.info(f"{self}: speaking through session {session_id}; viewers: "
                    f"{self.session.viewer_url}")
        await self._call_event_handler("on_session_ready", self.session)

    async def cleanup(self) -> None:
        """Whatever ended the pipeline, the session this made does not outlive it."""
        await self._close()
        await super().cleanup()

    def session_message(self) -> OutputTransportMessageUrgentFrame:
        """The session's viewer URL as a transport message frame (``as_message``), e.g.
        to queue from a transport's ``on_client_connected`` handler."""
        if self.session is None:
            raise SonicAvatarError("no session: the avatar is not set up (see its error)")
        return OutputTransportMessageUrgentFrame(message=self.session.as_message())

    # ---- frames -------------------------------------------------------------------------

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        """Every frame goes on unchanged; TTS audio is also streamed to the session."""
        await super().process_frame(frame, direction)
        if isinstance(frame, InterruptionFrame):
            self._interrupt()
        elif direction is FrameDirection.DOWNSTREAM:
            if isinstance(frame, TTSAudioRawFrame):
                self._audio(frame)
            elif isinstance(frame, TTSStartedFrame | TTSStoppedFrame):
                self._end_utterance()  # the next audio opens a new one
            elif isinstance(frame, EndFrame):
                await self._finish()
            elif isinstance(frame, CancelFrame):
                await self._close()
        await self.push_frame(frame, direction)
        if (isinstance(frame, StartFrame) and self._send_session_message
                and self.session is not None):
            await self.push_frame(self.session_message())

    def _audio(self, frame: TTSAudioRawFrame) -> None:
        if self._ws is None or self._closed or self._failed:
            return
        channels = frame.num_channels
        if not MIN_RATE <= frame.sample_rate <= MAX_RATE or channels not in (1, 2):
            logger.warning(f"{self}: {frame.sample_rate} Hz, {channels} channel(s) audio "
                           f"is not speech the server takes (8-96 kHz, mono or stereo)")
            return
        content_type = f"audio/L16;rate={frame.sample_rate};channels={channels}"
        pcm = np.frombuffer(frame.audio, "<i2", len(frame.audio) // (2 * channels) * channels)
        data = pcm.astype(">i2").tobytes()  # L16 is big-endian (RFC 2586)
        if self._open != content_type or self._open_bytes + len(data) > MAX_UTTERANCE_BYTES:
            self._end_utterance()  # a new TTS response, its format changed, or a long one
            self._outbox.put_nowait(("open", content_type))
            self._open, self._open_bytes = content_type, 0
        self._open_bytes += len(data)
        for start in range(0, len(data), MAX_MESSAGE_BYTES):
            self._outbox.put_nowait(("audio", data[start:start + MAX_MESSAGE_BYTES]))

    def _end_utterance(self) -> None:
        if self._open is not None:
            self._outbox.put_nowait(("end",))
            self._open = None

    def _interrupt(self) -> None:
        """Barge-in: audio not yet sent is dropped here, the open utterance is closed,
        and the session is interrupted over HTTP, so the cut never waits behind audio
        on the WebSocket. The next utterance is opened only once the cut is done."""
        if self._ws is None or self._closed or self._failed:
            return
        if self._quiet():
            return  # nothing sent can still be playing: no cut to make (no event either)
        kept = []
        while not self._outbox.empty():
            item = self._outbox.get_nowait()
            self._outbox.task_done()
            if item[0] != "audio":
                kept.append(item)  # utterances still open and close on the server
        for item in kept:
            self._outbox.put_nowait(item)
        self._end_utterance()
        self._interrupting = self.create_task(self._post_interrupt(), f"{self}::interrupt")

    def _quiet(self) -> bool:
        """Nothing is left to send, and all that was sent has played or been cut."""
        return (self._open is None and self._outbox.empty() and not self._busy
                and self._replies >= self._opened and not self._pending)

    async def _post_interrupt(self) -> None:
        try:
            answer = await self._request("POST", self._path("/interrupt"), 200)
        except SonicAvatarError as exc:
            await self.push_error(str(exc), exception=exc)
            return
        self.last_interrupt = answer
        await self._resolve(*(cut["utterance_id"] for cut in answer.get("interrupted", [])))
        await self._call_event_handler("on_interrupted", answer)

    async def _finish(self) -> None:
        """At the pipeline's end: send what is left, let the avatar say it (at most
        ``finish_timeout_s``), then end the session if this made it."""
        self._end_utterance()
        if self._ws is not None and not self._closed and not self._failed:
            try:
                await asyncio.wait_for(self._said_everything(), self._finish_timeout_s)
            except TimeoutError:
                logger.warning(f"{self}: the avatar had not finished speaking after "
                               f"{self._finish_timeout_s} s; ending its session")
        await self._close()

    async def _said_everything(self) -> None:
        await self._outbox.join()
        if self._interrupting is not None:
            await self._interrupting
        async with self._progress:
            await self._progress.wait_for(
                lambda: self._failed or (self._replies >= self._opened and not self._pending))

    # ---- the WebSocket ----------------------------------------------------------------

    async def _send(self) -> None:
        """Sends the outbox in order. The server reads speech no faster than its buffer
        (``session.speech_buffer_s``) takes it, so this may wait; frames never do."""
        assert self._ws is not None
        while True:
            item = await self._outbox.get()
            self._busy = True
            try:
                if self._failed:
                    continue
                if item[0] == "open":
                    if self._interrupting is not None:
                        await self._interrupting  # a cut sent late must not cut this one
                    self._opened += 1
                    await self._ws.send_json({"type": "speech", "content_type": item[1]})
                elif item[0] == "audio":
                    await self._ws.send_bytes(item[1])
                else:
                    await self._ws.send_json({"type": "end"})
            except (aiohttp.ClientError, OSError) as exc:
                await self._fail(f"lost the WebSocket of session {self._session_id}: {exc}")
            finally:
                self._busy = False
                self._outbox.task_done()

    async def _receive(self) -> None:
        """Follows the session's messages: utterance ids, their ends, cuts, errors."""
        assert self._ws is not None
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            try:
                event = json.loads(message.data)
            except json.JSONDecodeError:
                continue
            if not isinstance(event, dict):
                continue
            kind = event.get("type")
            if kind == "utterance_opened":
                async with self._progress:
                    self._replies += 1
                    utterance = str(event["utterance_id"])
                    if utterance in self._resolved_early:
                        self._resolved_early.discard(utterance)
                    else:
                        self._pending.add(utterance)
                    self._progress.notify_all()
            elif kind == "utterance_ended" or kind == "utterance_queued" and (
                    event.get("interrupted") or not event.get("samples")):
                await self._resolve(str(event["utterance_id"]))  # it will not play (more)
            elif kind == "interrupted":
                await self._resolve(*(cut["utterance_id"] for cut in event["interrupted"]))
            elif kind == "error":
                await self.push_error(f"session {self._session_id} refused: "
                                      f"{event.get('error')}: {event.get('message')}")
            await self._call_event_handler("on_session_event", event)
        if not self._closed:
            await self._fail(f"session {self._session_id} ended (its WebSocket closed)")

    async def _resolve(self, *utterances: str) -> None:
        async with self._progress:
            for utterance in utterances:
                if utterance in self._pending:
                    self._pending.discard(utterance)
                elif self._replies < self._opened:  # maybe its id has yet to come back
                    self._resolved_early.add(utterance)
            if self._replies >= self._opened:  # every id came: the rest were repeats
                self._resolved_early.clear()
            self._progress.notify_all()

    async def _fail(self, message: str) -> None:
        """The session is gone: the avatar cannot speak any more."""
        if self._failed:
            return
        self._failed = True
        async with self._progress:
            self._progress.notify_all()
        await self.push_error(message, force_treat_as_permanent=True)

    # ---- HTTP ---------------------------------------------------------------------------

    @property
    def _session_id(self) -> str:
        return self.session.session_id if self.session is not None else "(none)"

    def _path(self, suffix: str = "") -> str:
        return f"/sessions/{self._session_id}{suffix}"

    async def _request(self, method: str, path: str, status: int, **kwargs: Any) -> Any:
        assert self._http is not None
        url = self.base_url + path
        try:
            async with self._http.request(method, url, timeout=self._timeout,
                                          **kwargs) as response:
                text = await response.text()
                if response.status != status:
                    raise SonicAvatarError(f"{method} {url}: {response.status} {text[:300]}")
                return json.loads(text) if text else {}
        except (aiohttp.ClientError, OSError, TimeoutError, json.JSONDecodeError) as exc:
            raise SonicAvatarError(f"{method} {url} failed: cannot reach the Sonic media "
                                   f"server at {self.base_url} ({type(exc).__name__}: "
                                   f"{exc})") from exc

    async def _close(self) -> None:
        """Idempotent: stop sending, close the WebSocket, end the session if made here."""
        if self._closed:
            return
        self._closed = True
        for task in [*self._tasks, self._interrupting]:
            if task is not None and not task.done():
                await self.cancel_task(task)
        self._tasks, self._interrupting = [], None
        if self._ws is not None:
            await self._ws.close()
        if self._created and self._http is not None:
            try:
                await self._request("DELETE", self._path(), 204)
            except SonicAvatarError as exc:
                logger.warning(f"{self}: could not end session {self._session_id}: {exc}")
        if self._http is not None:
            await self._http.close()


class EspeakTTSService(TTSService):
    """Text to speech with the ``espeak-ng`` binary (``apt-get install espeak-ng``),
    streamed as it synthesises: offline and keyless, to try a pipeline with."""

    def __init__(self, *, voice: str = "en-us", words_per_minute: int = 150,
                 **kwargs: Any) -> None:
        super().__init__(push_start_frame=True, push_stop_frames=True,
                         settings=TTSSettings(model=None, voice=voice, language=None),
                         **kwargs)
        self._words_per_minute = words_per_minute
        if shutil.which("espeak-ng") is None:
            raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng)")

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """espeak-ng's WAV on stdout (22.05 kHz, sizes unknown), resampled to the
        pipeline's rate as it comes; the process goes if the generator does."""
        process = await asyncio.create_subprocess_exec(
            "espeak-ng", "--stdout", "-v", str(self._settings.voice),
            "-s", str(self._words_per_minute), "--", text,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        assert process.stdout is not None and process.stderr is not None
        said_all = False
        try:
            try:
                header = await process.stdout.readexactly(44)
            except asyncio.IncompleteReadError:
                said_all = True
                said = (await process.stderr.read()).decode(errors="replace")
                yield ErrorFrame(error=f"espeak-ng said nothing: {said.strip()[-300:]}")
                return
            rate = struct.unpack("<I", header[24:28])[0]

            async def chunks() -> AsyncGenerator[bytes, None]:
                assert process.stdout is not None
                while data := await process.stdout.read(rate // 5 * 2):  # 200 ms
                    yield data

            await self.start_tts_usage_metrics(text)
            async for frame in self._stream_audio_frames_from_iterator(
                    chunks(), in_sample_rate=rate, context_id=context_id):
                await self.stop_ttfb_metrics()
                yield frame
            said_all = True
        finally:
            if not said_all:  # interrupted (killing an exited one would reap it early)
                process.kill()
            await process.wait()
