"""Audio in: a peer's audio frames into one 48 kHz mono stream, behind a jitter/drift buffer.

The session clock reads fixed 20 ms chunks at its own pace; this buffer absorbs network
jitter (it refills to ``jitter_ms`` after running dry) and sender clock drift (past
``max_buffer_ms`` it drops the oldest audio). Every chunk read remembers when its first
sample arrived, so the pipeline delay can be measured from the real arrival time.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from server.media_clock import AUDIO_RATE

log = logging.getLogger(__name__)



@dataclass
class IngestStats:
    received_samples: int = 0
    underruns: int = 0
    dropped_samples: int = 0


class AudioIngest:
    """FIFO of mono int16 samples at 48 kHz, read in fixed chunks by the session clock."""

    def __init__(self, chunk_samples: int, jitter_ms: float, max_buffer_ms: float) -> None:
        self.chunk = chunk_samples
        self.target = int(AUDIO_RATE * jitter_ms / 1000)
        self.limit = int(AUDIO_RATE * max_buffer_ms / 1000)
        self.stats = IngestStats()
        self._segments: deque[tuple[np.ndarray, float]] = deque()
        self._level = 0
        self._buffering = True
        self.last_push: float | None = None

    @property
    def level(self) -> int:
        return self._level

    def push(self, samples: np.ndarray, arrival: float) -> None:
        if samples.size == 0:
            return
        self._segments.append((samples, arrival))
        self._level += samples.size
        self.stats.received_samples += samples.size
        self.last_push = arrival
        if self._level > self.limit:
            self._drop(self._level - self.target)

    def read(self) -> tuple[np.ndarray, float | None]:
        """One chunk and the arrival time of its first sample; silence (None) when dry."""
        if self._buffering:
            if self._level < max(self.target, self.chunk):
                return np.zeros(self.chunk, np.int16), None
            self._buffering = False
        if self._level < self.chunk:
            self.stats.underruns += 1
            self._buffering = True
            return np.zeros(self.chunk, np.int16), None
        arrival = self._segments[0][1]
        return self._take(self.chunk), arrival

    def _take(self, count: int) -> np.ndarray:
        parts = []
        while count > 0:
            samples, arrival = self._segments[0]
            if samples.size <= count:
                self._segments.popleft()
                parts.append(samples)
                count -= samples.size
            else:
                parts.append(samples[:count])
                self._segments[0] = (samples[count:], arrival)
                count = 0
        out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self._level -= out.size
        return out

    def _drop(self, count: int) -> None:
        self._take(count)
        self.stats.dropped_samples += count


def to_mono_48k(frame: av.AudioFrame, resampler: av.AudioResampler | None
                ) -> tuple[np.ndarray, av.AudioResampler | None]:
    """Mono int16 at 48 kHz. Takes one channel of packed s16 stereo (down-mixing identical
    channels would add 3 dB); anything else goes through PyAV's resampler."""
    if frame.sample_rate == AUDIO_RATE and frame.format.name == "s16":
        data = frame.to_ndarray().reshape(-1)
        channels = len(frame.layout.channels)
        return (data[::channels] if channels > 1 else data).copy(), resampler
    if resampler is None:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=AUDIO_RATE)
    out = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    return (np.concatenate(out) if out else np.zeros(0, np.int16)), resampler


async def pump_track(track: MediaStreamTrack, ingest: AudioIngest,
                     clock: Callable[[], float]) -> None:
    """Feed an inbound audio track into ``ingest`` until the track ends."""
    resampler: av.AudioResampler | None = None
    try:
        while True:
            frame = await track.recv()
            assert isinstance(frame, av.AudioFrame)
            samples, resampler = to_mono_48k(frame, resampler)
            ingest.push(samples, clock())
    except MediaStreamError:
        log.debug("inbound audio track ended")
