"""Speech a test or benchmark peer sends: Opus packets encoded once and sent on
time, or PCM paced with a skewed or stalling clock, as real senders do."""

from __future__ import annotations

import asyncio
import fractions
import time
from collections import deque

import av
import numpy as np
from aiortc.mediastreams import MediaStreamTrack

from server.media.encoding import SpeechOpusEncoder, join_opus


class EncodedSpeech(MediaStreamTrack):
    """Speech sent as Opus packets encoded once, in real time and looped: what a load
    generator's peers send, so that thousands of them do not each run an encoder (and
    aiortc's, which resamples every chunk to stereo on a thread of its own)."""

    kind = "audio"

    #: One packet's speech; packets sent later than ``LATE_S`` past their time are
    #: recorded in ``late``.
    PERIOD_S = 0.02
    LATE_S = 0.002

    def __init__(self, packets: list[bytes]) -> None:
        super().__init__()
        self._packets = packets
        self._n = 0
        self._start: float | None = None
        #: 20 ms frames a packet carries: ``run_session`` sets it from the answer's
        #: ``a=ptime``, as a browser does (``asked_ptime``).
        self.frames_per_packet = 1
        self._unsent: deque[av.Packet] = deque()  # frames that could not be joined
        #: (monotonic time, seconds late) of each packet that left over ``LATE_S`` after
        #: its time: the sender's own jitter (a busy loop, then a burst to catch up), which
        #: the server's jitter buffer then holds as extra delay.
        self.late: list[tuple[float, float]] = []

    @classmethod
    def encode_wav(cls, path: str) -> list[bytes]:
        """A WAV's speech (any rate and layout) as one mono Opus packet per 20 ms."""
        resampler = av.AudioResampler(format="s16", layout="mono", rate=48000)
        with av.open(path) as container:
            return cls.encode_pcm(np.concatenate([
                out.to_ndarray().reshape(-1) for frame in container.decode(audio=0)
                for out in resampler.resample(frame)]))

    @staticmethod
    def encode_pcm(pcm: np.ndarray) -> list[bytes]:
        """Mono 48 kHz int16 speech as one Opus packet per 20 ms."""
        encoder = SpeechOpusEncoder()
        return [bytes(encoder.encode(pcm[n * 960:(n + 1) * 960], n * 960))
                for n in range(pcm.size // 960)]

    @property
    def packet_s(self) -> float:
        """Speech a packet carries, in seconds: the time between two packets."""
        return self.PERIOD_S * self.frames_per_packet

    async def recv(self) -> av.Packet:
        if self._unsent:
            return self._unsent.popleft()
        loop = asyncio.get_running_loop()
        if self._start is None:
            self._start = loop.time()
        due = self._start + self._n * self.PERIOD_S
        if due > loop.time():
            await asyncio.sleep(due - loop.time())
        if (now := loop.time()) - due > self.LATE_S:
            self.late.append((now, now - due))
        frames = [self._frame(self._n + i) for i in range(self.frames_per_packet)]
        self._n += len(frames)
        joined = join_opus(frames) if len(frames) > 1 else frames[0]
        if joined is not None:
            return joined
        self._unsent.extend(frames[1:])
        return frames[0]

    def _frame(self, n: int) -> av.Packet:
        packet = av.Packet(self._packets[n % len(self._packets)])
        packet.pts, packet.time_base = n * 960, fractions.Fraction(1, 48000)
        return packet


class PacedSpeech(MediaStreamTrack):
    """Mono 48 kHz speech (looped) in 20 ms frames on a sender clock that may run off
    true time by ``skew`` (0.01: 1% fast) and may stall: the frames due in
    ``[stall_at, stall_at + stall_s)`` all leave when the stall ends."""

    kind = "audio"

    def __init__(self, pcm: np.ndarray, *, skew: float = 0.0, stall_at: float = -1.0,
                 stall_s: float = 0.0) -> None:
        super().__init__()
        self.pcm = pcm
        self.skew = skew
        self.stall_at, self.stall_s = stall_at, stall_s
        self.n = 0
        self.start: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self.start is None:
            self.start = time.monotonic()
        at = self.n * 0.02
        if self.stall_at <= at < self.stall_at + self.stall_s:
            at = self.stall_at + self.stall_s
        await asyncio.sleep(max(0.0, self.start + at / (1.0 + self.skew) - time.monotonic()))
        offset = (self.n * 960) % (self.pcm.size - 960)
        frame = av.AudioFrame.from_ndarray(self.pcm[offset:offset + 960].reshape(1, -1),
                                           format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48000, self.n * 960
        frame.time_base = fractions.Fraction(1, 48000)
        self.n += 1
        return frame
