"""Encoders tuned for a session's outbound media: VP8 for rendered video (the tracks hand
it frames already in YUV; ``EncodeBatches`` runs a process's encodes on threads), and Opus
for the returned speech (``join_opus`` puts several frames in one packet).

A session's video was most of its CPU. aiortc converts RGB to YUV with swscale and runs
libvpx with its noise filter, which only blurs frames a model rendered free of noise.
Converting with OpenCV (once per new frame, in the track) and encoding without the filter
halved the cost per 512x512 frame, 3.7 to 1.9 ms, and raised PSNR at 500 kbit/s from 37.7
to 39.6 dB (``python -m benchmarks.encoding``, benchmarks/results/). aiortc has no way to pass
encoder options, so ``use_realtime_vp8`` replaces its VP8 encoder factory for this
process.
"""

from __future__ import annotations

import asyncio
import fractions
import functools
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiortc.rtcrtpsender
import av
import numpy as np
from aiortc.codecs import vpx
from aiortc.codecs.base import Encoder
from aiortc.rtcrtpparameters import RTCRtpCodecParameters

from server.config import VideoSettings
from server.media.clock import AUDIO_RATE
from server.media.opus import OpusEncoder


@dataclass(frozen=True)
class Vp8Tuning:
    """How the server's VP8 encoder trades CPU for picture.

    ``speed`` is libvpx's ``cpu-used`` (higher is faster and a little coarser).
    ``static_threshold`` is its ``static-thresh``: a macroblock whose prediction is
    already this close (summed squared error over its 256 luma pixels) is not coded
    again. A rendered portrait keeps its background, hair and most of its skin still
    while the mouth moves, so most macroblocks of a frame are static: at 500, encoding a
    frame of the default avatar speaking costs 12-22% less CPU at 256x256 and 17-39% less
    at 512, with 16-17% fewer bits, for 0.2-0.4 dB of PSNR over the frame and at most
    0.17 dB over its moving part (``python -m benchmarks.encoding --rendered``)."""

    speed: int = 12
    static_threshold: int = 500


def vp8_tuning(video: VideoSettings) -> Vp8Tuning:
    """The tuning the ``[video]`` settings ask for."""
    return Vp8Tuning(video.encoder_speed, video.static_threshold)


class RealtimeVp8Encoder(vpx.Vp8Encoder):
    """aiortc's VP8 encoder with the noise filter off, tuned by ``Vp8Tuning``."""

    def __init__(self, tuning: Vp8Tuning = Vp8Tuning()) -> None:
        super().__init__()
        self.tuning = tuning

    def compress(self, frame: av.VideoFrame, force_keyframe: bool = False) -> bytes:
        """One frame as a VP8 frame (not yet in RTP payloads)."""
        if frame.format.name != "yuv420p":
            frame = frame.reformat(format="yuv420p")
        codec = self.codec
        if codec is not None and (
                frame.width != codec.width or frame.height != codec.height
                or abs(self.target_bitrate - codec.bit_rate) / codec.bit_rate > 0.1):
            self.codec = None  # re-opened at the new size or rate, as aiortc does
        if force_keyframe:
            frame.pict_type = av.video.frame.PictureType.I
        if self.codec is None:
            self.codec = self._open(frame.width, frame.height)
        return b"".join(bytes(packet) for packet in self.codec.encode(frame))

    def encode(self, frame: av.VideoFrame, force_keyframe: bool = False
               ) -> tuple[list[bytes], int]:
        data = self.compress(frame, force_keyframe)
        payloads = self._packetize(data, self.picture_id)
        timestamp = vpx.convert_timebase(frame.pts, frame.time_base, vpx.VIDEO_TIME_BASE)
        self.picture_id = (self.picture_id + 1) % (1 << 15)
        return payloads, timestamp

    def _open(self, width: int, height: int) -> av.video.codeccontext.VideoCodecContext:
        rate = self.target_bitrate
        codec = av.CodecContext.create("libvpx", "w")
        codec.width, codec.height = width, height
        codec.bit_rate = rate
        codec.pix_fmt = "yuv420p"
        codec.gop_size = 3000
        codec.qmin, codec.qmax = 2, 56
        codec.options = {
            "bufsize": str(rate), "minrate": str(rate), "maxrate": str(rate),  # CBR
            "cpu-used": str(-self.tuning.speed), "deadline": "realtime",
            "lag-in-frames": "0", "noise-sensitivity": "0", "overshoot-pct": "15",
            "undershoot-pct": "100", "partitions": "0",
            "static-thresh": str(self.tuning.static_threshold),
        }
        codec.thread_count = vpx.number_of_threads(width * height,
                                                   multiprocessing.cpu_count())
        return codec


def use_realtime_vp8(tuning: Vp8Tuning) -> None:
    """Every VP8 stream this process sends from now on uses ``RealtimeVp8Encoder``."""
    default = getattr(aiortc.rtcrtpsender.get_encoder, "aiortc_default",
                      aiortc.rtcrtpsender.get_encoder)

    def get_encoder(codec: RTCRtpCodecParameters) -> Encoder:
        if codec.mimeType.lower() == "video/vp8":
            return RealtimeVp8Encoder(tuning)
        return default(codec)

    get_encoder.aiortc_default = default  # type: ignore[attr-defined]
    aiortc.rtcrtpsender.get_encoder = get_encoder


class EncodeBatches:
    """The video encodes of one process's sessions, handed to threads a batch at a time.

    Handing one encode to an executor thread costs about 0.1 ms of CPU (a future, a
    thread woken, the loop woken back through its self-pipe): a sixth of encoding a
    256x256 frame, for every frame of every session. Sessions on one instant of the media
    grid ask in the same turn of the loop, so what is asked in one turn goes together, up
    to ``per_hand_off`` encodes a thread (one after another there: the last of them is
    ready that much later), and comes back with one wake-up. PyAV lets the GIL go while
    libvpx encodes, so the threads run beside the loop."""

    def __init__(self, per_hand_off: int = 4) -> None:
        self.per_hand_off = per_hand_off
        self._threads = ThreadPoolExecutor(thread_name_prefix="encode")
        self._asked: list[tuple[Callable[[], bytes], asyncio.Future[bytes]]] = []

    def compress(self, encoder: RealtimeVp8Encoder, frame: av.VideoFrame,
                 force_keyframe: bool = False) -> asyncio.Future[bytes]:
        """``encoder.compress(frame, force_keyframe)`` on a thread, with the others asked
        in this turn of the loop."""
        loop = asyncio.get_running_loop()
        if not self._asked:
            loop.call_soon(self._hand_off, loop)
        future: asyncio.Future[bytes] = loop.create_future()
        self._asked.append((functools.partial(encoder.compress, frame, force_keyframe),
                            future))
        return future

    def _hand_off(self, loop: asyncio.AbstractEventLoop) -> None:
        asked, self._asked = self._asked, []
        for start in range(0, len(asked), self.per_hand_off):
            self._threads.submit(self._encode, loop, asked[start:start + self.per_hand_off])

    @staticmethod
    def _encode(loop: asyncio.AbstractEventLoop,
                batch: list[tuple[Callable[[], bytes], asyncio.Future[bytes]]]) -> None:
        done: list[tuple[asyncio.Future[bytes], bytes | None, BaseException | None]] = []
        for encode, future in batch:
            try:
                done.append((future, encode(), None))
            except Exception as exc:  # noqa: BLE001 - the session that asked gets it
                done.append((future, None, exc))
        loop.call_soon_threadsafe(_settle, done)

    def close(self) -> None:
        self._threads.shutdown(wait=False)


def _settle(done: list[tuple[asyncio.Future[bytes], bytes | None, BaseException | None]]
            ) -> None:
    for future, data, error in done:
        if future.done():  # its session stopped waiting
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(data)  # type: ignore[arg-type]


class SpeechOpusEncoder:
    """The returned speech as Opus packets, made in the audio track so aiortc only packs
    them. aiortc's own encoder resamples every 20 ms chunk to stereo and runs on an
    executor thread (a thread hop per chunk costs more than encoding it); this one codes
    the mono chunk as it is, by libopus itself (``server.media.opus``), CELT-only (``lowdelay``)
    at 64 kbit/s, at complexity 5 (what WebRTC itself uses on phones): about a fifth less
    CPU than the default 10, with the same spectral error on real speech (``python -m
    benchmarks.speech_encoding``). Packets carry the chunk's own timestamp, so a track
    that skips ahead stays on the session clock.

    Digital silence (a muted or quiet peer, a hosted session between utterances, an
    underrun) costs libopus twice what speech does, for a 3-byte packet that is the same
    every time once the sound before it has died away. So once two silent chunks in a row
    came out the same, further silent chunks send that packet again without the encoder.
    Only encoder-side state (the bits VBR saves up) differs from coding them all: the
    decoded speech after a pause is within 0.2 dB of SNR (``tests/test_encoding.py``)."""

    def __init__(self, complexity: int = 5) -> None:
        self._time_base = fractions.Fraction(1, AUDIO_RATE)
        self._encoder = OpusEncoder(bitrate=64000, complexity=complexity)
        self._last = b""
        self._same_silence = 0  # silent chunks in a row that came out as ``_last``

    def encode(self, samples: np.ndarray, pts: int) -> av.Packet:
        """One 20 ms chunk (mono int16 at 48 kHz) that starts at sample ``pts`` in, one
        packet out."""
        silent = not samples.any()
        if not (silent and self._same_silence >= 2):
            data = self._encoder.encode(samples)
            self._same_silence = (self._same_silence + 1 if data == self._last else 1) \
                if silent else 0
            self._last = data
        packet = av.Packet(self._last)
        packet.pts, packet.time_base = pts, self._time_base
        return packet


def _opus_length(size: int) -> bytes:
    """A frame's length as an Opus packet codes it (RFC 6716, 3.2.1)."""
    if size < 252:
        return bytes([size])
    first = 252 + (size & 3)
    return bytes([first, (size - first) >> 2])


def join_opus(packets: list[av.Packet]) -> av.Packet | None:
    """Consecutive one-frame Opus packets of 20 ms as one packet of all their frames (RFC
    6716, 3.2.5: code 3, each length but the last coded), stamped as the first; None
    where they cannot share one (not one frame each, their modes differ, or more than
    the 120 ms a packet may hold). Sending 40 ms of
    speech a packet halves the audio's packets, and with them the per-packet work of
    the sender (RTP, SRTP, a system call each); the frames are the encoder's own, so the
    sound is the same."""
    data = [bytes(p) for p in packets]
    if len(data) < 2 or len(data) > 6 or any(not d or d[0] & 0x03 for d in data) or \
            any(d[0] != data[0][0] for d in data):
        return None
    frames = [d[1:] for d in data]
    header = bytes([data[0][0] | 0x03, 0x80 | len(frames)])  # code 3, VBR, no padding
    lengths = b"".join(_opus_length(len(f)) for f in frames[:-1])
    joined = av.Packet(header + lengths + b"".join(frames))
    joined.pts, joined.time_base = packets[0].pts, packets[0].time_base
    return joined
