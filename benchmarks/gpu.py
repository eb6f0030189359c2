"""GPU engine benchmark: frames/s and batch latency by batch size, against a per-frame baseline.

For each runtime and frame size it runs batches of real speech windows over several slots
of the default avatar back to back and reports p50/p99 batch latency and frames/s by batch
size. The BASELINE is what a naive peer does: plain PyTorch eager FP32 on the GPU, one
call per session per frame (the portrait already on the GPU, the frame copied back with
``.cpu()``). From these it derives the 25 fps sessions one GPU sustains with the p99 batch
latency under the budget, and the ratio to the baseline.

    python -m benchmarks.gpu --runtimes torch-cuda onnxruntime --sizes 256 512 \
        --batches 1 2 4 8 16 32 64 128

A runtime may carry options after a colon: ``torch-cuda:fp32``, ``torch-cuda:compile``,
``torch-cuda:amp`` (autocast), ``torch-cuda:eager`` (no CUDA graphs), ``torch-cuda:chunk=32``
(copy-back overlap chunk), ``torch-cuda:i420`` (frames in I420, as the server takes them).
Timing: ``Engine.run`` returns only once its frames are in host memory (it synchronises),
so a host clock around it measures the whole batch; the baseline synchronises through
``.cpu()``. ``--save-data DIR`` writes the speech windows and prepared portraits as .npy
so a machine without espeak-ng or librosa can run with ``--data DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from inference.engine import FrameInput, Manifest, PreparedPortrait
from inference.runtimes import create_engine

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "engines" / "sonic-lite.json"


# ---------------------------------------------------------------------- data
def speech_windows(manifest: Manifest, count: int) -> np.ndarray:
    """(count, window, n_mels) log-mel windows spread over ~12 s of espeak-ng speech."""
    from inference.features import log_mel
    from inference.tts import SpeechUnavailable, conversation

    try:
        samples = conversation().astype(np.float32) / 32768
    except SpeechUnavailable:
        samples = np.random.default_rng(0).normal(0, 0.1, 16000 * 12).astype(np.float32)
    mel = log_mel(samples, manifest.features)
    starts = np.linspace(0, len(mel) - manifest.window_frames, count).astype(int)
    return np.stack([mel[s : s + manifest.window_frames] for s in starts]).astype(np.float32)


def portrait(size: int) -> PreparedPortrait:
    from inference.images import load_default_avatar
    from inference.portrait import prepare_portrait

    return prepare_portrait(load_default_avatar(), size=size)


def save_data(out: Path, manifest: Manifest, sizes: list[int]) -> None:
    from inference.tts import conversation

    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "windows.npy", speech_windows(manifest, 256))
    np.save(out / "speech.npy", conversation())  # int16 PCM at 16 kHz, for the GPU tests
    for size in sizes:
        p = portrait(size)
        np.save(out / f"portrait_{size}.npy", p.image)
        np.save(out / f"geometry_{size}.npy", p.geometry)
    print(f"wrote windows and portraits {sizes} to {out}")


def load_data(data: Path | None, manifest: Manifest, sizes: list[int]
              ) -> tuple[np.ndarray, dict[int, PreparedPortrait]]:
    if data is None:
        return speech_windows(manifest, 256), {s: portrait(s) for s in sizes}
    portraits = {s: PreparedPortrait(np.load(data / f"portrait_{s}.npy"),
                                     np.load(data / f"geometry_{s}.npy")) for s in sizes}
    return np.load(data / "windows.npy"), portraits


# ---------------------------------------------------------------------- runs
def frames_for(slots: list[int], batch: int, windows: np.ndarray, offset: int
               ) -> list[FrameInput]:
    return [FrameInput(slot=slots[i % len(slots)],
                       mel=windows[(offset + i) % len(windows)],
                       knobs=np.ones(2, np.float32),
                       clock=np.array([(offset + i) / 25, 0.37 * i], np.float32))
            for i in range(batch)]


def summarise(latencies: list[float], batch: int) -> dict[str, float]:
    lat = np.array(latencies)
    return {"p50_ms": float(np.percentile(lat, 50) * 1e3),
            "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "mean_ms": float(lat.mean() * 1e3),
            # Sustained rate: batches back to back, so the mean (not the median) counts.
            "fps": float(batch / lat.mean()),
            "runs": len(latencies)}


def measure_engine(engine: Any, slots: list[int], batch: int, windows: np.ndarray,
                   seconds: float, min_runs: int, picture: bool = True) -> dict[str, float]:
    """Batches of ``run`` (or ``run_motion``, without ``picture``) back to back."""
    run = engine.run if picture else engine.run_motion
    inputs = [frames_for(slots, batch, windows, 7 * j) for j in range(4)]
    for j in range(3):
        run(inputs[j % 4])
    latencies: list[float] = []
    end = time.perf_counter() + seconds
    j = 0
    while time.perf_counter() < end or len(latencies) < min_runs:
        start = time.perf_counter()
        out = run(inputs[j % 4])
        latencies.append(time.perf_counter() - start)
        del out  # the pinned buffer goes back to the host allocator's cache
        j += 1
    row = summarise(latencies, batch)
    if picture and getattr(engine, "collect_timings", None) is not None \
            and hasattr(engine, "last_timings"):
        engine.collect_timings = True
        engine.run(inputs[0])
        row.update({f"gpu_{k}": v for k, v in engine.last_timings.items()})
        engine.collect_timings = False
    return row


def measure_baseline(size: int, p: PreparedPortrait, windows: np.ndarray,
                     seconds: float) -> dict[str, float]:
    """Plain eager FP32 torch, one call per frame, as a per-session peer would do it."""
    import torch

    from inference.model.export import build_model

    model = build_model().cuda().eval()
    chw = torch.from_numpy(p.image).cuda().permute(2, 0, 1).float().div(255.0)[None]
    geometry = torch.from_numpy(np.asarray(p.geometry, np.float32)).cuda()[None]

    def one(i: int) -> np.ndarray:
        with torch.no_grad():
            mel = torch.from_numpy(windows[i % len(windows)]).cuda()[None]
            knobs = torch.ones((1, 2), device="cuda")
            clock = torch.tensor([[i / 25, 0.0]], device="cuda")
            frame, _ = model(mel, chw, geometry, knobs, clock)
            return frame.cpu().numpy()  # synchronises

    for i in range(5):
        one(i)
    latencies: list[float] = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end or len(latencies) < 20:
        start = time.perf_counter()
        one(i)
        latencies.append(time.perf_counter() - start)
        i += 1
    return summarise(latencies, 1)


def parse_runtime(spec: str) -> tuple[str, dict[str, Any]]:
    """``name[:opt,opt=value]`` to (runtime, constructor options)."""
    name, _, rest = spec.partition(":")
    opts: dict[str, Any] = {}
    if name == "onnxruntime":
        opts["intra_op_threads"] = os.cpu_count() or 1
    for opt in filter(None, rest.split(",")):
        key, _, value = opt.partition("=")
        if key in ("fp32", "fp16", "amp"):
            opts["precision"] = key
        elif key == "compile":
            opts["compile"] = True
        elif key == "eager":
            opts["cuda_graphs"] = False
        elif key == "chunk":
            opts["max_chunk"] = int(value)
        elif key == "int8":
            opts["precision"] = "int8"
        elif key == "i420":
            opts["pixels"] = "i420"
        else:
            raise SystemExit(f"unknown runtime option {opt!r} in {spec!r}")
    return name, opts


def sessions(rows: list[dict[str, Any]], budget_ms: float, fps: int) -> tuple[int, int]:
    """(25 fps sessions, batch size giving them) with the p99 batch latency in budget."""
    best = (0, 0)
    for r in rows:
        if r["p99_ms"] <= budget_ms:
            best = max(best, (int(r["fps"] // fps), r["batch"]))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtimes", nargs="+", default=["torch-cuda", "onnxruntime"])
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--batches", type=int, nargs="+",
                        default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--seconds", type=float, default=1.5, help="per batch size")
    parser.add_argument("--min-runs", type=int, default=20)
    parser.add_argument("--slots", type=int, default=32, help="distinct sessions' portraits")
    parser.add_argument("--budget-ms", type=float, default=20.0)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--motion", action="store_true",
                        help="also time the coefficients alone (motion-only sessions), in "
                             "rows whose size reads 'none'")
    parser.add_argument("--data", type=Path, help="precomputed windows and portraits")
    parser.add_argument("--save-data", type=Path, help="write them here and exit")
    parser.add_argument("--out", type=Path, help="also write JSON lines here")
    args = parser.parse_args()

    manifest = Manifest.load(args.manifest)
    if args.save_data:
        save_data(args.save_data, manifest, args.sizes)
        return
    windows, portraits = load_data(args.data, manifest, args.sizes)
    out = args.out.open("w") if args.out else None
    results: list[dict[str, Any]] = []

    def emit(row: dict[str, Any]) -> None:
        results.append(row)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    except ImportError:
        gpu = "no torch"
    print(f"GPU: {gpu}; manifest {manifest.name}; budget p99 <= {args.budget_ms} ms", flush=True)

    if not args.no_baseline:
        for size in args.sizes:
            row = measure_baseline(size, portraits[size], windows, args.seconds)
            emit({"runtime": "baseline-eager-fp32", "size": size, "batch": 1, **row})
            print(f"baseline {size}: p50 {row['p50_ms']:.2f} ms p99 {row['p99_ms']:.2f} ms "
                  f"{row['fps']:.0f} frames/s", flush=True)

    for spec in args.runtimes:
        name, opts = parse_runtime(spec)
        start = time.perf_counter()
        engine = create_engine(name, args.manifest, **opts)
        for size in args.sizes:
            slots = [engine.prepare(portraits[size]) for _ in range(args.slots)]
            if hasattr(engine, "capture"):
                t0 = time.perf_counter()
                engine.capture(size)
                print(f"{spec} {size}: captured in {time.perf_counter() - t0:.1f} s", flush=True)
            for batch in args.batches:
                row = measure_engine(engine, slots, batch, windows, args.seconds, args.min_runs)
                emit({"runtime": spec, "size": size, "batch": batch, **row})
                gpu_ms = row.get("gpu_compute_and_copy_ms")
                print(f"{spec:>22} {size:>4} {batch:>4}  p50 {row['p50_ms']:8.2f}  "
                      f"p99 {row['p99_ms']:8.2f}  {row['fps']:9.0f} f/s"
                      + (f"  (gpu {gpu_ms:.2f} ms)" if gpu_ms is not None else ""), flush=True)
            if args.motion and size == args.sizes[0]:
                for batch in args.batches:
                    row = measure_engine(engine, slots, batch, windows, args.seconds,
                                         args.min_runs, picture=False)
                    emit({"runtime": spec, "size": "none", "batch": batch, **row})
                    print(f"{spec:>22} none {batch:>4}  p50 {row['p50_ms']:8.2f}  "
                          f"p99 {row['p99_ms']:8.2f}  {row['fps']:9.0f} f/s", flush=True)
            for slot in slots:
                engine.release(slot)
        print(f"{spec}: {time.perf_counter() - start:.0f} s", flush=True)
        del engine

    print(f"\n{'runtime':>24} {'size':>4} {'batch':>5} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'frames/s':>9}")
    for r in results:
        print(f"{r['runtime']:>24} {r['size']:>4} {r['batch']:>5} {r['p50_ms']:>8.2f} "
              f"{r['p99_ms']:>8.2f} {r['fps']:>9.0f}")
    print(f"\nsessions at {manifest.fps} fps per GPU, p99 batch latency <= {args.budget_ms} ms")
    for size in args.sizes:
        base = [r for r in results if r["runtime"] == "baseline-eager-fp32" and r["size"] == size]
        base_sessions = sessions(base, args.budget_ms, manifest.fps)[0] if base else 0
        base_fps = base[0]["fps"] if base else float("nan")
        for spec in ["baseline-eager-fp32", *args.runtimes]:
            rows = [r for r in results if r["runtime"] == spec and r["size"] == size]
            if not rows:
                continue
            n, b = sessions(rows, args.budget_ms, manifest.fps)
            best_fps = max(r["fps"] for r in rows if r["p99_ms"] <= args.budget_ms) \
                if n else 0.0
            ratio = f"{n / base_sessions:.1f}x" if base_sessions else "n/a"
            print(f"{spec:>24} {size:>4}: {n:>5} sessions (batch {b}), "
                  f"{best_fps:.0f} frames/s = {best_fps / base_fps:.1f}x baseline frames/s, "
                  f"{ratio} baseline sessions")
    if out:
        out.close()


if __name__ == "__main__":
    main()
