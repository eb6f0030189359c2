"""Adaptive playout with a real aiortc peer: a sender that stalls for 250 ms and then
sends its backlog at once has its buffer back at its target within 5 s, with nothing
dropped and lips and sound still together."""

from __future__ import annotations

import asyncio
import fractions
import time

import aiohttp
import av
import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamTrack

from inference.tts import SpeechUnavailable, conversation
from server.client import run_session

STALL_AT, STALL_S = 4.0, 0.25


class StallingSpeech(MediaStreamTrack):
    """Speech in 20 ms frames on the sender's clock, except that the frames due during
    the stall all leave when it ends."""

    kind = "audio"

    def __init__(self, pcm: np.ndarray) -> None:
        super().__init__()
        self.pcm = pcm
        self.n = 0
        self.start: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self.start is None:
            self.start = time.monotonic()
        at = self.n * 0.02
        if STALL_AT <= at < STALL_AT + STALL_S:
            at = STALL_AT + STALL_S
        await asyncio.sleep(max(0.0, self.start + at - time.monotonic()))
        offset = (self.n * 960) % (self.pcm.size - 960)
        frame = av.AudioFrame.from_ndarray(self.pcm[offset:offset + 960].reshape(1, -1),
                                           format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48000, self.n * 960
        frame.time_base = fractions.Fraction(1, 48000)
        self.n += 1
        return frame


async def test_a_stalled_sender_gets_its_delay_back_with_nothing_dropped(server):
    try:
        pcm = conversation(48000).astype(np.int16)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    buffered: list[tuple[float, float]] = []  # (seconds since start, buffer ms)
    last: dict = {}

    async def watch() -> None:
        begun = time.monotonic()
        async with aiohttp.ClientSession() as http:
            while time.monotonic() - begun < 12.5:
                await asyncio.sleep(0.25)
                async with http.get(f"{server.url}/sessions") as response:
                    sessions = (await response.json())["sessions"]
                if sessions:
                    last.update(sessions[-1])
                    buffered.append((time.monotonic() - begun,
                                     sessions[-1]["stats"]["audio"]["buffer_ms"]))

    received, _ = await asyncio.gather(
        run_session(server.url, "", seconds=13.0, audio=StallingSpeech(pcm), keep=False),
        watch())
    t = np.array([b[0] for b in buffered])
    ms = np.array([b[1] for b in buffered])
    # Polled at any moment, the buffer holds its target (session.jitter_ms, 30 ms) plus up
    # to the 20 ms chunk about to be read: 30-50 ms.
    target = 30 + 20
    assert ms[(t > STALL_AT) & (t < STALL_AT + 1.5)].max() > target + 150  # the backlog ...
    after = ms[t > STALL_AT + STALL_S + 5.0]  # ... is gone 5 s after the stall ended
    assert after.size >= 8 and after.max() <= target + 20, after
    audio = last["stats"]["audio"]
    assert audio["dropped_ms"] == 0 and audio["removed_ms"] > 100
    assert abs(last["stats"]["av_offset_ms"]["p95"]) < 40  # lips and sound together
    assert received.video_fps() >= 24.0
