"""Motion-only sessions on a real server with a real aiortc peer: no video m-line, no
encoder; each frame's coefficients on the data channel at 25 per second on the session's
clock, moving with the speech; the delayed audio still comes back; bad requests refused."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiortc import RTCPeerConnection
from conftest import ServerProcess

from server.client.peer import Received, run_session

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def session(server, speech_wav) -> tuple[Received, list[dict[str, Any]]]:
    """What the peer received, and the server's session list near the session's end."""
    async def run() -> tuple[Received, list[dict[str, Any]]]:
        peer = asyncio.create_task(run_session(
            server.url, str(speech_wav), seconds=11.0,
            options={"motion_only": True, "size": 256}))
        await asyncio.sleep(10.0)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/sessions") as response:
                listed = (await response.json())["sessions"]
        return await peer, listed

    return asyncio.run(run())


@pytest.fixture(scope="module")
def received(session) -> Received:
    return session[0]


def test_the_answer_carries_no_video(received):
    sdp = received.answer["sdp"]
    assert "m=audio" in sdp and "m=application" in sdp and "m=video" not in sdp
    assert received.video.pts == []


def test_coefficients_arrive_every_frame_on_the_session_clock(received):
    frames = [m["frame"] for m in received.coefficients]
    assert len(frames) >= 24 * 9
    assert frames == sorted(set(frames))  # each frame once, in order
    assert sum(np.diff(frames) > 1) <= 0.01 * len(frames)  # < 1% repeated
    assert all(abs(m["time"] - m["frame"] / 25) < 1e-3 for m in received.coefficients)
    names = set(received.coefficients[0]["coefficients"])
    assert {"jawOpen", "headPitch", "headYaw", "headRoll"} <= names


def test_jaw_follows_the_speech_and_the_audio_comes_back(received):
    jaw = np.array([m["coefficients"]["jawOpen"] for m in received.coefficients])
    assert jaw.max() > 0.3 and np.percentile(jaw, 10) < 0.05  # speech, and pauses
    rms = np.array([np.sqrt(np.mean(d.astype(np.float32) ** 2)) for d in received.audio.data])
    assert rms.max() > 500 and np.percentile(rms, 10) < 30


def test_the_session_lists_as_motion_only_with_its_stats(session):
    received, listed = session
    body = next(s for s in listed if s["session_id"] == received.session_id)
    assert body["motion_only"] is True and body["size"] == 256
    assert body["stats"]["frames_sent"] >= 24 * 8 and body["stats"]["fps"] >= 24
    assert body["stats"]["frames_repeated"] <= 0.01 * body["stats"]["frames_sent"]


async def test_a_motion_only_offer_without_a_data_channel_or_with_a_bad_flag_is_refused(
        server, speech_wav):
    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="sendrecv")
    await pc.setLocalDescription(await pc.createOffer())
    offer = {"sdp": pc.localDescription.sdp, "type": "offer"}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/metrics") as r:
                created_before = _created(await r.text())
            async with http.post(f"{server.url}/offer",
                                 json={**offer, "options": {"motion_only": True}}) as r:
                no_channel = (r.status, await r.json())
            async with http.post(f"{server.url}/offer",
                                 json={**offer, "options": {"motion_only": "yes"}}) as r:
                bad_flag = (r.status, await r.json())
            async with http.get(f"{server.url}/metrics") as r:
                created_after = _created(await r.text())
    finally:
        await pc.close()
    assert no_channel[0] == 400 and no_channel[1]["error"] == "no_data_channel"
    assert bad_flag[0] == 400 and bad_flag[1]["error"] == "invalid_options"
    assert "motion_only" in bad_flag[1]["message"]
    assert created_before >= 1 and created_after == created_before  # neither made one


def _created(exposition: str) -> float:
    return sum(float(line.split()[-1]) for line in exposition.splitlines()
               if line.startswith("sonic_sessions_total"))


async def test_the_engine_makes_motion_only_frames_without_rendering(server):
    """Their coefficients come from the model's motion graph: admission counts them at what
    that costs the engine, measured at start-up, a small part of a rendered frame."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/healthz") as r:
            health = await r.json()
    rendered = health["capacity_fps"]  # at the default size, 256x256
    assert rendered > 0 and health["motion_capacity_fps"] > 5 * rendered


def _batches(exposition: str) -> tuple[float, float]:
    """(engine calls, frames in them) so far, from /metrics."""
    def total(name: str) -> float:
        return sum(float(line.split()[-1]) for line in exposition.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))
    return total("sonic_engine_batch_size_count"), total("sonic_engine_batch_size_sum")


def test_sessions_share_engine_batches_on_the_instants_of_the_media_grid(speech_wav):
    """Session clocks start on one of two instants per frame (``session.grid_phases``, a
    GPU runtime's default), alternately: the frames of the sessions on one instant reach
    the engine together, as one batch, so four sessions made 10 ms apart make batches of
    two, not of one (each on its own clock) nor of four (all on one instant)."""
    with ServerProcess("--set", "session.grid_phases=2") as server:
        mean, fps = asyncio.run(_batched(server, speech_wav))
    assert all(f > 24 for f in fps), fps
    assert 1.8 <= mean <= 2.2, mean


async def _batched(server: ServerProcess, speech_wav: Path) -> tuple[float, list[float]]:
    """Four motion-only sessions, made 10 ms apart: the mean engine batch while all run,
    and each one's coefficient messages per second."""
    from server.client.speech import EncodedSpeech

    packets = EncodedSpeech.encode_wav(str(speech_wav))

    async def peer(after: float) -> Received:
        await asyncio.sleep(after)
        return await run_session(server.url, "", seconds=9.0,
                                 options={"motion_only": True, "size": 256},
                                 audio=EncodedSpeech(packets), count_only=True, keep=False)

    peers = [asyncio.create_task(peer(0.01 * i)) for i in range(4)]
    async with aiohttp.ClientSession() as http:
        await asyncio.sleep(4.0)  # all four connected and sending
        async with http.get(f"{server.url}/metrics") as r:
            calls, frames = _batches(await r.text())
        await asyncio.sleep(3.0)
        async with http.get(f"{server.url}/metrics") as r:
            later_calls, later_frames = _batches(await r.text())
    received = await asyncio.gather(*peers)
    return (later_frames - frames) / (later_calls - calls), [r.motion_fps() for r in received]
