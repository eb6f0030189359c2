"""The kiosk page in headless Chromium: it finds a named session by name and token, plays
it without a click (muted until the first touch where autoplay says so), and starts again
by itself when the session is made anew or the server restarts, saying so over the
picture while it has none."""

from __future__ import annotations

import pytest
from conftest import ServerProcess, call_json
from test_browser import CHROMIUM, chromium_page, poll

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed"),
    pytest.mark.timeout(300),
]
TOKEN = "kiosk-lobby-0123456789"


async def make_lobby(url: str) -> str:
    """What the kiosk's backend does after every start: the named session, same token."""
    status, made = await call_json("POST", f"{url}/sessions", {"name": "lobby", "token": TOKEN})
    assert status == 201, made
    return made["session_id"]


async def kiosk(page) -> dict:  # type: ignore[no-untyped-def]
    return await page.evaluate("({...window.kiosk})")


async def playing(page, after_frames: int = 0) -> dict | None:  # type: ignore[no-untyped-def]
    state = await kiosk(page)
    return state if state["state"] == "playing" and state["frames"] > after_frames + 25 \
        and state["notice"] == "" else None


@pytest.mark.e2e
async def test_named_sessions_are_unique_and_found_only_with_their_token(server):
    status, made = await call_json("POST", f"{server.url}/sessions",
                              {"name": "hall", "token": TOKEN})
    assert status == 201 and made["name"] == "hall" and made["token"] == TOKEN
    try:
        again = await call_json("POST", f"{server.url}/sessions", {"name": "hall"})
        assert (again[0], again[1]["error"]) == (409, "name_taken")
        found = await call_json("GET", f"{server.url}/names/hall?token={TOKEN}")
        assert found == (200, {"session_id": made["session_id"], "name": "hall"})
        assert (await call_json("GET", f"{server.url}/names/hall?token=wrong"))[0] == 403
        assert (await call_json("GET", f"{server.url}/names/nobody?token={TOKEN}"))[0] == 404
        for bad in ({"name": "a/b"}, {"name": ""}, {"name": 7}, {"token": "short"},
                    {"token": "x" * 20 + "!"}):
            status, body = await call_json("POST", f"{server.url}/sessions", bad)
            assert status == 400 and body["error"] in ("invalid_name", "invalid_token"), bad
    finally:
        await call_json("DELETE", f"{server.url}/sessions/{made['session_id']}")


@pytest.mark.browser
async def test_the_kiosk_plays_a_named_session_and_comes_back_by_itself(speech_wav, tmp_path):
    first = ServerProcess()
    with first:
        session_id = await make_lobby(first.url)
        async with chromium_page(tmp_path, speech_wav) as page:
            await page.goto(f"{first.url}/kiosk?name=lobby&token={TOKEN}")
            state = await poll(lambda: playing(page), 30, "the kiosk to play the session")
            # Headless Chromium plays sound without a gesture, whatever --autoplay-policy
            # says (tried): the muted path ("Touch for sound") is not reached here.
            hint = await page.is_visible("#sound")
            assert hint == state["muted"]
            if state["muted"]:
                await page.mouse.click(10, 10)
                assert not (await kiosk(page))["muted"]
                assert not await page.is_visible("#sound")

            # The session ends (a drop, as the kiosk sees it) and is made anew.
            await call_json("DELETE", f"{first.url}/sessions/{session_id}")
            await poll(lambda: page.is_visible("#notice"), 3,
                       "a notice over the stopped picture")
            await make_lobby(first.url)
            frames = (await kiosk(page))["frames"]
            await poll(lambda: playing(page, frames), 30, "the kiosk to come back")

            # The server goes away and comes back on the same address.
            first.stop()
            await poll(lambda: page.is_visible("#notice"), 3,
                       "a notice over the frozen picture")
            text = (await kiosk(page))["notice"]
            assert "reconnecting" in text.lower() or "waiting" in text.lower(), text
            with ServerProcess(port=first.port) as second:
                await poll(lambda: page.evaluate("window.kiosk.state === 'waiting' || "
                                                 "window.kiosk.state === 'offline'"), 20,
                           "the kiosk to wait for the session")
                await make_lobby(second.url)
                frames = (await kiosk(page))["frames"]
                state = await poll(lambda: playing(page, frames), 40,
                                   "the kiosk to come back after the restart")
                assert state["connects"] == 3
