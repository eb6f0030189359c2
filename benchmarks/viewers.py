"""What each extra viewer of a session costs the server: sessions driven by HTTP speech
(``POST /sessions`` and streamed WAV), watched by 1 and then by V aiortc viewers each,
and the server's CPU over the same window. The viewers count frames without decoding
them, so the machine's cores go to the server.

    python -m benchmarks.viewers --sessions 1 --viewers 1 4 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp

from benchmarks.sessions import _processes, started_server
from inference.tts import conversation, wav_bytes
from server.client.peer import run_session
from server.load import process_cpu_seconds
from server.media.peer import pin_host_addresses


async def point(url: str, pid: int, sessions: int, viewers: int, seconds: float,
                speech: bytes) -> dict[str, float]:
    async with aiohttp.ClientSession() as http:
        made = []
        for _ in range(sessions):
            async with http.post(f"{url}/sessions", json={}) as response:
                made.append(await response.json())

        async def speak(session_id: str) -> None:
            deadline = time.monotonic() + seconds + 6
            while time.monotonic() < deadline:  # one utterance after another, at real time
                async with http.post(f"{url}/sessions/{session_id}/speech", data=speech,
                                     headers={"Content-Type": "audio/wav"}):
                    pass

        watching = [run_session(url, "", seconds=seconds + 6, keep=False,
                                view=(m["session_id"], m["token"]), count_only=True)
                    for m in made for _ in range(viewers)]
        speaking = [asyncio.create_task(speak(m["session_id"])) for m in made]

        async def measure() -> float:
            await asyncio.sleep(4.0)  # connected and settled
            pids = [p for ps in _processes(url, pid).values() for p in ps]
            before = sum(map(process_cpu_seconds, pids))
            await asyncio.sleep(seconds)
            return (sum(map(process_cpu_seconds, pids)) - before) / seconds

        *received, cores = await asyncio.gather(*watching, measure())
        for task in speaking:
            task.cancel()
        for m in made:
            async with http.delete(f"{url}/sessions/{m['session_id']}"):
                pass
    return {"sessions": sessions, "viewers_each": viewers, "server_cores": round(cores, 3),
            "fps_min": round(min(r.video_fps() for r in received), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--viewers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    pin_host_addresses(["127.0.0.1"])
    speech = wav_bytes(conversation(16000), 16000)
    with started_server([]) as (url, server):
        rows = [asyncio.run(point(url, server.pid, args.sessions, v, args.seconds, speech))
                for v in args.viewers]
    for row in rows:
        print(json.dumps(row))
    first, last = rows[0], rows[-1]
    extra = (last["server_cores"] - first["server_cores"]) / max(
        1, (last["viewers_each"] - first["viewers_each"]) * args.sessions)
    print(json.dumps({"cores_per_extra_viewer": round(extra, 3)}))


if __name__ == "__main__":
    main()
