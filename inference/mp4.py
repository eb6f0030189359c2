"""An MP4 of a talking portrait: H.264 video and AAC audio, each stamped on its own clock.

One writer for the offline render (``inference.render``) and for recording a live session
(``server.media.recording``): frames carry their own ``pts`` and ``time_base`` (frame indices, or
the session's 90 kHz video clock), audio arrives as contiguous mono chunks stamped by their
first sample, so both tracks line up as they did on the clock that made them.
"""

from __future__ import annotations

import fractions
from pathlib import Path

import av
import numpy as np

#: AAC's frame: the audio is cut into pieces of exactly this many samples.
AAC_FRAME = 1024


class Mp4Writer:
    def __init__(self, path: str | Path, *, size: int, fps: int, audio_rate: int = 48000,
                 preset: str = "veryfast") -> None:
        self._container = av.open(str(path), "w", format="mp4")
        self._video = self._container.add_stream("libx264", rate=fps)
        self._video.width = self._video.height = size
        self._video.pix_fmt = "yuv420p"
        self._video.options = {"crf": "20", "preset": preset}
        self._audio = self._container.add_stream("aac", rate=audio_rate)
        self._audio.layout = "mono"
        self._audio_rate = audio_rate
        self._fifo = av.AudioFifo()
        self.frames = 0

    def video(self, frame: av.VideoFrame | np.ndarray, pts: int | None = None,
              time_base: fractions.Fraction | None = None) -> None:
        """One picture: an RGB array stamped ``pts`` in ``time_base``, or a frame already
        stamped."""
        if isinstance(frame, np.ndarray):
            frame = av.VideoFrame.from_ndarray(frame, format="rgb24")
            frame.pts, frame.time_base = pts, time_base
        self._container.mux(self._video.encode(frame))
        self.frames += 1

    def audio(self, samples: np.ndarray, start: int) -> None:
        """Mono samples (int16, or float in [-1, 1]) beginning at sample ``start``; chunks
        follow each other without gaps."""
        pcm = np.ascontiguousarray(samples.reshape(1, -1))
        frame = av.AudioFrame.from_ndarray(pcm, format="s16" if pcm.dtype == np.int16
                                           else "flt", layout="mono")
        frame.sample_rate = self._audio_rate
        frame.pts = start
        frame.time_base = fractions.Fraction(1, self._audio_rate)
        self._fifo.write(frame)
        while self._fifo.samples >= AAC_FRAME:
            self._container.mux(self._audio.encode(self._fifo.read(AAC_FRAME)))

    def close(self) -> None:
        if self._fifo.samples:
            self._container.mux(self._audio.encode(self._fifo.read()))
        self._container.mux(self._video.encode(None))
        self._container.mux(self._audio.encode(None))
        self._container.close()
