"""Build the CPU image from the repository's ``Dockerfile`` with Debian's podman, on a
Debian host (as root) where no base image can be pulled and nothing inside a build can
download. Prints each step; the last line on stdout is the image's name.

    python3 scripts/container_image.py            # builds localhost/sonic-cpu:latest

What it does, reusing what an earlier run left:

1. Installs Debian's ``podman``, ``runc`` and ``debootstrap`` if absent, and writes a
   ``containers.conf`` for these hosts (runc, cgroupfs, no default ulimits, file events);
   ``podman_env()`` gives every podman call here and in the tests the same.
2. Makes the stand-in for ``python:3.11-slim`` once: ``debootstrap --variant=minbase
   bookworm`` with Debian's python3.11 and pip (``python`` and ``pip`` on PATH, pip free to
   install system-wide as in the real image), imported as ``BASE_IMAGE``.
3. Makes a wheelhouse of the project's dependencies (``pyproject.toml``) and its build
   backend on the host, for CPython 3.11 on linux x86_64, cached by their list.
4. ``podman build --from BASE_IMAGE --network none -v WHEELS:/wheels:ro --build-arg
   PIP_OPTIONS="--no-index --find-links /wheels"``: the Dockerfile unchanged, its install
   step offline, the wheels mounted for the build and never in a layer. Podman's layer
   cache makes a rebuild of unchanged sources take seconds; the image it replaces is
   removed.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("SONIC_CONTAINER_CACHE", "/var/cache/sonic-container"))
IMAGE = "localhost/sonic-cpu:latest"
MIRROR = "http://deb.debian.org/debian"
#: The stand-in's packages: python3.11 with pip, and what python:3.11-slim also has.
BASE_PACKAGES = ("python3", "python3-pip", "python-is-python3", "ca-certificates", "netbase",
                 "tzdata")
#: Named by its recipe, so that a changed recipe makes a new one.
BASE_REPO = "localhost/sonic-base"
BASE_IMAGE = BASE_REPO + ":python3.11-bookworm-" + hashlib.sha256(
    json.dumps([MIRROR, BASE_PACKAGES, 1]).encode()).hexdigest()[:8]
#: Debian packages for the commands this needs.
TOOLS = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap"}
#: Wheels for these platforms install on Debian bookworm (glibc 2.36, x86_64).
PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(36, 16, -1)) + (
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64")
CONTAINERS_CONF = """\
# Written by scripts/container_image.py: podman on hosts without systemd, whose root may
# not raise rlimits (runc then fails "error setting rlimits").
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


class Unavailable(RuntimeError):
    """This host cannot build or run containers (not root, no apt, podman cannot run one)."""


def log(message: str) -> None:
    print(f"[container_image {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr,
          flush=True)


def run(cmd: list[str], *, timeout: float, check: bool = True, quiet: bool = False,
        env: dict[str, str] | None = None, **kwargs: object) -> subprocess.CompletedProcess:
    """Run ``cmd`` (printed, with how long it took), its output captured; raise on failure
    (with the output's tail) or after ``timeout`` seconds."""
    if not quiet:
        log("+ " + " ".join(cmd))
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=env or podman_env(), **kwargs)  # type: ignore[call-overload]
    if not quiet:
        log(f"  {time.monotonic() - started:.1f} s, exit {done.returncode}")
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd, (done.stdout or "")[-4000:],
                                            (done.stderr or "")[-4000:])
    return done


def podman_env() -> dict[str, str]:
    """The environment for podman here: its containers.conf (``CONTAINERS_CONF``)."""
    return {**os.environ, "CONTAINERS_CONF": str(CACHE / "containers.conf")}


def podman(*args: str, timeout: float = 120, check: bool = True, quiet: bool = False
           ) -> subprocess.CompletedProcess:
    return run(["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs", *args],
               timeout=timeout, check=check, quiet=quiet)


def ensure_tools() -> None:
    """Install podman, runc and debootstrap with apt if any is absent; write the config."""
    if os.geteuid() != 0:
        raise Unavailable("building images with podman here needs root")
    missing = sorted({pkg for cmd, pkg in TOOLS.items() if shutil.which(cmd) is None
                      and not Path("/usr/sbin", cmd).exists()})
    if missing:
        if shutil.which("apt-get") is None:
            raise Unavailable(f"{', '.join(missing)} absent and no apt-get to install them")
        log(f"installing {' '.join(missing)}")
        run(["apt-get", "update", "-qq"], timeout=300)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
            timeout=600, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    CACHE.mkdir(parents=True, exist_ok=True)
    conf = CACHE / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.write_text(CONTAINERS_CONF)


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False, quiet=True).returncode == 0


def image_id(name: str) -> str | None:
    done = podman("image", "inspect", "--format", "{{.Id}}", name, check=False, quiet=True)
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def ensure_base() -> None:
    """The stand-in for ``python:3.11-slim``, made once and kept by name."""
    if image_exists(BASE_IMAGE):
        log(f"base image {BASE_IMAGE} exists: reused")
        return
    rootfs = CACHE / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    log(f"making {BASE_IMAGE} with debootstrap (bookworm, minbase)")
    try:
        run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             "bookworm", str(rootfs), MIRROR], timeout=900)
        # As in the real image: pip installs system-wide (no PEP 668 marker), no package
        # caches or lists, no documentation but the licences.
        (rootfs / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink(missing_ok=True)
        for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*",
                        "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*"):
            for path in rootfs.glob(pattern):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in (rootfs / "usr/share/doc").rglob("*"):
            if path.is_file() and path.name != "copyright":
                path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            run(["podman", "import", "--change", "ENV LANG=C.UTF-8",
                 "--change", 'CMD ["python3"]', "-", BASE_IMAGE], stdin=tar.stdout,
                timeout=600)
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            if tar.wait(60) != 0:
                raise RuntimeError(f"tar of {rootfs} failed: {tar.returncode}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}", BASE_REPO, quiet=True)
    for old in set(listed.stdout.split()) - {BASE_IMAGE}:  # made by an earlier recipe
        podman("rmi", old, check=False)


def check_runs() -> None:
    """Podman can run a container here (by trying), with no network as the build's steps
    and on the host's as the tests' servers: else ``Unavailable``, saying why."""
    for network in ("none", "host"):
        done = podman("run", "--rm", "--pull=never", f"--network={network}", BASE_IMAGE,
                      "python", "-c", "import sys; print(sys.version_info[:2])",
                      check=False, timeout=120)
        if done.returncode != 0 or done.stdout.strip() != "(3, 11)":
            said = " ".join((done.stderr.strip() or done.stdout.strip()).split())
            raise Unavailable(f"podman cannot run a container here (--network={network}): "
                              + said[-500:])


def requirements() -> list[str]:
    """The project's dependencies and its build backend's, from ``pyproject.toml``."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    # The wheels are resolved for this interpreter, the image installs them on its own
    # 3.11 (Debian 12's is 3.11.2): what a dependency needs only below 3.11.3 goes too.
    below_3_11_3 = ["async-timeout>=4.0.3"]  # redis's
    return project["build-system"]["requires"] + ["wheel"] + \
        project["project"]["dependencies"] + below_3_11_3


def ensure_wheels() -> Path:
    """Wheels of ``requirements()`` for CPython 3.11 on linux x86_64, cached by that list."""
    wanted = requirements()
    key = hashlib.sha256(json.dumps(wanted).encode()).hexdigest()[:12]
    wheels = CACHE / f"wheels-{key}"
    if (wheels / ".complete").exists():
        log(f"wheelhouse {wheels} exists: reused")
        return wheels
    partial = CACHE / f"wheels-{key}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    host = (sys.implementation.name, sys.version_info[:2], sys.platform, platform.machine())
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    if host == ("cpython", (3, 11), "linux", "x86_64"):
        cmd = [*pip, "wheel", "--wheel-dir", str(partial), *wanted]
    else:  # another interpreter here: take the 3.11 wheels from the index as they are
        cmd = [*pip, "download", "--dest", str(partial), "--only-binary=:all:",
               "--implementation", "cp", "--python-version", "3.11",
               *[arg for tag in PLATFORMS for arg in ("--platform", tag)], *wanted]
    run(cmd, timeout=900)
    (partial / ".complete").write_text("\n".join(wanted) + "\n")
    for old in CACHE.glob("wheels-*"):  # wheelhouses for other dependency lists
        if old != partial:
            shutil.rmtree(old, ignore_errors=True)
    partial.rename(wheels)
    return wheels


def build(wheels: Path, tag: str = IMAGE) -> str:
    """``podman build`` of the repository's Dockerfile on the stand-in base, offline."""
    before = image_id(tag)
    podman("build", "--pull=never", "--from", BASE_IMAGE, "--network", "none",
           "--volume", f"{wheels}:/wheels:ro",
           "--build-arg", "PIP_OPTIONS=--no-index --find-links /wheels",
           "--tag", tag, "--file", str(REPO / "Dockerfile"), str(REPO), timeout=1800)
    after = image_id(tag)
    if before and after != before:  # the image this one replaces, and its own layers
        podman("rmi", before, check=False, timeout=120)
    return tag


def take_lock(lock: object, timeout: float) -> None:
    """One build at a time on this host: wait up to ``timeout`` s for another to finish."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[arg-type]
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("flock", timeout) from None
            time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default=IMAGE)
    args = parser.parse_args()
    started = time.monotonic()
    try:
        ensure_tools()
        with open(CACHE / "lock", "w") as lock:
            take_lock(lock, timeout=1800)
            ensure_base()
            check_runs()
            wheels = ensure_wheels()
            tag = build(wheels, args.tag)
    except Unavailable as exc:
        log(f"unavailable: {exc}")
        sys.exit(3)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        log(f"failed: {exc}\n{getattr(exc, 'output', '') or ''}"
            f"\n{getattr(exc, 'stderr', '') or ''}")
        sys.exit(1)
    size = podman("image", "inspect", "--format", "{{.Size}}", tag, quiet=True).stdout
    log(f"built {tag} ({int(size) / 1e6:.0f} MB) in {time.monotonic() - started:.0f} s")
    print(tag)


if __name__ == "__main__":
    main()
