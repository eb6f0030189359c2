"""One clock per session: where every chunk of audio and every video frame sits in time.

The session timeline starts at ``origin`` (loop time). Timeline audio chunk ``k`` covers
``[k, k+1) * chunk`` of input audio and is read from the ingest buffer when it is due;
video frame ``i`` shows input time ``i / fps``. Both leave the server exactly
``delay`` after the input they carry, stamped from the same origin (audio by sample
count, video by frame index), so lips and sound stay together at the viewer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The audio rate of the whole server: ingest, the timeline and the outbound track (Opus).
AUDIO_RATE = 48000
VIDEO_RATE = 90000  # RTP clock of video


def on_grid(now: float, fps: int, phase: int, phases: int) -> float:
    """The first time at or after ``now`` on the media grid: whole frame periods of the
    monotonic clock (which every process of the server reads), shifted by ``phase``
    of ``phases`` equal parts of one.

    Sessions whose clocks start on the grid share their instants: their timers fire
    together, so one wake-up of a worker's loop serves every session then due, and their
    frames reach the shared scheduler together, as one batch per phase rather than one
    small batch per session. Spread over the phases, each instant carries a share of the
    sessions rather than all of them. A session starting on the grid waits at most a
    frame period for its first chunk; its delay is unchanged."""
    period = 1.0 / fps
    offset = phase * period / phases
    return math.ceil((now - offset) / period) * period + offset


@dataclass(frozen=True)
class MediaClock:
    origin: float
    fps: int
    delay: float
    chunk_samples: int = AUDIO_RATE // 50
    #: How late past its send time a frame may still leave, rather than the last one again.
    grace: float = 0.0
    #: Audio chunks sent together in one packet, at the first one's send time.
    packet_chunks: int = 1

    @property
    def chunk_seconds(self) -> float:
        return self.chunk_samples / AUDIO_RATE

    @property
    def packet_seconds(self) -> float:
        return self.packet_chunks * self.chunk_seconds

    @property
    def frame_seconds(self) -> float:
        return 1.0 / self.fps

    @property
    def chunks_per_frame(self) -> int:
        return round(self.frame_seconds / self.chunk_seconds)

    def chunk_due(self, k: int) -> float:
        """When chunk ``k``'s last sample has had time to arrive."""
        return self.origin + (k + 1) * self.chunk_seconds

    def audio_send_time(self, k: int) -> float:
        """When chunk ``k`` leaves: with the packet it is in, at that packet's first chunk's
        time on the timeline."""
        return self.origin + self.delay + (k - k % self.packet_chunks) * self.chunk_seconds

    def video_send_time(self, i: int) -> float:
        return self.origin + self.delay + i * self.frame_seconds

    def frame_deadline(self, i: int) -> float:
        """When frame ``i`` must be rendered by to be shown at all (``grace``)."""
        return self.video_send_time(i) + self.grace

    def _periods_sent(self, t: float, period: float) -> float:
        """Periods of the outbound timeline elapsed by ``t``."""
        return (t - self.origin - self.delay) / period

    def video_index_due(self, t: float) -> int:
        """The newest frame whose send time has come by ``t`` (0 before the first)."""
        return max(0, math.floor(self._periods_sent(t, self.frame_seconds) + 1e-6))

    def chunk_index_due(self, t: float) -> int:
        """The first chunk of the newest audio packet whose send time has come by ``t`` (0
        before the first)."""
        packets = math.floor(self._periods_sent(t, self.packet_seconds) + 1e-6)
        return max(0, packets * self.packet_chunks)

    def chunk_index_at(self, t: float) -> int:
        """The first audio chunk whose send time has not passed by ``t`` (a packet's first)."""
        packets = math.ceil(self._periods_sent(t, self.packet_seconds))
        return max(0, packets * self.packet_chunks)

    def video_pts(self, i: int) -> int:
        return i * VIDEO_RATE // self.fps

    def audio_pts(self, k: int) -> int:
        return k * self.chunk_samples
