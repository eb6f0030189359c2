"""What the cluster costs and how it behaves, against a real ``redis-server``:

- ``forwarding``: two hosts; a control call (``GET /sessions/{id}``) and a viewer's offer
  sent to the host holding the session and to the other one, medians of each;
- ``failover``: ``kill -9`` of a host holding sessions, then the time until another host
  answers ``410`` for them and until ``GET /cluster`` no longer lists it (the default lease);
- ``placement``: ``--hosts`` simulated hosts' records (rooms drawn at random) in Redis,
  ``--placements`` reservations from 8 front doors at once: placements a second, each
  call's latency, and how evenly the places follow the rooms;
- ``memory``: Redis's memory per session, unnamed and named, with sessions on real hosts.

    python -m benchmarks.cluster --hosts 100 --placements 10000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import aiohttp
from aiortc import RTCConfiguration, RTCPeerConnection

from benchmarks.sessions import started_server
from server.cluster.records import SERVING, NodeRecord
from server.cluster.registry import Registry

#: One worker each, and admission by count: unwatched hosted sessions cost nothing, but
#: admission charges each one a watched session's cores.
HOST_ARGS = ["--set", "workers.count=1", "--set", "cluster.drain_timeout_s=0",
             "--set", "session.max_host_load=1.0", "--set", "session.cores_per_session=0.01"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port",
                             str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                              text=True).stdout.strip() == "PONG":
                break
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def _ms(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"median_ms": round(1000 * statistics.median(ordered), 2),
            "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 2)}


async def _timed(http: aiohttp.ClientSession, method: str, url: str, **kwargs: object
                 ) -> tuple[float, int]:
    started = time.perf_counter()
    async with http.request(method, url, **kwargs) as response:
        await response.read()
        return time.perf_counter() - started, response.status


async def _live(http: aiohttp.ClientSession, url: str) -> list[str]:
    async with http.get(f"{url}/cluster") as response:
        return [n["id"] for n in (await response.json())["nodes"]]


async def _wait_hosts(http: aiohttp.ClientSession, urls: list[str]) -> None:
    for url in urls:
        while len(await _live(http, url)) < len(urls):
            await asyncio.sleep(0.2)


async def forwarding(urls: list[str], calls: int, offers: int) -> dict[str, object]:
    async with aiohttp.ClientSession() as http:
        await _wait_hosts(http, urls)
        made = []
        for _ in range(4):
            async with http.post(f"{urls[0]}/sessions", json={}) as response:
                made.append(await response.json())
        # Node ids h0, h1 name the hosts in urls' order.
        owner_of = {m["session_id"]: urls[int(m["session_id"].split(".")[0][1:])]
                    for m in made}
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("audio", direction="recvonly")
        pc.addTransceiver("video", direction="recvonly")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
        await pc.close()
        times: dict[str, list[float]] = {"control_owner": [], "control_other": [],
                                         "offer_owner": [], "offer_other": []}
        for i in range(calls):
            m = made[i % len(made)]
            owner = owner_of[m["session_id"]]
            other = next(u for u in urls if u != owner)
            for kind, url in (("control_owner", owner), ("control_other", other)):
                took, status = await _timed(http, "GET", f"{url}/sessions/{m['session_id']}")
                assert status == 200, status
                times[kind].append(took)
        for i in range(offers):
            m = made[i % len(made)]  # at most max_viewers a session: reaped after 5 s
            owner = owner_of[m["session_id"]]
            other = next(u for u in urls if u != owner)
            for kind, url in (("offer_owner", owner), ("offer_other", other)):
                took, status = await _timed(http, "POST", f"{url}/offer", json={
                    "sdp": sdp, "type": "offer", "session_id": m["session_id"],
                    "token": m["token"]})
                assert status == 200, status
                times[kind].append(took)
            if i % 8 == 7:
                await asyncio.sleep(5.5)  # the unconnected viewers reaped
        for m in made:
            await http.delete(f"{urls[0]}/sessions/{m['session_id']}")
    out: dict[str, object] = {k: _ms(v) for k, v in times.items()}
    for what in ("control", "offer"):
        out[f"{what}_added_ms"] = round(out[f"{what}_other"]["median_ms"]  # type: ignore[index]
                                        - out[f"{what}_owner"]["median_ms"], 2)  # type: ignore[index]
    return out


async def failover(urls: list[str], victim: subprocess.Popen[bytes]) -> dict[str, float]:
    async with aiohttp.ClientSession() as http:
        await _wait_hosts(http, urls)
        held = None
        while held is None:
            async with http.post(f"{urls[1]}/sessions", json={}) as response:
                made = await response.json()
            if made["session_id"].startswith("h1."):
                held = made["session_id"]
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        gone410 = gone_listed = None
        while gone410 is None or gone_listed is None:
            now = time.monotonic() - killed
            if gone410 is None:
                async with http.get(f"{urls[0]}/sessions/{held}") as response:
                    if response.status == 410:
                        gone410 = now
            if gone_listed is None and "h1" not in await _live(http, urls[0]):
                gone_listed = now
            await asyncio.sleep(0.05)
    return {"to_410_s": round(gone410, 2), "to_unlisted_s": round(gone_listed, 2)}


async def placement(url: str, hosts: int, placements: int) -> dict[str, object]:
    """Simulated hosts as real ones behave: each renews its record once a second with its
    room less the sessions placed on it, dropping the reservations they fill."""
    rng = random.Random(7)
    rooms = {f"sim{i:03d}": rng.randint(50, 150) for i in range(hosts)}
    doors = [Registry(url, lease_s=600) for _ in range(8)]
    placed: Counter[str] = Counter()
    filled: dict[str, list[str]] = {node: [] for node in rooms}
    stop = asyncio.Event()

    def record(node: str) -> NodeRecord:
        room = rooms[node] - placed[node]
        return NodeRecord(node, f"http://{node}:8080", "0badc0de", SERVING, placed[node], 0,
                          0.2, rooms[node], time.time(), {"256": room, "512": room // 4})

    async def host(node: str) -> None:
        while not stop.is_set():
            fulfilled, filled[node] = filled[node], []
            await doors[0].publish(record(node), fulfilled)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    try:
        await doors[0].redis.flushdb()
        for node in rooms:
            await doors[0].publish(record(node))
        names = list(rooms)
        latencies: list[float] = []
        queue = iter(range(placements))

        async def door(registry: Registry) -> None:
            for i in queue:
                candidates = names[:]
                random.shuffle(candidates)
                started = time.perf_counter()
                chosen = await registry.reserve(candidates, "256", 1.0, f"p{i}")
                latencies.append(time.perf_counter() - started)
                if chosen is not None:
                    placed[chosen[0]] += 1
                    filled[chosen[0]].append(chosen[1])

        renewing = [asyncio.create_task(host(node)) for node in names]
        started = time.perf_counter()
        await asyncio.gather(*(door(d) for d in doors for _ in range(4)))
        elapsed = time.perf_counter() - started
        stop.set()
        await asyncio.gather(*renewing)
        left = [rooms[n] - placed[n] for n in names]
        over = sum(max(0, -x) for x in left)
        for node in names:
            await doors[0].leave(node)
    finally:
        for d in doors:
            await d.close()
    return {"hosts": hosts, "placements": placements, "room_total": sum(rooms.values()),
            "room_min_max": [min(rooms.values()), max(rooms.values())],
            "placed": sum(placed.values()), "overfilled": over,
            "per_s": round(placements / elapsed), **_ms(latencies),
            # Most room first: what is left of each host's room comes out even.
            "room_left_min_max": [min(left), max(left)]}


async def memory(redis_url: str, urls: list[str], sessions: int) -> dict[str, object]:
    """What the cluster keeps in Redis for a session: keys added once the renewals have
    dropped the reservations, and their bytes (``MEMORY USAGE``); the rest of Redis's
    memory (the hosts' records, scripts, connections) does not grow with sessions."""
    port = redis_url.rsplit(":", 1)[1].split("/")[0]

    def cli(*args: str) -> str:
        return subprocess.run(["redis-cli", "-p", port, *args], capture_output=True,
                              text=True).stdout.strip()

    def keys() -> dict[str, int]:
        return {key: int(cli("memory", "usage", key) or 0)
                for key in cli("--scan", "--pattern", "sonic:*").split()}

    out: dict[str, object] = {}
    async with aiohttp.ClientSession() as http:
        await _wait_hosts(http, urls)
        for kind in ("unnamed", "named"):
            await asyncio.sleep(2.5)
            before = keys()
            made = []
            for i in range(sessions):
                body = {"name": f"kiosk-{i:04d}"} if kind == "named" else {}
                async with http.post(f"{urls[i % len(urls)]}/sessions", json=body) as response:
                    assert response.status == 201, await response.text()
                    made.append((await response.json())["session_id"])
            await asyncio.sleep(2.5)  # the reservations dropped by the hosts' renewals
            after = keys()
            added = set(after) - set(before)
            out[f"{kind}_keys_per_session"] = round(len(added) / sessions, 2)
            out[f"{kind}_bytes_per_session"] = round(
                sum(after[k] for k in added) / sessions, 1)
            out[f"{kind}_hosts_records_bytes"] = sum(
                v for k, v in after.items() if k.startswith("sonic:node:"))
            for session_id in made:
                await http.delete(f"{urls[0]}/sessions/{session_id}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=100)
    parser.add_argument("--placements", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--offers", type=int, default=24)
    parser.add_argument("--sessions", type=int, default=12)
    args = parser.parse_args()
    results: dict[str, object] = {}
    with redis_server() as redis_url:
        results["placement"] = asyncio.run(placement(redis_url, args.hosts, args.placements))
        print(json.dumps(results["placement"]), flush=True)
        with contextlib.ExitStack() as stack:
            common = [*HOST_ARGS, "--cluster", redis_url,
                      "--set", f"session.max_sessions={args.sessions}"]
            hosts = [stack.enter_context(started_server([*common, "--node-id", f"h{i}"]))
                     for i in range(2)]
            urls = [url for url, _ in hosts]
            results["forwarding"] = asyncio.run(forwarding(urls, args.calls, args.offers))
            print(json.dumps(results["forwarding"]), flush=True)
            results["memory"] = asyncio.run(memory(redis_url, urls, args.sessions))
            print(json.dumps(results["memory"]), flush=True)
            results["failover"] = asyncio.run(failover(urls, hosts[1][1]))
            print(json.dumps(results["failover"]), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
