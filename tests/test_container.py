"""The CPU image, built and run: ``scripts/container_image.py`` builds the repository's
``Dockerfile`` with podman (once a session; podman's layer cache makes a rebuild of an
unchanged source take seconds), a container of it serves on the host's network, on
loopback only, and the reference client (``server.client.peer.run_session``) sends it espeak-ng
speech and gets the animated portrait back at 25 fps, with the speech.

Needs root on a Debian host (the script installs podman, runc and debootstrap with apt if
absent, and makes a stand-in for ``python:3.11-slim``); skips, saying why, where it is not
root or podman cannot run a container. Writes the build's log, the container's log and
the figures it measured (``container.json``) to ``out/``."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port

from server.client.peer import run_session
from server.config import REPO_ROOT

pytestmark = pytest.mark.container

SCRIPT = REPO_ROOT / "scripts" / "container_image.py"
OUT = REPO_ROOT / "out"
UNAVAILABLE = 3  # the script's exit status where this host cannot build or run containers


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    """Podman as the script runs it (runc, cgroupfs, its containers.conf)."""
    env = {**os.environ, "CONTAINERS_CONF": str(_cache() / "containers.conf")}
    return subprocess.run(["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs",
                           *args], capture_output=True, text=True, timeout=timeout,
                          check=check, env=env)


def _cache() -> Path:
    return Path(os.environ.get("SONIC_CONTAINER_CACHE", "/var/cache/sonic-container"))


def _write(name: str, text: str) -> None:
    if OUT.is_dir():
        (OUT / name).write_text(text)


def _figures(**figures: object) -> None:
    """Add to ``out/container.json``, the figures docs/containers.md quotes."""
    if not OUT.is_dir():
        return
    path = OUT / "container.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**known, **figures}, indent=1) + "\n")


@pytest.fixture(scope="session")
def cpu_image() -> str:
    """The CPU image's id, built (or found unchanged) by the script."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("the image is built for linux x86_64 hosts")
    if os.geteuid() != 0:
        pytest.skip("building and running images with podman here needs root")
    if shutil.which("podman") is None and shutil.which("apt-get") is None:
        pytest.skip("no podman, and no apt-get to install it")
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=1800, cwd=REPO_ROOT)
    build_s = time.monotonic() - started
    _write("container-build.log", done.stderr)
    if done.returncode == UNAVAILABLE:
        pytest.skip(next(line for line in reversed(done.stderr.splitlines())
                         if "unavailable:" in line))
    assert done.returncode == 0, done.stderr[-3000:]
    name = done.stdout.strip().splitlines()[-1]
    # By its id: the one built here, whatever the name points to later.
    image, size = podman("image", "inspect", "--format", "{{.Id}} {{.Size}}", name
                         ).stdout.split()
    _figures(build_s=round(build_s, 1), image=name, image_mb=round(int(size) / 1e6))
    return image


def _wait_ready(url: str, name: str, timeout: float) -> None:
    """Until ``/healthz`` answers 200 (503 while the server calibrates); fails at once if
    the container stops."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        state = podman("inspect", "--format", "{{.State.Status}}", name, check=False)
        assert state.stdout.strip() == "running", f"the container stopped: {state.stdout}"
        time.sleep(0.25)
    raise TimeoutError(f"{url}/healthz not 200 within {timeout:.0f} s")


@pytest.mark.timeout(2400)
async def test_client_gets_25_fps_and_the_speech_from_the_cpu_image(cpu_image, speech_wav):
    port = free_port()
    name = f"sonic-test-{port}"
    url = f"http://127.0.0.1:{port}"
    # The image's ENTRYPOINT listens on 0.0.0.0:8080; later arguments win: loopback only,
    # on a free port, its ICE candidates on loopback.
    started = time.monotonic()
    container = ""
    try:  # a failed run may still leave the container made: removed below all the same
        container = podman("run", "--detach", "--pull=never", "--name", name,
                           "--network=host", cpu_image, "--host", "127.0.0.1",
                           "--port", str(port), "--ice-host", "127.0.0.1").stdout.strip()
        _wait_ready(url, name, timeout=180)
        ready_s = time.monotonic() - started
        received = await run_session(url, str(speech_wav), seconds=10.0, coefficients=True)
        # The session was the container's: its server logged it.
        assert received.session_id in _logs(name)
        fps = received.video_fps()
        _figures(ready_s=round(ready_s, 1), video_fps=round(fps, 2),
                 video_frames=len(received.video.pts), audio_frames=len(received.audio.pts),
                 measured=time.strftime("%Y-%m-%d"))
        assert fps >= 24.0, fps
        assert len(received.video.data) >= 24 * 9
        rms = np.array([np.sqrt(np.mean(d.astype(np.float32) ** 2))
                        for d in received.audio.data])
        assert len(rms) > 0 and rms.max() > 500, "the speech did not come back"
        jaw = np.array([m["coefficients"]["jawOpen"] for m in received.coefficients])
        assert len(jaw) > 200 and jaw.max() > 0.3, "the mouth did not move with the speech"
    finally:
        try:
            stopping = time.monotonic()
            podman("stop", "--time", "10", name, check=False, timeout=60)
            _figures(stop_s=round(time.monotonic() - stopping, 1))
            _write("container-server.log", _logs(name))
        finally:  # killed and removed, whatever stopping it did
            podman("rm", "--force", "--time", "0", name, check=False, timeout=60)
    assert podman("container", "exists", name, check=False).returncode != 0
    # Nothing of it left running: conmon, the container's monitor, has its id in its
    # command line, as had every process podman started for it.
    assert container and not _processes_naming(container)


def _logs(name: str) -> str:
    """The container's output (the server logs to stderr)."""
    done = podman("logs", name, check=False)
    return done.stdout + done.stderr


def _processes_naming(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command:
            found.append(f"{cmdline.parent.name}: {command}")
    return found
