"""What a viewer received, saved as an MP4 (H.264 and AAC): each frame and each piece of
sound placed where the server meant it to play, by the sender reports of both streams
(``Stream.sender_times``), so lips and sound line up in the file as a browser plays them."""

from __future__ import annotations

import fractions
from pathlib import Path

import numpy as np

from inference.mp4 import Mp4Writer
from server.client.peer import RATES, Received, Stream

VIDEO_TIME_BASE = fractions.Fraction(1, RATES["video"])


def _times(stream: Stream) -> np.ndarray:
    """Each item's time in seconds: on the server's clock where sender reports came, else
    from the stream's own RTP clock."""
    try:
        return stream.sender_times()
    except RuntimeError:
        return np.asarray(stream.pts, np.float64) / RATES[stream.kind]


def save_mp4(received: Received, path: str | Path, fps: int = 25) -> int:
    """Write ``received`` (taken with ``keep``) to ``path``; the frames written."""
    video, audio = received.video, received.audio
    if not video.data:
        raise ValueError("no video frames were kept to save (a motion-only session?)")
    video_at, audio_at = _times(video), _times(audio) if audio.data else np.zeros(0)
    start = min(video_at[0], audio_at[0]) if audio_at.size else video_at[0]
    writer = Mp4Writer(path, size=video.data[0].shape[0], fps=fps, audio_rate=RATES["audio"])
    try:
        if audio.data:
            rate = RATES["audio"]
            places = np.round((audio_at - start) * rate).astype(np.int64)
            track = np.zeros(int(places[-1]) + audio.data[-1].size, np.int16)
            for at, samples in zip(places, audio.data, strict=True):
                track[at:at + samples.size] = samples  # a lost packet stays silent
            writer.audio(track, 0)
        last = -1
        for at, picture in zip(video_at, video.data, strict=True):
            pts = max(last + 1, round((at - start) * RATES["video"]))
            writer.video(picture, pts, VIDEO_TIME_BASE)
            last = pts
    finally:
        writer.close()
    return writer.frames
