"""Hostile tenants against a real server, from outside: oversized bodies before any key is
shown, one caller's streams against everyone's control plane, secrets in any alphabet,
other sites' pages, a token holder's viewers, paths that try to reach another route. Each
was a failure of the server before ``server.http.guard`` (issue 43)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from conftest import ServerProcess, call_json
from test_http_api import _offer_sdp

pytestmark = pytest.mark.e2e

KEYS = "tenant-a-key,tenant-b-key"
A, B = ({"Authorization": f"Bearer {key}"} for key in KEYS.split(","))
MB = 1 << 20


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def _raw(url: str, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request written by hand (headers in any bytes a client may send): status, body."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.fixture(scope="module")
def keyed():  # type: ignore[no-untyped-def]
    with ServerProcess("--set", f"http.api_keys={KEYS}", "--set", "session.max_viewers=2"
                       ) as server:
        yield server


async def test_oversized_bodies_are_refused_unread_and_memory_stays_bounded(keyed):
    """40 at once, three rounds, of 10 MB bodies with no key: 401 before a byte is read.
    With a key, the same: 413 by their length. Without a length, read only to the route's
    limit. The front door's memory stays within a few tens of MB of where it was."""
    before = _rss_mb(keyed.proc.pid)
    huge = b"{" + b" " * (10 * MB) + b"}"

    async def one(http: aiohttp.ClientSession, headers: dict[str, str], body: object) -> int:
        try:
            async with http.post(f"{keyed.url}/sessions", data=body,
                                 headers={"Content-Type": "application/json", **headers},
                                 timeout=aiohttp.ClientTimeout(total=30)) as response:
                await response.read()
                return response.status
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            return 0  # closed while still sending: what a refusal unread may look like

    async def streamed():  # no Content-Length: chunked
        for _ in range(10):
            yield b" " * MB

    async with aiohttp.ClientSession() as http:
        for headers, expected in (({}, {401}), (A, {413})):
            for _ in range(3):
                statuses = await asyncio.gather(*(one(http, headers, huge) for _ in range(40)))
                assert set(statuses) <= expected | {0} and set(statuses) & expected, statuses
        statuses = await asyncio.gather(*(one(http, A, streamed()) for _ in range(40)))
        assert set(statuses) <= {413, 0} and 413 in statuses, statuses
    grown = _rss_mb(keyed.proc.pid) - before
    assert grown < 64, f"the front door grew {grown:.0f} MB"
    status, health = await call_json("GET", f"{keyed.url}/healthz")
    assert status == 200, health


async def test_one_callers_streams_never_starve_everyones_control_plane(keyed):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{keyed.url}/sessions", json={}, headers=A) as response:
            session_id = (await response.json())["session_id"]
        streams: list[aiohttp.ClientResponse] = []
        refused = 0
        try:
            for _ in range(100):
                response = await http.get(f"{keyed.url}/sessions/{session_id}/events",
                                          headers=A, timeout=aiohttp.ClientTimeout(total=None))
                if response.status == 200:
                    streams.append(response)
                else:
                    assert response.status == 429 and "Retry-After" in response.headers
                    assert (await response.json())["error"] == "too_many_streams"
                    refused += 1
                    response.release()
            settings = (await (await http.get(f"{keyed.url}/config")).json())["settings"]
            assert len(streams) == settings["http"]["max_streams_per_caller"] == 100 - refused
            started = time.monotonic()
            timeout = aiohttp.ClientTimeout(total=5)
            for method, path, headers in (("GET", "/healthz", {}), ("GET", "/sessions", B),
                                          ("GET", "/metrics", B), ("POST", "/sessions", B),
                                          ("GET", f"/sessions/{session_id}", A)):
                async with http.request(method, f"{keyed.url}{path}", headers=headers,
                                        json={} if method == "POST" else None,
                                        timeout=timeout) as response:
                    assert response.status in (200, 201), (path, response.status)
            assert time.monotonic() - started < 5
            # Another caller's streams are its own to count.
            async with http.get(f"{keyed.url}/sessions", headers=B) as response:
                (b_session,) = [s for s in (await response.json())["sessions"]]
            async with http.get(f"{keyed.url}/sessions/{b_session['session_id']}/events",
                                headers=B) as response:
                assert response.status == 200
        finally:
            for response in streams:
                response.close()


async def test_a_secret_in_any_alphabet_is_only_a_wrong_one(keyed):
    for path in (b"/sessions", b"/metrics"):
        status, body = await _raw(keyed.url, b"GET " + path + b" HTTP/1.1\r\n"
                                  b"Authorization: Bearer caf\xc3\xa9")
        assert status == 401 and b'"unauthorized"' in body, (path, status, body)
    status, body = await _raw(keyed.url, b"GET /avatars HTTP/1.1\r\n"
                              b"Authorization: Bearer caf\xc3\xa9")
    assert status == 200 and body.startswith(b"{"), body
    status, made = await call_json("POST", f"{keyed.url}/sessions", {})  # keyless: 401
    assert status == 401
    async with aiohttp.ClientSession(headers=A) as http:
        async with http.post(f"{keyed.url}/sessions", json={}) as response:
            session_id = (await response.json())["session_id"]
        sdp = await _offer_sdp(audio=True, video=True)
        async with http.post(f"{keyed.url}/offer", json={
                "sdp": sdp, "type": "offer", "session_id": session_id,
                "token": "caf\u00e9" * 8}) as response:
            assert (response.status, (await response.json())["error"]) == (403, "bad_token")
        async with http.post(f"{keyed.url}/sessions/{session_id}/whep?token=caf%C3%A9",
                             data=sdp, headers={"Content-Type": "application/sdp"}
                             ) as response:
            assert (response.status, (await response.json())["error"]) == (403, "bad_token")


async def test_other_sites_pages_cannot_drive_a_keyless_server(server, speech_wav):
    evil = {"Origin": "http://evil.example"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/sessions", json={}) as response:
            made = await response.json()
        path = f"/sessions/{made['session_id']}"
        form = aiohttp.FormData()
        form.add_field("image", b"\x89PNG not really", filename="face.png")
        async with http.post(f"{server.url}/avatars", data=form, headers=evil) as response:
            assert (response.status, (await response.json())["error"]) == (403, "cross_origin")
        for headers in ({}, evil):  # a form post, with or without a foreign Origin
            async with http.post(f"{server.url}/avatars", data=b"\x89PNG",
                                 headers={"Content-Type": "text/plain", **headers}) as r:
                assert (r.status, (await r.json())["error"]) == (403, "cross_origin")
            async with http.post(f"{server.url}{path}/interrupt", data=b"stop",
                                 headers={"Content-Type": "text/plain", **headers}) as r:
                assert (r.status, (await r.json())["error"]) == (403, "cross_origin")
        async with http.post(f"{server.url}/sessions", json={}, headers=evil) as response:
            assert response.status == 403
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with http.ws_connect(f"{server.url}{path}/ws", headers=evil):
                pass
        assert refused.value.status == 403
        # The server's own page, and clients that are no page, go on as before.
        own = {"Origin": server.url}
        async with http.post(f"{server.url}{path}/interrupt", headers=own) as response:
            assert response.status == 200
        async with http.ws_connect(f"{server.url}{path}/ws") as ws:
            await ws.send_json({"type": "interrupt"})
            assert (await ws.receive_json(timeout=5))["type"] == "interrupted"
        async with http.delete(f"{server.url}{path}") as response:
            assert response.status == 204


async def test_a_token_holder_gets_the_sessions_viewers_and_no_more(keyed):
    async with aiohttp.ClientSession(headers=A) as http:
        async with http.post(f"{keyed.url}/sessions", json={}) as response:
            made = await response.json()
    viewers = []
    try:
        async def view() -> tuple[int, dict]:
            from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

            pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
            pc.addTransceiver("audio", direction="recvonly")
            pc.addTransceiver("video", direction="recvonly")
            await pc.setLocalDescription(await pc.createOffer())
            viewers.append(pc)
            status, answer = await call_json("POST", f"{keyed.url}/offer", {
                "sdp": pc.localDescription.sdp, "type": "offer",
                "session_id": made["session_id"], "token": made["token"]})
            if status == 200:
                await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], "answer"))
            return status, answer

        answers = [await view() for _ in range(3)]  # the keyed server's max_viewers: 2
        assert [status for status, _ in answers] == [200, 200, 429], answers
        assert answers[2][1]["error"] == "too_many_viewers"
    finally:
        await asyncio.gather(*(pc.close() for pc in viewers))


async def test_offers_from_one_address_wait_their_turn():
    with ServerProcess("--set", "http.max_offers_in_flight=1") as server:
        sdp = await _offer_sdp()
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{server.url}/sessions", json={}) as response:
                made = await response.json()

            async def view() -> int:
                async with http.post(f"{server.url}/offer", json={
                        "sdp": sdp, "type": "offer", "session_id": made["session_id"],
                        "token": made["token"]}) as response:
                    if response.status == 429:
                        assert response.headers["Retry-After"] == "1"
                    return response.status

            statuses = await asyncio.gather(*(view() for _ in range(6)))
            assert 429 in statuses, statuses


async def test_paths_ids_and_names_cannot_reach_past_their_route(server):
    async with aiohttp.ClientSession() as http:
        # A session id carrying "/../offer?" stays a (missing) session's: never /offer.
        async with http.post(f"{server.url}/sessions/w0-x%2F..%2F..%2Foffer%3F/interrupt",
                             json={}) as response:
            assert (response.status, (await response.json())["error"]) == \
                (404, "unknown_session")
        for size, status in ((100_000, 400), (1 << 20, 413)):  # within and past the limit
            async with http.post(f"{server.url}/sessions",
                                 json={"name": "n" * size}) as response:
                answer = await response.text()  # the name is not sent back
                assert response.status == status and len(answer) < 300, answer[:300]
        async with http.post(f"{server.url}/avatars", data=b"--x\r\n",
                             headers={"Content-Type": "multipart/form-data",
                                      "Origin": server.url}) as response:
            assert response.status == 400 and response.content_type == "application/json"
            assert (await response.json())["error"] == "bad_multipart"
