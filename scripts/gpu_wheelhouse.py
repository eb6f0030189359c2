"""Build a wheelhouse for an offline GPU machine, in parts small enough to carry.

Run it where the package index is reachable. It downloads the server's dependencies
(``pyproject.toml``) as wheels for the target's Python and platform, leaves out what the
target already has (``--present``: the target's ``pip list --format=freeze``), and packs
the rest into ``part-N`` folders of at most ``--part-mib`` MiB each:

    python scripts/gpu_wheelhouse.py --present gpu-freeze.txt --out wheelhouse

Then, on the target, install each part as it arrives (each into the same folder):

    python3 -m pip install --no-index --no-deps --target /opt/sonic-site part-1/*.whl
    export PYTHONPATH=/opt/sonic-site:$PWD

``--no-deps``: the parts together are the dependency closure, so no part needs the index.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Wheels for these platforms install on the lent GPU machine (glibc 2.39, x86_64).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_27_x86_64", "linux_x86_64")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(path: Path) -> str:
    return normalise(path.name.split("-")[0])


def present_projects(freeze: Path | None) -> set[str]:
    """Project names from ``pip list --format=freeze`` (or ``pip freeze``) output."""
    if freeze is None:
        return set()
    names = set()
    for line in freeze.read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if match and not line.lstrip().startswith("#"):
            names.add(normalise(match.group(1)))
    return names


def requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


def pack(wheels: list[Path], limit: int) -> list[list[Path]]:
    """First fit, largest first: few parts, none over ``limit`` bytes."""
    parts: list[tuple[int, list[Path]]] = []
    for wheel in sorted(wheels, key=lambda w: w.stat().st_size, reverse=True):
        size = wheel.stat().st_size
        if size > limit:
            raise SystemExit(f"{wheel.name} alone is {size / 2**20:.1f} MiB, over the limit")
        for i, (used, members) in enumerate(parts):
            if used + size <= limit:
                parts[i] = (used + size, [*members, wheel])
                break
        else:
            parts.append((size, [wheel]))
    return [members for _, members in parts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the parts")
    parser.add_argument("--present", type=Path,
                        help="the target's `pip list --format=freeze`; those projects are "
                             "left out")
    parser.add_argument("--python", default="3.12", help="the target's Python (3.12)")
    parser.add_argument("--part-mib", type=float, default=60.0)
    parser.add_argument("--extra", nargs="*", default=[],
                        help="more requirements (e.g. a pinned package the target lacks)")
    args = parser.parse_args()
    have = present_projects(args.present)
    abi = "cp" + args.python.replace(".", "")
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                   "--python-version", args.python, "--implementation", "cp", "--abi", abi,
                   "--abi", "abi3", "--abi", "none", "-d", tmp,
                   *(f"--platform={p}" for p in PLATFORMS), *requirements(), *args.extra]
        subprocess.run(command, check=True)
        wheels = [w for w in Path(tmp).glob("*.whl") if wheel_project(w) not in have]
        skipped = sorted({wheel_project(w) for w in Path(tmp).glob("*.whl")}
                         - {wheel_project(w) for w in wheels})
        parts = pack(wheels, int(args.part_mib * 2**20))
        if args.out.exists():
            shutil.rmtree(args.out)
        for number, members in enumerate(parts, 1):
            folder = args.out / f"part-{number}"
            folder.mkdir(parents=True)
            for wheel in members:
                shutil.copy2(wheel, folder / wheel.name)
            total = sum(w.stat().st_size for w in members) / 2**20
            print(f"{folder}: {len(members)} wheels, {total:.1f} MiB: "
                  + ", ".join(sorted(wheel_project(w) for w in members)))
    if skipped:
        print("already on the target: " + ", ".join(skipped))
    print("install each part there with:\n  python3 -m pip install --no-index --no-deps "
          "--target /opt/sonic-site part-N/*.whl\nthen: export PYTHONPATH=/opt/sonic-site:$PWD")


if __name__ == "__main__":
    main()
