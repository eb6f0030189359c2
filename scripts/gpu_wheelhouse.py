"""Build a wheelhouse for an offline GPU machine, in parts small enough to carry.

Run it where the package index is reachable. It downloads the server's dependencies
(``pyproject.toml``) as wheels for the target's Python and platform, leaves out what the
target already has (``--present``: the target's ``pip list --format=freeze``), and packs
the rest, unpacked, into ``site-N.tar.xz`` parts of at most ``--part-mib`` MiB each (xz
takes a third off the wheels: the lent machine takes 64 MiB per call, repository included):

    python scripts/gpu_wheelhouse.py --present gpu-freeze.txt --out .wheelhouse

Then, on the target, unpack each part as it arrives, all into the same folder:

    mkdir -p /tmp/sonic-site && tar -xJf site-1.tar.xz -C /tmp/sonic-site
    export PYTHONPATH=/tmp/sonic-site:$PWD

A wheel is a zip made to be unpacked into site-packages as it is; the parts together are
the dependency closure of what the target lacks, so nothing needs the index there.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Wheels for these platforms install on the lent GPU machine (glibc 2.39, x86_64).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_27_x86_64", "linux_x86_64")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(path: Path) -> str:
    return normalise(path.name.split("-")[0])


#: Projects that install the same module under another name: any one present will do.
SAME_MODULE = {
    "opencv-python-headless": {"opencv-python", "opencv-contrib-python",
                               "opencv-contrib-python-headless"},
}


def present_projects(freeze: Path | None) -> set[str]:
    """Project names from ``pip list --format=freeze`` (or ``pip freeze``) output, and the
    projects those stand in for (``SAME_MODULE``)."""
    if freeze is None:
        return set()
    names = set()
    for line in freeze.read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if match and not line.lstrip().startswith("#"):
            names.add(normalise(match.group(1)))
    return names | {wanted for wanted, alike in SAME_MODULE.items() if names & alike}


def requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


def balance(wheels: list[Path], parts: int) -> list[list[Path]]:
    """Largest first, each into the lightest part so far."""
    groups: list[tuple[int, list[Path]]] = [(0, []) for _ in range(parts)]
    for wheel in sorted(wheels, key=lambda w: w.stat().st_size, reverse=True):
        i = min(range(parts), key=lambda k: groups[k][0])
        groups[i] = (groups[i][0] + wheel.stat().st_size, [*groups[i][1], wheel])
    return [members for _, members in groups if members]


def unpacked_archive(wheels: list[Path], out: Path) -> int:
    """The wheels unpacked as site-packages, as one tar.xz; returns its size."""
    with tempfile.TemporaryDirectory() as site:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
        for data in Path(site).glob("*.data"):  # a wheel's purelib/platlib go to the root
            for scheme in ("purelib", "platlib"):
                if (data / scheme).is_dir():
                    shutil.copytree(data / scheme, site, dirs_exist_ok=True)
            shutil.rmtree(data)
        subprocess.run(["tar", "-C", site, "-cf", str(out), "--use-compress-program",
                        "xz -T0 -6", "."], check=True)
    return out.stat().st_size


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
        if args.out.exists():
            shutil.rmtree(args.out)
        args.out.mkdir(parents=True)
        limit = int(args.part_mib * 2**20)
        for count in range(1, 9):
            groups = balance(wheels, count)
            sizes = [unpacked_archive(g, args.out / f"site-{n}.tar.xz")
                     for n, g in enumerate(groups, 1)]
            if max(sizes) <= limit:
                break
            for old in args.out.glob("site-*.tar.xz"):
                old.unlink()
        else:
            raise SystemExit("could not fit the wheels into 8 parts")
        for n, (group, size) in enumerate(zip(groups, sizes, strict=True), 1):
            print(f"{args.out}/site-{n}.tar.xz: {size / 2**20:.1f} MiB: "
                  + ", ".join(sorted(wheel_project(w) for w in group)))
    if skipped:
        print("already on the target: " + ", ".join(skipped))
    print("unpack each part there with:\n  mkdir -p /tmp/sonic-site && "
          "tar -xJf site-N.tar.xz -C /tmp/sonic-site\n"
          "then: export PYTHONPATH=/tmp/sonic-site:$PWD")


if __name__ == "__main__":
    main()
