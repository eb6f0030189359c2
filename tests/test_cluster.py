"""Three hosts as one server, meeting in a real Redis (Debian's ``redis-server``): each is
``python -m server --cluster ... --node-id ...`` with one worker and room for two sessions,
so spreading and a full cluster are reached with a few hosted sessions (which render
nothing while unwatched). Sessions made through one host land on all three; every route
kind works through a host that does not hold the session (a viewer receiving frames
straight from the holder, streamed speech, the WebSocket, server-sent events, WHIP and
WHEP with their DELETEs); names are unique across hosts; a host killed with -9 answers
410 for its sessions within 10 s while placement goes on; Redis restarted loses no
running session; a drained host leaves."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.contrib.media import MediaPlayer
from conftest import REPO_ROOT, ServerProcess, free_port

from server.client.peer import run_session

pytestmark = pytest.mark.e2e

REDIS = shutil.which("redis-server")
if REDIS is None:  # the test command installs it (scripts/test.sh)
    pytest.skip("redis-server is not installed", allow_module_level=True)

#: Each host: one worker, room for two video sessions, and a host gone within 3 s. Three
#: hosts share this machine's cores, each measuring only its own processes: the session
#: count, not their measured load, is what fills a host here.
HOST = ("--set", "workers.count=1", "--set", "session.max_sessions=2",
        "--set", "session.max_host_load=1.0", "--set", "session.max_worker_load=1.0",
        "--set", "cluster.lease_s=3", "--set", "cluster.forward_timeout_s=1.5",
        "--set", "session.peer_timeout_s=3")


class Redis:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if subprocess.run(["redis-cli", "-p", str(self.port), "ping"],
                              capture_output=True, text=True).stdout.strip() == "PONG":
                return
            time.sleep(0.1)
        raise TimeoutError("redis-server did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def host(redis: Redis, node: str, *extra: str) -> ServerProcess:
    port = free_port()
    return ServerProcess("--cluster", redis.url, "--node-id", node,
                         "--advertise-url", f"http://127.0.0.1:{port}", *HOST, *extra,
                         port=port)


def start(*hosts: ServerProcess) -> None:
    """Ready together: they start at once and each waits for the others' model loads."""
    try:
        for h in hosts:
            h.wait_ready(timeout=180)
    except BaseException:
        for h in hosts:
            h.stop()
        raise


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Redis, list[ServerProcess]]]:
    redis = Redis()
    hosts = [host(redis, f"h{i}") for i in range(3)]
    try:
        start(*hosts)
        yield redis, hosts
    finally:
        for h in hosts:
            h.stop()
        redis.stop()


async def _json(response: aiohttp.ClientResponse) -> dict:
    return json.loads(await response.read())


async def _until(check, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := await check():
            return result
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout} s")


async def _live(http: aiohttp.ClientSession, url: str) -> list[str]:
    async with http.get(f"{url}/cluster") as response:
        return [n["id"] for n in (await _json(response))["nodes"]]


async def _create(http: aiohttp.ClientSession, url: str, **body: object) -> dict:
    async with http.post(f"{url}/sessions", json=body) as response:
        answer = await _json(response)
    if response.status != 201:
        async with http.get(f"{url}/cluster") as response:
            table = await _json(response)
        raise AssertionError(f"{answer}: {table}")
    return answer


def _node(session_id: str) -> str:
    return session_id.split(".")[0]


async def _end_all(http: aiohttp.ClientSession, url: str) -> None:
    async with http.get(f"{url}/sessions") as response:
        listed = await _json(response)
    for s in listed["sessions"]:
        async with http.delete(f"{url}/sessions/{s['session_id']}"):
            pass


async def test_sessions_placed_through_one_host_spread_over_all_and_the_full_cluster_refuses(
        cluster):
    _, hosts = cluster
    first = hosts[0].url
    async with aiohttp.ClientSession() as http:
        for h in hosts:  # each has read the others' leases
            await _until(lambda h=h: _count(http, h.url, 3), 10, "three live hosts")
        async with http.get(f"{first}/cluster") as response:
            table = await _json(response)
        assert table["node"] == "h0" and table["redis"] == "ok"
        assert {n["url"] for n in table["nodes"]} == {h.url for h in hosts}
        assert all(n["state"] == "serving" and n["room"]["256"] == 2 for n in table["nodes"])

        made = [await _create(http, first) for _ in range(6)]  # two hosts' worth each
        nodes = sorted(_node(m["session_id"]) for m in made)
        assert nodes == ["h0", "h0", "h1", "h1", "h2", "h2"], nodes
        async with http.post(f"{first}/sessions", json={}) as response:
            refused = await _json(response)
            assert (response.status, refused["error"]) == (503, "at_capacity"), refused
            assert int(response.headers["Retry-After"]) > 0
        async with http.post(f"{hosts[2].url}/offer", json={"sdp": "v=0", "type": "offer"}
                             ) as response:
            assert response.status == 503  # full whichever host is asked
        async with http.get(f"{hosts[1].url}/sessions") as response:
            listed = await _json(response)
        assert sorted((s["session_id"], s["node"]) for s in listed["sessions"]) == \
            sorted((m["session_id"], _node(m["session_id"])) for m in made), listed
        assert listed["unreachable"] == []
        await _end_all(http, hosts[1].url)
        async with http.get(f"{first}/sessions") as response:
            assert (await _json(response))["sessions"] == []


async def _count(http: aiohttp.ClientSession, url: str, wanted: int) -> bool:
    return len(await _live(http, url)) == wanted


async def test_every_route_of_a_session_works_through_a_host_that_does_not_hold_it(
        cluster, speech_wav: Path):
    _, hosts = cluster
    async with aiohttp.ClientSession() as http:
        made = await _create(http, hosts[0].url)
        holder = _node(made["session_id"])
        other = next(h.url for i, h in enumerate(hosts) if f"h{i}" != holder)
        session = f"{other}/sessions/{made['session_id']}"
        async with http.get(session) as response:
            assert (await _json(response))["session_id"] == made["session_id"]
        async with http.patch(session, json={"motion_scale": 1.2}) as response:
            assert response.status == 200, await response.text()

        events: list[dict] = []

        async def follow() -> None:
            async with http.get(f"{session}/events") as response:
                assert response.headers["Content-Type"].startswith("text/event-stream")
                async for line in response.content:
                    if line.startswith(b"data: "):
                        events.append(json.loads(line[6:]))

        following = asyncio.create_task(follow())
        pcm = (np.sin(np.arange(16000 * 2) / 16000 * 2 * np.pi * 220) * 8000).astype("<i2")

        async def chunks():  # type: ignore[no-untyped-def]
            data = pcm.tobytes()
            for start in range(0, len(data), 6400):  # sent on as it arrives
                yield data[start:start + 6400]
                await asyncio.sleep(0.05)

        async def speak() -> dict:
            await asyncio.sleep(1.0)
            async with http.post(f"{session}/speech", data=chunks(),
                                 headers={"Content-Type": "audio/L16;rate=16000"}) as response:
                answer = await _json(response)
                assert response.status == 200, answer
                return answer

        # A viewer's offer sent to the other host: the answer carries the holder's
        # candidates, and the frames come straight from it.
        received, spoken = await asyncio.gather(
            run_session(other, "", seconds=5.0, view=(made["session_id"], made["token"]),
                        keep=False, count_only=True),
            speak())
        assert spoken["duration_s"] == pytest.approx(2.0, abs=0.01)
        assert received.video_fps() >= 20.0, received.video_fps()

        async with http.ws_connect(f"{session}/ws") as ws:
            await ws.send_str(json.dumps({"type": "interrupt"}))
            message = await asyncio.wait_for(ws.receive_json(), 10)
            assert message["type"] in ("interrupted", "utterance_ended", "error"), message
        async with http.post(f"{session}/interrupt") as response:
            assert response.status == 200
        async with http.delete(session) as response:
            assert response.status == 204
        await asyncio.wait_for(following, 10)  # the relayed stream ends with the session
        assert "utterance_started" in [e["type"] for e in events], events


async def test_whip_and_whep_with_their_deletes_through_a_host_that_does_not_hold_them(
        cluster, speech_wav: Path):
    _, hosts = cluster
    async with aiohttp.ClientSession() as http:
        publisher = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        publisher.addTrack(MediaPlayer(str(speech_wav)).audio)
        viewer = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        viewer.addTransceiver("audio", direction="recvonly")
        viewer.addTransceiver("video", direction="recvonly")
        frames: list[float] = []

        @viewer.on("track")
        def on_track(track) -> None:  # type: ignore[no-untyped-def]
            async def count() -> None:
                while True:
                    await track.recv()
                    if track.kind == "video":
                        frames.append(time.monotonic())
            asyncio.ensure_future(count())

        try:
            await publisher.setLocalDescription(await publisher.createOffer())
            async with http.post(f"{hosts[1].url}/whip?size=256",
                                 data=publisher.localDescription.sdp.encode(),
                                 headers={"Content-Type": "application/sdp"}) as response:
                assert response.status == 201, await response.text()
                whip_location = response.headers["Location"]
                token = response.headers["X-Viewer-Token"]
                session_id = response.headers["X-Session-Id"]
                await publisher.setRemoteDescription(
                    RTCSessionDescription(await response.text(), "answer"))
            others = [h.url for i, h in enumerate(hosts) if f"h{i}" != _node(session_id)]
            await viewer.setLocalDescription(await viewer.createOffer())
            async with http.post(f"{others[0]}/sessions/{session_id}/whep",
                                 data=viewer.localDescription.sdp.encode(),
                                 headers={"Content-Type": "application/sdp",
                                          "Authorization": f"Bearer {token}"}) as response:
                assert response.status == 201, await response.text()
                whep_location = response.headers["Location"]
                await viewer.setRemoteDescription(
                    RTCSessionDescription(await response.text(), "answer"))
            await _until(lambda: asyncio.sleep(0, len(frames) > 50), 15, "WHEP frames")
            async with http.delete(others[1] + whep_location) as response:
                assert response.status == 200
            async with http.delete(others[0] + whip_location) as response:
                assert response.status == 200
            async with http.get(f"{others[1]}/sessions/{session_id}") as response:
                assert response.status == 404  # the publisher hung up: the session ended
        finally:
            await publisher.close()
            await viewer.close()


async def test_names_are_unique_across_hosts_and_found_from_any(cluster):
    _, hosts = cluster
    async with aiohttp.ClientSession() as http:
        made = await _create(http, hosts[0].url, name="lobby")
        for url in (hosts[1].url, hosts[2].url):
            async with http.post(f"{url}/sessions", json={"name": "lobby"}) as response:
                assert (response.status, (await _json(response))["error"]) == \
                    (409, "name_taken")
        for h in hosts:
            async with http.get(f"{h.url}/names/lobby",
                                params={"token": made["token"]}) as response:
                assert response.status == 200, await response.text()
                assert (await _json(response))["session_id"] == made["session_id"]
        async with http.delete(f"{hosts[2].url}/sessions/{made['session_id']}") as response:
            assert response.status == 204
        again = await _create(http, hosts[1].url, name="lobby")  # free once it ended
        async with http.delete(f"{hosts[0].url}/sessions/{again['session_id']}"):
            pass


async def test_a_portrait_uploaded_to_one_host_serves_sessions_on_every_host(cluster):
    from test_front_door import _portrait_png

    _, hosts = cluster
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{hosts[1].url}/avatars", data=_portrait_png(),
                             headers={"Content-Type": "image/png"}) as response:
            uploaded = await _json(response)
            assert response.status == 201, uploaded
        avatar = uploaded["avatar_id"]
        for h in hosts:
            async with http.get(f"{h.url}/avatars/{avatar}") as response:
                assert response.status == 200, (h.url, await response.text())
        made = [await _create(http, hosts[2].url, avatar=avatar) for _ in range(3)]
        assert sorted(_node(m["session_id"]) for m in made) == ["h0", "h1", "h2"]
        for m in made:
            async with http.delete(f"{hosts[0].url}/sessions/{m['session_id']}"):
                pass
        async with http.delete(f"{hosts[0].url}/avatars/{avatar}") as response:
            assert response.status == 204
        for h in hosts:
            async with http.get(f"{h.url}/avatars/{avatar}") as response:
                assert response.status == 404, h.url


async def test_forged_ids_and_hops_route_nowhere(cluster):
    _, hosts = cluster
    async with aiohttp.ClientSession() as http:
        made = await _create(http, hosts[0].url)
        holder = _node(made["session_id"])
        other = next(h.url for i, h in enumerate(hosts) if f"h{i}" != holder)
        for forged in ("nohost.12345678.w0-" + "0" * 32, made["session_id"][:-1] + "x",
                       f"{holder}.00000000.w0-" + "0" * 32):
            async with http.get(f"{other}/sessions/{forged}") as response:
                assert (response.status, (await _json(response))["error"]) == \
                    (404, "unknown_session"), forged
        # A request another host sent is answered from the receiver's own sessions: never
        # sent on again, so none goes round the cluster.
        async with http.get(f"{other}/sessions/{made['session_id']}",
                            headers={"X-Sonic-Hop": "h9"}) as response:
            assert response.status == 404
        async with http.delete(f"{other}/sessions/{made['session_id']}") as response:
            assert response.status == 204


async def test_redis_restarted_mid_run_loses_no_running_session(cluster):
    redis, hosts = cluster
    async with aiohttp.ClientSession() as http:
        made = [await _create(http, hosts[0].url) for _ in range(3)]
        redis.stop()
        await _until(lambda: _degraded(http, hosts[0].url), 10, "health saying degraded")
        for m in made:  # routed by their ids, with no Redis to ask
            async with http.get(f"{hosts[2].url}/sessions/{m['session_id']}") as response:
                assert response.status == 200, await response.text()
        alone = await _create(http, hosts[1].url)  # placed on the host asked
        assert _node(alone["session_id"]) == "h1"
        redis.start()
        until = time.monotonic() + 3
        while time.monotonic() < until:  # as the hosts find one another again in an empty
            for m in made:  # Redis, none takes another for lost
                async with http.get(f"{hosts[1].url}/sessions/{m['session_id']}") as response:
                    assert response.status == 200, await response.text()
            await asyncio.sleep(0.1)
        for h in hosts:
            await _until(lambda h=h: _healthy(http, h.url), 10, "Redis found again")
        await _until(lambda: _count(http, hosts[0].url, 3), 5, "the hosts back in Redis")
        for m in [*made, alone]:
            async with http.delete(f"{hosts[1].url}/sessions/{m['session_id']}") as response:
                assert response.status == 204


async def _degraded(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(f"{url}/healthz") as response:
        return (await _json(response)).get("cluster") == "degraded"


async def _healthy(http: aiohttp.ClientSession, url: str) -> bool:
    return not await _degraded(http, url)


async def test_a_host_killed_is_gone_within_10_s_and_placement_goes_on(cluster):
    """Last of the module's tests: it kills one of its hosts."""
    _, hosts = cluster
    victim, survivors = hosts[2], hosts[:2]
    async with aiohttp.ClientSession() as http:
        made = await _create(http, victim.url, name="kiosk-0")
        for i in range(1, 4):  # a named session the victim holds (it is asked first)
            if _node(made["session_id"]) == "h2":
                break
            made = await _create(http, victim.url, name=f"kiosk-{i}")
        assert _node(made["session_id"]) == "h2"
        name = made["name"]
        session = f"{survivors[0].url}/sessions/{made['session_id']}"

        # A frozen holder: its requests time out (504), the forwarding host's others do not.
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            slow = asyncio.create_task(http.get(session))
            async with http.get(f"{survivors[0].url}/healthz") as response:
                assert response.status == 200 and time.monotonic() - started < 1.0
            async with await slow as response:
                assert (response.status, (await _json(response))["error"]) == \
                    (504, "upstream_timeout")
            assert time.monotonic() - started < 2.5
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        os.kill(victim.proc.pid, signal.SIGKILL)
        killed = time.monotonic()

        async def lost() -> bool:
            async with http.get(session) as response:
                return response.status == 410 and \
                    (await _json(response))["error"] == "host_lost"

        await _until(lost, 10, "410 host_lost")
        await _until(lambda: _count(http, survivors[1].url, 2), 10 - (time.monotonic() - killed),
                     "the table without the dead host")
        assert time.monotonic() - killed < 10
        placed = [await _create(http, survivors[0].url) for _ in range(4)]
        assert sorted(_node(p["session_id"]) for p in placed) == ["h0", "h0", "h1", "h1"]
        async with http.get(f"{survivors[1].url}/names/{name}") as response:
            assert response.status == 404  # its names are free again
        await _end_all(http, survivors[0].url)


def test_keys_hold_on_every_host_and_a_drained_host_leaves_when_its_own_end():
    """Two hosts with API keys: a key's session is its own whichever host is asked. Then
    one host drains: no new session goes to it, its own runs on, it leaves and stops."""
    redis = Redis()
    keys = ("--set", "http.api_keys=alpha,beta")
    hosts = [host(redis, "d0", *keys, "--set", "cluster.drain_timeout_s=20"),
             host(redis, "d1", *keys)]
    alpha, beta = ({"Authorization": f"Bearer {k}"} for k in ("alpha", "beta"))
    try:
        start(*hosts)

        async def scenario() -> None:
            async with aiohttp.ClientSession(headers=alpha) as http, \
                    aiohttp.ClientSession() as other:
                for h in hosts:
                    await _until(lambda h=h: _count(http, h.url, 2), 10, "two hosts")
                made = await _create(http, hosts[0].url)
                while _node(made["session_id"]) != "d0":
                    made = await _create(http, hosts[0].url)
                elsewhere = f"{hosts[1].url}/sessions/{made['session_id']}"
                async with other.get(elsewhere) as response:
                    assert response.status == 401  # refused at the first host
                async with other.get(elsewhere, headers=beta) as response:
                    assert response.status == 404  # another key's: not there for it
                async with other.get(f"{hosts[1].url}/sessions", headers=beta) as response:
                    assert (await _json(response))["sessions"] == []
                async with http.get(f"{hosts[1].url}/sessions") as response:
                    listed = (await _json(response))["sessions"]
                assert [(s["session_id"], s["node"]) for s in listed] == \
                    [(made["session_id"], "d0")]
                async with other.post(f"{hosts[0].url}/cluster/drain") as response:
                    assert response.status == 401
                async with http.post(f"{hosts[0].url}/cluster/drain") as response:
                    assert response.status == 202
                    assert (await _json(response))["state"] == "draining"

                async def draining() -> bool:
                    async with http.get(f"{hosts[1].url}/cluster") as response:
                        table = await _json(response)
                    return {n["id"]: n["state"] for n in table["nodes"]}["d0"] == "draining"

                await _until(draining, 3, "the others seeing it draining")
                for _ in range(2):  # only the other host takes them now
                    assert _node((await _create(http, hosts[0].url))["session_id"]) == "d1"
                async with http.get(elsewhere) as response:
                    assert response.status == 200  # its session runs on
                async with http.delete(elsewhere):
                    pass
                await _until(lambda: _count(http, hosts[1].url, 1), 10, "d0 gone")

        asyncio.run(scenario())
        hosts[0].proc.wait(timeout=20)  # it left, then stopped by itself
    finally:
        for h in hosts:
            h.stop()
        redis.stop()


def test_a_host_whose_redis_is_unreachable_says_so_in_one_line_and_exits():
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "server", "--port", str(free_port()),
         "--cluster", f"redis://127.0.0.1:{port}/0", "--set", "workers.count=1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
