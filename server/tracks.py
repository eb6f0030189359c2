"""Outbound aiortc tracks, and the motion-only sender, paced by the session's media clock.

Each viewer gets its own pair of tracks reading the same session, so more viewers only
add encoders. A track sends item ``n`` at its clock time with a pts from the same
origin; if it starts late it skips ahead rather than bursting old media.
"""

from __future__ import annotations

import asyncio
import fractions
from typing import Protocol

import av
import cv2
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from server.encoding import SpeechOpusEncoder
from server.media_clock import AUDIO_RATE, VIDEO_RATE, MediaClock


class VideoSource(Protocol):
    clock: MediaClock

    @property
    def is_closed(self) -> bool: ...

    def video_frame(self, index: int) -> np.ndarray | None:
        """The rendered frame ``index`` if it is ready, else None."""
        ...

    def idle_frame(self) -> np.ndarray: ...

    def report_video(self, index: int, content_index: int, sent_at: float) -> None: ...

    def report_skipped(self, count: int) -> None:
        """``count`` frame times passed unsent: the viewer kept the old picture meanwhile."""
        ...


class AudioSource(Protocol):
    clock: MediaClock

    @property
    def is_closed(self) -> bool: ...

    def audio_chunk(self, k: int) -> np.ndarray | None: ...

    def report_audio(self, k: int, sent_at: float) -> None: ...


async def _sleep_until(t: float) -> None:
    delay = t - asyncio.get_running_loop().time()
    if delay > 0:
        await asyncio.sleep(delay)


class FramePacer:
    """Frame ``i`` of a session leaves at ``clock.video_send_time(i)``: the next index and
    its rendered frame (None if not ready). Frame times that passed while the loop was
    busy are skipped, not burst, and reported as skipped."""

    def __init__(self, source: VideoSource) -> None:
        self._source = source
        self._next = 0

    async def next(self) -> tuple[int, np.ndarray | None]:
        clock = self._source.clock
        index = max(self._next, clock.video_index_at(asyncio.get_running_loop().time()))
        if self._next and index > self._next:
            self._source.report_skipped(index - self._next)
        await _sleep_until(clock.video_send_time(index))
        self._next = index + 1
        return index, self._source.video_frame(index)


async def send_motion(source: VideoSource) -> None:
    """A motion-only session's output: each frame's time is reported as if a frame left,
    and the session sends that frame's coefficients; no picture, so no encoder."""
    pacer = FramePacer(source)
    loop = asyncio.get_running_loop()
    last = -1
    while not source.is_closed:
        index, frame = await pacer.next()
        if frame is not None:
            last = index
        source.report_video(index, last, loop.time())


class SessionVideoTrack(MediaStreamTrack):
    """The avatar's video: frame ``i`` at ``clock.video_send_time(i)``; the last frame is
    repeated when the next one is not ready in time."""

    kind = "video"

    def __init__(self, source: VideoSource) -> None:
        super().__init__()
        self._source = source
        self._pacer = FramePacer(source)
        self._last: np.ndarray | None = None
        self._last_index = -1
        self._time_base = fractions.Fraction(1, VIDEO_RATE)

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live" or self._source.is_closed:
            self.stop()
            raise MediaStreamError
        index, frame = await self._pacer.next()
        if frame is not None:
            self._last, self._last_index = cv2.cvtColor(frame, cv2.COLOR_RGB2YUV_I420), index
        elif self._last is None:
            self._last = cv2.cvtColor(self._source.idle_frame(), cv2.COLOR_RGB2YUV_I420)
        # YUV, converted once per new frame: the encoder then converts nothing.
        out = av.VideoFrame.from_ndarray(self._last, format="yuv420p")
        out.pts = self._source.clock.video_pts(index)
        out.time_base = self._time_base
        self._source.report_video(index, self._last_index, asyncio.get_running_loop().time())
        return out


class SessionAudioTrack(MediaStreamTrack):
    """The driving audio, delayed by the pipeline delay: chunk ``k`` at
    ``clock.audio_send_time(k)``; silence keeps the RTP clock running when there is none.
    Chunks leave already encoded (``SpeechOpusEncoder``): aiortc only packs them."""

    kind = "audio"

    def __init__(self, source: AudioSource) -> None:
        super().__init__()
        self._source = source
        self._next = 0
        self._time_base = fractions.Fraction(1, AUDIO_RATE)
        self._encoder: SpeechOpusEncoder | None = SpeechOpusEncoder()

    async def recv(self) -> av.Packet:
        if self.readyState != "live" or self._source.is_closed:
            self.stop()
            raise MediaStreamError
        clock = self._source.clock
        loop = asyncio.get_running_loop()
        k = max(self._next, clock.chunk_index_at(loop.time()))
        await _sleep_until(clock.audio_send_time(k))
        samples = self._source.audio_chunk(k)
        if samples is None:
            samples = np.zeros(clock.chunk_samples, np.int16)
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = AUDIO_RATE
        frame.pts = clock.audio_pts(k)
        frame.time_base = self._time_base
        self._next = k + 1
        self._source.report_audio(k, loop.time())
        if self._encoder is None:  # stopped while it slept
            raise MediaStreamError
        return self._encoder.encode(frame)

    def stop(self) -> None:
        """Also let the encoder go now: PyAV keeps a resampler in it whose filter graph
        holds a thread per core, and a garbage collection that would free the track may
        be minutes away."""
        super().stop()
        self._encoder = None
