"""Bad input gets a clear 4xx JSON error, leaves nothing behind, and disturbs no one else."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator

import aiohttp
import cv2
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection
from conftest import ServerProcess
from prometheus_client.parser import text_string_to_metric_families

from inference.engine import KNOB_NAMES
from server.client.peer import run_session
from server.config import REPO_ROOT


async def _offer_sdp(audio: bool = True, video: bool = True) -> str:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    if audio:
        pc.addTransceiver("audio", direction="sendrecv")
    if video:
        pc.addTransceiver("video", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


def _png(image: np.ndarray) -> bytes:
    ok, data = cv2.imencode(".png", image)
    assert ok
    return data.tobytes()


def _png_claiming(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(
        b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


JSON = {"Content-Type": "application/json"}


async def _expect(http: aiohttp.ClientSession, method: str, url: str, status: int, code: str,
                  **kwargs) -> dict:
    async with http.request(method, url, **kwargs) as response:
        body = await response.json(content_type=None)
        assert response.status == status, (response.status, body)
        assert response.content_type == "application/json"
        assert body["error"] == code and body["message"], body
        return body


async def _avatar_ids(http: aiohttp.ClientSession, url: str) -> list[str]:
    async with http.get(f"{url}/avatars") as response:
        return [a["avatar_id"] for a in (await response.json())["avatars"]]


@pytest.mark.e2e
async def test_every_bad_input_is_refused_while_a_live_session_keeps_running(server, speech_wav):
    async with aiohttp.ClientSession() as http:
        avatars_before = await _avatar_ids(http, server.url)
    live = asyncio.create_task(run_session(server.url, str(speech_wav), seconds=8.0, keep=False))
    await asyncio.sleep(2.0)  # the live session is streaming while the bad requests come in
    valid = await _offer_sdp()
    url = server.url
    async with aiohttp.ClientSession() as http:
        await _expect(http, "POST", f"{url}/offer", 400, "invalid_json", data=b"{not json",
                      headers=JSON)
        await _expect(http, "POST", f"{url}/offer", 400, "invalid_json", json=[1, 2])
        await _expect(http, "POST", f"{url}/offer", 400, "missing_sdp", json={"type": "offer"})
        await _expect(http, "POST", f"{url}/offer", 400, "not_an_offer",
                      json={"sdp": valid, "type": "answer"})
        await _expect(http, "POST", f"{url}/offer", 400, "malformed_sdp",
                      json={"sdp": "hello world", "type": "offer"})
        await _expect(http, "POST", f"{url}/offer", 400, "malformed_sdp",
                      json={"sdp": "v=0\r\nm=audio nonsense\r\n", "type": "offer"})
        await _expect(http, "POST", f"{url}/offer", 400, "no_audio",
                      json={"sdp": await _offer_sdp(audio=False), "type": "offer"})
        await _expect(http, "POST", f"{url}/offer", 400, "no_video",
                      json={"sdp": await _offer_sdp(video=False), "type": "offer"})
        await _expect(http, "POST", f"{url}/offer", 404, "unknown_avatar",
                      json={"sdp": valid, "type": "offer", "avatar": "nobody"})
        await _expect(http, "POST", f"{url}/offer", 400, "invalid_options",
                      json={"sdp": valid, "type": "offer", "options": {"motion_scale": 9}})
        await _expect(http, "POST", f"{url}/offer", 400, "invalid_options",
                      json={"sdp": valid, "type": "offer", "options": {"warp": 1}})
        await _expect(http, "POST", f"{url}/offer", 400, "invalid_options",
                      json={"sdp": valid, "type": "offer", "options": {"size": 300}})
        await _expect(http, "POST", f"{url}/offer", 413, "body_too_large",
                      data=b"x" * (9 * 1024 * 1024), headers=JSON)
        await _expect(http, "POST", f"{url}/avatars", 413, "body_too_large",
                      data=b"x" * (9 * 1024 * 1024))
        await _expect(http, "POST", f"{url}/avatars", 400, "not_an_image",
                      data=b"%PDF-1.4 definitely not a portrait")
        await _expect(http, "POST", f"{url}/avatars", 400, "missing_image", data=b"")
        grey = np.full((300, 300, 3), 128, np.uint8)
        await _expect(http, "POST", f"{url}/avatars", 422, "no_face", data=_png(grey))
        await _expect(http, "POST", f"{url}/avatars", 413, "image_too_large",
                      data=_png_claiming(100_000, 100_000))
        form = aiohttp.FormData()
        form.add_field("image", io.BytesIO(_png(grey)), filename="grey.png")
        page = {"Origin": url}  # a form upload is taken from the server's own page
        await _expect(http, "POST", f"{url}/avatars", 422, "no_face", data=form, headers=page)

        async def chunked_multipart():  # no Content-Length: the limit must hold while streaming
            boundary = b"b0undary"
            yield b"--" + boundary + b'\r\nContent-Disposition: form-data; name="image"; ' \
                b'filename="big.png"\r\nContent-Type: image/png\r\n\r\n'
            for _ in range(10):
                yield b"x" * (1024 * 1024)
            yield b"\r\n--" + boundary + b"--\r\n"

        await _expect(http, "POST", f"{url}/avatars", 413, "body_too_large",
                      data=chunked_multipart(),
                      headers={"Content-Type": "multipart/form-data; boundary=b0undary", **page})
        await _expect(http, "PATCH", f"{url}/sessions/nope", 404, "unknown_session", json={})
        await _expect(http, "DELETE", f"{url}/sessions/nope", 404, "unknown_session")
        await _expect(http, "GET", f"{url}/no/such/page", 404, "not_found")
        received = await live
        assert received.video_fps() >= 24.0, received.video_fps()
        async with http.get(f"{url}/sessions") as response:
            assert (await response.json())["sessions"] == []  # nothing leaked
        assert await _avatar_ids(http, url) == avatars_before
        async with http.get(f"{url}/healthz") as response:
            health = await response.json()
        assert health["status"] == "ok" and health["session_capacity"] >= 2


@pytest.mark.e2e
async def test_protocol_hygiene_every_answer_is_json_and_nothing_is_made(server):
    valid = await _offer_sdp()
    url = server.url

    def broken(old: str, new: str) -> str:
        assert old in valid
        return valid.replace(old, new)

    ufrag = next(line for line in valid.splitlines() if line.startswith("a=ice-ufrag:"))
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as response:
            created_before = _created(await response.text())
        # A page on another origin can post text or forms without asking; JSON it cannot.
        await _expect(http, "POST", f"{url}/offer", 415, "unsupported_media_type",
                      data=json.dumps({"sdp": valid, "type": "offer"}),
                      headers={"Content-Type": "text/plain"})
        await _expect(http, "POST", f"{url}/offer", 415, "unsupported_media_type",
                      data={"sdp": valid, "type": "offer"})  # a form
        await _expect(http, "POST", f"{url}/offer", 400, "invalid_json",
                      data="[" * 100_000, headers=JSON)
        for avatar in ({}, False, 7, ""):
            await _expect(http, "POST", f"{url}/offer", 400, "invalid_avatar",
                          json={"sdp": valid, "type": "offer", "avatar": avatar})
        for options in ([], "size=256", 0):
            await _expect(http, "POST", f"{url}/offer", 400, "invalid_options",
                          json={"sdp": valid, "type": "offer", "options": options})
        await _expect(http, "POST", f"{url}/offer", 400, "bad_ice_credentials",
                      json={"sdp": broken(ufrag, "a=ice-ufrag:a b"), "type": "offer"})
        md5_only = "\r\n".join("a=fingerprint:md5 00:11:22" if line.startswith(
            "a=fingerprint:") else line for line in valid.split("\r\n"))
        await _expect(http, "POST", f"{url}/offer", 400, "bad_fingerprint",
                      json={"sdp": md5_only, "type": "offer"})
        media = valid[valid.index("m=audio"):valid.index("m=video")]
        await _expect(http, "POST", f"{url}/offer", 400, "too_many_m_lines",
                      json={"sdp": valid + media * 40, "type": "offer"})
        await _expect(http, "POST", f"{url}/offer", 400, "sdp_too_large",
                      json={"sdp": valid + "a=x-padding:" + "x" * 70_000 + "\r\n",
                            "type": "offer"})
        # A name re-pointed at loopback (DNS rebinding) does not reach the server.
        await _expect(http, "GET", f"{url}/sessions", 403, "host_not_allowed",
                      headers={"Host": "attacker.example"})
        async with http.get(f"{url}/healthz", headers={"Host": "localhost:1234"}) as response:
            assert response.status == 200
        async with http.get(f"{url}/metrics") as response:
            assert _created(await response.text()) == created_before


def _created(exposition: str) -> float:
    return sum(float(line.split()[-1]) for line in exposition.splitlines()
               if line.startswith("sonic_sessions_total"))


@pytest.mark.e2e
async def test_upload_a_portrait_and_talk_with_it(server, speech_wav):
    photo = cv2.imread(str(REPO_ROOT / "static" / "avatars" / "astronaut.png"))
    mirrored = np.ascontiguousarray(photo[:, ::-1])
    ok, jpeg = cv2.imencode(".jpg", mirrored)
    async with aiohttp.ClientSession() as http:
        form = aiohttp.FormData()
        form.add_field("image", jpeg.tobytes(), filename="mirror.jpg", content_type="image/jpeg")
        async with http.post(f"{server.url}/avatars", data=form,  # as the page sends it
                             headers={"Origin": server.url}) as response:
            assert response.status == 201, await response.text()
            avatar_id = (await response.json())["avatar_id"]
        async with http.get(f"{server.url}/avatars/{avatar_id}") as response:
            assert (await response.json())["geometry_source"] == "landmarks"
        async with http.get(f"{server.url}/avatars/{avatar_id}/image") as response:
            assert response.status == 200 and response.content_type == "image/png"
    received = await run_session(server.url, str(speech_wav), seconds=3.0, avatar=avatar_id,
                                 options={"size": 512, "motion_scale": 1.5})
    assert received.video.data[-1].shape == (512, 512, 3)
    async with aiohttp.ClientSession() as http:
        async with http.delete(f"{server.url}/sessions/{received.session_id}") as response:
            assert response.status == 404  # run_session already hung up


@pytest.mark.e2e
async def test_knobs_change_live_and_bad_knobs_are_refused(server, speech_wav):
    task = asyncio.create_task(run_session(server.url, str(speech_wav), seconds=4.0, keep=False))
    async with aiohttp.ClientSession() as http:
        for _ in range(50):
            async with http.get(f"{server.url}/sessions") as response:
                sessions = (await response.json())["sessions"]
            if sessions:
                break
            await asyncio.sleep(0.1)
        session_id = sessions[0]["session_id"]
        async with http.patch(f"{server.url}/sessions/{session_id}",
                              json={"motion_scale": 0.5, "dynamic_scale": 0}) as response:
            assert response.status == 200
            assert (await response.json())["options"] == {"motion_scale": 0.5,
                                                          "dynamic_scale": 0.0}
        await _expect(http, "PATCH", f"{server.url}/sessions/{session_id}", 400,
                      "invalid_options", json={"motion_scale": "big"})
    await task


async def _closed_by_peer_timeout(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sonic_sessions_closed_total" \
                    and sample.labels.get("reason") == "peer timeout":
                return sample.value
    return 0.0


@pytest.mark.e2e
@pytest.mark.timeout(60)
async def test_a_peer_that_vanishes_is_cleaned_up(server, speech_wav):
    client = subprocess.Popen(
        [sys.executable, "-m", "server.client", server.url, str(speech_wav), "--seconds", "30"],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    async with aiohttp.ClientSession() as http:
        timed_out_before = await _closed_by_peer_timeout(http, server.url)
        try:
            deadline = time.monotonic() + 20
            sessions: list[dict] = []
            while time.monotonic() < deadline and not any(
                    s["state"] == "connected" for s in sessions):
                await asyncio.sleep(0.2)
                async with http.get(f"{server.url}/sessions") as response:
                    sessions = (await response.json())["sessions"]
            assert [s["state"] for s in sessions] == ["connected"], sessions  # ours alone
        finally:
            client.send_signal(signal.SIGKILL)  # gone without hanging up
            client.wait()
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < 15:
            async with http.get(f"{server.url}/sessions") as response:
                if not (await response.json())["sessions"]:
                    break
            await asyncio.sleep(0.25)
        gone_after = time.monotonic() - killed_at
        assert gone_after < 10, f"session still listed {gone_after:.1f} s after the peer vanished"
        # It was the only session, and exactly one more session ended by timing out.
        assert await _closed_by_peer_timeout(http, server.url) == timed_out_before + 1


@pytest.fixture(scope="module")
def strict_server() -> Iterator[ServerProcess]:
    """A server that takes no session (its engine allowance is next to nothing) and closes
    a connection after 2 s without a request."""
    with ServerProcess("--set", "session.max_engine_load=0.001",
                       "--set", "http.idle_timeout_s=2") as process:
        yield process


@pytest.mark.e2e
async def test_a_session_the_engine_cannot_carry_is_refused_up_front(strict_server):
    url = strict_server.url
    async with aiohttp.ClientSession() as http:
        body = await _expect(http, "POST", f"{url}/offer", 503, "at_capacity",
                             json={"sdp": await _offer_sdp(), "type": "offer"})
        assert "max_engine_load" in body["message"]
        async with http.get(f"{url}/sessions") as response:
            assert (await response.json())["sessions"] == []


async def _raw_answer(url: str, request: bytes) -> tuple[bytes, dict[str, object]]:
    """Send raw bytes; the status line and headers, and the JSON body, of the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        body = await asyncio.wait_for(reader.read(), 10)  # the server closes after an error
    finally:
        writer.close()
    return head, json.loads(body)


@pytest.mark.e2e
async def test_errors_aiohttp_answers_itself_are_in_the_json_shape(strict_server):
    head, body = await _raw_answer(strict_server.url, b"GET /healthz HTTP/1.1\r\nHost: "
                                   b"127.0.0.1\r\nX-Big: " + b"x" * 20_000 + b"\r\n\r\n")
    assert head.split()[1] == b"400" and b"application/json" in head
    assert body["error"] == "bad_request" and "8190" in str(body["message"])
    head, body = await _raw_answer(strict_server.url, b"NOT HTTP AT ALL\r\n\r\n")
    assert head.split()[1] == b"400" and body["error"] == "bad_request"


@pytest.mark.e2e
async def test_a_connection_that_sends_nothing_or_trickles_its_headers_is_closed(strict_server):
    host, port = strict_server.url.removeprefix("http://").split(":")
    for first, trickled in ((b"", b""), (b"GET /healthz HTTP/1.1\r\nX-Slow: ", b"a")):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(first)
        started = time.monotonic()

        async def trickle(writer: asyncio.StreamWriter = writer, trickled: bytes = trickled
                          ) -> None:
            for _ in range(20):  # a header byte a second, for longer than anyone should wait
                await asyncio.sleep(1.0)
                writer.write(trickled)
                with contextlib.suppress(ConnectionError):
                    await writer.drain()

        sender = asyncio.create_task(trickle())
        try:
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, unanswered
            closed_after = time.monotonic() - started
        finally:
            sender.cancel()
            writer.close()
        assert closed_after < 4  # http.idle_timeout_s = 2 in the fixture


@pytest.mark.e2e
async def test_config_shows_the_settings_in_force_and_the_knobs(server):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/config") as response:
            assert response.status == 200
            config = await response.json()
        async with http.get(f"{server.url}/healthz") as response:
            health = await response.json()
    assert config["settings"]["session"]["peer_timeout_s"] == 3.0  # the fixture's --set
    assert config["settings"]["http"]["port"] == server.port
    assert config["settings"]["ice"]["host_addresses"] == ["127.0.0.1"]
    assert [k["name"] for k in config["knobs"]] == list(KNOB_NAMES)
    assert all(k["min"] < k["max"] and k["min"] <= k["default"] <= k["max"] and k["doc"]
               for k in config["knobs"])
    assert health["runtime"] == "onnxruntime" and health["runtime_verified"] is True
    # The same settings were logged at start-up, and third-party chatter was not.
    log = (REPO_ROOT / "out" / f"server-{server.port}.log").read_text()
    assert "settings [session] pipeline_delay_ms=130.0 " in log
    assert "peer_timeout_s=3.0" in log
    assert "loading sonic-lite.json on onnxruntime" in log
    assert "INFO: Created TensorFlow Lite" not in log


@pytest.mark.unit
def test_the_candidate_policy_keeps_the_server_from_sending_where_an_offer_points():
    from server.config import IceSettings
    from server.media.peer import allowed_candidates

    lines = [
        "v=0", "m=audio 9 UDP/TLS/RTP/SAVPF 111",
        "a=candidate:1 1 udp 2130706431 127.0.0.1 50000 typ host",
        "a=candidate:2 1 udp 2130706431 169.254.169.254 80 typ host",  # cloud metadata
        "a=candidate:3 1 udp 2130706431 fe80::1 50000 typ host",  # link-local
        "a=candidate:4 1 udp 2130706431 224.0.0.251 5353 typ host",  # multicast
        "a=candidate:5 1 udp 2130706431 internal.corp.example 80 typ host",  # a DNS name
        "a=candidate:6 1 udp 2130706431 3c8f1b2e-0d4a.local 50000 typ host",  # mDNS
        "a=candidate:7 1 udp 1694498815 203.0.113.7 50001 typ srflx raddr 0.0.0.0 rport 0",
        "a=candidate:8 broken",
        "a=end-of-candidates", "",
    ]
    sdp = "\r\n".join(lines)
    kept, dropped = allowed_candidates(sdp, IceSettings())
    addresses = [line.split()[4] for line in kept.splitlines()
                 if line.startswith("a=candidate:")]
    assert addresses == ["127.0.0.1", "203.0.113.7"] and dropped == 6
    assert kept.endswith("a=end-of-candidates\r\n")  # the rest of the SDP untouched
    kept, _ = allowed_candidates(sdp, IceSettings(mdns=True, blocked_ranges=[]))
    assert "3c8f1b2e-0d4a.local" in kept and "169.254.169.254" in kept
    assert "internal.corp.example" not in kept  # names other than .local: never
    # An IPv4 address written as IPv6 is judged as the IPv4 it is; private ranges are
    # refused where ice.private_candidates says so (loopback never).
    mapped = "\r\n".join(["v=0", "a=candidate:1 1 udp 1 ::ffff:169.254.169.254 80 typ host",
                           "a=candidate:2 1 udp 1 ::ffff:192.168.1.7 5000 typ host",
                           "a=candidate:3 1 udp 1 10.1.2.3 5000 typ host",
                           "a=candidate:4 1 udp 1 127.0.0.1 5000 typ host", ""])
    kept, dropped = allowed_candidates(mapped, IceSettings())
    assert "169.254.169.254" not in kept and dropped == 1
    kept, dropped = allowed_candidates(mapped, IceSettings(private_candidates=False))
    assert dropped == 3 and kept.count("a=candidate:") == 1 and "127.0.0.1" in kept


@pytest.mark.unit
async def test_an_avatar_keeps_portraits_at_the_served_sizes_not_the_upload():
    from inference.images import load_default_avatar
    from server.config import AvatarSettings
    from server.media.avatars import AvatarStore

    photo = cv2.resize(load_default_avatar(), (3000, 3000))  # 27 MB decoded
    ok, png = cv2.imencode(".png", cv2.cvtColor(photo, cv2.COLOR_RGB2BGR))
    store = AvatarStore(None, AvatarSettings(), sizes=(256, 512))  # type: ignore[arg-type]
    avatar = await store.add_upload(png.tobytes(), "big")  # (the engine is not needed yet)
    held = [v for v in vars(avatar).values() if isinstance(v, np.ndarray)]
    held += [p.image for p in avatar.prepared.values()]
    assert sorted(a.shape[0] for a in held) == [256, 512]
    assert sum(a.nbytes for a in held) == 3 * (256 ** 2 + 512 ** 2)  # about 1 MB, not 27
    assert (avatar.width, avatar.height) == (3000, 3000)


@pytest.mark.e2e
async def test_a_client_trickling_its_body_is_answered_408_and_let_go(server):
    host, port = server.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /offer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{")
    await writer.drain()
    started = time.monotonic()

    async def trickle() -> None:
        for _ in range(20):  # a byte a second, for longer than anyone should wait
            await asyncio.sleep(1.0)
            writer.write(b" ")
            await writer.drain()

    sender = asyncio.create_task(trickle())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        answered_after = time.monotonic() - started
    finally:
        sender.cancel()
        writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"application/json" in head
    assert answered_after < 5  # http.body_timeout_s = 2 in the fixture
