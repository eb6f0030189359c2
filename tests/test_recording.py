"""Recording (issue 12): a session asked to record (``options.record``) writes an MP4 of
what its viewers get, video and the delayed audio on the session clock, with the same
writer as the offline render; lips and sound line up in the file."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import av
import numpy as np
import pytest
from conftest import ServerProcess

from benchmarks.mouth import mouth_box, mouth_openness
from inference.tts import SpeechUnavailable, conversation, wav_bytes

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def recording_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("recordings")
    server = ServerProcess("--set", f"session.recording_dir={folder}")
    try:
        server.wait_ready()
        yield server, folder
    finally:
        server.stop()


def _read(path) -> tuple[list[np.ndarray], list[float], np.ndarray]:  # type: ignore[no-untyped-def]
    """Frames (RGB), their times, and the audio (mono float, 48 kHz)."""
    frames, times, audio = [], [], []
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            frames.append(frame.to_ndarray(format="rgb24"))
            times.append(float(frame.pts * frame.time_base))
    with av.open(str(path)) as container:
        start = None
        for frame in container.decode(audio=0):
            if start is None:
                start = float(frame.pts * frame.time_base)
            audio.append(frame.to_ndarray().reshape(-1))
    return frames, times, np.concatenate(audio)


async def test_a_recorded_session_is_an_mp4_with_lips_and_sound_in_step(recording_server):
    server, folder = recording_server
    try:
        speech = conversation(16000)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/sessions",
                             json={"size": 256, "options": {"record": True}}) as response:
            created = await response.json()
            assert response.status == 201, created
        session = f"{server.url}/sessions/{created['session_id']}"
        async with http.get(session) as response:
            assert (await response.json())["recording"] == f"{created['session_id']}.mp4"
        async with http.post(f"{session}/speech", data=wav_bytes(speech, 16000),
                             headers={"Content-Type": "audio/wav"}) as response:
            assert response.status == 200
        await asyncio.sleep(speech.size / 16000 + 1.0)
        async with http.get(session) as response:
            live = await response.json()
        async with http.delete(session) as response:
            assert response.status == 204
        async with http.post(f"{server.url}/sessions",
                             json={"options": {"record": "yes"}}) as response:
            assert (response.status, (await response.json())["error"]) == \
                (400, "invalid_options")
    frames, times, audio = _read(folder / f"{created['session_id']}.mp4")
    seconds = speech.size / 16000
    assert len(frames) >= 25 * seconds * 0.95, \
        {k: live[k] for k in ("frames_sent", "frames_skipped", "frames_repeated")}
    assert abs(audio.size / 48000 - times[-1]) < 0.2  # the tracks end together
    with urllib.request.urlopen(f"{server.url}/avatars/astronaut", timeout=5) as response:
        geometry = json.loads(response.read())["geometry"]["256"]
    mouth = mouth_openness(frames, mouth_box(geometry, 256))
    # Loudness of the audio under each frame, and the lag that best lines the two up.
    loud = np.array([np.sqrt(np.mean(audio[int(t * 48000):int((t + 0.04) * 48000)] ** 2))
                     for t in times])
    assert mouth[loud > 0.2 * loud.max()].mean() > 3 * mouth[loud < 0.02 * loud.max()].mean()
    lags = range(-4, 5)
    r = [np.corrcoef(mouth[4 + lag:len(mouth) - 4 + lag], loud[4:len(loud) - 4])[0, 1]
         for lag in lags]
    assert abs(lags[int(np.argmax(r))]) <= 1, r  # within a frame
