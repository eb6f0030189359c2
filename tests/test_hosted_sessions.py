"""Sessions an application drives (issue 10, first step): ``POST /sessions`` makes one with
no peer, the application streams its speech over HTTP as it synthesises it, and viewers
attach with the session's token; the avatar speaks that speech to them in sync."""

from __future__ import annotations

import asyncio
import json
import struct
import time
import urllib.request

import aiohttp
import numpy as np
import pytest
from test_webrtc_session import _mouth_box, _mouth_signal, assert_mouth_follows_speech

from inference.tts import SpeechUnavailable, conversation, espeak, wav_bytes
from server.client.peer import NTP_EPOCH, run_session, without_bandwidth_estimates

pytestmark = pytest.mark.e2e


def _wav_stream(pcm: np.ndarray, rate: int) -> bytes:
    """A WAV as streaming TTS writes it: the sizes unknown (0xFFFFFFFF) when it starts."""
    data = bytearray(wav_bytes(pcm, rate))
    data[4:8] = data[40:44] = struct.pack("<I", 0xFFFFFFFF)
    return bytes(data)


async def _follow(http: aiohttp.ClientSession, url: str, events: list[dict]) -> None:
    """Read a session's server-sent events into ``events`` until its stream ends."""
    async with http.get(url) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for line in response.content:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))


async def _create(http: aiohttp.ClientSession, url: str, **body: object) -> dict:
    async with http.post(f"{url}/sessions", json=body) as response:
        answer = await response.json()
        assert response.status == 201, answer
        return answer


async def test_an_application_speaks_through_a_session_that_a_viewer_watches(server):
    try:
        speech = conversation(16000)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    body = _wav_stream(speech, 16000)
    async with aiohttp.ClientSession() as http:
        created = await _create(http, server.url)
        session_id, token = created["session_id"], created["token"]
        assert created["urls"]["speech"] == f"/sessions/{session_id}/speech"
        assert created["urls"]["viewer_page"] == f"/?session={session_id}&token={token}"

        async def synthesised():  # type: ignore[no-untyped-def]
            for start in range(0, len(body), 8000):  # 4x faster than real time
                yield body[start:start + 8000]
                await asyncio.sleep(0.0625)

        async def speak() -> dict:
            await asyncio.sleep(1.0)  # the viewer is watching by then
            async with http.post(f"{server.url}/sessions/{session_id}/speech",
                                 data=synthesised(),
                                 headers={"Content-Type": "Audio/WAV"}) as response:
                answer = await response.json()
                assert response.status == 200, answer
                return answer

        events: list[dict] = []
        following = asyncio.create_task(
            _follow(http, f"{server.url}/sessions/{session_id}/events", events))
        received, spoken = await asyncio.gather(
            run_session(server.url, "", seconds=speech.size / 16000 + 2.5,
                        view=(session_id, token)),
            speak())
        assert spoken["duration_s"] == pytest.approx(speech.size / 16000, abs=0.01)
        async with http.get(f"{server.url}/sessions/{session_id}") as response:
            left = await response.json()
            assert left["state"] == "ready"  # the viewer left; the session stays ...
        await asyncio.sleep(1.0)
        async with http.get(f"{server.url}/sessions/{session_id}") as response:
            later = await response.json()  # ... and the engine renders nothing for it
            assert later["stats"]["frames_submitted"] == left["stats"]["frames_submitted"]
        async with http.delete(f"{server.url}/sessions/{session_id}") as response:
            assert response.status == 204
        await asyncio.wait_for(following, 5)  # the stream ends with the session

    # Its start and end were announced with the times its sound left, which are the
    # times the viewer's own sender reports give for that audio.
    started, ended = ([e for e in events if e["type"] == kind] for kind in
                      ("utterance_started", "utterance_ended"))
    assert [e["utterance_id"] for e in started] == [spoken["utterance_id"]]
    assert [e["utterance_id"] for e in ended] == [spoken["utterance_id"]]
    assert ended[0]["media_time_s"] - started[0]["media_time_s"] == pytest.approx(
        speech.size / 16000, abs=0.03)
    audio_times = received.audio.sender_times() - NTP_EPOCH
    heard = audio_times[np.argmax([np.abs(d).max() > 300 for d in received.audio.data])]
    lead = np.argmax(np.abs(speech) > 300) / 16000  # the speech opens with a silence
    assert abs(heard - (started[0]["wall_time"] + lead)) < 0.04  # within one frame

    assert received.video_fps() >= 24.0
    # The viewer hears the pushed speech, and the mouth follows it.
    assert_mouth_follows_speech(received, _mouth_box(server, 256), min_quiet=25)


async def test_an_interrupt_stops_the_sound_and_closes_the_mouth_within_200_ms(server):
    try:
        speech = espeak("Let me tell you a rather long story about a lighthouse keeper, "
                        "who counted every ship that passed his rock for forty years, and "
                        "never once left the island.", rate=16000)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    body = _wav_stream(speech, 16000)
    async with aiohttp.ClientSession() as http:
        created = await _create(http, server.url)
        session_id = created["session_id"]
        marks: dict[str, object] = {}

        async def synthesised():  # type: ignore[no-untyped-def]
            for start in range(0, len(body), 8000):  # a little faster than real time, so
                yield body[start:start + 8000]  # the request is still arriving at the cut
                await asyncio.sleep(0.2)

        async def speak_then_cut() -> None:
            await asyncio.sleep(1.0)
            async with http.post(f"{server.url}/sessions/{session_id}/speech",
                                 data=synthesised(),
                                 headers={"Content-Type": "audio/wav"}) as response:
                marks["speech"] = await response.json()

        async def cut() -> None:
            await asyncio.sleep(4.0)  # 3 s into the speech
            marks["at"] = time.monotonic()
            marks["at_wall"] = time.time()  # the clock of the server's sender reports
            async with http.post(f"{server.url}/sessions/{session_id}/interrupt") as response:
                assert response.status == 200
                marks["interrupt"] = await response.json()

        events: list[dict] = []
        following = asyncio.create_task(
            _follow(http, f"{server.url}/sessions/{session_id}/events", events))
        received, _, _ = await asyncio.gather(
            run_session(server.url, "", seconds=7.0, view=(session_id, created["token"])),
            speak_then_cut(), cut())
        async with http.delete(f"{server.url}/sessions/{session_id}"):
            pass
        await asyncio.wait_for(following, 5)
    # Followers heard of the cut as the interrupting caller did; the utterance never ended.
    assert [e["type"] for e in events] == ["utterance_started", "interrupted"]
    assert events[1]["interrupted"] == marks["interrupt"]["interrupted"]  # type: ignore[index]

    at = float(marks["at"])  # type: ignore[arg-type]
    assert marks["speech"]["interrupted"] is True  # type: ignore[index]
    (cut_off,) = marks["interrupt"]["interrupted"]  # type: ignore[index]
    assert cut_off["utterance_id"] == marks["speech"]["utterance_id"]  # type: ignore[index]
    assert 2.5 < cut_off["heard_s"] < 3.5  # about what had played when it was cut
    audio = received.audio
    loudness = np.array([np.sqrt(np.mean(d.astype(np.float32) ** 2)) for d in audio.data])
    arrivals = np.asarray(audio.arrivals)
    before = loudness[(arrivals > at - 0.5) & (arrivals < at)]
    # When the server sent each packet (its sender reports' clock), not when the viewer
    # played it: aiortc's receiver holds four packets, 160 ms of 40 ms ones, before any.
    sent = audio.sender_times() - NTP_EPOCH
    after = loudness[sent > float(marks["at_wall"]) + 0.2]  # type: ignore[arg-type]
    assert before.max() > 1000  # it was speaking ...
    assert after.size > 50 and after.max() < 50  # ... and was silent within 200 ms
    mouth = _mouth_signal(received, _mouth_box(server, 256))
    video_at = np.asarray(received.video.arrivals)
    speaking = mouth[(video_at > at - 2.0) & (video_at < at)]
    closed = mouth[video_at > at + 0.2]
    assert closed.size > 40 and closed.max() < 0.5 * speaking.max()
    assert np.median(closed) < 0.25 * np.median(speaking)


async def test_speech_and_barge_in_over_one_websocket_with_events_back(server):
    try:
        speech = espeak("Hello from the other end of a web socket.", rate=16000)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    async with aiohttp.ClientSession() as http:
        created = await _create(http, server.url)
        session_id = created["session_id"]
        messages: list[dict] = []

        async def drive() -> None:
            async with http.ws_connect(f"{server.url}/sessions/{session_id}/ws") as ws:
                async def until(kind: str) -> dict:
                    while True:
                        message = await asyncio.wait_for(ws.receive_json(), 10)
                        messages.append(message)
                        if message["type"] == kind:
                            return message

                await asyncio.sleep(1.0)  # the viewer is watching
                await ws.send_bytes(b"\x00\x00")  # audio before any utterance
                assert (await until("error"))["error"] == "no_utterance"
                await ws.send_str("not json")
                assert (await until("error"))["error"] == "bad_message"
                await ws.send_json({"type": "speech", "content_type": "audio/L16;rate=16000"})
                opened = await until("utterance_opened")
                pcm = speech.astype(">i2").tobytes()
                for start in range(0, len(pcm), 3200):  # 100 ms a message, all at once
                    await ws.send_bytes(pcm[start:start + 3200])
                await ws.send_json({"type": "end"})
                queued = await until("utterance_queued")
                assert queued["utterance_id"] == opened["utterance_id"]
                assert queued["duration_s"] == pytest.approx(speech.size / 16000, abs=0.01)
                ended = await until("utterance_ended")
                assert ended["utterance_id"] == opened["utterance_id"]
                await ws.send_json({"type": "interrupt"})  # nothing playing: a no-op
                assert (await until("interrupted"))["interrupted"] == []

        received, _ = await asyncio.gather(
            run_session(server.url, "", seconds=speech.size / 16000 + 3.0,
                        view=(session_id, created["token"])),
            drive())
        async with http.delete(f"{server.url}/sessions/{session_id}"):
            pass
    kinds = [m["type"] for m in messages]
    assert kinds.index("utterance_started") < kinds.index("utterance_ended")
    loudness = [np.abs(d).max() for d in received.audio.data]
    assert max(loudness) > 1000  # the viewer heard it


async def test_bad_speech_and_bad_viewers_are_refused_and_the_session_runs_on(server):
    async with aiohttp.ClientSession() as http:
        created = await _create(http, server.url, size=256)
        url = f"{server.url}/sessions/{created['session_id']}/speech"

        async def expect(status: int, code: str, data: bytes, content_type: str,
                         target: str = url) -> None:
            async with http.post(target, data=data,
                                 headers={"Content-Type": content_type}) as response:
                answer = await response.json()
                assert (response.status, answer["error"]) == (status, code), answer

        pcm = np.zeros(1600, "<i2").tobytes()
        await expect(415, "unsupported_media_type", pcm, "text/plain")
        await expect(400, "bad_audio_format", pcm, "audio/L16")  # no rate
        await expect(400, "bad_audio_format", pcm, "audio/L16;rate=4000")
        await expect(400, "odd_byte_count", pcm + b"\x00", "audio/L16;rate=16000")
        await expect(400, "bad_wav", b"RIFX" + pcm, "audio/wav")
        await expect(400, "bad_audio_format",
                     _wav_stream(np.zeros(10), 16000).replace(b"\x10\x00data", b"\x08\x00data"),
                     "audio/wav")
        await expect(404, "unknown_session", pcm, "audio/L16;rate=16000",
                     f"{server.url}/sessions/w0-nosuchsession/speech")
        # L16 as RFC 2586 defines it (big-endian), parameters in any case: accepted.
        async with http.post(url, data=np.zeros(3200, ">i2").tobytes(),
                             headers={"Content-Type": "audio/l16; Rate=16000; CHANNELS=1"}
                             ) as response:
            assert response.status == 200 and (await response.json())["duration_s"] == 0.2

        for token in ("wrong", None):
            offer = {"sdp": "v=0", "type": "offer", "session_id": created["session_id"],
                     "token": token}
            async with http.post(f"{server.url}/offer", json=offer) as response:
                answer = await response.json()
                assert (response.status, answer["error"]) == (403, "bad_token"), answer
        async with http.get(f"{server.url}/sessions/{created['session_id']}") as response:
            assert (await response.json())["state"] == "ready"
        async with http.delete(f"{server.url}/sessions/{created['session_id']}") as response:
            assert response.status == 204
        async with http.delete(f"{server.url}/sessions/{created['session_id']}") as response:
            assert response.status == 404


async def test_the_example_agent_speaks_and_cuts_itself_off(server):
    from examples.agent import SENTENCES, run

    try:
        espeak("test", rate=16000)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    events = await run(server.url, wait_s=0.5, cut_after_s=1.0)
    kinds = [e["type"] for e in events]
    assert kinds.count("utterance_started") == len(SENTENCES)
    assert kinds.count("utterance_ended") == len(SENTENCES) - 1
    (cut,) = [e for e in events if e["type"] == "interrupted"]
    (heard,) = cut["interrupted"]
    assert heard["utterance_id"].endswith(f"-u{len(SENTENCES)}")
    assert 0.8 < heard["heard_s"] < 1.5  # cut 1 s after its sound started
    # Each sentence ended when its sound did, and the next began as it did.
    at = {(e["type"], e["utterance_id"][-2:]): e["media_time_s"] for e in events
          if e["type"] != "interrupted"}
    for n in range(1, len(SENTENCES)):
        assert at["utterance_ended", f"u{n}"] <= at["utterance_started", f"u{n + 1}"] + 0.025


def _encoded(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        return sum(sample.value for family in text_string_to_metric_families(
            response.read().decode()) for sample in family.samples
            if sample.name == "sonic_video_frames_encoded_total")


async def test_two_viewers_get_one_encoding_and_a_late_one_starts_at_once(server):
    async with aiohttp.ClientSession() as http:
        created = await _create(http, server.url)
        view = (created["session_id"], created["token"])
        before = await asyncio.to_thread(_encoded, server.url)

        async def late() -> tuple[float, object]:
            await asyncio.sleep(1.5)
            joined = time.monotonic()
            return joined, await run_session(server.url, "", seconds=3.0, view=view)

        first, (joined, second) = await asyncio.gather(
            run_session(server.url, "", seconds=5.0, view=view), late())
        encoded = await asyncio.to_thread(_encoded, server.url) - before
        async with http.delete(f"{server.url}/sessions/{created['session_id']}"):
            pass
    # One encoding for both: about a frame per frame time, not one per viewer and frame.
    assert len(first.video.data) >= 24 * 4.5
    assert encoded <= 1.05 * len(first.video.data) + 10
    # The late viewer's first frame came at once (a key frame was made for it) ...
    assert second.video.arrivals[0] - joined < 0.5
    # ... and both decoded the very same pictures at the same media times (encoders of
    # their own, started apart, would differ in nearly every one; once in a full run here
    # one picture differed, likely a packet lost on the busy loopback).
    times_a = np.round(first.video.sender_times() * 25).astype(np.int64)
    times_b = np.round(second.video.sender_times() * 25).astype(np.int64)
    common = sorted(set(times_a.tolist()) & set(times_b.tolist()))
    assert len(common) >= 50
    same = [np.array_equal(first.video.data[int(np.flatnonzero(times_a == t)[0])],
                           second.video.data[int(np.flatnonzero(times_b == t)[0])])
            for t in common[5:]]
    assert np.mean(same) >= 0.9, f"{same.count(False)} of {len(same)} pictures differ"


async def test_a_viewer_asks_the_agent_to_speak_on_the_events_channel(server):
    """The web page's text box: a viewer sends text on its ``events`` data channel, the
    application hears a ``viewer_message`` event, and the example agent says it (cutting
    off what it was saying); garbage and floods are refused on the channel alone."""
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

    from examples.agent import answer_viewers
    from server.client.session_client import SessionClient
    from server.media.events import MESSAGES_PER_WINDOW

    try:
        espeak("test", rate=16000)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    seen: list[dict] = []
    async with SessionClient(server.url) as avatar:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio", direction="recvonly")
        pc.addTransceiver("video", direction="recvonly")
        channel = pc.createDataChannel("events")
        channel.on("message", lambda message: seen.append(json.loads(message)))
        opened = asyncio.Event()
        channel.on("open", opened.set)
        try:
            await pc.setLocalDescription(await pc.createOffer())
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{server.url}/offer", json={
                        "sdp": pc.localDescription.sdp, "type": "offer",
                        "session_id": avatar.session_id, "token": avatar.token}) as response:
                    answer = await response.json()
                    assert response.status == 200, answer
            await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], "answer"))
            await asyncio.wait_for(opened.wait(), 10)

            async def until(check, what: str) -> None:  # type: ignore[no-untyped-def]
                for _ in range(200):
                    if check():
                        return
                    await asyncio.sleep(0.05)
                pytest.fail(f"the viewer never saw {what}: {seen}")

            listening = asyncio.Event()
            agent = asyncio.create_task(answer_viewers(avatar, 6.0, listening))
            await asyncio.wait_for(listening.wait(), 5)
            channel.send("not json")
            channel.send(json.dumps({"type": "message", "text": "   "}))
            await until(lambda: len([e for e in seen if e["type"] == "error"]) == 2, "errors")
            assert {e["error"] for e in seen} == {"bad_message"}
            channel.send(json.dumps({"type": "message", "text": "Hello, how are you today?"}))
            await until(lambda: any(e["type"] == "utterance_started" for e in seen),
                        "the agent speaking")
            channel.send(json.dumps({"type": "message", "text": "Say something else."}))
            await until(lambda: [e["type"] for e in seen].count("utterance_started") == 2,
                        "the second request spoken")
            said = await agent
            assert said == ["Hello, how are you today?", "Say something else."]
            kinds = [e["type"] for e in seen if e["type"] != "error"]
            assert kinds[:4] == ["viewer_message", "utterance_started", "viewer_message",
                                 "interrupted"], kinds
            (cut,) = [e for e in seen if e["type"] == "interrupted"]
            assert cut["interrupted"][0]["utterance_id"].endswith("-u1")
            assert 0 < cut["interrupted"][0]["heard_s"] < 2.0
            # A flood: the rest of the window's allowance goes through, then refusals.
            for n in range(MESSAGES_PER_WINDOW):
                channel.send(json.dumps({"type": "message", "text": f"flood {n}"}))
            await until(lambda: any(e.get("error") == "too_many_messages" for e in seen),
                        "the flood refused")
            assert [e["text"] for e in seen if e["type"] == "viewer_message"][2:] == [
                f"flood {n}" for n in range(MESSAGES_PER_WINDOW - 2)]
        finally:
            await pc.close()


async def _poor_viewer(url: str, view: tuple[str, str], bitrate: int, seconds: float) -> None:
    """A viewer whose receiver reports (REMB) it can take only ``bitrate`` bit/s: its
    offer leaves out the send-time extension that aiortc's own estimates need."""
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.rtp import RTCP_PSFB_APP, RtcpPsfbPacket, pack_remb_fci

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    video = pc.addTransceiver("video", direction="recvonly")
    try:
        await pc.setLocalDescription(await pc.createOffer())
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/offer", json={
                    "sdp": without_bandwidth_estimates(pc.localDescription.sdp), "type": "offer",
                    "session_id": view[0], "token": view[1]}) as response:
                answer = await response.json()
        await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], "answer"))
        section = answer["sdp"].split("m=video", 1)[1]
        ssrc = int(section.split("a=ssrc:", 1)[1].split()[0])
        for _ in range(int(seconds / 0.5)):
            await asyncio.sleep(0.5)
            if pc.connectionState == "connected":
                await video.receiver._send_rtcp(RtcpPsfbPacket(
                    fmt=RTCP_PSFB_APP, ssrc=1, media_ssrc=0,
                    fci=pack_remb_fci(bitrate, [ssrc])))
    finally:
        await pc.close()


async def test_the_shared_encoding_runs_at_the_rate_its_poorest_viewer_can_take(server):
    async with aiohttp.ClientSession() as http:
        created = await _create(http, server.url)
        view = (created["session_id"], created["token"])

        async def bitrate() -> int:
            async with http.get(f"{server.url}/sessions/{view[0]}") as response:
                return (await response.json())["stats"]["video_bitrate"]

        async def meanwhile() -> tuple[int, int]:
            await asyncio.sleep(1.0)
            poor = asyncio.create_task(_poor_viewer(server.url, view, 260_000, 5.0))
            await asyncio.sleep(4.0)
            held = await bitrate()
            await poor  # it leaves
            await asyncio.sleep(3.0)
            return held, await bitrate()

        # The other viewer tells no estimate of its own: on a busy machine aiortc's would
        # follow the bounded rate down and climb back only slowly.
        received, (held, after) = await asyncio.gather(
            run_session(server.url, "", seconds=10.0, view=view, estimates=False),
            meanwhile())
        async with http.delete(f"{server.url}/sessions/{view[0]}"):
            pass
    # The poor viewer's estimate bounded everyone's encoding ...
    assert 250_000 <= held <= 260_000
    assert after > 260_000  # ... until it left: then the other viewer's own estimate
    assert received.video_fps() >= 24
