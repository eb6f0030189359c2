"""The web page end to end in a real browser: Debian's headless Chromium, driven by Playwright.

Chromium's fake microphone plays the espeak-ng speech WAV; the page sends it to the server
over WebRTC on loopback and must show the avatar's video, keep decoding frames at the
server's rate, pass slider moves to the session, and end the session on Stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = Path("/tmp/page.png")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed "
                       "(apt-get install chromium)"),
    pytest.mark.timeout(180),  # the shared server fixture may start inside this test
]
playwright_api = pytest.importorskip("playwright.async_api",
                                     reason="playwright is not installed (pip install .[test])")


def chromium_args(speech_wav: Path) -> list[str]:
    """Keep the browser on loopback and feed it the speech as its microphone.

    Chromium keeps only the last ``--disable-features``; ours follows Playwright's own
    list, so exactly these features are off. Without a shell the host rules need no quotes.
    """
    return [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={speech_wav}",
        "--allow-loopback-in-peer-connection",
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
        "--disable-features=WebRtcHideLocalIpsWithMdns,MediaRouter,DialMediaRouteProvider",
    ]


#: The window a laptop user sees the page in: what matters must show without scrolling.
VIEWPORT = {"width": 1280, "height": 900}


@contextlib.asynccontextmanager
async def chromium_page(tmp_path: Path, speech_wav: Path,
                        viewport: dict[str, int] | None = None) -> AsyncIterator[Any]:
    """A page of a fresh headless Chromium kept on loopback, its microphone the speech
    (Playwright's 1280x720 window unless ``viewport`` says otherwise)."""
    async with playwright_api.async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True,
            args=chromium_args(speech_wav), timeout=30_000,
            **({"viewport": viewport} if viewport else {}))
        try:
            yield context.pages[0] if context.pages else await context.new_page()
        finally:
            await context.close()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


async def get_json(url: str) -> dict:
    return await asyncio.to_thread(_get, url)


async def poll(check, timeout: float, what: str):  # type: ignore[no-untyped-def]
    """Await ``check()`` until it returns something truthy, or fail saying ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.2)


def msid_streams(sdp: str) -> dict[str, str]:
    """kind -> the MediaStream id of each m-line's msid (same id: played in sync)."""
    streams: dict[str, str] = {}
    for section in re.split(r"\r?\nm=", sdp)[1:]:
        match = re.search(r"^a=msid:(\S+)", section, re.MULTILINE)
        if match:
            streams[section.split(" ", 1)[0]] = match.group(1)
    return streams


COUNT_VIDEO_FRAMES = """() => {
    const video = document.getElementById('video');
    window.presented = 0;
    const tick = () => { window.presented += 1; video.requestVideoFrameCallback(tick); };
    video.requestVideoFrameCallback(tick);
}"""

SAMPLE = """async () => ({
    frames: await window.sonic.framesDecoded(),
    audio: await window.sonic.audioReceived(),
    sent: await window.sonic.audioPacketsSent(),
    now: performance.now(),
    currentTime: document.getElementById('video').currentTime,
    presented: window.presented,
})"""


async def test_page_talks_to_the_server(server, speech_wav, tmp_path):
    expect = playwright_api.expect
    async with playwright_api.async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True,
            args=chromium_args(speech_wav), viewport={"width": 1200, "height": 860},
            timeout=30_000)
        try:
            context.set_default_timeout(10_000)
            page = context.pages[0] if context.pages else await context.new_page()
            problems: list[str] = []
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.on("console", lambda m: problems.append(f"console: {m.text}")
                    if m.type == "error" else None)

            # The avatar list renders, with the default avatar chosen and its thumbnail.
            await page.goto(f"{server.url}/", wait_until="load")
            await expect(page).to_have_title(re.compile("Sonic"))
            default = page.locator("#avatar-list input[value='astronaut']")
            await expect(default).to_be_checked()
            await expect(page.locator("#avatar-list img").first).to_have_js_property(
                "complete", True)
            # Its name is shown whole (the credit goes to the tooltip).
            name = page.locator("#avatar-list label:has(input[value='astronaut']) span")
            await expect(name).to_have_text("Astronaut")
            assert await name.evaluate(
                "el => el.scrollWidth <= el.clientWidth && el.scrollHeight <= el.clientHeight")

            # The controls are the server's: one slider per knob with its range and
            # default, the frame sizes it allows; and the muted audio says why.
            config = await get_json(f"{server.url}/config")
            sliders = page.locator("#knobs input[type='range']")
            await expect(sliders).to_have_count(len(config["knobs"]))
            for knob in config["knobs"]:
                slider = page.locator(f"#knobs input[data-knob='{knob['name']}']")
                shown = await slider.evaluate("i => [i.min, i.max, i.value].map(Number)")
                assert shown == [knob["min"], knob["max"], knob["default"]], (shown, knob)
            sizes = await page.locator("#size option").evaluate_all(
                "options => options.map(o => Number(o.value))")
            assert sizes == config["settings"]["video"]["allowed_sizes"]
            await expect(page.locator("#mute-hint")).to_be_visible()
            assert await page.locator("#avatar-list img").first.evaluate(
                "img => img.naturalWidth") > 0

            # A failed upload shows the server's complaint. (No successful upload here: the
            # shared server's avatar list must stay as the other tests expect it.)
            await page.locator("#upload").set_input_files(
                {"name": "notes.txt", "mimeType": "text/plain", "buffer": b"not a picture"})
            await expect(page.locator("#upload-error")).to_contain_text("Upload failed: ")
            await expect(default).to_be_checked()
            problems.clear()  # the browser logs the failed request itself

            # Start: the page offers, the server answers, ICE connects over loopback.
            async with page.expect_response("**/offer") as answered:
                await page.click("#start")
            response = await answered.value
            assert response.status == 200, await response.text()
            answer = await response.json()
            streams = msid_streams(answer["sdp"])
            assert streams.get("audio") and streams.get("audio") == streams.get("video"), \
                f"returned audio and video must share one MediaStream to play in sync: {streams}"
            await page.wait_for_function("window.sonic.state === 'connected'", timeout=15_000)
            session_id = await page.evaluate("window.sonic.sessionId")
            assert session_id == answer["session_id"]
            await expect(page.locator("#status")).to_have_attribute("data-state", "connected")
            kinds = await page.evaluate(
                "document.getElementById('video').srcObject.getTracks().map(t => t.kind).sort()")
            assert kinds == ["audio", "video"]

            # Frames keep coming: decoded, presented, and the element's clock runs.
            await page.evaluate(COUNT_VIDEO_FRAMES)
            await page.wait_for_function("window.presented > 0", timeout=10_000)
            before = await page.evaluate(SAMPLE)
            await asyncio.sleep(5.0)
            after = await page.evaluate(SAMPLE)
            decoded = after["frames"] - before["frames"]
            assert decoded >= 100, f"only {decoded} frames decoded in 5 s"
            assert after["currentTime"] - before["currentTime"] >= 4.0, (before, after)
            assert after["presented"] - before["presented"] >= 50, (before, after)
            assert await page.evaluate("document.getElementById('video').videoWidth") == 256
            # The returned speech plays out whole, in 40 ms packets (session.audio_packet_ms).
            samples = after["audio"]["samples"] - before["audio"]["samples"]
            concealed = after["audio"]["concealed"] - before["audio"]["concealed"]
            packets = after["audio"]["packets"] - before["audio"]["packets"]
            assert samples >= 4.0 * 48000 and concealed <= 0.02 * samples, (before, after)
            assert abs(packets - samples / 1920) <= 3, (before, after)
            # The microphone's speech comes in 40 ms packets too: the answer asks for them
            # (a=ptime:40) and Chromium sends 25 a second where it would send 50.
            assert "a=ptime:40" in answer["sdp"]
            sent_per_s = (after["sent"] - before["sent"]) / ((after["now"] - before["now"]) / 1e3)
            assert 23.0 <= sent_per_s <= 27.0, (before, after)

            # The stats panel shows numbers (it refreshes every second).
            stats = page.locator("#stats")
            await expect(stats.locator("[data-stat='fps']")).to_have_text(re.compile(r"^\d"))
            fps = float(await stats.locator("[data-stat='fps']").inner_text())
            assert 18 <= fps <= 32, fps
            for name in ("framesDecoded", "rtt", "videoJitter", "audioJitter", "avOffset",
                         "pipelineP95", "serverFps"):
                shown = stats.locator(f"[data-stat='{name}']")
                try:
                    await expect(shown).to_have_text(re.compile(r"^-?\d"))
                except AssertionError as exc:
                    described = await get_json(f"{server.url}/sessions/{session_id}")
                    raise AssertionError(f"stat {name} shows no number; the server's session: "
                                         f"{described}") from exc

            # A slider move reaches the session (debounced PATCH).
            await page.locator("#motion-scale").fill("0.5")
            await expect(page.locator("#motion-scale-value")).to_have_text("0.50")

            async def motion_scale_applied() -> bool:
                described = await get_json(f"{server.url}/sessions/{session_id}")
                return described["options"]["motion_scale"] == 0.5

            await poll(motion_scale_applied, 5.0, "the server to see motion_scale=0.5")

            # Returned audio starts muted; unmuting and muting again never stops the video.
            mute = page.locator("#mute")
            await expect(mute).to_be_checked()
            assert await page.evaluate("document.getElementById('video').muted") is True
            await mute.uncheck()
            assert await page.evaluate("document.getElementById('video').muted") is False
            presented = await page.evaluate("window.presented")
            await page.wait_for_function(f"window.presented > {presented + 10}", timeout=5_000)
            await mute.check()
            assert await page.evaluate(
                "(v => v.muted && !v.paused)(document.getElementById('video'))")

            await page.screenshot(path=str(SCREENSHOT))

            # Stop: the session ends on the server, the page goes back to idle.
            await page.click("#stop")
            await expect(page.locator("#status")).to_have_attribute("data-state", "stopped")
            await expect(page.locator("#start")).to_be_enabled()

            async def session_gone() -> bool:
                listed = await get_json(f"{server.url}/sessions")
                return all(s["session_id"] != session_id for s in listed["sessions"])

            await poll(session_gone, 5.0, f"session {session_id} to end")
            await expect(page.locator("#error")).to_be_hidden()
            assert not problems, problems
        finally:
            await context.close()


async def test_the_page_watches_a_session_an_application_drives(server, speech_wav, tmp_path):
    """/?session=ID&token=T: no microphone, a receive-only viewer whose text box asks the
    example agent to speak; Stop leaves the session running."""
    import aiohttp

    from examples.agent import answer_viewers
    from server.client.session_client import SessionClient

    async with SessionClient(server.url) as avatar, aiohttp.ClientSession() as http:
        session_id = avatar.session_id
        async with chromium_page(tmp_path, speech_wav) as page:
            await page.goto(f"{server.url}/?session={session_id}&token={avatar.token}",
                            wait_until="load")
            await page.click("#start")
            await page.wait_for_function("window.sonic.state === 'connected'",
                                         timeout=15_000)
            async with http.post(f"{server.url}/sessions/{session_id}/speech",
                                 data=speech_wav.read_bytes(),
                                 headers={"Content-Type": "audio/wav"}) as response:
                assert response.status == 200, await response.text()
            await page.evaluate(COUNT_VIDEO_FRAMES)
            await page.wait_for_function("window.presented > 0", timeout=10_000)
            before = await page.evaluate(SAMPLE)
            await asyncio.sleep(3.0)
            after = await page.evaluate(SAMPLE)
            assert after["frames"] - before["frames"] >= 60, (before, after)

            listening = asyncio.Event()
            agent = asyncio.create_task(answer_viewers(avatar, 5.0, listening))
            await listening.wait()
            await page.wait_for_selector("#say-send:not([disabled])", timeout=5_000)
            await page.fill("#say-text", "Good morning to you.")
            await page.click("#say-send")
            await page.wait_for_selector('#events li[data-type="utterance_started"]',
                                         timeout=10_000)
            assert await agent == ["Good morning to you."]
            assert await page.input_value("#say-text") == ""
            await page.click("#stop")
            await page.wait_for_function("window.sonic.state === 'stopped'")
        async with http.get(f"{server.url}/sessions/{session_id}") as response:
            assert response.status == 200  # the viewer left; the session did not end


async def test_a_page_and_an_application_that_start_while_the_server_calibrates_get_sessions(
        speech_wav, tmp_path):
    """A fresh server answers new sessions 503 ``calibrating`` for its first seconds: the
    page says so and offers again when ``Retry-After`` says, instead of failing the Start,
    and so does an application's ``SessionClient``."""
    from conftest import ServerProcess

    from server.client.session_client import SessionClient

    server = ServerProcess("--set", "session.calibration_sessions=2")
    try:
        async with chromium_page(tmp_path, speech_wav) as page, \
                contextlib.AsyncExitStack() as stack:
            async def calibrating() -> bool:
                try:
                    await get_json(f"{server.url}/healthz")
                except urllib.error.HTTPError as refusal:
                    return json.loads(refusal.read())["status"] == "calibrating"
                except OSError:
                    return False
                pytest.fail("the server was ready before the page could press Start")

            await poll(calibrating, 120.0, "the server to start calibrating")
            offers: list[int] = []
            page.on("response", lambda r: offers.append(r.status) if r.url.endswith(
                "/offer") else None)
            await page.goto(f"{server.url}/", wait_until="load")
            await page.click("#start")
            application = asyncio.create_task(
                stack.enter_async_context(SessionClient(server.url)))
            await playwright_api.expect(page.locator("#status")).to_contain_text(
                "The server is starting: trying again in 5 s")
            assert not application.done()
            await page.wait_for_function("window.sonic.state === 'connected'",
                                         timeout=60_000)
            await page.evaluate(COUNT_VIDEO_FRAMES)
            await page.wait_for_function("window.presented > 25", timeout=10_000)
            assert offers[0] == 503 and offers[-1] == 200, offers
            assert await page.locator("#error").is_hidden()
            avatar = await asyncio.wait_for(application, 30.0)
            listed = await get_json(f"{server.url}/sessions")
            assert sorted(s["session_id"] for s in listed["sessions"]) == sorted(
                [await page.evaluate("window.sonic.sessionId"), avatar.session_id])
    finally:
        server.stop()


async def test_viewer_mode_is_a_watching_page_that_plays_the_avatars_speech_with_sound(
        server, speech_wav, tmp_path):
    """/?session=ID&token=T says it shows an avatar an application drives, with none of the
    microphone page's wording and none of its avatar, upload, size or expression controls
    (they do nothing for a viewer); its mute box starts unticked, and after Start the
    avatar's speech is decoded and played by an unmuted element."""
    import aiohttp

    from server.client.session_client import SessionClient

    expect = playwright_api.expect
    async with SessionClient(server.url) as avatar, aiohttp.ClientSession() as http:
        async with chromium_page(tmp_path, speech_wav, VIEWPORT) as page:
            await page.goto(f"{server.url}/?session={avatar.session_id}&token={avatar.token}",
                            wait_until="load")
            shown = (await page.locator("body").inner_text()).lower()  # rendered text only
            for mic_wording in ("microphone", "your own voice", "speak into", "returned audio"):
                assert mic_wording not in shown, (mic_wording, shown)
            await expect(page.locator(".tagline")).to_contain_text("an application drives")
            await expect(page.locator("#mute-hint")).to_contain_text("with sound")
            for control in ("#chooser", "#avatar-list", "#upload", "#size", "#knobs"):
                await expect(page.locator(control)).to_be_hidden()
            mute = page.locator("#mute")
            await expect(mute).to_be_visible()
            await expect(mute).not_to_be_checked()

            await page.click("#start")
            await page.wait_for_function("window.sonic.state === 'connected'",
                                         timeout=15_000)
            quiet = await page.evaluate("window.sonic.audioReceived()")
            async with http.post(f"{server.url}/sessions/{avatar.session_id}/speech",
                                 data=speech_wav.read_bytes(),
                                 headers={"Content-Type": "audio/wav"}) as response:
                assert response.status == 200, await response.text()

            async def speech_heard() -> dict | None:
                audio = await page.evaluate("window.sonic.audioReceived()")
                return audio if audio["energy"] > quiet["energy"] + 1e-3 else None

            heard = await poll(speech_heard, 15.0, "the avatar's speech to be decoded")
            assert heard["samples"] > quiet["samples"] > 0, (quiet, heard)
            element = await page.evaluate(
                "(v => ({muted: v.muted, volume: v.volume, paused: v.paused,"
                " audio: v.srcObject.getAudioTracks().length}))"
                "(document.getElementById('video'))")
            assert element == {"muted": False, "volume": 1, "paused": False, "audio": 1}, \
                element
            await expect(mute).not_to_be_checked()
            await page.click("#stop")
            await page.wait_for_function("window.sonic.state === 'stopped'")


async def test_an_upload_error_shows_beside_the_upload_control_without_scrolling(
        server, speech_wav, tmp_path):
    """A refused upload's alert is in the 1280x900 window, just under the file input."""
    async with chromium_page(tmp_path, speech_wav, VIEWPORT) as page:
        await page.goto(f"{server.url}/", wait_until="load")
        await page.wait_for_selector("#avatar-list input")
        await page.locator("#upload").set_input_files(
            {"name": "notes.txt", "mimeType": "text/plain", "buffer": b"not a picture"})
        alert = page.get_by_role("alert").filter(has_text="Upload failed: ")
        await playwright_api.expect(alert).to_be_visible()
        assert await page.evaluate("window.scrollY") == 0
        box = await alert.bounding_box()
        assert box and box["y"] >= 0 and box["y"] + box["height"] <= VIEWPORT["height"], box
        assert box["x"] >= 0 and box["x"] + box["width"] <= VIEWPORT["width"], box
        control = await page.locator("#upload").bounding_box()
        assert 0 <= box["y"] - (control["y"] + control["height"]) <= 40, (control, box)


async def test_uploaded_portraits_show_their_file_names_whole(speech_wav, tmp_path):
    """Uploads are named after their files, which are often longer than a thumbnail is wide
    ("my_portrait.jpg" showed as "my_portrait.jp"): each name is shown whole, wrapped, not
    cut. (A server of its own: the shared one's avatar list must stay as other tests expect.)"""
    import io

    from conftest import ServerProcess

    image = pytest.importorskip("PIL.Image")
    astronaut = image.open(Path(__file__).parents[1] / "static/avatars/astronaut.png")
    names = ["my_portrait.jpg", "headshot-for-the-lobby-display_2024-05-12_final.png",
             "averyveryverylongportraitnamewithnobreaksatall.png"]
    with ServerProcess() as server:
        async with chromium_page(tmp_path, speech_wav, VIEWPORT) as page:
            await page.goto(f"{server.url}/", wait_until="load")
            await page.wait_for_selector("#avatar-list input")
            for i, name in enumerate(names):
                photo = io.BytesIO()
                astronaut.convert("RGB").rotate(3 * (i + 1)).save(photo, format="PNG")
                await page.locator("#upload").set_input_files(
                    {"name": name, "mimeType": "image/png", "buffer": photo.getvalue()})
                await page.wait_for_selector(f"#avatar-list[data-count='{i + 2}']",
                                             timeout=30_000)
            for name in ["Astronaut", *names]:
                shown = page.locator("#avatar-list label span").filter(has_text=name)
                await playwright_api.expect(shown).to_have_count(1)
                fits = await shown.evaluate("""el => {
                    const box = el.getBoundingClientRect();
                    const tile = el.closest('label').getBoundingClientRect();
                    return {text: el.textContent, width: [el.scrollWidth, el.clientWidth],
                            height: [el.scrollHeight, el.clientHeight],
                            inside: box.left >= tile.left && box.right <= tile.right};
                }""")
                assert fits["text"] == name, fits
                assert fits["width"][0] <= fits["width"][1], (name, fits)
                assert fits["height"][0] <= fits["height"][1], (name, fits)
                assert fits["inside"], (name, fits)
