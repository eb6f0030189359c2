"""Mouth to avatar: how long after a peer speaks the server sends the avatar speaking it.

A real server on loopback and one aiortc peer that sends tone bursts after silence, in
the packets the server's answer asks for (``a=ptime``). Each burst's start is found in
the returned speech, which is the peer's own delayed, and timed by when the server sent
it (its sender reports' clock; the video frame of that instant leaves with it).

A browser sends a packet once it has captured the packet's whole length; this peer sends
each packet at its first sample's time, one packet early. So the time from speaking to
the server's send is the measured gap plus one packet's length, and that is what is
reported: ``speech to avatar``. The returned speech is decoded by aiortc, whose own
jitter buffer does not matter here: only the server's send times are used.

    python -m benchmarks.latency --bursts 10 [-- SERVER ARGS]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

from benchmarks.sessions import started_server
from server.client.peer import NTP_EPOCH, run_session
from server.client.speech import EncodedSpeech
from server.media.peer import pin_host_addresses

RATE = 48000
FRAME_S = 0.02
#: Silence then a tone, in 20 ms frames: an even count each, so that every burst starts a
#: packet of 20 or 40 ms.
SILENT_FRAMES, TONE_FRAMES = 48, 16


def burst_wav(path: Path, bursts: int) -> Path:
    """``bursts`` periods of silence then a 440 Hz tone at -12 dBFS, mono 48 kHz."""
    t = np.arange(int(TONE_FRAMES * FRAME_S * RATE)) / RATE
    tone = 0.25 * np.sin(2 * np.pi * 440 * t)
    period = np.concatenate([np.zeros(int(SILENT_FRAMES * FRAME_S * RATE)), tone])
    pcm = (np.tile(period, bursts + 1) * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.tobytes())
    return path


def onsets(levels: np.ndarray, times: np.ndarray, floor: float = 1000.0) -> np.ndarray:
    """Times of the first loud item after quiet ones."""
    loud = levels > floor
    starts = np.flatnonzero(loud[1:] & ~loud[:-1]) + 1
    return times[starts]


async def measure(url: str, wav: Path, bursts: int) -> dict[str, object]:
    speech = EncodedSpeech(EncodedSpeech.encode_wav(str(wav)))
    period_s = (SILENT_FRAMES + TONE_FRAMES) * FRAME_S
    received = await run_session(url, "", seconds=(bursts + 0.5) * period_s, audio=speech,
                                 keep=True)
    assert speech._start is not None
    # The monotonic clock of the peer's loop against the wall clock of the server's reports.
    wall_minus_mono = time.time() - time.monotonic()
    audio = received.audio
    levels = np.array([np.sqrt(np.mean(d.astype(np.float32) ** 2)) for d in audio.data])
    echoed = onsets(levels, audio.sender_times() - NTP_EPOCH - wall_minus_mono)
    spoken = speech._start + FRAME_S * (SILENT_FRAMES + np.arange(bursts + 2) *
                                        (SILENT_FRAMES + TONE_FRAMES))
    packet_s = speech.packet_s if hasattr(speech, "packet_s") else FRAME_S
    # Each echo belongs to the latest burst spoken before it.
    gaps = [echo - spoken[spoken < echo].max() for echo in echoed if (spoken < echo).any()]
    to_avatar = np.asarray(gaps) + packet_s
    return {"packet_ms": round(packet_s * 1000), "bursts": len(gaps),
            "speech_to_avatar_ms": {q: round(float(np.percentile(to_avatar, p)) * 1000, 1)
                                    for q, p in (("p50", 50), ("min", 0), ("max", 100))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("server_args", nargs="*", help="extra server arguments after --")
    args = parser.parse_args()
    pin_host_addresses(["127.0.0.1"])
    with tempfile.TemporaryDirectory() as tmp, started_server(args.server_args) as (url, _):
        wav = burst_wav(Path(tmp) / "bursts.wav", args.bursts)
        print(asyncio.run(measure(url, wav, args.bursts)))


if __name__ == "__main__":
    main()
