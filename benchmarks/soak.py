"""Soak and fault run: a real server on loopback, one long session that must keep its
frame rate and delay, and around it, cycle after cycle, sessions that join and leave
over bad networks, with stalled and skewed senders, offers that never connect, and
hostile requests. At the end the server's processes must be back to their memory, file
descriptors and threads of the start, and every error answer must have been JSON.

Bad networks are made at the client's sockets (``server.client.peer.Impairment``): these
machines have no netem. Everything is sent to 127.0.0.1, bounded in count and time.

    python -m benchmarks.soak --minutes 30     # tests/test_soak.py runs 1 minute
    # (figures: benchmarks/results/2026-11-30-soak-30-minutes.md)
    python -m benchmarks.soak --minutes 0.67 --busy 0.35 0.35   # with busy neighbours
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection

from benchmarks.sessions import _get, _processes, busy_neighbours, started_server
from inference.tts import conversation
from server.client.impairment import Impairment
from server.client.peer import run_session
from server.client.speech import PacedSpeech
from server.media.peer import pin_host_addresses

#: Transient sessions, two at a time, each this long.
TRANSIENT_S = 4.0
#: What each transient session's sender and network do, in turn.
KINDS: dict[str, dict[str, Any]] = {
    "clean": {},
    "stalled": {"audio": {"stall_at": 1.5, "stall_s": 0.3}},
    "fast clock": {"audio": {"skew": 0.01}},
    "slow clock": {"audio": {"skew": -0.01}},
    "lossy": {"network": Impairment(loss=0.03, delay_s=0.02, jitter_s=0.03)},
    "bad network": {"network": Impairment(loss=0.08, delay_s=0.08, jitter_s=0.06)},
}


@dataclass
class Usage:
    """What a set of processes holds: resident memory, open file descriptors, threads."""

    rss_mb: float
    fds: int
    threads: int

    @staticmethod
    def of(pids: list[int]) -> Usage:
        rss = fds = threads = 0
        for pid in pids:
            status = dict(line.split(":", 1) for line in
                          Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
            rss += int(status["VmRSS"].split()[0])
            threads += int(status["Threads"])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        return Usage(round(rss / 1024, 1), fds, threads)


def usage_by_kind(url: str, pid: int) -> dict[str, Usage]:
    return {kind: Usage.of(pids) for kind, pids in _processes(url, pid).items()}


@dataclass
class SoakReport:
    cycles: int = 0
    steady_fps: list[float] = field(default_factory=list)  # received, per 5 s window
    steady_delay_p50_ms: list[float] = field(default_factory=list)  # server's, per cycle
    steady_delay_p95_ms: list[float] = field(default_factory=list)
    steady_av_p50_ms: list[float] = field(default_factory=list)
    steady_av_p95_ms: list[float] = field(default_factory=list)
    #: Of the frames the long session sent while measured, those that repeated the last.
    steady_repeated_pct: float | None = None
    transient_fps: dict[str, list[float]] = field(default_factory=dict)
    transient_failures: list[str] = field(default_factory=list)
    hostile_answers: int = 0
    bad_answers: list[str] = field(default_factory=list)  # not 4xx in the JSON shape
    #: Offers refused with 503 ``at_capacity`` and ``Retry-After``: the designed answer
    #: while admission sees the host too busy, which it checks before reading the offer.
    refused: int = 0
    start: dict[str, Usage] = field(default_factory=dict)
    end: dict[str, Usage] = field(default_factory=dict)
    trace: list[dict[str, Any]] = field(default_factory=list)  # usage after each cycle

    def summary(self) -> dict[str, Any]:
        return {
            "cycles": self.cycles,
            "steady_fps_min": round(min(self.steady_fps, default=0.0), 2),
            "steady_delay_p50_ms_max": max(self.steady_delay_p50_ms, default=None),
            "steady_delay_p95_ms_max": max(self.steady_delay_p95_ms, default=None),
            "steady_av_p50_ms_max": max(self.steady_av_p50_ms, default=None),
            "steady_av_p95_ms_max": max(self.steady_av_p95_ms, default=None),
            "steady_repeated_pct": self.steady_repeated_pct,
            "transient_fps_median": {k: round(float(np.median(v)), 2)
                                     for k, v in self.transient_fps.items()},
            "transient_failures": self.transient_failures[:5],
            "hostile_answers": self.hostile_answers,
            "refused": self.refused,
            "bad_answers": self.bad_answers[:5],
            "start": {k: vars(u) for k, u in self.start.items()},
            "end": {k: vars(u) for k, u in self.end.items()},
        }


async def _offer_sdp() -> str:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="sendrecv")
    pc.addTransceiver("video", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


def _hostile(url: str, sdp: str) -> Iterator[tuple[str, str, dict[str, Any], int]]:
    """(method, url, request arguments, status expected) for each bad request."""
    ufrag = next(line for line in sdp.splitlines() if line.startswith("a=ice-ufrag:"))
    media = sdp[sdp.index("m=audio"):sdp.index("m=video")]
    json_type = {"Content-Type": "application/json"}
    yield "POST", f"{url}/offer", {"data": json.dumps({"sdp": sdp, "type": "offer"}),
                                   "headers": {"Content-Type": "text/plain"}}, 415
    yield "POST", f"{url}/offer", {"data": "[" * 100_000, "headers": json_type}, 400
    yield "POST", f"{url}/offer", {"json": {"sdp": sdp + media * 40, "type": "offer"}}, 400
    yield "POST", f"{url}/offer", {"json": {"sdp": sdp.replace(ufrag, "a=ice-ufrag:a b"),
                                            "type": "offer"}}, 400
    yield "POST", f"{url}/offer", {"json": {"sdp": sdp, "type": "offer", "avatar": {}}}, 400
    yield "POST", f"{url}/avatars", {"data": b"GIF89a" + bytes(64),
                                     "headers": {"Content-Type": "image/gif"}}, 400
    yield "GET", f"{url}/sessions", {"headers": {"Host": "attacker.example"}}, 403
    yield "DELETE", f"{url}/sessions/no-such-session", {}, 404
    yield "GET", f"{url}/healthz", {"headers": {"X-Big": "x" * 20_000}}, 400


def _refused(response: aiohttp.ClientResponse, body: Any) -> bool:
    return response.status == 503 and isinstance(body, dict) and \
        body.get("error") == "at_capacity" and "Retry-After" in response.headers


async def _hostile_round(http: aiohttp.ClientSession, url: str, report: SoakReport) -> None:
    sdp = await _offer_sdp()
    for method, target, kwargs, status in _hostile(url, sdp):
        report.hostile_answers += 1
        try:
            async with http.request(method, target, **kwargs) as response:
                body = await response.json(content_type=None)
                if target.endswith("/offer") and _refused(response, body):
                    report.refused += 1
                elif response.status != status or set(body) != {"error", "message"}:
                    report.bad_answers.append(f"{method} {target}: {response.status} {body}")
        except (aiohttp.ClientError, ValueError) as exc:
            report.bad_answers.append(f"{method} {target}: {exc!r}")
    # An offer whose peer never connects: the server lets its place go by itself.
    async with http.post(f"{url}/offer", json={"sdp": sdp, "type": "offer"}) as response:
        body = await response.json(content_type=None)
        if _refused(response, body):
            report.refused += 1
        elif response.status != 200:
            report.bad_answers.append(f"ghost offer: {response.status}")


async def _transient(url: str, pcm: np.ndarray, kind: str, seed: int,
                     report: SoakReport) -> None:
    spec = KINDS[kind]
    network = spec.get("network")
    if network is not None:
        network = Impairment(network.loss, network.delay_s, network.jitter_s, seed)
    try:
        # Over a bad network the peer decodes, so its losses come back as the NACKs and
        # picture-loss reports a real one sends; the others only count their frames.
        received = await run_session(url, "", seconds=TRANSIENT_S, keep=False,
                                     audio=PacedSpeech(pcm, **spec.get("audio", {})),
                                     network=network, count_only=network is None)
        report.transient_fps.setdefault(kind, []).append(received.video_fps())
    except Exception as exc:  # noqa: BLE001 - a failed session is a finding, not a crash
        report.transient_failures.append(f"{kind}: {exc!r}")


async def _settled(url: str, sessions: int, timeout: float = 20.0) -> None:
    """Until the server lists only ``sessions`` sessions (the others have closed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len((await asyncio.to_thread(_get, f"{url}/sessions"))["sessions"]) <= sessions:
            return
        await asyncio.sleep(0.5)


def _windows(arrivals: list[float], start: float, end: float, width: float = 5.0
             ) -> list[float]:
    t = np.asarray(arrivals)
    edges = np.arange(start, end - width + 1e-9, width)
    return [float(((t >= a) & (t < a + width)).sum() / width) for a in edges]


async def soak(url: str, pid: int, pcm: np.ndarray, seconds: float) -> SoakReport:
    """Cycles for ``seconds`` around one steady session; see the module's docstring."""
    report = SoakReport()
    warm_up = 3 * TRANSIENT_S + 25.0  # a cycle of each kind, then settling
    steady_s = warm_up + seconds + 30.0
    steady = asyncio.create_task(run_session(url, "", seconds=steady_s, keep=False,
                                             audio=PacedSpeech(pcm), count_only=True))
    kinds = list(KINDS)
    async with aiohttp.ClientSession() as http:
        await asyncio.sleep(3.0)

        async def cycle(n: int) -> None:
            a, b = kinds[(2 * n) % len(kinds)], kinds[(2 * n + 1) % len(kinds)]
            await asyncio.gather(_transient(url, pcm, a, 2 * n, report),
                                 _transient(url, pcm, b, 2 * n + 1, report),
                                 _hostile_round(http, url, report))

        for n in range(3):  # every kind once: what the first sessions allocate for good
            await cycle(n)
        await _settled(url, 1)
        report.start = usage_by_kind(url, pid)
        measured_from = time.monotonic()
        first: dict[str, Any] | None = None  # the long session's stats after a cycle
        while time.monotonic() - measured_from < seconds:
            await cycle(3 + report.cycles)
            report.cycles += 1
            sessions = (await asyncio.to_thread(_get, f"{url}/sessions"))["sessions"]
            longest = min(sessions, key=lambda s: s["created"])["stats"]
            first = first or longest
            if longest["pipeline_delay_ms"]["p95"] is not None:
                report.steady_delay_p50_ms.append(longest["pipeline_delay_ms"]["p50"])
                report.steady_delay_p95_ms.append(longest["pipeline_delay_ms"]["p95"])
                report.steady_av_p50_ms.append(abs(longest["av_offset_ms"]["p50"]))
                report.steady_av_p95_ms.append(abs(longest["av_offset_ms"]["p95"]))
            total = usage_by_kind(url, pid)
            report.trace.append({"t": round(time.monotonic() - measured_from, 1),
                                 **{k: vars(u) for k, u in total.items()}})
        measured_to = time.monotonic()
        if first is not None and longest["frames_sent"] > first["frames_sent"]:
            report.steady_repeated_pct = round(100 * (
                longest["frames_repeated"] - first["frames_repeated"]) / (
                longest["frames_sent"] - first["frames_sent"]), 1)
        await _settled(url, 1)
        await asyncio.sleep(2.0)  # closed sessions' last callbacks
        report.end = usage_by_kind(url, pid)
    received = await steady
    report.steady_fps = _windows(received.video.arrivals, measured_from, measured_to)
    return report


#: A process that keeps ``share`` of one core busy, in 10 ms slots.
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--busy", type=float, nargs="*", default=[],
                        help="share of a core each of these neighbour processes spins")
    parser.add_argument("server_args", nargs="*", help="extra server arguments after --")
    args = parser.parse_args()
    pin_host_addresses(["127.0.0.1"])
    with started_server(["--set", "session.peer_timeout_s=3", *args.server_args]) as (
            url, server), busy_neighbours(args.busy):
        report = asyncio.run(soak(url, server.pid, conversation(48000).astype(np.int16),
                                  60.0 * args.minutes))
    for row in report.trace[:: max(1, len(report.trace) // 30)]:
        print(json.dumps(row))
    print(json.dumps(report.summary(), indent=1))


if __name__ == "__main__":
    main()
