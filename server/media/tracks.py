"""Outbound aiortc tracks, and the motion-only sender, paced by the session's media clock.

Each viewer gets its own pair of tracks reading the same session, so more viewers only
add encoders. A track sends item ``n`` at its clock time with a pts from the same
origin; if it starts late it skips ahead rather than bursting old media.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import av
import numpy as np
from aiortc.codecs import vpx
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from inference.pixels import rgb_to_i420
from server.media.clock import VIDEO_RATE, MediaClock
from server.media.encoding import (
    EncodeBatches,
    RealtimeVp8Encoder,
    SpeechOpusEncoder,
    Vp8Tuning,
    join_opus,
)

log = logging.getLogger(__name__)


class VideoSource(Protocol):
    clock: MediaClock

    @property
    def is_closed(self) -> bool: ...

    def video_frame(self, index: int) -> np.ndarray | None:
        """The rendered frame ``index`` (I420) if it is ready, else None."""
        ...

    async def wait_video_frame(self, index: int, until: float) -> np.ndarray | None:
        """The rendered frame ``index`` (I420) once it is ready, if that is by loop time
        ``until``; else None."""
        ...

    def idle_frame(self) -> np.ndarray:
        """The portrait at rest (RGB)."""
        ...

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


async def sleep_until(t: float) -> None:
    delay = t - asyncio.get_running_loop().time()
    if delay > 0:
        await asyncio.sleep(delay)


class FramePacer:
    """Frame ``i`` of a session leaves at ``clock.video_send_time(i)``: the next index and
    its rendered frame, or None if it is not ready within ``clock.grace`` of that (a frame
    a few milliseconds late is shown late, lips that much behind the sound, rather than
    the last picture again for a whole frame). A frame the loop comes to late still leaves,
    that much late; only a frame time the next one's has also passed is skipped, not
    burst, and reported as skipped: skipping every frame whose time had passed at all
    made a worker a few milliseconds behind lose whole frames."""

    def __init__(self, source: VideoSource) -> None:
        self._source = source
        self._next = 0

    async def next(self) -> tuple[int, np.ndarray | None]:
        clock = self._source.clock
        index = max(self._next, clock.video_index_due(asyncio.get_running_loop().time()))
        if self._next and index > self._next:
            self._source.report_skipped(index - self._next)
        due = clock.video_send_time(index)
        await sleep_until(due)
        self._next = index + 1
        frame = self._source.video_frame(index)
        if frame is None and clock.grace > 0:
            frame = await self._source.wait_video_frame(index, due + clock.grace)
        return index, frame


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


VIDEO_TIME_BASE = fractions.Fraction(1, VIDEO_RATE)


def i420_frame(yuv: np.ndarray) -> av.VideoFrame:
    """A video frame of an I420 picture, (3/2 H, W) as OpenCV makes it, copied plane by
    plane: a tenth of ``VideoFrame.from_ndarray``'s time (5.6 against 55 us at 256x256),
    once per frame time of every session."""
    height, width = yuv.shape[0] * 2 // 3, yuv.shape[1]
    frame = av.VideoFrame(width, height, "yuv420p")
    planes = frame.planes
    if any(p.line_size != p.width for p in planes):  # rows padded: copy row by row
        return av.VideoFrame.from_ndarray(yuv, format="yuv420p")
    flat = yuv.reshape(-1)
    luma, chroma = width * height, width * height // 4
    planes[0].update(flat[:luma])
    planes[1].update(flat[luma:luma + chroma])
    planes[2].update(flat[luma + chroma:])
    return frame


class PicturePacer:
    """Each frame time on the session clock and the picture it shows: the newest rendered
    frame, the last one again when the next is not ready in time, the idle portrait before
    any. Rendered frames come in I420 (the engine converts them), so neither this nor the
    encoder converts anything; each frame time is reported to the session as it leaves."""

    def __init__(self, source: VideoSource) -> None:
        self._source = source
        self._pacer = FramePacer(source)
        self._last: np.ndarray | None = None
        self._last_index = -1

    async def next(self) -> av.VideoFrame:
        index, frame = await self._pacer.next()
        if frame is not None:
            self._last = frame
            self._last_index = index
        elif self._last is None:
            self._last = rgb_to_i420(self._source.idle_frame())
        out = i420_frame(self._last)
        out.pts, out.time_base = self._source.clock.video_pts(index), VIDEO_TIME_BASE
        self._source.report_video(index, self._last_index, asyncio.get_running_loop().time())
        return out


class SessionVideoTrack(MediaStreamTrack):
    """The avatar's video for one viewer, encoded by its own sender (``SharedVideo``
    encodes once for all viewers where the codec allows)."""

    kind = "video"

    def __init__(self, source: VideoSource) -> None:
        super().__init__()
        self._source = source
        self._pictures = PicturePacer(source)

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live" or self._source.is_closed:
            self.stop()
            raise MediaStreamError
        return await self._pictures.next()


#: Encoded frames a viewer may fall behind by before it is made to start again at a key
#: frame (its decoder could not use a later frame without the ones it missed).
VIEWER_BACKLOG = 25
#: The shared encoding's rate rises at most this often (each change re-opens the encoder).
RETARGET_EVERY_S = 5.0


class SharedVideo:
    """A session's video encoded once for all its viewers (VP8): a task paces the frames
    on the session clock, encodes each once (on a thread, with the other sessions' of the
    instant: ``EncodeBatches``) and hands the same packet to every viewer's queue, where
    aiortc only packetises it. A viewer starts at a key frame (one is made
    when it joins, and when any viewer reports a lost picture); a viewer too far behind
    starts again at the next. Before, every viewer had an encoder of its own.

    One encoding has one rate: the lowest that any viewer's receiver estimates it can
    take (REMB), so that no viewer is sent more than its path carries; aiortc's default
    until a viewer says, and never above ``max_bitrate``. (Viewers on poorer paths holding
    back the rest is the price of encoding once; simulcast layers would lift it.)"""

    def __init__(self, source: VideoSource, encodes: EncodeBatches, tuning: Vp8Tuning,
                 max_bitrate: int = vpx.MAX_BITRATE,
                 on_encoded: Callable[[], None] = lambda: None,
                 retarget_every_s: float = RETARGET_EVERY_S) -> None:
        self._source = source
        self._encodes = encodes
        self._encoder = RealtimeVp8Encoder(tuning)
        self._max_bitrate = max_bitrate
        self._encoder.target_bitrate = min(self._encoder.target_bitrate, max_bitrate)
        self._on_encoded = on_encoded
        self._queues: dict[asyncio.Queue[av.Packet | None], bool] = {}  # -> has a key frame
        self._rates: dict[asyncio.Queue[av.Packet | None], int] = {}  # -> estimate, bit/s
        self._retarget_every_s = retarget_every_s
        self._retargeted = float("-inf")  # when the rate last changed (monotonic)
        self._held_rise: asyncio.TimerHandle | None = None  # a rise waiting out the hold
        self._keyframe = False
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def attach(self) -> asyncio.Queue[av.Packet | None]:
        queue: asyncio.Queue[av.Packet | None] = asyncio.Queue(VIEWER_BACKLOG + 1)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return queue

    def start(self, queue: asyncio.Queue[av.Packet | None]) -> None:
        """The viewer's sender reads ``queue`` from now (its transport is up): it gets the
        packets from the next frame on, a key frame made for it. Packets queued while the
        handshake ran would reach it in a burst, as old as the handshake took."""
        if self._closed:
            queue.put_nowait(None)
            return
        self._queues[queue] = False
        self._keyframe = True

    def detach(self, queue: asyncio.Queue[av.Packet | None]) -> None:
        self._queues.pop(queue, None)
        self._rates.pop(queue, None)
        self._retarget()

    def request_keyframe(self) -> None:
        self._keyframe = True

    def limit_bitrate(self, queue: asyncio.Queue[av.Packet | None], bitrate: int) -> None:
        """The viewer reading ``queue`` estimates it can take ``bitrate`` bit/s."""
        if queue in self._queues:
            self._rates[queue] = bitrate
            self._retarget()

    @property
    def bitrate(self) -> int:
        """The rate the encoder aims at (within aiortc's VP8 limits)."""
        return self._encoder.target_bitrate

    @property
    def estimate(self) -> int | None:
        """The lowest rate any viewer estimates it can take; None until one says."""
        return min(self._rates.values(), default=None)

    def _retarget(self) -> None:
        """A new rate re-opens the encoder (a key frame for everyone): follow a fall at
        once, a rise only once it is 10% and the last change 5 s old, so that estimates
        wandering as they ramp do not re-open it every second. A rise held back is taken
        when the hold ends, also when no viewer reports again (the poorest one left)."""
        if self._held_rise is not None:
            self._held_rise.cancel()
            self._held_rise = None
        estimate = self.estimate
        target = min(vpx.DEFAULT_BITRATE if estimate is None else estimate,
                     self._max_bitrate)
        current = self._encoder.target_bitrate
        now = time.monotonic()
        held = self._retargeted + self._retarget_every_s - now
        if target <= 0.9 * current or (target >= 1.1 * current and held <= 0):
            self._encoder.target_bitrate = target
            self._retargeted = now
        elif target >= 1.1 * current and not self._closed:
            self._held_rise = asyncio.get_running_loop().call_later(held, self._retarget)

    def close(self) -> None:
        """Viewers' streams end, and the encoder goes now, not at a later collection."""
        self._closed = True
        if self._held_rise is not None:
            self._held_rise.cancel()
        if self._task is not None:
            self._task.cancel()
        for queue in self._queues:
            queue.put_nowait(None)
        self._queues.clear()
        self._encoder.codec = None

    async def _run(self) -> None:
        try:
            await self._encode_frames()
        except Exception:
            log.exception("the session's video encoder failed; its viewers' video ends")
            self.close()

    async def _encode_frames(self) -> None:
        pictures = PicturePacer(self._source)
        while not self._source.is_closed:
            picture = await pictures.next()
            if not self._queues:
                continue
            pts = picture.pts  # (encoding rescales the frame's)
            key, self._keyframe = self._keyframe, False
            data = await self._encodes.compress(self._encoder, picture, key)
            self._on_encoded()
            packet = av.Packet(data)
            packet.pts, packet.time_base = pts, VIDEO_TIME_BASE
            is_key = bool(data) and not data[0] & 0x01  # VP8: bit 0 clear on a key frame
            for queue, started in list(self._queues.items()):
                if not started and not is_key:
                    continue
                if queue.qsize() >= VIEWER_BACKLOG:
                    while not queue.empty():
                        queue.get_nowait()
                    self._queues[queue] = False
                    self._keyframe = True
                    continue
                self._queues[queue] = True
                queue.put_nowait(packet)


class SharedVideoTrack(MediaStreamTrack):
    """One viewer's video from its session's ``SharedVideo``: packets already encoded."""

    kind = "video"

    def __init__(self, video: SharedVideo) -> None:
        super().__init__()
        self._video = video
        self._queue = video.attach()
        self._reading = False

    def request_keyframe(self) -> None:
        """For this viewer's sender, when its viewer reports a lost picture (PLI, FIR)."""
        self._video.request_keyframe()

    def limit_bitrate(self, bitrate: int) -> None:
        """For this viewer's sender, when its viewer estimates what it can take (REMB)."""
        self._video.limit_bitrate(self._queue, bitrate)

    async def recv(self) -> av.Packet:
        if self.readyState != "live":
            raise MediaStreamError
        if not self._reading:
            self._reading = True
            self._video.start(self._queue)
        packet = await self._queue.get()
        if packet is None:
            self.stop()
            raise MediaStreamError
        return packet

    def stop(self) -> None:
        super().stop()
        self._video.detach(self._queue)


class SessionAudioTrack(MediaStreamTrack):
    """The driving audio, delayed by the pipeline delay: the packet of chunks from ``k``
    at ``clock.audio_send_time(k)``; silence keeps the RTP clock running when there is
    none. Chunks leave already encoded (``SpeechOpusEncoder``), ``clock.packet_chunks``
    of them joined in one packet (``join_opus``): aiortc only packs them."""

    kind = "audio"

    def __init__(self, source: AudioSource) -> None:
        super().__init__()
        self._source = source
        self._next = 0
        self._encoder: SpeechOpusEncoder | None = SpeechOpusEncoder()
        self._unsent: deque[av.Packet] = deque()  # chunks that could not be joined

    async def recv(self) -> av.Packet:
        if self.readyState != "live" or self._source.is_closed:
            self.stop()
            raise MediaStreamError
        if self._unsent:
            return self._unsent.popleft()
        clock = self._source.clock
        loop = asyncio.get_running_loop()
        k = max(self._next, clock.chunk_index_due(loop.time()))  # late: sent late, as video
        await sleep_until(clock.audio_send_time(k))
        now = loop.time()
        packets = [self._encode(j, now) for j in range(k, k + clock.packet_chunks)]
        self._next = k + clock.packet_chunks
        joined = join_opus(packets) if len(packets) > 1 else packets[0]
        if joined is not None:
            return joined
        self._unsent.extend(packets[1:])
        return packets[0]

    def _encode(self, k: int, now: float) -> av.Packet:
        clock = self._source.clock
        samples = self._source.audio_chunk(k)
        if samples is None:
            samples = np.zeros(clock.chunk_samples, np.int16)
        self._source.report_audio(k, now)
        if self._encoder is None:  # stopped while it slept
            raise MediaStreamError
        return self._encoder.encode(samples, clock.audio_pts(k))

    def stop(self) -> None:
        """Also let the encoder (its libopus state) go now: a garbage collection that
        would free the track may be minutes away, and a ``recv`` asleep meanwhile ends
        when it wakes."""
        super().stop()
        self._encoder = None
