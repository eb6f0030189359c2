"""WHEP egress: viewers of a session through the standard exchange (an SDP offer POSTed
with the viewer token as bearer, 201 with the answer and a ``Location`` to DELETE), on the
encode-once fan-out. Watched by an aiortc client speaking only WHEP, and by headless
Chromium running nothing of this project's: a page script doing the bare exchange."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from test_browser import CHROMIUM, chromium_page

from server.client.session_client import SessionClient

WHEP = "application/sdp"


async def _create(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.post(f"{url}/sessions", json={"size": 256}) as response:
        assert response.status == 201
        return await response.json()


@pytest.mark.e2e
async def test_a_whep_client_watches_a_session_and_leaves_it_running(server):
    async with aiohttp.ClientSession() as http:
        created = await _create(http, server.url)
        endpoint = f"{server.url}/sessions/{created['session_id']}/whep"
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio", direction="recvonly")
        pc.addTransceiver("video", direction="recvonly")
        frames: list[float] = []

        @pc.on("track")
        def on_track(track) -> None:  # type: ignore[no-untyped-def]
            async def count() -> None:
                while True:
                    await track.recv()
                    if track.kind == "video":
                        frames.append(time.monotonic())
            asyncio.ensure_future(count())

        try:
            await pc.setLocalDescription(await pc.createOffer())
            offer = pc.localDescription.sdp.encode()
            async with http.post(endpoint, data=offer, headers={
                    "Content-Type": WHEP, "Authorization": "Bearer wrong"}) as response:
                assert (response.status, (await response.json())["error"]) == (403, "bad_token")
            async with http.post(endpoint, data=offer, headers={
                    "Content-Type": WHEP,
                    "Authorization": f"Bearer {created['token']}"}) as response:
                assert response.status == 201, await response.text()
                assert response.headers["Content-Type"].startswith(WHEP)
                location = response.headers["Location"]
                answer = await response.text()
            assert location.startswith(f"/sessions/{created['session_id']}/whep/")
            await pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
            await asyncio.sleep(5.0)
            recent = [t for t in frames if t > frames[-1] - 4.0] if frames else []
            assert len(recent) >= 0.95 * 4.0 * 25, len(recent)  # >= 24 fps
            async with http.patch(server.url + location) as response:
                assert response.status == 405
            async with http.delete(server.url + location) as response:
                assert response.status == 200
            async with http.delete(server.url + location) as response:
                assert response.status == 404  # gone already
        finally:
            await pc.close()
        async with http.get(f"{server.url}/sessions/{created['session_id']}") as response:
            assert response.status == 200  # the session outlives its viewer
        async with http.delete(f"{server.url}/sessions/{created['session_id']}"):
            pass


BARE_WHEP = """async ([endpoint, token]) => {
    const pc = new RTCPeerConnection({iceServers: []});
    pc.addTransceiver('audio', {direction: 'recvonly'});
    pc.addTransceiver('video', {direction: 'recvonly'});
    const video = document.createElement('video');
    video.muted = true;
    document.body.append(video);
    window.presented = 0;
    pc.ontrack = (event) => {
        if (event.track.kind !== 'video') return;
        video.srcObject = new MediaStream([event.track]);
        video.play();
        const tick = () => { window.presented += 1; video.requestVideoFrameCallback(tick); };
        video.requestVideoFrameCallback(tick);
    };
    await pc.setLocalDescription(await pc.createOffer());
    await new Promise((resolve) => {
        if (pc.iceGatheringState === 'complete') return resolve();
        pc.onicegatheringstatechange = () => pc.iceGatheringState === 'complete' && resolve();
        setTimeout(resolve, 3000);
    });
    const response = await fetch(endpoint, {method: 'POST', body: pc.localDescription.sdp,
        headers: {'Content-Type': 'application/sdp', 'Authorization': 'Bearer ' + token}});
    if (response.status !== 201) throw new Error('WHEP answered ' + response.status);
    window.whepLocation = response.headers.get('Location');
    await pc.setRemoteDescription({type: 'answer', sdp: await response.text()});
    window.whepPeer = pc;
}"""


#: Frames the browser's decoder has produced (presentation callbacks can skip some).
DECODED = """async () => {
    let frames = 0;
    (await window.whepPeer.getStats()).forEach((s) => {
        if (s.type === 'inbound-rtp' && s.kind === 'video') frames = s.framesDecoded;
    });
    return frames;
}"""


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed")
@pytest.mark.timeout(180)
async def test_chromium_watches_through_the_bare_whep_exchange(server, speech_wav, tmp_path):
    async with SessionClient(server.url, size=256) as avatar:
        async with chromium_page(tmp_path, speech_wav) as page:
            await page.goto(f"{server.url}/healthz")  # same origin, nothing of ours runs
            await page.evaluate(BARE_WHEP, [
                f"/sessions/{avatar.session_id}/whep", avatar.token])
            await page.wait_for_function("window.presented > 0", timeout=15_000)
            before = await page.evaluate(DECODED)
            await asyncio.sleep(4.0)
            after = await page.evaluate(DECODED)
            assert after - before >= 0.95 * 4.0 * 25, (before, after)  # >= 24 fps
            location = await page.evaluate("window.whepLocation")
            status = await page.evaluate(
                "async (url) => (await fetch(url, {method: 'DELETE'})).status", location)
            assert status == 200
