"""How long each thread of the server waits for a core: every thread of every process
under the server, sampled from ``/proc/<pid>/task/<tid>/schedstat`` (time on a core, time
runnable but waiting in the run queue, timeslices), summed over the run. The inference
process is named by the server's ``/healthz`` (``--url``), else as the one mapping libcuda; a
thread that waits long in the run queue for each slice is one that loses its core to the
others (issue 45: batches abandoned on an idle GPU).

    python -m benchmarks.schedstat --root PID --url http://127.0.0.1:8080 --seconds 40 \
        --out sched.json &
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path


def children(root: int) -> list[int]:
    """``root`` and every process under it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [root], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == pid]
        found += kids
        frontier += kids
    return found


def roles_from_health(url: str) -> dict[int, str]:
    """Each process's role as the front door's ``/healthz`` names it."""
    with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
        health = json.load(response)
    named = {w["pid"]: f"worker {w['index']}" for w in health.get("workers", [])}
    named.update({p["pid"]: f"inference {p['gpu']}" for p in health.get("inference", [])})
    return named


def role(pid: int) -> str:
    """Where the server's own health cannot say: the process mapping CUDA infers."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    if "libcuda" in maps:
        return "inference"
    if "-m server" in cmdline:
        return "front door"
    return "child"


def sample(pids: list[int]) -> dict[tuple[int, int], tuple[int, int, int, str]]:
    out = {}
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                run, wait, slices = map(int, Path(f"/proc/{pid}/task/{tid}/schedstat")
                                        .read_text().split())
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except (OSError, ValueError):
                continue
            out[pid, int(tid)] = (run, wait, slices, comm)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--url", help="the server's URL, to name its processes by /healthz")
    args = parser.parse_args()
    first: dict[tuple[int, int], tuple[int, int, int, str]] = {}
    last: dict[tuple[int, int], tuple[int, int, int, str]] = {}
    roles: dict[int, str] = roles_from_health(args.url) if args.url else {}
    worst: dict[tuple[int, int], float] = {}  # the largest wait a slice in one interval
    timeline: list[dict[str, object]] = []  # each interval, by role: cpu, run queue, slices
    started = time.monotonic()
    end = started + args.seconds
    while time.monotonic() < end and Path(f"/proc/{args.root}").exists():
        pids = children(args.root)
        for pid in pids:
            if roles.get(pid, "child") == "child":
                roles[pid] = role(pid)
        now = sample(pids)
        interval: dict[str, list[float]] = {}
        for key, value in now.items():
            before = last.get(key)
            if before is not None:
                sums = interval.setdefault(roles.get(key[0], "?"), [0.0, 0.0, 0.0])
                for i in range(3):
                    sums[i] += value[i] - before[i]
        if interval:
            timeline.append({"t": round(time.monotonic() - started, 1), **{
                r: {"cpu_s": round(v[0] / 1e9, 2), "runqueue_s": round(v[1] / 1e9, 3),
                    "wait_per_slice_ms": round(v[1] / max(1.0, v[2]) / 1e6, 3)}
                for r, v in interval.items()}})
        for key, value in now.items():
            first.setdefault(key, value)
            before = last.get(key)
            if before is not None and value[2] > before[2]:
                per_slice = (value[1] - before[1]) / (value[2] - before[2]) / 1e6
                worst[key] = max(worst.get(key, 0.0), per_slice)
        last = now
        time.sleep(args.every)
    threads = []
    for key, (run, wait, slices, comm) in last.items():
        run0, wait0, slices0, _ = first[key]
        n = slices - slices0
        if run - run0 < 1e7:  # under 10 ms on a core all run: idle
            continue
        threads.append({"pid": key[0], "tid": key[1], "role": roles.get(key[0], "?"),
                        "comm": comm, "cpu_s": round((run - run0) / 1e9, 2),
                        "runqueue_s": round((wait - wait0) / 1e9, 2), "slices": n,
                        "wait_per_slice_ms": round((wait - wait0) / max(1, n) / 1e6, 3),
                        "worst_interval_wait_per_slice_ms": round(worst.get(key, 0.0), 3)})
    threads.sort(key=lambda t: (not str(t["role"]).startswith("inference"), -t["cpu_s"]))
    Path(args.out).write_text(json.dumps({"threads": threads, "timeline": timeline},
                                         indent=1))


if __name__ == "__main__":
    main()
