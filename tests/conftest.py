"""Shared fixtures: real speech from espeak-ng and a real server process on loopback; and
the test layers (``pyproject.toml`` markers), one to a test."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.tts import SpeechUnavailable, conversation, write_wav
from server.config import REPO_ROOT
from server.media.peer import pin_host_addresses

# The test peers offer loopback host candidates only, like the server started below.
pin_host_addresses(["127.0.0.1"])

#: The layers a test may be in; ``python -m pytest -m unit`` runs the fast one alone.
LAYERS = ("unit", "e2e", "browser", "soak", "gpu", "container")
_running_layer: str | None = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test is in exactly one layer, or the run stops naming those that are not."""
    wrong = []
    for item in items:
        layers = {mark.name for mark in item.iter_markers() if mark.name in LAYERS}
        if len(layers) != 1:
            wrong.append(f"{item.nodeid}: {sorted(layers) or 'no layer'}")
    if wrong:
        raise pytest.UsageError("each test needs exactly one of the markers "
                                f"{', '.join(LAYERS)}:\n  " + "\n  ".join(wrong))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Which layer the running test is in (before its fixtures), so a unit test cannot
    start a server, not even through a shared fixture."""
    global _running_layer
    _running_layer = next(m.name for m in item.iter_markers() if m.name in LAYERS)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    global _running_layer
    _running_layer = None

@pytest.fixture(scope="session")
def speech_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 12 s: silence, a sentence, a long pause, another sentence, silence."""
    try:
        pcm = conversation()
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    return write_wav(tmp_path_factory.mktemp("speech") / "speech.wav", pcm)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _call_json(method: str, url: str, body: dict | None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"},
                                     method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
            return response.status, json.loads(text) if text else {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


async def call_json(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    """An HTTP request with a JSON body (or none), off the event loop: the status and the
    JSON answer ({} for none), errors included."""
    return await asyncio.to_thread(_call_json, method, url, body)


def stop_process(proc: subprocess.Popen) -> None:
    """Ask a process to stop; kill it if it has not within 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ServerProcess:
    """``python -m server`` for a test. Unless ``extra`` says otherwise (a later ``--set``
    wins), its engine may be loaded to 1.2 of what it measured: the tests' peers share the
    two cores with it, and on a slow host the CPU engine measured itself short of the
    sessions a test opens (one 512x512 session, or a soak's four at 256x256) and refused
    them; and it is ready without the start-up calibration's 10 s of sessions. Admission
    at capacity and the calibration have their own servers and tests."""

    def __init__(self, *extra: str, ice_host: str = "127.0.0.1", port: int | None = None
                 ) -> None:
        if _running_layer == "unit":
            raise RuntimeError("a unit test starts no server: mark it e2e")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(REPO_ROOT / "out" / f"server-{self.port}.log", "w") \
            if (REPO_ROOT / "out").is_dir() else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--port", str(self.port), "--ice-host", ice_host,
             "--set", "session.max_engine_load=1.2",
             "--set", "session.calibration_sessions=-1", *extra],
            cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT,
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
        stop_process(self.proc)

    def __enter__(self) -> ServerProcess:
        """Ready to serve; stopped on leaving, even if it never became ready."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One server for the session's end-to-end tests: peers that send nothing close in 3 s,
    request bodies must arrive within 2 s."""
    with ServerProcess("--set", "session.peer_timeout_s=3",
                       "--set", "http.body_timeout_s=2") as process:
        yield process
