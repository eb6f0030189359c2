"""Load generator: a real server process and N real aiortc peers on loopback.

For each session count it starts a fresh server (the front door with its media workers
and inference process, unless told otherwise after ``--``), streams speech from N peers
at once for ``--seconds``, and reports what the peers received (fps) and what the server
measured per session (repeated frames, pipeline delay and A/V offset p50/p95/p99), in all
and for each session, with the server's CPU by process (front door, workers, inference),
the whole machine's busy, idle and stolen cores, the GPU's utilisation where
``nvidia-smi`` exists, the engine's mean batch size and the admission decisions. All of it
is taken in the steady state: from when every offer has been answered until just before
the first session ends.

The peers must not be the bottleneck on a machine they share with the server: they run in
``--client-processes`` processes, and all but ``--decoded`` of them are counting peers:
they send speech encoded once (``server.client.peer.EncodedSpeech``) and count the frames and
audio packets they receive from the RTP headers (``count_frames``), decoding nothing
(decoding video costs 0.2-0.3 cores per stream, and aiortc's receive path a thread per
track). The decoding ones check picture and sound in full.

    python -m benchmarks.sessions --sessions 1 2 4 --size 256 --seconds 20
    python -m benchmarks.sessions --sessions 64 128 --size 256 -- --runtime torch-cuda
    python -m benchmarks.sessions --points 512x64 256x112 motionx256 -- --runtime torch-cuda
    python -m benchmarks.sessions --sessions 256 --motion-only --server-cpus 0-15 \
        --client-cpus 16-63 -- --runtime torch-cuda
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.tts import conversation, write_wav
from server.client.peer import run_session
from server.client.speech import EncodedSpeech
from server.config import REPO_ROOT
from server.load import CLOCK_TICKS, process_cpu_seconds
from server.media.peer import pin_host_addresses
from server.media.session import RECENT_FRAMES

#: Per-session counters in /sessions, taken over the measuring window.
COUNTERS = ("frames_sent", "frames_repeated", "frames_skipped")


def _processes(url: str, pid: int) -> dict[str, list[int]]:
    """The server's processes by kind, from its /healthz."""
    health = _get(f"{url}/healthz")
    if "workers" not in health:  # an embedded server: one process
        return {"server": [pid]}
    return {"front_door": [pid],
            "workers": [w["pid"] for w in health["workers"] if w["pid"]],
            "inference": [p["pid"] for p in health["inference"] if p["pid"]]}


def _gpu_utilisation() -> float | None:
    """Mean utilisation of the GPUs the server may use (``CUDA_VISIBLE_DEVICES``)."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        query.append(f"--id={visible}")
    out = subprocess.run(query, capture_output=True, text=True)
    values = [float(v) for v in out.stdout.split() if v.strip()]
    return float(np.mean(values)) if values else None


def _host_ticks() -> np.ndarray:
    """The whole machine's CPU time so far, from /proc/stat's ``cpu`` line, in ticks: busy
    (user, nice, system, irq, softirq), idle, iowait, steal. Steal is time the hypervisor
    ran someone else on these cores: on a shared VM it shows why a server can be slow
    while its own processes look idle."""
    with open("/proc/stat") as stat:
        user, nice, system, idle, iowait, irq, softirq, steal = map(
            int, stat.readline().split()[1:9])
    return np.array([user + nice + system + irq + softirq, idle, iowait, steal], np.float64)


def _live(health: dict[str, Any]) -> int:
    """Sessions on the server, by its /healthz, motion-only ones included."""
    return int(health.get("sessions", 0) + health.get("motion_sessions", 0))


def _cpus(spec: str) -> set[int]:
    """``"0-15,32"`` as a set of core numbers."""
    out: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def _metric_sums(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"/{v}" for k, v in sorted(sample.labels.items())
                                        if k in ("decision", "reason"))
            sums[key] = sums.get(key, 0.0) + sample.value
    return sums


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _clients(url: str, wav: str, sessions: int, size: int, seconds: float,
                   motion_only: bool = False, packets: list[bytes] | None = None
                   ) -> list[dict[str, Any]]:
    """``sessions`` peers in this process; each one's received fps (of video frames, or of
    coefficient messages when ``motion_only``) with the times they arrived, or why it was
    refused. Given ``packets`` (the speech encoded once), the peers send those and count
    what they receive without decoding it."""

    async def one(delay: float) -> dict[str, Any]:
        await asyncio.sleep(delay)
        speech = EncodedSpeech(packets) if packets else None
        try:
            received = await run_session(url, wav, seconds=seconds, keep=False,
                                         options={"size": size, "motion_only": motion_only},
                                         audio=speech, count_only=packets is not None)
        except RuntimeError as exc:
            return {"refused": str(exc)[:200]}
        if motion_only:
            fps, arrivals = received.motion_fps(), received.coefficient_arrivals
        else:
            fps, arrivals = received.video_fps(), received.video.arrivals
        return {"session_id": received.session_id, "fps": fps,
                "arrivals": [round(t, 4) for t in arrivals],
                "late": None if speech is None else
                [(round(t, 4), round(1000 * s, 1)) for t, s in speech.late],
                "packet_s": None if speech is None else speech.packet_s}

    # Offers spread over the first second, as real callers would arrive.
    return list(await asyncio.gather(*(one(i / max(1, sessions)) for i in range(sessions))))


async def _client_process(url: str, wav: Path, sessions: int, size: int, seconds: float,
                          motion_only: bool) -> asyncio.subprocess.Process:
    """A process of counting peers, started and ready (imports done, speech encoded): its
    peers offer once it reads ``go`` (``_client_results``). Starting dozens of processes on
    a few cores takes tens of seconds, so the peers must not start as each process does."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.sessions", "--client-of", url, str(wav),
        str(sessions), str(size), str(seconds), str(int(motion_only)), cwd=REPO_ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    if (await proc.stdout.readline()).strip() != b"ready":
        raise RuntimeError("a client process failed to start")
    return proc


async def _client_results(proc: asyncio.subprocess.Process) -> list[dict[str, Any]]:
    out, _ = await proc.communicate(b"go\n")
    return list(json.loads(out.decode().strip().splitlines()[-1]))


def _frame_times(stats: dict[str, Any]) -> tuple[int, int]:
    """Frame times a session had, and how many of them showed an old picture: a skipped
    frame time left the old picture up, as a repeat does."""
    return (stats["frames_sent"] + stats["frames_skipped"],
            stats["frames_repeated"] + stats["frames_skipped"])


def _session_row(stats: dict[str, Any], fps: float | None) -> dict[str, Any]:
    sent, repeated = _frame_times(stats)
    return {"session_id": stats["session_id"],
            "fps": None if fps is None else round(fps, 2),
            "repeated_%": round(100 * repeated / sent, 2) if sent else None,
            "pipeline_delay_ms": stats["pipeline_delay_ms"],
            "av_offset_ms": stats["av_offset_ms"]}


def _late_ms(late: list[list[float]], t0: float, t1: float, packet_s: float,
             *qs: float) -> list[float]:
    """The ``qs`` quantiles of how late a peer sent its packets (one every ``packet_s``)
    between ``t0`` and ``t1``: ``late`` holds (time, ms) of those over
    ``EncodedSpeech.LATE_S``, and the rest count as on time."""
    sent = round((t1 - t0) / packet_s)
    values = sorted((ms for t, ms in late if t0 <= t < t1), reverse=True)
    ranks = (int(round((1.0 - q) * sent, 6)) for q in qs)
    return [values[rank] if rank < len(values) else 0.0 for rank in ranks]


def _window_fps(arrivals: list[float], t0: float, t1: float) -> float:
    """Frames received per second between ``t0`` and ``t1`` (monotonic clock: one for all
    processes of the machine)."""
    return sum(t0 <= t < t1 for t in arrivals) / (t1 - t0)


@dataclass
class _Window:
    """What the server and the machine did while every session was live and steady."""

    t0: float
    t1: float
    cpu: dict[str, float]  # cores busy, by kind of server process
    peers: float  # cores the peers' processes (and this one's) kept busy
    unmeasured: list[str]  # kinds of process that died meanwhile: their CPU is unknown
    host: dict[str, float]  # the whole machine's cores busy, idle, in iowait, stolen
    gpu: list[float]  # utilisation samples
    at_start: dict[str, dict[str, Any]]  # each session's stats, by id
    at_end: dict[str, dict[str, Any]]
    health: dict[str, Any]  # /healthz at the end


async def _steady_window(url: str, kinds: dict[str, list[int]], peers: list[int],
                         go: float, seconds: float) -> _Window:
    """Waits until every offer is answered (the server's count of sessions stops
    growing), then measures until just before the first session ends: the steady state,
    not the connections' start."""

    async def get(path: str) -> Any:
        return await asyncio.to_thread(_get, f"{url}{path}")

    async def sessions_now() -> dict[str, dict[str, Any]]:
        return {s["session_id"]: s["stats"] for s in (await get("/sessions"))["sessions"]}

    def cpu_seconds() -> dict[int, float]:
        return {p: process_cpu_seconds(p) for pids in [*kinds.values(), peers] for p in pids}

    await asyncio.sleep(3.0)
    last, since = -1, time.monotonic()
    while time.monotonic() - go < seconds / 2:
        live = _live(await get("/healthz"))
        if live != last:
            last, since = live, time.monotonic()
        elif live and time.monotonic() - since >= 1.0:
            break
        await asyncio.sleep(0.25)
    at_start = await sessions_now()
    t0, c0, h0 = time.monotonic(), cpu_seconds(), _host_ticks()
    gpu: list[float] = []
    end = go + seconds - 1.5
    while time.monotonic() < end:
        util = await asyncio.to_thread(_gpu_utilisation)
        if util is not None:
            gpu.append(util)
        await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))
    t1, c1, h1 = time.monotonic(), cpu_seconds(), _host_ticks()
    host = (h1 - h0) / CLOCK_TICKS / (t1 - t0)
    return _Window(
        t0, t1,
        cpu={k: sum(c1[p] - c0[p] for p in pids) / (t1 - t0) for k, pids in kinds.items()},
        peers=sum(c1[p] - c0[p] for p in peers) / (t1 - t0),
        # A process replaced meanwhile reads 0 at the end.
        unmeasured=sorted(k for k, pids in kinds.items() if any(c1[p] == 0.0 for p in pids)),
        host=dict(zip(("busy", "idle", "iowait", "steal"),
                      (round(float(v), 2) for v in host), strict=True)),
        gpu=gpu, at_start=at_start, at_end=await sessions_now(), health=await get("/healthz"))


async def _measure(url: str, pid: int, wav: Path, sessions: int, seconds: float,
                   size: int, client_processes: int, decoded: int,
                   motion_only: bool) -> dict[str, Any]:
    kinds = await asyncio.to_thread(_processes, url, pid)
    before = await asyncio.to_thread(_metric_sums, url)
    decoded = min(decoded, sessions)
    rest = sessions - decoded
    shares = [len(part) for part in np.array_split(np.arange(rest), client_processes)
              if len(part)]
    procs = await asyncio.gather(*(_client_process(url, wav, n, size, seconds, motion_only)
                                   for n in shares))
    go = time.monotonic()
    window, local, *remote = await asyncio.gather(
        _steady_window(url, kinds, [os.getpid(), *(p.pid for p in procs)], go, seconds),
        _clients(url, str(wav), decoded, size, seconds, motion_only),
        *(_client_results(proc) for proc in procs))
    results = local + [r for chunk in remote for r in chunk]
    after = await asyncio.to_thread(_metric_sums, url)
    # Each session's counters over the window; its percentiles over its last 500 frames.
    first, last = window.at_start, window.at_end
    stats = [{**last[k], **{n: last[k][n] - first[k][n] for n in COUNTERS},
              "session_id": k} for k in sorted(last.keys() & first.keys())]
    fps_by_id = {r["session_id"]: _window_fps(r["arrivals"], window.t0, window.t1)
                 for r in results if "fps" in r}
    fps = list(fps_by_id.values())
    late = [_late_ms(r["late"], window.t0, window.t1, r["packet_s"], 0.95, 0.99)
            for r in results if r.get("late") is not None]
    late_p95, late_p99 = [q for q, _ in late], [q for _, q in late]
    fps_whole = [r["fps"] for r in results if "fps" in r]

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    def worst(key: str, q: str) -> float | None:
        values = [abs(s[key][q]) for s in stats if s[key][q] is not None]
        return round(float(max(values)), 1) if values else None

    def median(key: str, q: str) -> float | None:
        values = [s[key][q] for s in stats if s[key][q] is not None]
        return round(float(np.median(values)), 1) if values else None

    batches = delta("sonic_engine_batch_size_count")
    served = len(fps)
    times = [_frame_times(s) for s in stats]
    sent, repeated = sum(t for t, _ in times), sum(old for _, old in times)
    skipped = sum(s["frames_skipped"] for s in stats)
    bitrates = [s["video_bitrate"] for s in stats if s.get("video_bitrate")]
    workers = [w for w in window.health.get("workers", []) if w.get("loop_load") is not None]
    loops = [w["loop_load"] for w in workers]
    # A loop's load per session it holds (motion-only ones included).
    per_session = [w["loop_load"] / n for w in workers
                   if (n := (w.get("sessions") or 0) + (w.get("motion_sessions") or 0))]
    units = [w["loop_unit"] for w in workers if w.get("loop_unit") is not None]
    total_cpu = sum(window.cpu.values())
    gone = window.unmeasured
    return {
        "sessions": sessions, "size": size, "served": served,
        "refused": sum("refused" in r for r in results),
        "refusals": sorted({r["refused"] for r in results if "refused" in r}),
        "fps_min": round(min(fps), 2) if fps else None,
        "fps_median": round(float(np.median(fps)), 2) if fps else None,
        "fps_below_24": sum(f < 24 for f in fps),
        # Over each whole session, its connection included.
        "fps_min_whole": round(min(fps_whole), 2) if fps_whole else None,
        "window_s": round(window.t1 - window.t0, 1),
        "sessions_measured": len(stats),  # live on the server when the window opened
        "repeated_%": round(100 * repeated / sent, 2) if sent else None,
        "skipped_%": round(100 * skipped / sent, 2) if sent else None,
        # The server's percentiles cover each session's latest RECENT_FRAMES frames: where
        # a session sent fewer in the window, they include its connection's start too.
        "pipeline_delay_steady": bool(times) and min(t for t, _ in times) >= RECENT_FRAMES,
        "pipeline_delay_ms_p50": median("pipeline_delay_ms", "p50"),
        "pipeline_delay_ms_p95_median": median("pipeline_delay_ms", "p95"),
        "pipeline_delay_ms_p95_worst": worst("pipeline_delay_ms", "p95"),
        "pipeline_delay_ms_p99_worst": worst("pipeline_delay_ms", "p99"),
        "av_offset_ms_p95_worst": worst("av_offset_ms", "p95"),
        # How late the counting peers sent their speech (a busy peer sends late, then in a
        # burst): the server's delay above includes what its jitter buffer held of that.
        "peer_late_ms_p95_median": round(float(np.median(late_p95)), 1) if late else None,
        "peer_late_ms_p95_worst": round(max(late_p95), 1) if late else None,
        "peer_late_ms_p99_worst": round(max(late_p99), 1) if late else None,
        "server_cpu_cores": None if gone else round(total_cpu, 2),
        "cpu_per_session": round(total_cpu / served, 3) if served and not gone else None,
        "cpu_by_process": {k: round(v, 2) for k, v in window.cpu.items()},
        # The peers' own CPU over the window (this process's included): with the peers on
        # cores of their own, near their count it says they, not the server, were the limit.
        "client_cpu_cores": round(window.peers, 2),
        "host_cores": window.host,
        "gpu_util_%": round(float(np.mean(window.gpu)), 1) if window.gpu else None,
        # The workers' event loops at the end (share of their thread's time), and the
        # rate the sessions' video was encoded at (what their viewers' REMB allowed).
        "worker_loop_load_max": round(max(loops), 2) if loops else None,
        "loop_load_per_session_median": round(float(np.median(per_session)), 4)
        if per_session else None,
        # What admission charges by then: cores per 256x256 session (the front door's host
        # model) and the median worker's loop share per 256x256 session.
        "learnt": {"cores_per_session": window.health.get("cores_per_session"),
                   "loop_unit_median": round(float(np.median(units)), 4) if units else None},
        # What the server measured at start-up (``server.client.calibration``), before any offer.
        "calibration": window.health.get("calibration"),
        "video_kbps_median": round(float(np.median(bitrates)) / 1000) if bitrates else None,
        "batch_mean": round(delta("sonic_engine_batch_size_sum") / batches, 2)
        if batches else None,
        "scheduler_drops": {k.split("/", 1)[1]: delta(k) for k in after
                            if k.startswith("sonic_scheduler_frames_dropped_total/")
                            and delta(k)},
        "admissions": {k.split("/", 1)[1]: delta(k) for k in after
                       if k.startswith("sonic_admissions_total/") and delta(k)},
        # Each session measured: what its peer received and the server's figures for it.
        "per_session": [_session_row(s, fps_by_id.get(s["session_id"])) for s in stats],
        "restarts": {kind: delta(f"sonic_{kind}_restarts_total")
                     for kind in ("worker", "inference")
                     if delta(f"sonic_{kind}_restarts_total")},
        # Kinds of process that died while the CPU was measured: their figures are not.
        "cpu_unmeasured": gone,
    }


@contextlib.contextmanager
def started_server(args: list[str], cpus: set[int] | None = None, log_to: Path | None = None
                   ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m server`` on a free loopback port (on ``cpus``, if given), ready to
    serve: its URL and process. Stopped on leaving. Its output goes to ``log_to`` if given
    (kept), else to a temporary file."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(log_to, "w+b") if log_to else tempfile.TemporaryFile()  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, "-m", "server", "--port", str(port), "--ice-host", "127.0.0.1",
         # Every peer here comes from one address, as every client does through a proxy.
         "--set", "http.max_offers_in_flight=1024", *args],
        cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                _get(f"{url}/healthz")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError("server failed to start:\n"
                                       + log.read().decode()[-2000:]) from None
                time.sleep(0.2)
        yield url, server
    finally:
        server.terminate()
        server.wait(30)
        log.close()


_SPIN = """import sys, time
share = float(sys.argv[1])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.01 * share:
        pass
    time.sleep(0.01 * (1 - share))
"""


@contextlib.contextmanager
def busy_neighbours(shares: list[float]) -> Iterator[None]:
    """Processes spinning beside the server, as other tenants of a shared machine do."""
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN, str(s)]) for s in shares]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def _point(spec: str) -> tuple[int, int, bool]:
    """``512x64``: 64 sessions at 512x512; ``motionx256``: 256 motion-only ones (at 256)."""
    kind, _, count = spec.partition("x")
    try:
        return (256, int(count), True) if kind == "motion" else (int(kind), int(count), False)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: give SIZExN or motionxN") from None


def _wait_until_idle(url: str, timeout: float = 60.0) -> None:
    """Until the last point's sessions have all ended on the server."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _live(_get(f"{url}/healthz")):
            return
        time.sleep(0.5)
    raise RuntimeError(f"sessions still live on the server after {timeout:.0f} s")


def run_points(points: list[tuple[int, int, bool]], seconds: float, wav: Path,
               extra: list[str], client_processes: int, decoded: int,
               server_cpus: set[int] | None = None, logs: Path | None = None
               ) -> Iterator[dict[str, Any]]:
    """Each point on one server, started once (its default frame size the first point's):
    a GPU runtime compiles for minutes at start-up, which a fresh server per point would
    pay every time. A point starts once the last one's sessions have ended."""
    names = [f"{'motion' if motion else size}x{n}" for size, n, motion in points]
    most = max(4, *(n for _, n, _ in points))
    log = None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"server-{'-'.join(names)}.log"
    with started_server(["--set", f"video.size={points[0][0]}",
                         "--set", f"session.max_sessions={most}",
                         "--set", f"session.max_motion_sessions={most}", *extra],
                        server_cpus, log) as (url, server):
        for name, (size, n, motion) in zip(names, points, strict=True):
            _wait_until_idle(url)
            row = asyncio.run(_measure(url, server.pid, wav, n, seconds, size,
                                       client_processes or math.ceil(n / 8),
                                       0 if motion else decoded, motion))
            yield {"point": name, **row}


def _print_row(row: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
        return
    print(f"{row['sessions']:>8} {row['size']:>5} {row['fps_min']!s:>8} "
          f"{row['fps_median']!s:>8} {row['server_cpu_cores']!s:>6} "
          f"{row['pipeline_delay_ms_p50']!s:>10} {row['pipeline_delay_ms_p95_worst']!s:>10} "
          f"{row['av_offset_ms_p95_worst']!s:>8} {row['repeated_%']!s:>9}", flush=True)
    print("  ", json.dumps({k: row[k] for k in (
        "served", "refused", "refusals", "fps_below_24", "cpu_per_session",
        "cpu_by_process", "client_cpu_cores", "host_cores", "learnt", "calibration",
        "gpu_util_%", "batch_mean", "scheduler_drops", "admissions")}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4],
                        help="session counts, each on a fresh server")
    parser.add_argument("--points", type=_point, nargs="+", metavar="SIZExN",
                        help="instead: runs such as 512x64 or motionx256, one after another "
                             "on one server started once")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--client-processes", type=int, default=0,
                        help="processes the counting peers run in (0: one per 8 sessions)")
    parser.add_argument("--decoded", type=int, default=1,
                        help="peers that decode their video (the rest count frames)")
    parser.add_argument("--wav", type=Path,
                        help="speech to send (default: espeak-ng's, where it is installed)")
    parser.add_argument("--json", action="store_true", help="print JSON lines only")
    parser.add_argument("--motion-only", action="store_true",
                        help="motion-only sessions: coefficients on a data channel, no video")
    parser.add_argument("--server-cpus", type=_cpus, metavar="LIST",
                        help="cores the server runs on, e.g. 0-15 (default: all)")
    parser.add_argument("--client-cpus", type=_cpus, metavar="LIST",
                        help="cores the peers run on, e.g. 16-31: on a larger machine, the "
                             "server measured as if its peers were elsewhere")
    parser.add_argument("--busy", type=float, nargs="*", default=[],
                        help="share of a core each of these neighbour processes spins "
                             "beside the server, as on a shared machine")
    parser.add_argument("--server-logs", type=Path, metavar="DIR",
                        help="keep each run's server output here")
    parser.add_argument("--client-of", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("server_args", nargs="*", help="extra server arguments after --")
    args = parser.parse_args()
    pin_host_addresses(["127.0.0.1"])
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)  # the client processes inherit it
    if args.client_of:  # one of the client processes of a run
        url, wav, n, size, seconds, motion = args.client_of
        packets = EncodedSpeech.encode_wav(wav)
        print("ready", flush=True)
        if not sys.stdin.readline():  # no "go": the run was abandoned
            return
        print(json.dumps(asyncio.run(_clients(url, wav, int(n), int(size), float(seconds),
                                              motion == "1", packets))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.wav is not None:
            import wave

            with wave.open(str(args.wav)) as w:
                assert w.getframerate() == 16000 and w.getsampwidth() == 2, args.wav
                speech = np.frombuffer(w.readframes(w.getnframes()), np.int16)
        else:
            speech = conversation()
        wav = write_wav(Path(tmp) / "speech.wav",
                        np.tile(speech, int(np.ceil(args.seconds * 16000 / len(speech))) + 1))
        if not args.json:
            print(f"{'sessions':>8} {'size':>5} {'fps min':>8} {'fps med':>8} {'cpu':>6} "
                  f"{'delay p50':>10} {'delay p95':>10} {'A/V p95':>8} {'repeat %':>9}")
        # --points share one server; --sessions get a fresh one each.
        runs = [args.points] if args.points else \
            [[(args.size, n, args.motion_only)] for n in args.sessions]
        with busy_neighbours(args.busy):
            for points in runs:
                for row in run_points(points, args.seconds, wav, args.server_args,
                                      args.client_processes, args.decoded,
                                      args.server_cpus, args.server_logs):
                    _print_row(row, args.json)


if __name__ == "__main__":
    main()
