"""Shared fixtures: real speech from espeak-ng and a real server process on loopback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import urllib.request

from server.config import REPO_ROOT
from server.peer import pin_host_addresses

# The test peers offer loopback host candidates only, like the server started below.
pin_host_addresses(["127.0.0.1"])

SPEECH_RATE = 16000


def espeak(text: str, path: Path, voice: str = "en-us") -> np.ndarray:
    """Speech as int16 at 16 kHz (espeak-ng's 22.05 kHz resampled)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (the README's test command installs it)")
    subprocess.run(["espeak-ng", "-v", voice, "-s", "150", "-w", str(path), text], check=True,
                   capture_output=True)
    with wave.open(str(path)) as w:
        rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32)
    n = int(len(pcm) * SPEECH_RATE / rate)
    return np.interp(np.arange(n) * rate / SPEECH_RATE, np.arange(len(pcm)), pcm).astype(np.int16)


def write_wav(path: Path, pcm: np.ndarray, rate: int = SPEECH_RATE) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype(np.int16).tobytes())
    return path


@pytest.fixture(scope="session")
def speech_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 12 s: silence, a sentence, a long pause, another sentence, silence."""
    tmp = tmp_path_factory.mktemp("speech")
    first = espeak("Hello there. I am a talking portrait, and my lips follow your voice.",
                   tmp / "a.wav")
    second = espeak("Speech in, video out, in real time.", tmp / "b.wav", voice="en-gb")
    silence = np.zeros(int(1.5 * SPEECH_RATE), np.int16)
    pause = np.zeros(int(2.0 * SPEECH_RATE), np.int16)
    pcm = np.concatenate([silence, first, pause, second, silence, silence])
    return write_wav(tmp / "speech.wav", pcm)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(REPO_ROOT / "out" / f"server-{self.port}.log", "w") \
            if (REPO_ROOT / "out").is_dir() else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--port", str(self.port), "--ice-host", "127.0.0.1",
             *extra], cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("server did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One server for the session's end-to-end tests; peers that go silent close in 3 s."""
    process = ServerProcess("--set", "session.peer_timeout_s=3")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()
