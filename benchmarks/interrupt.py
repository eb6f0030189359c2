"""Barge-in latency at a viewer: how long after ``POST /sessions/{id}/interrupt`` the
viewer's audio goes silent and the avatar's mouth closes.

A real server on loopback, one hosted session, one aiortc viewer that decodes. For each
trial the application streams an espeak-ng sentence and cuts it 2-3 s in. The audio's
latency is to the last audible packet as the server sent it (its sender reports' clock):
aiortc's receiver holds four packets before it plays any, 160 ms of 40 ms ones, which a
browser's time-based buffer does not; the mouth's is to the last frame the viewer got
whose mouth is still open after the request.

    python -m benchmarks.interrupt --trials 10
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
import numpy as np

from benchmarks.mouth import mouth_box, mouth_openness
from benchmarks.sessions import _get, started_server
from inference.tts import espeak, wav_bytes
from server.client.peer import NTP_EPOCH, run_session
from server.media.peer import pin_host_addresses

SENTENCE = ("Let me tell you a rather long story about a lighthouse keeper, who counted every "
            "ship that passed his rock for forty years, and never once left the island.")


def _box(url: str, size: int = 256) -> tuple[slice, slice]:
    """Around the default avatar's mouth, as the end-to-end tests measure it."""
    return mouth_box(_get(f"{url}/avatars/astronaut")["geometry"][str(size)], size)


async def trial(url: str, wav: bytes, cut_after: float) -> tuple[float, float]:
    """(seconds to silence, seconds to a closed mouth) after one interrupt."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/sessions", json={}) as response:
            created = await response.json()
        session = created["session_id"]
        marks: dict[str, float] = {}

        async def speak_and_cut() -> None:
            await asyncio.sleep(1.0)
            async with http.post(f"{url}/sessions/{session}/speech", data=wav,
                                 headers={"Content-Type": "audio/wav"}):
                pass
            await asyncio.sleep(cut_after)
            marks["at"] = time.monotonic()
            marks["at_wall"] = time.time()
            async with http.post(f"{url}/sessions/{session}/interrupt"):
                pass

        received, _ = await asyncio.gather(
            run_session(url, "", seconds=cut_after + 3.0, view=(session, created["token"])),
            speak_and_cut())
        async with http.delete(f"{url}/sessions/{session}"):
            pass
    at = marks["at"]
    loud = np.array([np.sqrt(np.mean(d.astype(np.float32) ** 2)) for d in received.audio.data])
    sent = received.audio.sender_times() - NTP_EPOCH
    heard = sent[(sent > marks["at_wall"] - 1.0) & (loud > 300)]
    silence = max(0.0, float(heard.max() - marks["at_wall"])) if heard.size else float("nan")
    mouth = mouth_openness(received.video.data, _box(url))
    shown = np.asarray(received.video.arrivals)
    open_level = np.percentile(mouth[(shown > at - 2.0) & (shown < at)], 90)
    opened = shown[(shown > at - 1.0) & (mouth > 0.5 * open_level)]
    closed = max(0.0, float(opened.max() - at)) if opened.size else float("nan")
    return silence, closed


async def run(url: str, trials: int) -> None:
    speech = wav_bytes(espeak(SENTENCE, rate=16000), 16000)
    rng = np.random.default_rng(0)
    results = [await trial(url, speech, float(rng.uniform(2.0, 3.0)))
               for _ in range(trials)]
    silence, closed = (np.array(r) * 1000 for r in zip(*results, strict=True))
    for name, ms in (("audio silent", silence), ("mouth closed", closed)):
        print(f"{name:13s} after the request: p50 {np.nanpercentile(ms, 50):5.0f} ms  "
              f"p95 {np.nanpercentile(ms, 95):5.0f} ms  max {np.nanmax(ms):5.0f} ms  "
              f"({trials} trials)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    pin_host_addresses(["127.0.0.1"])
    with started_server([]) as (url, _):
        asyncio.run(run(url, args.trials))


if __name__ == "__main__":
    main()
