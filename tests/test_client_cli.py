"""``python -m server.client`` as a person runs it: watching a session an application
drives and saving what it received as an MP4, lips and sound as they played."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
import av
import numpy as np
import pytest
from conftest import call_json

from server.config import REPO_ROOT

pytestmark = pytest.mark.e2e


async def test_a_viewer_saves_the_session_it_watches_as_an_mp4_with_its_speech(
        server, speech_wav, tmp_path):
    status, made = await call_json("POST", f"{server.url}/sessions", {})
    assert status == 201, made
    session_id, token = made["session_id"], made["token"]
    out = (REPO_ROOT / "out" / "client-clip.mp4") if (REPO_ROOT / "out").is_dir() \
        else tmp_path / "clip.mp4"  # kept in out/ to look at
    viewer = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server.client", server.url, "--view", session_id, token,
        "--seconds", "8", "--out", str(out), cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        await asyncio.sleep(2.0)  # it is watching
        async with aiohttp.ClientSession() as http, http.post(
                f"{server.url}/sessions/{session_id}/speech", data=speech_wav.read_bytes(),
                headers={"Content-Type": "audio/wav"}) as response:
            upload = await response.json()
        stdout, stderr = await asyncio.wait_for(viewer.communicate(), 60)
    finally:
        if viewer.returncode is None:
            viewer.kill()
        await call_json("DELETE", f"{server.url}/sessions/{session_id}")
    assert viewer.returncode == 0, stderr.decode()[-2000:]
    assert upload["samples"] > 0, upload
    said = json.loads(stdout.decode().strip().splitlines()[-1])
    assert said["out"] == str(out) and said["frames_saved"] >= 175, said

    with av.open(str(out)) as clip:
        video = clip.streams.video[0]
        assert (video.width, video.height) == (256, 256)
        frames = [f.to_ndarray(format="gray") for f in clip.decode(video=0)]
    with av.open(str(out)) as clip:
        sound = np.concatenate([f.to_ndarray().reshape(-1) for f in clip.decode(audio=0)])
    assert len(frames) == said["frames_saved"]
    # About the seconds it watched, both streams: the sound lies where it played.
    assert abs(len(frames) / 25 - sound.size / 48000) < 0.5, (len(frames), sound.size)
    loud = np.sqrt(np.mean(sound[:sound.size // 960 * 960].reshape(-1, 960) ** 2, axis=1))
    assert loud.max() > 0.02 and (loud < 0.002).any(), loud  # speech, and silence before it
    assert np.abs(np.diff(np.stack(frames), axis=0)).mean(axis=(1, 2)).max() > 0.5  # it moved
