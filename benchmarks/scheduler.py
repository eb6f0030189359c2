"""Scheduler benchmark: the shared scheduler and a real engine under many simulated sessions,
on an event loop that is busy with other work, as a loaded media server's is.

Each simulated session submits one frame every 40 ms (staggered phases) with the deadline a
live session gives it; the loop is kept busy ``--loop-load`` of the time in slices of
``--loop-slice-ms`` (media work: peers, packetisation, encoder hand-off). It reports the
frames answered on time, dropped and late, the batch sizes and engine time per batch, and
how busy the engine was, with the engine in a process of its own or on a thread of the
sessions' process. No WebRTC: this isolates the scheduler and the engine boundary.

    python -m benchmarks.scheduler --runtime torch-cuda --size 512 --sessions 64 256 \\
        --loop-load 0 0.5 --engine process thread --data .gpudata
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
from inference.process.standalone import EngineProcess
from inference.runtimes import create_engine
from inference.service import Inference, InlineInference

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


async def _run(args: argparse.Namespace, inference: Inference, slot: int, sessions: int,
               load: float, windows: np.ndarray, batches: list[tuple[int, float]]
               ) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    for batch in sorted({1, 2, inference.max_batch}):
        await inference.warm_up([FrameInput(slot, windows[0], np.ones(2, np.float32),
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
            future = inference.submit(FrameInput(slot, mel, np.ones(2, np.float32),
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
    total = sum(outcomes.values())
    sizes = [n for n, _ in batches]
    return {"on_time_%": 100 * outcomes["on_time"] / max(total, 1),
            "dropped_%": 100 * outcomes["dropped"] / max(total, 1),
            "late_%": 100 * outcomes["late"] / max(total, 1),
            "batch_median": statistics.median(sizes) if sizes else 0,
            "batch_ms": 1000 * statistics.median(s for _, s in batches) if batches else 0,
            "engine_busy_%": 100 * sum(s for _, s in batches) / wall}


async def _bench(args: argparse.Namespace, portrait: PreparedPortrait, windows: np.ndarray
                 ) -> None:
    engine = None
    print("where     switch_ms sessions loop_load  on_time%  dropped%  late%  batch_med  "
          "batch_ms  engine_busy%")
    for where in args.engine:
        for switch_ms in args.switch_interval_ms:
            sys.setswitchinterval(switch_ms / 1000)
            batches: list[tuple[int, float]] = []
            common = dict(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                          max_pending=4 * max(args.sessions) + 8,
                          on_batch=lambda n, s, b=batches: b.append((n, s)))
            inference: Inference
            if where == "process":
                inference = EngineProcess(args.runtime, MANIFEST, max_side=args.size, **common)
            else:
                if engine is None:
                    engine = create_engine(args.runtime, MANIFEST)
                inference = InlineInference(engine, **common)
            await inference.start()
            slot = await inference.prepare(portrait)
            for sessions in args.sessions:
                for load in args.loop_load:
                    r = await _run(args, inference, slot, sessions, load, windows, batches)
                    print(f"{where:9s} {switch_ms:9.2f} {sessions:8d} {load:9.2f} "
                          f"{r['on_time_%']:9.1f} {r['dropped_%']:9.1f} {r['late_%']:6.1f} "
                          f"{r['batch_median']:10.0f} {r['batch_ms']:9.2f} "
                          f"{r['engine_busy_%']:13.1f}", flush=True)
            inference.release(slot)
            await inference.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default="onnxruntime")
    parser.add_argument("--engine", nargs="+", choices=("process", "thread"),
                        default=["process", "thread"],
                        help="the engine in a process of its own, or on a thread of this one")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--sessions", type=int, nargs="+", default=[4])
    parser.add_argument("--loop-load", type=float, nargs="+", default=[0.0, 0.5])
    parser.add_argument("--loop-slice-ms", type=float, default=5.0)
    parser.add_argument("--max-batch", type=int, default=0, help="0: the engine's choice")
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--data", type=Path, help="precomputed windows and portraits")
    parser.add_argument("--switch-interval-ms", type=float, nargs="+",
                        default=[1000 * sys.getswitchinterval()],
                        help="the GIL's switch interval (sys.setswitchinterval)")
    args = parser.parse_args()
    portrait = _portrait(args.size, args.data)
    if args.data is not None:
        windows = np.load(args.data / "windows.npy").astype(np.float32)
    else:
        from inference.engine import Manifest
        from inference.features import log_mel
        from inference.tts import conversation

        spec = Manifest.load(MANIFEST).features
        mel = log_mel(conversation().astype(np.float32) / 32768, spec)
        windows = np.stack([mel[i:i + 16] for i in range(0, len(mel) - 16, 4)])
    print(f"runtime {args.runtime}, {args.size}x{args.size}, {args.seconds:g} s each, "
          f"deadline {1000 * DEADLINE_S:.0f} ms after submit")
    asyncio.run(_bench(args, portrait, windows))


if __name__ == "__main__":
    main()
