"""A session lives as long as its peer does, not as long as its microphone talks: a quiet
microphone keeps the call (the peer still reports on what it receives), while an offer
whose peer never connects frees its place after session.connect_timeout_s, counted apart."""

from __future__ import annotations

import asyncio
import fractions
import time

import aiohttp
import av
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection
from aiortc.mediastreams import MediaStreamTrack

from server.client.peer import run_session

pytestmark = pytest.mark.e2e


class SpeaksThenFallsSilent(MediaStreamTrack):
    """One second of a tone, then no audio packets at all (a muted microphone)."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.start: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self.start is None:
            self.start = time.monotonic()
        if self.n >= 50:
            await asyncio.Event().wait()  # never again
        await asyncio.sleep(max(0.0, self.start + self.n * 0.02 - time.monotonic()))
        t = (self.n * 960 + np.arange(960)) / 48000
        pcm = (3000 * np.sin(2 * np.pi * 220 * t)).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48000, self.n * 960
        frame.time_base = fractions.Fraction(1, 48000)
        self.n += 1
        return frame


def _closed(exposition: str, reason: str) -> float:
    return sum(float(line.split()[-1]) for line in exposition.splitlines()
               if line.startswith("sonic_sessions_closed_total")
               and f'reason="{reason}"' in line)


async def test_a_quiet_microphone_keeps_the_call(server):
    # The fixture closes peers that send nothing for 3 s; this one sends no audio for 7 s.
    async def listing_late() -> list[dict]:
        await asyncio.sleep(7.0)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/sessions") as response:
                return (await response.json())["sessions"]

    received, listed = await asyncio.gather(
        run_session(server.url, "", seconds=8.0, audio=SpeaksThenFallsSilent(), keep=False),
        listing_late())
    ours = [s for s in listed if s["session_id"] == received.session_id]
    assert ours and ours[0]["state"] == "connected", listed  # still there, 6 s into silence
    assert ours[0]["stats"]["audio"]["received_s"] <= 1.1
    arrivals = np.asarray(received.video.arrivals)
    late = arrivals[arrivals > arrivals[-1] - 3.0]
    assert len(late) >= 3 * 24  # the video kept coming through the silence


async def test_an_offer_that_never_connects_frees_its_place_and_is_counted(server):
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="sendrecv")
    pc.addTransceiver("video", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/metrics") as response:
                before = _closed(await response.text(), "never connected")
            async with http.post(f"{server.url}/offer", json={
                    "sdp": pc.localDescription.sdp, "type": "offer"}) as response:
                session_id = (await response.json())["session_id"]
            posted = time.monotonic()  # the answer is never applied: no ICE, no DTLS
            while time.monotonic() - posted < 15:
                async with http.get(f"{server.url}/sessions/{session_id}") as response:
                    if response.status == 404:
                        break
                await asyncio.sleep(0.25)
            gone_after = time.monotonic() - posted
            async with http.get(f"{server.url}/metrics") as response:
                after = _closed(await response.text(), "never connected")
    finally:
        await pc.close()
    assert 4.0 < gone_after < 8.0, gone_after  # connect_timeout_s = 5
    assert after == before + 1
