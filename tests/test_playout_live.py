"""Adaptive playout with a real aiortc peer: a sender that stalls for 250 ms and then
sends its backlog at once has its buffer back at its target within 5 s, with nothing
dropped and lips and sound still together."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest

from inference.tts import SpeechUnavailable, conversation
from server.client.peer import run_session
from server.client.speech import PacedSpeech

pytestmark = pytest.mark.e2e

STALL_AT, STALL_S = 4.0, 0.25


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
        run_session(server.url, "", seconds=13.0, keep=False,
                    audio=PacedSpeech(pcm, stall_at=STALL_AT, stall_s=STALL_S)),
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
