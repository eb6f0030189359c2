"""What hostile requests cost the server's memory: rounds of oversized bodies sent at once
(no key; a key and a length past the route's limit; a key and no length at all) against
a server with API keys, the front door's RSS after each round; then create-media-delete
cycles of real sessions, a worker's RSS every ``--every`` cycles (does it level off?).

    python -m benchmarks.hostile --rounds 3 --at-once 40 --cycles 120
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from benchmarks.sessions import _get, started_server
from inference.tts import conversation, write_wav
from server.client.peer import run_session
from server.media.peer import pin_host_addresses

MB = 1 << 20
KEY = "benchmark-key"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024


async def _post(http: aiohttp.ClientSession, url: str, headers: dict[str, str],
                body: object) -> int:
    try:
        async with http.post(f"{url}/sessions", data=body, headers={
                "Content-Type": "application/json", **headers}) as response:
            await response.read()
            return response.status
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
        return 0  # closed while still sending, as a refusal unread may be


async def _chunked(size_mb: int) -> AsyncIterator[bytes]:
    for _ in range(size_mb):
        yield b" " * MB


async def bodies(url: str, pid: int, rounds: int, at_once: int, size_mb: int
                 ) -> list[dict[str, object]]:
    huge = b"{" + b" " * (size_mb * MB) + b"}"
    key = {"Authorization": f"Bearer {KEY}"}
    rows: list[dict[str, object]] = [{"kind": "start", "rss_mb": round(rss_mb(pid), 1)}]
    async with aiohttp.ClientSession() as http:
        for kind, headers, body in (("no key", {}, lambda: huge),
                                    ("key, length past the limit", key, lambda: huge),
                                    ("key, no length", key, lambda: _chunked(size_mb))):
            for number in range(rounds):
                statuses = await asyncio.gather(*(_post(http, url, headers, body())
                                                  for _ in range(at_once)))
                rows.append({"kind": kind, "round": number + 1,
                             "statuses": sorted(set(statuses)),
                             "rss_mb": round(rss_mb(pid), 1)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


async def cycles(url: str, pid: int, count: int, every: int, wav: str
                 ) -> list[tuple[int, float]]:
    samples = [(0, round(rss_mb(pid), 1))]
    for cycle in range(1, count + 1):
        await run_session(url, wav, seconds=1.5, keep=False, count_only=True,
                          headers={"Authorization": f"Bearer {KEY}"})
        if cycle % every == 0:
            await asyncio.sleep(1)
            samples.append((cycle, round(rss_mb(pid), 1)))
            print(json.dumps({"cycle": cycle, "worker_rss_mb": samples[-1][1]}), flush=True)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hostile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--at-once", type=int, default=40)
    parser.add_argument("--size-mb", type=int, default=10)
    parser.add_argument("--cycles", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    pin_host_addresses(["127.0.0.1"])
    with tempfile.TemporaryDirectory() as tmp, started_server(
            ["--set", f"http.api_keys={KEY}", "--set", "session.calibration_sessions=-1",
             "--set", "session.peer_timeout_s=3"]) as (url, server):
        wav = str(write_wav(Path(tmp) / "speech.wav", conversation()))
        worker = _get(f"{url}/healthz")["workers"][0]["pid"]
        rows = asyncio.run(bodies(url, server.pid, args.rounds, args.at_once, args.size_mb))
        samples = asyncio.run(cycles(url, worker, args.cycles, args.every, wav)) \
            if args.cycles else []
    print(json.dumps({"bodies": rows, "worker_rss_by_cycle": samples}))


if __name__ == "__main__":
    main()
