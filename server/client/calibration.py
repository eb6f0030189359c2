"""The start-up calibration's peers (``python -m server.client.calibration``), which the
front door starts in a process of their own while it measures what a session costs its
cores (``server.front_door.calibration``): their CPU is not counted.

They send speech encoded once and count what comes back without decoding it, as the load
generator's peers do. The speech is a synthetic voice (voiced syllables on formants, with
pauses), so that no recording need be shipped. Their request headers (the front door's
token, an API key, the Host the server answers to) come on standard input, not on a
command line every user of the machine can read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import numpy as np

from server.client.peer import run_session
from server.client.speech import EncodedSpeech
from server.media.peer import pin_host_addresses

RATE = 48000

#: (F1, F2, F3) in Hz of five vowels, as a grown voice speaks them.
VOWELS = np.array([(730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240),
                   (530, 1840, 2480), (570, 840, 2410)], np.float64)


def synthetic_speech(seconds: float = 8.0, rate: int = RATE, seed: int = 0) -> np.ndarray:
    """A voice-like signal (int16, mono): phrases of 3-7 voiced syllables, each a vowel's
    formants on a falling pitch with a noise burst at its onset, and pauses between
    phrases. It drives the mouth and the encoders as speech does; its words mean nothing."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    control = rate // 100  # formants, pitch and loudness change every 10 ms
    steps = n // control + 1
    loudness = np.zeros(steps)
    formants = np.tile(VOWELS[0], (steps, 1))
    pitch = np.full(steps, 120.0)
    burst = np.zeros(steps)
    at = int(rng.uniform(20, 40))
    while at < steps:
        syllables = int(rng.integers(3, 8))
        start_pitch = rng.uniform(110, 150)
        for k in range(syllables):
            length = int(rng.uniform(16, 30))
            end = min(at + length, steps)
            span = np.arange(end - at)
            loudness[at:end] = np.sin(np.pi * (span + 0.5) / length) ** 0.6
            formants[at:end] = VOWELS[rng.integers(len(VOWELS))]
            pitch[at:end] = start_pitch * (1 - 0.2 * k / syllables) * (1 + 0.05 * np.sin(span / 4))
            burst[at:min(at + 3, steps)] = 0.3
            at = end + int(rng.uniform(1, 5))
        at += int(rng.uniform(30, 60))  # a pause between phrases
    t = np.arange(n) / control
    per_sample = [np.interp(t, np.arange(steps), column) for column in
                  (loudness, pitch, burst, *formants.T)]
    loud, f0, noise_level, *peaks = per_sample
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voice = np.zeros(n)
    for harmonic in range(1, 40):
        frequency = harmonic * f0
        envelope = sum(np.exp(-0.5 * ((frequency - peak) / (60 + 0.05 * peak)) ** 2) * gain
                       for peak, gain in zip(peaks, (1.0, 0.5, 0.25), strict=True))
        voice += np.where(frequency < rate / 2, envelope / harmonic ** 0.5, 0.0) * \
            np.sin(harmonic * phase)
    voice = voice * loud + noise_level * rng.standard_normal(n) * 0.3
    return (np.clip(voice / np.abs(voice).max() * 0.5, -1, 1) * 32767).astype(np.int16)


async def run_peers(url: str, sessions: int, seconds: float, headers: dict[str, str]
                    ) -> list[float]:
    """``sessions`` counting peers at once, each streaming the synthetic voice for
    ``seconds``; the video fps each received (0 for one that failed)."""
    packets = EncodedSpeech.encode_pcm(synthetic_speech())

    async def one(k: int) -> float:
        try:
            received = await run_session(url, "", seconds=seconds, keep=False,
                                         count_only=True, headers=headers,
                                         audio=EncodedSpeech(packets[k * 25:] + packets[:k * 25]))
        except Exception as exc:  # noqa: BLE001 - reported, and the front door goes on
            print(f"calibration peer {k}: {exc}", file=sys.stderr)
            return 0.0
        return received.video_fps()

    return list(await asyncio.gather(*(one(k) for k in range(sessions))))


def main() -> None:
    parser = argparse.ArgumentParser(description="the front door's start-up calibration "
                                     "peers (it starts them itself)")
    parser.add_argument("url")
    parser.add_argument("--sessions", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--ice-host", action="append", default=[])
    args = parser.parse_args()
    pin_host_addresses(args.ice_host)
    headers = json.loads(sys.stdin.readline() or "{}")
    fps = asyncio.run(run_peers(args.url, args.sessions, args.seconds, headers))
    print(json.dumps({"video_fps": fps}))


if __name__ == "__main__":
    main()
