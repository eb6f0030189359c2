"""WHIP ingest (RFC 9725) against a WHIP client that is not ours: FFmpeg's own ``whip``
muxer, in the FFmpeg that PyAV bundles, pushes Opus speech to ``POST /whip`` through the
front door; an aiortc viewer watches the session with its token and must see the avatar
speak at 25 fps. The muxer's DTLS needs a P-256 certificate (aiortc refuses its default
P-224 one), made here with openssl."""

from __future__ import annotations

import asyncio
import fractions
import shutil
import subprocess
import threading
import time
from pathlib import Path

import aiohttp
import av
import numpy as np
import pytest
from test_webrtc_session import _mouth_box, assert_mouth_follows_speech

from inference.tts import SpeechUnavailable, conversation
from server.client.peer import run_session

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif("whip" not in av.formats_available,
                       reason="this PyAV's FFmpeg has no whip muxer"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("whip")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=whip-test"],
                   check=True, capture_output=True)
    return cert, key


def push(url: str, pcm: np.ndarray, certificate: tuple[Path, Path]) -> None:
    """FFmpeg's WHIP muxer sends 48 kHz mono ``pcm`` (int16) as Opus at real time, then
    ends the session (its DELETE)."""
    cert, key = certificate
    out = av.open(url, mode="w", format="whip", timeout=10,
                  options={"cert_file": str(cert), "key_file": str(key)})
    try:
        stream = out.add_stream("libopus", rate=48000, layout="stereo")
        started, pts, n = time.monotonic(), 0, 960
        for start in range(0, pcm.size - n, n):
            frame = av.AudioFrame.from_ndarray(
                np.repeat(pcm[start:start + n][None], 2, axis=0).T.reshape(1, -1),
                format="s16", layout="stereo")
            frame.sample_rate, frame.pts = 48000, pts
            frame.time_base = fractions.Fraction(1, 48000)
            pts += n
            for packet in stream.encode(frame):
                out.mux(packet)
            time.sleep(max(0.0, started + pts / 48000 - time.monotonic()))
        for packet in stream.encode(None):
            out.mux(packet)
    finally:
        out.close()


async def _published(http: aiohttp.ClientSession, url: str) -> dict:
    for _ in range(100):
        async with http.get(f"{url}/sessions") as response:
            found = [s for s in (await response.json())["sessions"] if s.get("published")]
        if found:
            return found[0]
        await asyncio.sleep(0.1)
    pytest.fail("no WHIP session appeared")


async def test_ffmpeg_publishes_over_whip_and_a_viewer_sees_the_avatar_speak(server,
                                                                              certificate):
    try:
        speech = conversation(48000)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    pcm = (np.clip(speech, -1.0, 1.0) * 32767).astype(np.int16)
    pusher = threading.Thread(target=push, args=(f"{server.url}/whip?size=256", pcm,
                                                 certificate))
    pusher.start()
    try:
        async with aiohttp.ClientSession() as http:
            session = await _published(http, server.url)
            received = await run_session(server.url, "", seconds=min(8.0, pcm.size / 48000 - 2),
                                         view=(session["session_id"], session["token"]))
            async with http.get(f"{server.url}/sessions/{session['session_id']}") as response:
                stats = (await response.json())["stats"]
    finally:
        await asyncio.to_thread(pusher.join, 30)
    assert stats["audio"]["received_s"] > 3  # the publisher's Opus arrived and was decoded
    assert received.video_fps() >= 24
    assert_mouth_follows_speech(received, _mouth_box(server, 256))
    async with aiohttp.ClientSession() as http:  # the muxer's DELETE ended it
        async with http.get(f"{server.url}/sessions/{session['session_id']}") as response:
            assert response.status == 404


async def test_whip_refuses_what_is_not_an_sdp_offer_and_answers_options(server):
    async with aiohttp.ClientSession() as http:
        async with http.options(f"{server.url}/whip") as response:
            assert response.status == 204
            assert response.headers["Accept-Post"] == "application/sdp"
        async with http.post(f"{server.url}/whip", data=b"v=0",
                             headers={"Content-Type": "application/json"}) as response:
            answer = await response.json()
            assert (response.status, answer["error"]) == (415, "unsupported_media_type")
        async with http.post(f"{server.url}/whip", data=b"not sdp",
                             headers={"Content-Type": "application/sdp"}) as response:
            answer = await response.json()
            assert (response.status, answer["error"]) == (400, "malformed_sdp")
        async with http.post(f"{server.url}/whip?size=300", data=b"v=0\r\n",
                             headers={"Content-Type": "application/sdp"}) as response:
            assert response.status == 400
        async with http.delete(f"{server.url}/whip/w0-nosuchsession") as response:
            assert response.status == 404
        async with http.get(f"{server.url}/healthz") as response:
            assert (await response.json())["sessions"] == 0
