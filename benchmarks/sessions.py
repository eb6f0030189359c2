"""Concurrent-session benchmark: a real server process and N real aiortc peers on loopback.

For each session count it starts a fresh server, streams speech from N peers at once for
``--seconds``, and reports received fps, the server's CPU use, the server-measured
pipeline delay (audio arrival to frame out) p50/p95, the A/V offset at the sender, and
the lips-to-sound lag seen by the peers from the streams' sender reports.

    python -m benchmarks.sessions --sessions 1 2 4 --size 256 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from inference.tts import conversation, write_wav
from server.client import run_session
from server.config import REPO_ROOT
from server.peer import pin_host_addresses

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _cpu_seconds(pid: int) -> float:
    """CPU time of the server and its live child processes (the engine process)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    total = 0.0
    for process in (pid, *map(int, children)):
        fields = _stat(process)
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _measure(url: str, pid: int, wav: Path, sessions: int, seconds: float,
                   size: int) -> dict[str, Any]:
    snapshot: list[dict[str, Any]] = []

    async def monitor() -> tuple[float, float]:
        await asyncio.sleep(3.0)  # connected and steady
        t0, c0 = time.monotonic(), await asyncio.to_thread(_cpu_seconds, pid)
        await asyncio.sleep(seconds - 4.0)
        t1, c1 = time.monotonic(), await asyncio.to_thread(_cpu_seconds, pid)
        snapshot.extend(await asyncio.to_thread(lambda: _get(f"{url}/sessions")["sessions"]))
        return t1 - t0, c1 - c0

    clients = [run_session(url, str(wav), seconds=seconds, keep=False,
                           options={"size": size}) for _ in range(sessions)]
    (wall, cpu), *received = await asyncio.gather(monitor(), *clients)
    stats = [s["stats"] for s in snapshot]

    def pooled(key: str, q: str) -> float | None:
        values = [s[key][q] for s in stats if s[key][q] is not None]
        return round(float(np.median(values)), 1) if values else None

    fps = [r.video_fps() for r in received]
    return {
        "sessions": sessions, "size": size,
        "fps_min": round(min(fps), 2), "fps_median": round(float(np.median(fps)), 2),
        "server_cpu_cores": round(cpu / wall, 2),
        "pipeline_delay_ms_p50": pooled("pipeline_delay_ms", "p50"),
        "pipeline_delay_ms_p95": max((s["pipeline_delay_ms"]["p95"] or 0) for s in stats)
        if stats else None,
        "av_offset_ms_p50": pooled("av_offset_ms", "p50"),
        "av_offset_ms_p95": max((abs(s["av_offset_ms"]["p95"] or 0)) for s in stats)
        if stats else None,
        "frames_repeated": sum(s["frames_repeated"] for s in stats),
        "frames_sent": sum(s["frames_sent"] for s in stats),
    }


def run_point(sessions: int, size: int, seconds: float, wav: Path, extra: list[str]
              ) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(
        [sys.executable, "-m", "server", "--port", str(port), "--ice-host", "127.0.0.1",
         "--set", f"video.size={size}", "--set", f"session.max_sessions={max(sessions, 4)}",
         *extra], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                _get(f"{url}/healthz")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError("server failed to start:\n"
                                       + log.read().decode()[-2000:]) from None
                time.sleep(0.2)
        return asyncio.run(_measure(url, server.pid, wav, sessions, seconds, size))
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json", action="store_true", help="print JSON lines only")
    parser.add_argument("server_args", nargs="*", help="extra server arguments after --")
    args = parser.parse_args()
    pin_host_addresses(["127.0.0.1"])
    with tempfile.TemporaryDirectory() as tmp:
        speech = conversation()
        wav = write_wav(Path(tmp) / "speech.wav",
                        np.tile(speech, int(np.ceil(args.seconds * 16000 / len(speech))) + 1))
        if not args.json:
            print(f"{'sessions':>8} {'size':>5} {'fps min':>8} {'fps med':>8} {'cpu':>6} "
                  f"{'delay p50':>10} {'delay p95':>10} {'A/V p50':>8} {'A/V p95':>8} "
                  f"{'repeated':>9}")
        for n in args.sessions:
            row = run_point(n, args.size, args.seconds, wav, args.server_args)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{n:>8} {args.size:>5} {row['fps_min']:>8} {row['fps_median']:>8} "
                      f"{row['server_cpu_cores']:>6} {row['pipeline_delay_ms_p50']!s:>10} "
                      f"{row['pipeline_delay_ms_p95']!s:>10} {row['av_offset_ms_p50']!s:>8} "
                      f"{row['av_offset_ms_p95']!s:>8} "
                      f"{row['frames_repeated']:>4}/{row['frames_sent']:<5}", flush=True)


if __name__ == "__main__":
    main()
