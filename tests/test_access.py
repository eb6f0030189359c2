"""With API keys set, control routes need a key and each key sees only its own sessions;
viewers need only their session's token (issue 10, item 5)."""

from __future__ import annotations

import os

import aiohttp
import pytest
from conftest import ServerProcess

from server.client.peer import run_session

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def keyed():  # type: ignore[no-untyped-def]
    """A server whose keys come from the environment, as an operator would pass them, that
    answers a public name first (as behind a proxy) and calibrates itself at start-up."""
    os.environ["SONIC_API_KEYS"] = "key-one,key-two"
    try:
        with ServerProcess("--set", "session.peer_timeout_s=3",
                           "--set", "http.allowed_hosts=avatar.example.com,127.0.0.1",
                           "--set", "session.calibration_sessions=1") as server:
            yield server
    finally:
        del os.environ["SONIC_API_KEYS"]


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_without_a_key_control_routes_are_401(keyed):
    async with aiohttp.ClientSession() as http:
        for method, path, kwargs in (
                ("POST", "/sessions", {"json": {}}),
                ("POST", "/offer", {"json": {"sdp": "v=0", "type": "offer"}}),
                ("POST", "/whip", {"data": b"v=0", "headers": {"Content-Type": "application/sdp"}}),
                ("GET", "/sessions", {}),
                ("GET", "/metrics", {}),
                ("POST", "/avatars", {"data": b"x", "headers": {"Content-Type": "image/png"}})):
            for key in ({}, _as("not-a-key")):
                sent = dict(kwargs)
                sent["headers"] = {**sent.get("headers", {}), **key}
                async with http.request(method, f"{keyed.url}{path}", **sent) as response:
                    body = await response.json()
                    assert (response.status, body["error"]) == (401, "unauthorized"), \
                        (method, path, body)
                    assert response.headers["WWW-Authenticate"] == "Bearer"
        async with http.get(f"{keyed.url}/healthz") as response:
            assert response.status == 200
        async with http.get(f"{keyed.url}/config") as response:
            assert (await response.json())["settings"]["http"]["api_keys"] != \
                ["key-one", "key-two"]  # withheld


async def test_the_start_up_calibration_passes_the_servers_own_key_and_host_checks(keyed):
    """Its peers are clients like any other: they need a key and a Host the server
    answers to, and still measured what a session costs."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{keyed.url}/healthz") as response:
            health = await response.json()
    assert health["status"] == "ok" and health["sessions"] == 0, health
    calibration = health["calibration"]
    assert calibration["sessions"] == 1 and calibration["fps_min"] >= 24, calibration
    assert health["cores_per_session"] == calibration["cores_per_session"] > 0.09, health


async def test_each_key_sees_and_drives_only_its_own_sessions(keyed):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{keyed.url}/sessions", json={}, headers=_as("key-one")) as r:
            created = await r.json()
            assert r.status == 201, created
        mine = f"{keyed.url}/sessions/{created['session_id']}"
        for method, suffix in (("GET", ""), ("PATCH", ""), ("DELETE", ""),
                               ("POST", "/interrupt"), ("GET", "/events")):
            async with http.request(method, mine + suffix, json={},
                                    headers=_as("key-two")) as response:
                assert response.status == 404, (method, suffix)
        async with http.post(mine + "/speech", data=b"\x00\x00",
                             headers={"Content-Type": "audio/L16;rate=16000",
                                      **_as("key-two")}) as response:
            assert response.status == 404
        async with http.get(f"{keyed.url}/sessions", headers=_as("key-two")) as response:
            assert (await response.json())["sessions"] == []
        async with http.get(f"{keyed.url}/sessions", headers=_as("key-one")) as response:
            listed = [s["session_id"] for s in (await response.json())["sessions"]]
            assert listed == [created["session_id"]]
        # A viewer needs no key, only the session's token.
        received = await run_session(keyed.url, "", seconds=2.0,
                                     view=(created["session_id"], created["token"]))
        assert received.video_fps() >= 20
        async with http.delete(mine, headers=_as("key-one")) as response:
            assert response.status == 204


async def test_an_uploaded_face_is_private_to_its_key_and_deletable(keyed):
    from test_front_door import _portrait_png

    async with aiohttp.ClientSession() as http:
        async with http.post(f"{keyed.url}/avatars", data=_portrait_png(),
                             headers={"Content-Type": "image/png", **_as("key-one")}) as r:
            uploaded = await r.json()
            assert r.status == 201 and uploaded["public"] is False, uploaded
        face = uploaded["avatar_id"]

        async def listed(headers: dict[str, str]) -> list[str]:
            async with http.get(f"{keyed.url}/avatars", headers=headers) as response:
                return [a["avatar_id"] for a in (await response.json())["avatars"]]

        assert face in await listed(_as("key-one"))
        assert await listed(_as("key-two")) == await listed({}) == ["astronaut"]
        for path in (f"/avatars/{face}", f"/avatars/{face}/image"):
            async with http.get(keyed.url + path, headers=_as("key-two")) as response:
                assert response.status == 404
        async with http.post(f"{keyed.url}/sessions", json={"avatar": face},
                             headers=_as("key-two")) as response:
            assert (response.status, (await response.json())["error"]) == \
                (404, "unknown_avatar")
        async with http.delete(f"{keyed.url}/avatars/{face}", headers=_as("key-two")) as r:
            assert r.status == 404
        async with http.delete(f"{keyed.url}/avatars/astronaut", headers=_as("key-one")) as r:
            assert (r.status, (await r.json())["error"]) == (403, "shipped_avatar")
        async with http.delete(f"{keyed.url}/avatars/{face}", headers=_as("key-one")) as r:
            assert r.status == 204
        assert face not in await listed(_as("key-one"))


async def test_only_configured_origins_get_cors_answers(monkeypatch):
    monkeypatch.delenv("SONIC_API_KEYS", raising=False)  # the keyed server's, if it is up
    with ServerProcess("--set", "http.cors_origins=https://app.example.com") as server:
        async with aiohttp.ClientSession() as http:
            preflight = {"Origin": "https://app.example.com",
                         "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "content-type, authorization"}
            async with http.options(f"{server.url}/sessions", headers=preflight) as response:
                assert response.status == 204
                assert response.headers["Access-Control-Allow-Origin"] == \
                    "https://app.example.com"
                assert "Authorization" in response.headers["Access-Control-Allow-Headers"]
            async with http.get(f"{server.url}/sessions",
                                headers={"Origin": "https://app.example.com"}) as response:
                assert response.headers["Access-Control-Allow-Origin"] == \
                    "https://app.example.com"
            async with http.get(f"{server.url}/sessions/nope",
                                headers={"Origin": "https://app.example.com"}) as response:
                assert response.status == 404  # errors carry it too, so pages can read why
                assert "Access-Control-Allow-Origin" in response.headers
            for origin in ("https://evil.example", None):
                headers = {"Origin": origin} if origin else {}
                async with http.get(f"{server.url}/sessions", headers=headers) as response:
                    assert "Access-Control-Allow-Origin" not in response.headers
                asking = {k: v for k, v in preflight.items() if k != "Origin"}
                async with http.options(f"{server.url}/sessions",
                                        headers={**asking, **headers}) as response:
                    assert "Access-Control-Allow-Origin" not in response.headers
