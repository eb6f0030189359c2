"""Scheduler benchmark: the shared scheduler and a real engine under many simulated sessions,
on an event loop that is busy with other work, as a loaded media server's is.

Each simulated session submits one frame every 40 ms (staggered phases) with the deadline a
live session gives it; the loop is kept busy ``--loop-load`` of the time in slices of
``--loop-slice-ms`` (media work: peers, packetisation, encoder hand-off). It reports the
frames answered on time, dropped and late, the batch sizes, and how busy the engine was,
for each number of batches allowed in flight. No WebRTC: this isolates the scheduler.

    python -m benchmarks.scheduler --runtime torch-cuda --size 512 --sessions 64 256 \\
        --loop-load 0 0.5 --in-flight 1 2 --data .gpudata
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from inference.engine import FrameInput, PreparedPortrait
from inference.runtimes import create_engine
from inference.scheduler import Scheduler

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "engines" / "sonic-lite.json"
#: Engine time a frame may take after its audio is complete (the live default: 130 ms of
#: pipeline delay less the 85 ms the features need before a frame can start).
DEADLINE_S = 0.045


def _portrait(size: int, data: Path | None) -> PreparedPortrait:
    if data is not None:
        return PreparedPortrait(np.load(data / f"portrait_{size}.npy"),
                                np.load(data / f"geometry_{size}.npy"))
    from inference.images import load_default_avatar
    from inference.portrait import prepare_portrait

    return prepare_portrait(load_default_avatar(), size=size)


async def _run(args: argparse.Namespace, engine, slot: int, sessions: int, load: float,  # type: ignore[no-untyped-def]
               in_flight: int, windows: np.ndarray) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    batches: list[tuple[int, float]] = []
    drops: list[str] = []
    scheduler = Scheduler(engine, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                          max_pending=4 * sessions + 8, max_in_flight=in_flight,
                          on_batch=lambda n, s: batches.append((n, s)), on_drop=drops.append)
    await scheduler.start()
    for batch in sorted({1, 2, args.max_batch}):
        await scheduler.warm_up([FrameInput(slot, windows[0], np.ones(2, np.float32),
                                            np.zeros(2, np.float32))] * batch)
    batches.clear()
    outcomes = {"on_time": 0, "late": 0, "dropped": 0}
    stop_at = loop.time() + args.seconds

    def record(future: asyncio.Future, deadline: float) -> None:  # type: ignore[type-arg]
        kind = ("dropped" if future.result() is None
                else "on_time" if loop.time() <= deadline else "late")
        outcomes[kind] += 1

    async def session(k: int) -> None:
        next_at = loop.time() + 0.04 * k / sessions
        i = 0
        while next_at < stop_at:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            deadline = next_at + DEADLINE_S
            mel = windows[(i + k) % len(windows)]
            future = scheduler.submit(FrameInput(slot, mel, np.ones(2, np.float32),
                                                 np.array([i * 0.04, k], np.float32)), deadline)
            future.add_done_callback(functools.partial(record, deadline=deadline))
            next_at += 0.04
            i += 1

    async def busy() -> None:
        slice_s = args.loop_slice_ms / 1000
        while loop.time() < stop_at:
            time.sleep(slice_s)  # blocks the loop, as synchronous media work does
            await asyncio.sleep(slice_s * (1 - load) / load)

    began = time.perf_counter()
    tasks = [asyncio.create_task(session(k)) for k in range(sessions)]
    if load > 0:
        tasks.append(asyncio.create_task(busy()))
    await asyncio.gather(*tasks)
    await asyncio.sleep(0.2)
    wall = time.perf_counter() - began
    await scheduler.stop()
    total = sum(outcomes.values())
    sizes = [n for n, _ in batches]
    return {"sessions": sessions, "loop_load": load, "in_flight": in_flight,
            "batch1_ms": 1000 * scheduler.estimate.seconds(args.size, 1),
            "on_time_%": 100 * outcomes["on_time"] / max(total, 1),
            "dropped_%": 100 * outcomes["dropped"] / max(total, 1),
            "late_%": 100 * outcomes["late"] / max(total, 1),
            "batch_median": statistics.median(sizes) if sizes else 0,
            "engine_busy_%": 100 * sum(s for _, s in batches) / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default="onnxruntime")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--sessions", type=int, nargs="+", default=[4])
    parser.add_argument("--loop-load", type=float, nargs="+", default=[0.0, 0.5])
    parser.add_argument("--loop-slice-ms", type=float, default=5.0)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--data", type=Path, help="precomputed windows and portraits")
    parser.add_argument("--switch-interval-ms", type=float, nargs="+",
                        default=[1000 * sys.getswitchinterval()],
                        help="the GIL's switch interval (sys.setswitchinterval)")
    args = parser.parse_args()
    engine = create_engine(args.runtime, MANIFEST)
    slot = engine.prepare(_portrait(args.size, args.data))
    if args.data is not None:
        windows = np.load(args.data / "windows.npy").astype(np.float32)
    else:
        from inference.features import log_mel
        from inference.tts import conversation

        mel = log_mel(conversation().astype(np.float32) / 32768, engine.manifest.features)
        windows = np.stack([mel[i:i + 16] for i in range(0, len(mel) - 16, 4)])
    print(f"runtime {args.runtime}, {args.size}x{args.size}, max batch {args.max_batch}, "
          f"{args.seconds:g} s each, deadline {1000 * DEADLINE_S:.0f} ms after submit")
    print("switch_ms sessions loop_load in_flight  on_time%  dropped%  late%  batch_med  "
          "engine_busy%  batch1_ms")
    for switch_ms in args.switch_interval_ms:
        sys.setswitchinterval(switch_ms / 1000)
        for sessions in args.sessions:
            for load in args.loop_load:
                for in_flight in args.in_flight:
                    r = asyncio.run(_run(args, engine, slot, sessions, load, in_flight,
                                         windows))
                    print(f"{switch_ms:9.2f} {r['sessions']:8d} {r['loop_load']:9.2f} "
                          f"{r['in_flight']:9d} {r['on_time_%']:9.1f} {r['dropped_%']:9.1f} "
                          f"{r['late_%']:6.1f} {r['batch_median']:10.0f} "
                          f"{r['engine_busy_%']:13.1f} {r['batch1_ms']:10.2f}", flush=True)


if __name__ == "__main__":
    main()
