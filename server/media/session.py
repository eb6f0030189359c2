"""A session: one avatar, its audio source, its media clock and its viewers' tracks.

Data flows one way: its audio source (``server.media.audio_sources``: a peer's audio
behind the ingest buffer, or pushed speech) gives the session's timeline loop one 20 ms
chunk per tick; the loop keeps it for the outbound audio, turns it into features and,
whenever a video frame's feature window is complete, submits that frame to the shared
scheduler with its deadline. Viewer tracks read frames and chunks by
index at their clock times. The session knows nothing of batching or of SDP.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
from aiortc import RTCDataChannel
from aiortc.codecs import vpx
from aiortc.mediastreams import MediaStreamTrack

from inference.engine import FrameInput, Manifest
from inference.features import FrameWindows
from inference.scheduler import FrameResult
from inference.service import Inference
from server.config import SessionSettings
from server.media.audio_ingest import Resampler
from server.media.audio_sources import PeerAudio, PushedSpeech, audio_source
from server.media.clock import AUDIO_RATE, MediaClock, on_grid
from server.media.encoding import EncodeBatches, Vp8Tuning
from server.media.events import EventStream
from server.media.recording import record
from server.media.tracks import (
    SessionAudioTrack,
    SessionVideoTrack,
    SharedVideo,
    SharedVideoTrack,
    send_motion,
)
from server.metrics import Metrics
from server.session_spec import SessionKind, SessionOptions

log = logging.getLogger(__name__)

KEEP_CHUNKS = 100  # outbound audio kept for late viewers: 2 s
KEEP_FRAMES = 25
#: Frames the delay and A/V percentiles in a session's stats are taken over: its latest.
RECENT_FRAMES = 500


@dataclass(frozen=True)
class AvatarHandle:
    """An avatar prepared at one size and resident in the engine."""

    avatar_id: str
    slot: int
    size: int
    idle_frame: np.ndarray


def _percentiles_ms(values: deque[float]) -> dict[str, float | None]:
    """p50, p95 and p99 of ``values`` (seconds) in milliseconds; None while empty."""
    qs = (50, 95, 99)
    if not values:
        return {f"p{q}": None for q in qs}
    found = np.percentile(np.fromiter(values, float), qs)
    return {f"p{q}": round(1000 * float(v), 1) for q, v in zip(qs, found, strict=True)}


@dataclass(frozen=True)
class SessionContext:
    """What every session of a server shares: its settings, the model, the inference it
    submits frames to, the metrics it counts in, and the encoders' threads and tuning."""

    settings: SessionSettings
    fps: int
    manifest: Manifest
    inference: Inference
    metrics: Metrics
    encodes: EncodeBatches
    vp8: Vp8Tuning


class Session:
    def __init__(self, session_id: str, kind: SessionKind, avatar: AvatarHandle,
                 options: SessionOptions, context: SessionContext, *,
                 motion_only: bool = False, owner: str | None = None, name: str | None = None,
                 token: str | None = None, max_bitrate: int = vpx.MAX_BITRATE,
                 grid_phase: tuple[int, int] | None = None, calibration: bool = False
                 ) -> None:
        loop = asyncio.get_running_loop()
        settings, manifest, fps = context.settings, context.manifest, context.fps
        self.id = session_id
        #: How it was made, so where its speech comes from (``audio``) and who may watch.
        self.kind = kind
        self.owner = owner  # the API key that made it (``server.http.access``), if keys are on
        #: What viewers attach with, where they may (a hosted, WHIP or room session).
        self.token = (token or secrets.token_urlsafe(24)) if kind.watched_with_token \
            else None
        #: A name its creator gave it, unique among live sessions: a kiosk finds it by
        #: name (and token) again after the session is made anew, across server restarts.
        self.name = name
        #: No video: each frame's coefficients on the data channel, and the audio back.
        self.motion_only = motion_only
        #: One of the sessions the front door runs against itself at start-up to measure
        #: what a session costs: no client's, so its end is no news.
        self.calibration = calibration
        self.avatar = avatar
        self.options = options
        self.settings = settings
        self.manifest = manifest
        self.created = time.time()
        self.events = EventStream(self.id)
        self._next_chunk = 0
        self.close_reason: str | None = None
        #: (phase, phases): where on the media grid its clock starts (``on_grid``); None: now.
        self.grid_phase = grid_phase
        origin = loop.time() if grid_phase is None else \
            on_grid(loop.time(), fps, *grid_phase)
        self.clock = MediaClock(origin=origin, fps=fps,
                                delay=settings.pipeline_delay_ms / 1000.0,
                                grace=settings.frame_grace_ms / 1000.0,
                                packet_chunks=settings.audio_packet_ms // 20)
        self._tasks: set[asyncio.Task[None]] = set()
        #: Where its driving speech comes from (``server.media.audio_sources``).
        self.audio = audio_source(kind, session_id, self.clock, settings, self.events,
                                  self._spawn, KEEP_CHUNKS)
        inference, metrics, encodes, vp8 = (context.inference, context.metrics,
                                            context.encodes, context.vp8)
        self._inference = inference
        self._metrics = metrics
        self._windows = FrameWindows(manifest)
        self._resampler = Resampler(manifest.features.sample_rate)
        self._unheard: list[np.ndarray] = []  # timeline chunks the features have not heard
        self._phase = random.uniform(0.0, 1000.0)
        self._chunks: dict[int, np.ndarray] = {}
        self._arrivals: dict[int, float] = {}
        self._audio_sent: dict[int, float] = {}
        # Video frames sent before the audio of the same media time: (content, sent_at).
        self._video_awaiting_audio: dict[int, list[tuple[int, float]]] = {}
        self._frames: dict[int, asyncio.Future[FrameResult | None]] = {}
        self._viewers_started = False
        self._closed = asyncio.Event()
        self._close_task: asyncio.Task[None] | None = None
        self._on_close: list[Callable[[Session], Any]] = []
        self._coefficients: np.ndarray | None = None
        self._coefficient_channels: list[RTCDataChannel] = []
        self._outbound: list[MediaStreamTrack] = []
        self.recording: Path | None = None  # the MP4 this session is recorded to
        #: Where the session sits in an SFU's room, if it does (``server.integrations.janus``).
        #: Shown as is.
        self.room: Callable[[], dict[str, Any]] | None = None
        self._video: SharedVideo | None = None
        self._encodes = encodes
        self._vp8 = vp8
        self._max_bitrate = max_bitrate
        self._coefficients_sent = -1
        self._motion_started = False
        # stats
        self.frames_submitted = 0
        self.frames_dropped = 0
        self.frames_sent = 0
        self.frames_repeated = 0
        self.frames_skipped = 0
        self._sent: deque[tuple[float, bool]] = deque(maxlen=50)  # (when, fresh) per frame
        self._pipeline_delays: deque[float] = deque(maxlen=RECENT_FRAMES)
        self._av_offsets: deque[float] = deque(maxlen=RECENT_FRAMES)
        self._timeline_task = loop.create_task(self._timeline())

    # ---- wiring ---------------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        return self._closed.is_set()

    def on_close(self, callback: Callable[[Session], Any]) -> None:
        self._on_close.append(callback)

    @property
    def state(self) -> str:
        """Its driving peer's connection state (``ready`` for pushed speech), or closed."""
        return "closed" if self._closed.is_set() else self.audio.state

    @property
    def pushed(self) -> PushedSpeech | None:
        """The speech an application pushes into it, if that is where its speech comes
        from (``POST /sessions``)."""
        return self.audio if isinstance(self.audio, PushedSpeech) else None

    def add_audio_track(self, track: MediaStreamTrack) -> None:
        """Its driving peer's audio: the offering peer's, a WHIP publisher's, or a room
        participant's (whose track may come and go)."""
        if not isinstance(self.audio, PeerAudio):
            raise TypeError(f"session {self.id} speaks pushed speech, not a peer's audio")
        self.audio.add_track(track)

    def peer_state(self, state: str) -> None:
        """Its driving peer's connection changed state."""
        self.audio.peer_state(state, asyncio.get_running_loop().time())

    def heard_from_peer(self, at: float) -> None:
        """A peer sent something other than media (an RTCP report): it is still there,
        even with its microphone quiet."""
        self.audio.heard(at)

    def add_coefficient_channel(self, channel: RTCDataChannel) -> None:
        """Send each fresh frame's motion coefficients on ``channel`` as the frame leaves:
        JSON ``{"frame", "time", "coefficients": {name: value}}``, on the video's clock, for
        clients that drive their own avatar (a 3D head, a kiosk) from the same speech.
        A motion-only session starts sending with its first channel."""
        self._coefficient_channels.append(channel)
        if self.motion_only and not self._motion_started:
            self._motion_started = True
            self._spawn(send_motion(self))

    def viewer_tracks(self, shared: bool = True
                      ) -> tuple[SessionAudioTrack, SharedVideoTrack | SessionVideoTrack]:
        """A fresh pair of outbound tracks for one viewer, stopped when the session ends.
        With ``shared`` (a VP8 viewer) its video is the session's one encoding; else it is
        encoded for this viewer alone."""
        if shared and self._video is None:
            self._video = SharedVideo(self, self._encodes, self._vp8,
                                      self._max_bitrate,
                                      self._metrics.frames_encoded.inc)
        video = SharedVideoTrack(self._video) if self._video is not None and shared \
            else SessionVideoTrack(self)
        tracks = SessionAudioTrack(self), video
        self._outbound = [t for t in self._outbound if t.readyState == "live"] + [*tracks]
        return tracks

    def record(self, path: Path) -> None:
        """Write what viewers get to ``path`` (MP4) until the session ends; the recording
        counts as a viewer, so a session nobody else watches is still rendered."""
        _, video = self.viewer_tracks(shared=False)
        self.recording = path
        self._spawn(record(self, video, self.avatar.size, path))

    def interrupt(self) -> dict[str, Any]:
        """Barge-in: everything not yet sent to a viewer goes, together. Queued speech is
        dropped, chunks on the timeline but unsent become silence, the features forget
        them, and frames that would show them are made again from silence, so the mouth
        closes as the sound stops. Says which utterances were cut and how much of each
        was sent (so an agent can cut its transcript to what was heard)."""
        # The first chunk whose time to be sent has not come (the tracks send on the clock).
        now = asyncio.get_running_loop().time()
        cut = max(self.clock.chunk_index_at(now), self._next_chunk - KEEP_CHUNKS)
        for k in range(cut, self._next_chunk):
            self._chunks[k] = np.zeros(self.clock.chunk_samples, np.int16)
        speech = self.pushed
        heard = speech.utterances.cut(cut, self._next_chunk) if speech is not None else []
        self._hear()  # what the features still hold back is silenced with the rest
        rate = self.manifest.features.sample_rate
        self._windows.silence_from(cut * self.clock.chunk_samples * rate // AUDIO_RATE)
        first_frame = -(-cut // self.clock.chunks_per_frame)
        for index in [i for i in self._frames if i >= first_frame]:
            self._submit(index, self._windows.silent_window())
        result = {"session_id": self.id, "interrupted": heard,
                  "at_s": round(cut * self.clock.chunk_seconds, 3), "frame": first_frame}
        self.events.publish({"type": "interrupted", **result})
        return result

    def close_soon(self, reason: str) -> None:
        """Close from a callback or from the session's own tasks."""
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self.close(reason))

    async def close(self, reason: str = "closed") -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.close_reason = reason
        (log.debug if self.calibration else log.info)("session %s closed: %s", self.id,
                                                      reason)
        tasks = [t for t in (self._timeline_task, *self._tasks) if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for future in self._frames.values():
            future.cancel()
        self._frames.clear()
        for track in self._outbound:
            track.stop()
        self._outbound.clear()
        if self._video is not None:
            self._video.close()
        self.audio.close()
        self.events.close()
        for callback in self._on_close:
            result = callback(self)
            if asyncio.iscoroutine(result):
                await result

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- the timeline ---------------------------------------------------------------
    async def _timeline(self) -> None:
        loop = asyncio.get_running_loop()
        k = 0
        try:
            while True:
                due = self.clock.chunk_due(k)
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                reason = self.audio.gone(loop.time(), self._watched())
                if reason:
                    self.close_soon(reason)
                    return
                self._advance(k)
                k += 1
        except asyncio.CancelledError:
            pass

    def _watched(self) -> bool:
        return any(track.readyState == "live" for track in self._outbound)

    def _advance(self, k: int) -> None:
        self._next_chunk = k + 1
        samples, arrival = self.audio.next_chunk(k, asyncio.get_running_loop().time())
        self._chunks[k] = samples
        self._chunks.pop(k - KEEP_CHUNKS, None)
        if arrival is not None:
            self._arrivals[k] = arrival
        self._arrivals.pop(k - KEEP_CHUNKS, None)
        self._audio_sent.pop(k - KEEP_CHUNKS, None)
        self._video_awaiting_audio.pop(k - KEEP_CHUNKS, None)
        self._unheard.append(samples)
        unheard = len(self._unheard) * self.clock.chunk_samples
        if self._windows.samples_pushed + self._resampler.output_after(unheard, AUDIO_RATE) \
                >= self._windows.samples_wanted():
            self._hear()

    def _hear(self) -> None:
        """The features hear the chunks held back, and the frames they complete go to the
        engine. Chunks are held until the next frame's window can be complete, so the
        resampling and the log-mel run once per frame, not once per chunk; no frame waits
        for it."""
        if not self._unheard:
            return
        samples = np.concatenate(self._unheard) if len(self._unheard) > 1 else self._unheard[0]
        self._unheard.clear()
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = AUDIO_RATE
        pcm = self._resampler.resample(frame)
        if pcm.size:
            self._windows.push(pcm.astype(np.float32) / 32768.0)
        self._submit_ready_frames()

    def _submit_ready_frames(self) -> None:
        for i, mel in self._windows.ready():
            if not self._viewers_started or (self.token and not self._watched()):
                continue  # nobody is watching: keep the timeline, skip the compute
            self._submit(i, mel)
            self._frames.pop(i - KEEP_FRAMES, None)

    def _submit(self, i: int, mel: np.ndarray) -> None:
        request = FrameInput.for_frame(self.avatar.slot, i, self.clock.fps, mel,
                                       self.manifest.knob_vector(self.options.values),
                                       self._phase)
        future = self._inference.submit(request, self.clock.frame_deadline(i),
                                        picture=not self.motion_only)
        future.add_done_callback(self._count_drop)
        self._frames[i] = future
        self.frames_submitted += 1

    def _count_drop(self, future: asyncio.Future[FrameResult | None]) -> None:
        if not future.cancelled() and future.result() is None:
            self.frames_dropped += 1

    # ---- what viewer tracks read ----------------------------------------------------
    def video_frame(self, index: int) -> np.ndarray | None:
        self._viewers_started = True
        future = self._frames.get(index)
        if future is None or not future.done() or future.cancelled():
            return None
        result = future.result()
        if result is None:
            return None
        self._coefficients = result.coefficients
        return result.frame

    async def wait_video_frame(self, index: int, until: float) -> np.ndarray | None:
        future = self._frames.get(index)
        if future is not None and not future.done():
            try:
                await asyncio.wait_for(asyncio.shield(future),
                                       until - asyncio.get_running_loop().time())
            except (TimeoutError, asyncio.CancelledError):
                if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    raise
        return self.video_frame(index)

    def idle_frame(self) -> np.ndarray:
        return self.avatar.idle_frame

    def audio_chunk(self, k: int) -> np.ndarray | None:
        return self._chunks.get(k)

    def report_audio(self, k: int, sent_at: float) -> None:
        if k in self._audio_sent:
            return
        self._audio_sent[k] = sent_at
        for content_index, video_at in self._video_awaiting_audio.pop(k, ()):
            self._observe_av_offset(content_index, video_at, sent_at)

    def report_video(self, index: int, content_index: int, sent_at: float) -> None:
        self.frames_sent += 1
        self._sent.append((sent_at, content_index == index))
        self._metrics.frames_sent.inc()
        if content_index != index:
            self.frames_repeated += 1
            self._metrics.frames_repeated.inc()
        if content_index < 0:
            return
        if content_index == index and index > self._coefficients_sent:
            self._coefficients_sent = index
            self._send_coefficients(index)
        # Audio chunk carrying the start of this frame's content, on the same timeline; the
        # two tracks send at the same instants, so either may report first.
        k = content_index * self.clock.chunks_per_frame
        audio_at = self._audio_sent.get(k)
        if audio_at is not None:
            self._observe_av_offset(content_index, sent_at, audio_at)
        else:
            self._video_awaiting_audio.setdefault(k, []).append((content_index, sent_at))
        arrival = self._arrivals.get(k)
        if arrival is not None and content_index == index:
            delay = sent_at - arrival
            self._pipeline_delays.append(delay)
            self._metrics.pipeline_delay.observe(delay)

    def report_skipped(self, count: int) -> None:
        self.frames_skipped += count
        self._metrics.frames_skipped.inc(count)

    def _observe_av_offset(self, content_index: int, video_at: float, audio_at: float) -> None:
        """How much later than its audio a frame left, each against its own schedule."""
        k = content_index * self.clock.chunks_per_frame
        offset = (video_at - self.clock.video_send_time(content_index)) - \
            (audio_at - self.clock.audio_send_time(k))
        self._av_offsets.append(offset)
        self._metrics.av_offset.observe(offset)

    def _send_coefficients(self, index: int) -> None:
        if not self._coefficient_channels or self._coefficients is None:
            return
        message = json.dumps({
            "frame": index, "time": round(index / self.clock.fps, 3),
            "coefficients": {name: round(float(v), 4) for name, v in
                             zip(self.manifest.coefficient_names, self._coefficients,
                                 strict=False)}})
        self._coefficient_channels = [c for c in self._coefficient_channels
                                      if c.readyState in ("connecting", "open")]
        for channel in self._coefficient_channels:
            if channel.readyState == "open":
                channel.send(message)

    # ---- stats ----------------------------------------------------------------------
    def fps(self) -> tuple[float, float]:
        """Frames sent per second, and how many of them were fresh (not a repeat), over the
        last 50 frame times: a viewer counting frames sees the first, lips move at the
        second."""
        sent = self._sent
        if len(sent) < 2 or sent[-1][0] == sent[0][0]:
            return 0.0, 0.0
        span = sent[-1][0] - sent[0][0]
        fresh = sum(is_fresh for _, is_fresh in list(sent)[1:])
        return (len(sent) - 1) / span, fresh / span

    def stats(self) -> dict[str, Any]:
        coefficients = None
        if self._coefficients is not None:
            coefficients = {name: round(float(v), 3) for name, v in
                            zip(self.manifest.coefficient_names, self._coefficients,
                                strict=False)}
        fps, fresh_fps = self.fps()
        return {
            "fps": round(fps, 2),
            "fresh_fps": round(fresh_fps, 2),
            "frames_sent": self.frames_sent,
            "frames_submitted": self.frames_submitted,
            "frames_repeated": self.frames_repeated,
            "frames_skipped": self.frames_skipped,
            "frames_dropped": self.frames_dropped,
            # The shared encoding's rate: the lowest its viewers estimate they can take.
            "video_bitrate": self._video.bitrate if self._video is not None else None,
            "video_estimate": self._video.estimate if self._video is not None else None,
            # Over the last 500 frames (20 s at 25 fps).
            "pipeline_delay_ms": _percentiles_ms(self._pipeline_delays),
            "av_offset_ms": _percentiles_ms(self._av_offsets),
            "audio": self.audio.stats(),
            "coefficients": coefficients,
        }

    def describe(self) -> dict[str, Any]:
        return {
            "session_id": self.id,
            "name": self.name,
            "state": self.state,
            "avatar": self.avatar.avatar_id,
            "size": self.avatar.size,
            "motion_only": self.motion_only,
            # What viewers attach with, shown to whoever may drive the session (a WHIP
            # publisher's operator learns it here: the encoder keeps the answer's headers).
            "token": self.token,
            "kind": self.kind.value,
            "published": self.kind in (SessionKind.ROOM, SessionKind.PUBLISHER),
            "recording": self.recording.name if self.recording else None,
            "room": self.room() if self.room else None,
            "created": self.created,
            "options": dict(self.options.values),
            "stats": self.stats(),
        }
