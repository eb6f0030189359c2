"""Engine benchmark: batch latency and throughput of one runtime, by frame size and batch.

Runs the shipped model on the default avatar with real speech features, back to back,
and prints p50/p99 batch latency, frames per second, and how many 25 fps sessions that
batch size sustains with its p99 inside the latency budget.

    python -m benchmarks.engine --runtime onnxruntime --sizes 256 512 --batches 1 2 4 8

With ``--motion`` it also times ``run_motion`` (the coefficients alone, which is all a
motion-only session needs), in rows whose size reads "none".
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.gpu import speech_windows
from inference.engine import FrameInput
from inference.images import load_default_avatar
from inference.portrait import prepare_portrait
from inference.runtimes import create_engine
from server.config import REPO_ROOT


def measure(engine, slot: int, batch: int, seconds: float, windows,  # type: ignore[no-untyped-def]
            picture: bool = True) -> dict[str, float]:
    inputs = [FrameInput(slot=slot, mel=windows[i % len(windows)],
                         knobs=np.ones(2, np.float32),
                         clock=np.array([i / 25, 7.0], np.float32)) for i in range(batch)]
    run = engine.run if picture else engine.run_motion
    for _ in range(3):
        run(inputs)
    latencies = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(latencies) < 10:
        start = time.perf_counter()
        run(inputs)
        latencies.append(time.perf_counter() - start)
    lat = np.array(latencies)
    return {"p50_ms": float(np.percentile(lat, 50) * 1000),
            "p99_ms": float(np.percentile(lat, 99) * 1000),
            "fps": float(batch / np.median(lat))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default="onnxruntime")
    parser.add_argument("--manifest", default=str(REPO_ROOT / "engines" / "sonic-lite.json"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--budget-ms", type=float, default=20.0,
                        help="p99 batch latency a batch size must meet to count sessions")
    parser.add_argument("--motion", action="store_true",
                        help="also time the coefficients alone (motion-only sessions)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    engine = create_engine(args.runtime, args.manifest)
    windows = list(speech_windows(engine.manifest, 64))
    image = load_default_avatar()
    if not args.json:
        print(f"runtime {args.runtime}")
        print(f"{'size':>5} {'batch':>5} {'p50 ms':>8} {'p99 ms':>8} {'frames/s':>9} "
              f"{'sessions@25':>11}")
    shapes = [(size, True) for size in args.sizes] + ([(args.sizes[0], False)]
                                                      if args.motion else [])
    for size, picture in shapes:
        slot = engine.prepare(prepare_portrait(image, size=size))
        for batch in args.batches:
            row = measure(engine, slot, batch, args.seconds, windows, picture)
            sessions = int(row["fps"] // 25) if row["p99_ms"] <= args.budget_ms else 0
            shown = size if picture else "none"
            if args.json:
                print(json.dumps({"runtime": args.runtime, "size": shown, "batch": batch,
                                  **row, "sessions_at_25fps": sessions}), flush=True)
            else:
                print(f"{shown:>5} {batch:>5} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} "
                      f"{row['fps']:>9.1f} {sessions:>11}", flush=True)
        engine.release(slot)


if __name__ == "__main__":
    main()
