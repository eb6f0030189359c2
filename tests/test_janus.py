"""The avatar in a real meeting room: Debian's Janus gateway, its VideoRoom plugin, and a
participant in headless Chromium speaking through a fake microphone.

Janus is started here with a configuration made in a temp dir: its REST API on loopback,
only the VideoRoom plugin, one room. Janus's ICE (libnice) never gathers loopback
candidates, so its media and the server's use this machine's own interface address:
packets to a local address go through the kernel's loopback path and never leave the host.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import ServerProcess, call_json, free_port, stop_process
from test_browser import CHROMIUM, chromium_page, get_json, poll

from benchmarks.mouth import CAVITY_LUMINANCE, mouth_box

JANUS = shutil.which("janus")
LIBDIR = Path("/usr/lib/x86_64-linux-gnu/janus")
ROOM = 1234
PARTICIPANT_JS = (Path(__file__).parent / "data" / "janus_participant.js").read_text()

pytestmark = [
    pytest.mark.skipif(JANUS is None or not (LIBDIR / "plugins").is_dir(),
                       reason="Janus is not installed (apt-get install janus)"),
    pytest.mark.timeout(240),
]


def interface_address() -> str | None:
    """This machine's first global IPv4 address: Janus's media can use no other."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                         capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    return None


def write_janus_config(folder: Path, port: int, rtp_ports: tuple[int, int]) -> None:
    disabled = ",".join(p.name for p in (LIBDIR / "plugins").glob("libjanus_*.so")
                        if p.name != "libjanus_videoroom.so")
    transports = ",".join(p.name for p in (LIBDIR / "transports").glob("libjanus_*.so")
                          if p.name != "libjanus_http.so")
    (folder / "janus.jcfg").write_text(f"""
general: {{
    configs_folder = "{folder}"
    plugins_folder = "{LIBDIR}/plugins"
    transports_folder = "{LIBDIR}/transports"
    events_folder = "{LIBDIR}/events"
    loggers_folder = "{LIBDIR}/loggers"
    debug_level = 4
    session_timeout = 60
}}
media: {{ rtp_port_range = "{rtp_ports[0]}-{rtp_ports[1]}" }}
nat: {{ ignore_mdns = true }}
plugins: {{ disable = "{disabled}" }}
transports: {{ disable = "{transports}" }}
events: {{ broadcast = false }}
""")
    (folder / "janus.transport.http.jcfg").write_text(f"""
general: {{ base_path = "/janus" http = true port = {port} ip = "127.0.0.1" https = false }}
admin: {{ admin_http = false }}
""")
    (folder / "janus.plugin.videoroom.jcfg").write_text(f"""
general: {{ }}
room-{ROOM}: {{
    description = "Sonic test room"
    publishers = 6
    bitrate = 1000000
    audiocodec = "opus"
    videocodec = "vp8"
}}
""")


def _janus_request(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps({**body, "transaction": "t"}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


class JanusProcess:
    def __init__(self, folder: Path, rtp_ports: tuple[int, int]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/janus"
        write_janus_config(folder, self.port, rtp_ports)
        self.log = folder / "janus.log"
        self.proc = subprocess.Popen([JANUS, "-F", str(folder), "-C", str(folder / "janus.jcfg"),
                                      "-L", str(self.log)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                _janus_request(self.url, {"janus": "info"})
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        pytest.fail(f"Janus did not start: {self.log.read_text() if self.log.exists() else ''}")

    def participants(self) -> list[str]:
        """Display names of the room's participants, asked of Janus directly."""
        session = _janus_request(self.url, {"janus": "create"})["data"]["id"]
        handle = _janus_request(f"{self.url}/{session}",
                                {"janus": "attach", "plugin": "janus.plugin.videoroom"}
                                )["data"]["id"]
        reply = _janus_request(f"{self.url}/{session}/{handle}",
                               {"janus": "message",
                                "body": {"request": "listparticipants", "room": ROOM}})
        _janus_request(f"{self.url}/{session}", {"janus": "destroy"})
        return [p.get("display") for p in reply["plugindata"]["data"]["participants"]]

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="module")
def address() -> str:
    found = interface_address()
    if found is None:
        pytest.skip("no non-loopback IPv4 address: Janus's ICE (libnice) gathers none on "
                    "loopback")
    return found


@pytest.fixture(scope="module")
def janus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JanusProcess]:
    process = JanusProcess(tmp_path_factory.mktemp("janus"), (42000, 42099))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def room_server(janus: JanusProcess, address: str) -> Iterator[ServerProcess]:
    with ServerProcess("--set", f"janus.url={janus.url}", "--set", "janus.timeout_s=5",
                       ice_host=address) as process:
        yield process


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed")
async def test_the_avatar_speaks_in_a_janus_room_with_a_participants_voice(
        room_server, janus, speech_wav, tmp_path):
    status, made = await call_json("POST", f"{room_server.url}/sessions", {"janus": {
        "room": ROOM, "listen_to": "Alice", "display": "Avatar"}})
    assert status == 201, made
    assert made["room"]["listening"] is False  # Alice has not joined yet
    session_url = f"{room_server.url}/sessions/{made['session_id']}"
    assert "Avatar" in await asyncio.to_thread(janus.participants)
    geometry = (await get_json(f"{room_server.url}/avatars/astronaut"))["geometry"]["256"]
    rows, cols = mouth_box(geometry, 256)
    box = [rows.start, rows.stop, cols.start, cols.stop]

    async with chromium_page(tmp_path, speech_wav) as page:
        await page.goto(f"{room_server.url}/healthz")  # an http://127.0.0.1 origin
        await page.add_script_tag(content=PARTICIPANT_JS)
        await page.evaluate("url => participant.open(url)", janus.url)
        asked = time.monotonic()
        await page.evaluate("([room, who]) => participant.watch(room, who)", [ROOM, "Avatar"])
        await poll(lambda: page.evaluate("participant.framesDecoded()"), 20,
                   "the avatar's video through Janus")
        first_frame_s = time.monotonic() - asked
        before = await page.evaluate("participant.framesDecoded()")
        t0 = time.monotonic()
        quiet = await page.evaluate("([b, ms, l]) => participant.sample(b, ms, l)",
                                    [box, 2000, CAVITY_LUMINANCE])
        await page.evaluate("([room, who]) => participant.speak(room, who)", [ROOM, "Alice"])

        async def listening() -> bool:
            return (await get_json(session_url))["room"]["listening"]

        async def not_listening() -> bool:
            return not await listening()
        await poll(listening, 15, "the avatar to subscribe to Alice")
        talking = await page.evaluate("([b, ms, l]) => participant.sample(b, ms, l)",
                                      [box, 7000, CAVITY_LUMINANCE])
        fps = (await page.evaluate("participant.framesDecoded()") - before) / \
            (time.monotonic() - t0)
        stats = (await get_json(session_url))["stats"]
        # Alice leaves and comes back: the avatar waits for her, then listens again.
        await page.evaluate("participant.leave()")
        await poll(not_listening, 15, "the avatar to notice Alice left")
        await page.evaluate("url => participant.open(url)", janus.url)
        await page.evaluate("([room, who]) => participant.speak(room, who)", [ROOM, "Alice"])
        await poll(listening, 15, "the avatar to listen to Alice again")
        await page.evaluate("participant.leave()")

    print(f"janus room: first frame {first_frame_s:.2f} s after subscribing, {fps:.2f} fps "
          f"at the participant, mouth cavity p95 quiet {np.percentile(quiet, 95):.3f} "
          f"talking {np.percentile(talking, 95):.3f}, A/V p95 at the server "
          f"{stats['av_offset_ms']['p95']} ms")
    assert fps >= 24, f"the avatar reached the participant at {fps:.1f} fps"
    assert stats["audio"]["received_s"] > 3, stats["audio"]  # Alice's voice drove it
    quiet, talking = np.array(quiet), np.array(talking)
    assert quiet.size > 20 and talking.size > 80
    assert quiet.max() < 0.03, f"the mouth moved before anyone spoke: {quiet.max():.3f}"
    assert np.percentile(talking, 95) > 0.06, \
        f"the mouth hardly opened while Alice spoke: p95 {np.percentile(talking, 95):.3f}"
    assert (talking < 0.03).mean() > 0.1, "the mouth never closed between words"

    assert (await call_json("DELETE", session_url))[0] == 204

    async def left() -> bool:
        return "Avatar" not in await asyncio.to_thread(janus.participants)
    await poll(left, 10, "the avatar to leave the room")


@pytest.mark.e2e
async def test_rooms_that_are_not_there_are_refused_and_leave_nothing(room_server, janus):
    cases = [
        ({"room": 999, "listen_to": "Alice"}, 404, "unknown_room"),
        ({"room": ROOM}, 400, "invalid_janus"),
        ({"room": ROOM, "listen_to": "Alice", "secret": "x"}, 400, "invalid_janus"),
        ({"room": True, "listen_to": "Alice"}, 400, "invalid_janus"),
        ("1234", 400, "invalid_janus"),
    ]
    for janus_body, status, code in cases:
        answer = await call_json("POST", f"{room_server.url}/sessions", {"janus": janus_body})
        assert answer == (status, {"error": code, "message": answer[1]["message"]}), janus_body
    assert (await get_json(f"{room_server.url}/sessions"))["sessions"] == []
    assert await asyncio.to_thread(janus.participants) == []


@pytest.mark.e2e
async def test_a_janus_that_is_down_is_a_502_and_one_that_dies_ends_its_sessions(
        address, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/janus"
    with ServerProcess("--set", f"janus.url={dead}", ice_host=address) as server:
        status, body = await call_json("POST", f"{server.url}/sessions",
                                  {"janus": {"room": ROOM, "listen_to": "Alice"}})
        assert (status, body["error"]) == (502, "janus_unreachable"), body
        assert (await get_json(f"{server.url}/sessions"))["sessions"] == []

    mortal = JanusProcess(tmp_path, (42100, 42199))
    try:
        with ServerProcess("--set", f"janus.url={mortal.url}", ice_host=address) as server:
            status, made = await call_json("POST", f"{server.url}/sessions",
                                      {"janus": {"room": ROOM, "listen_to": "Alice"}})
            assert status == 201, made
            mortal.stop()

            async def ended() -> bool:
                return not (await get_json(f"{server.url}/sessions"))["sessions"]
            await poll(ended, 15, "the session to end with its Janus")
            assert (await get_json(f"{server.url}/healthz"))["status"] == "ok"
    finally:
        mortal.stop()


@pytest.mark.e2e
async def test_a_server_without_janus_says_so(server):
    status, body = await call_json("POST", f"{server.url}/sessions",
                              {"janus": {"room": ROOM, "listen_to": "Alice"}})
    assert (status, body["error"]) == (400, "janus_off")
