"""Offline speech from espeak-ng, for tests, benchmarks and (later) the training corpus."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np


class SpeechUnavailable(RuntimeError):
    """espeak-ng is not installed."""


def espeak(text: str, *, voice: str = "en-us", words_per_minute: int = 150,
           rate: int = 16000) -> np.ndarray:
    """``text`` spoken by espeak-ng, as int16 mono at ``rate`` Hz."""
    if shutil.which("espeak-ng") is None:
        raise SpeechUnavailable("espeak-ng is not installed (apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", str(path),
                        text], check=True, capture_output=True)
        with wave.open(str(path)) as w:
            source_rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32)
    n = int(len(pcm) * rate / source_rate)
    return np.interp(np.arange(n) * source_rate / rate, np.arange(len(pcm)), pcm).astype(np.int16)


def silence(seconds: float, rate: int = 16000) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.int16)


def write_wav(path: str | Path, pcm: np.ndarray, rate: int = 16000) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype(np.int16).tobytes())
    return Path(path)


def conversation(rate: int = 16000) -> np.ndarray:
    """About 12 s: silence, a sentence, a long pause, another sentence, silence."""
    first = espeak("Hello there. I am a talking portrait, and my lips follow your voice.",
                   rate=rate)
    second = espeak("Speech in, video out, in real time.", voice="en-gb", rate=rate)
    return np.concatenate([silence(1.5, rate), first, silence(2.0, rate), second,
                           silence(3.0, rate)])
