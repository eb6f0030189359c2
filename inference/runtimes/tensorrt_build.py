"""Build TensorRT engines ahead of serving (never on a request), and calibrate INT8.

    python -m inference.runtimes.tensorrt_build build --precision fp16 --sizes 256 512
    python -m inference.runtimes.tensorrt_build build --precision int8 --sizes 256 512

UNVERIFIED where it needs TensorRT (see :mod:`inference.runtimes.tensorrt`). What IS
verified (on the CPU, with onnxruntime): the slot-gather ONNX wrapper and the INT8
calibration/Q-DQ insertion (``calibrate``), whose accuracy check runs the quantised graph
in onnxruntime. A timing cache per GPU and TensorRT version makes rebuilds fast.

INT8 uses explicit quantization (Q/DQ nodes; the implicit-calibrator API is deprecated in
TensorRT 10): activation ranges come from mel windows of varied voices, levels and noise
(a clean read-speech set makes the mouth jitter on noisy input), and a tensor is quantised
only if the quantised graph keeps the coefficients within ``INT8_COEFF_TOL`` on that set.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inference.engine import Manifest
from inference.runtimes.tensorrt import (
    CACHE_DIR,
    DEFAULT_BATCH_SIZES,
    PRECISIONS,
    engine_key,
    engine_path,
    gpu_identity,
    import_tensorrt,
    model_bytes,
)

DEFAULT_MANIFEST = Path(__file__).resolve().parents[2] / "engines" / "sonic-lite.json"
#: Largest coefficient change INT8 may cause on the calibration set (mouth jitter bound).
INT8_COEFF_TOL = 0.02


def slot_gather_onnx(onnx_bytes: bytes) -> bytes:
    """Wrap the shipped graph so portraits and geometry are gathered from banks by slot."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load_from_string(onnx_bytes)
    graph = model.graph
    inputs = {i.name: i for i in graph.input}
    for name in ("portrait", "geometry"):
        if name not in inputs:
            raise ValueError(f"ONNX has no input {name!r}")
    new_inputs = []
    for i in graph.input:
        if i.name in ("portrait", "geometry"):
            bank = onnx.ValueInfoProto()
            bank.CopyFrom(i)
            bank.name = f"{i.name}_bank"
            bank.type.tensor_type.shape.dim[0].dim_param = "slots"
            new_inputs.append(bank)
        else:
            new_inputs.append(i)
    new_inputs.append(helper.make_tensor_value_info("slot", TensorProto.INT32, ["batch"]))
    del graph.input[:]
    graph.input.extend(new_inputs)
    gathers = [helper.make_node("Gather", [f"{n}_bank", "slot"], [n], axis=0,
                                name=f"slot_gather_{n}") for n in ("portrait", "geometry")]
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(gathers + nodes)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _run_ort(onnx_bytes: bytes, feeds: dict[str, np.ndarray], outputs: list[str]
             ) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


def calibration_windows(manifest: Manifest, seed: int = 0) -> np.ndarray:
    """Mel windows from varied voices, levels and noise (the set INT8 is calibrated on).

    Voices: espeak-ng's English variants, male and female, at three speaking rates, when
    espeak-ng is present (otherwise formant-like harmonic sweeps). Levels from -45 to 0 dBFS
    peak; white, pink and babble noise at 20, 10 and 0 dB SNR; noise and silence alone.
    """
    from inference.features import log_mel
    from inference.tts import SpeechUnavailable, espeak

    rng = np.random.default_rng(seed)
    rate = manifest.features.sample_rate
    text = "The quick brown fox jumps over the lazy dog, then naps in the warm sun."
    clips: list[np.ndarray] = []
    try:
        for voice, wpm in itertools.product(("en-us", "en-gb", "en-us+f3", "en-gb-scotland+f2"),
                                            (120, 170, 220)):
            clips.append(espeak(text, voice=voice, words_per_minute=wpm, rate=rate)
                         .astype(np.float32) / 32768)
    except SpeechUnavailable:
        t = np.arange(rate * 3) / rate
        for f0 in (95.0, 140.0, 210.0):
            pitch = f0 * (1 + 0.1 * np.sin(2 * np.pi * 0.7 * t))
            phase = 2 * np.pi * np.cumsum(pitch) / rate
            env = np.clip(np.sin(2 * np.pi * 3.1 * t), 0, None)
            clips.append((env * sum(np.sin(k * phase) / k for k in range(1, 30)))
                         .astype(np.float32) * 0.1)

    def noise(kind: str, n: int) -> np.ndarray:
        white = rng.normal(0, 1, n)
        if kind == "white":
            return white
        if kind == "pink":
            spectrum = np.fft.rfft(white) / np.sqrt(np.arange(1, n // 2 + 2))
            return np.fft.irfft(spectrum, n)
        others = [clips[int(rng.integers(len(clips)))] for _ in range(4)]
        babble = np.zeros(n)
        for o in others:
            babble[: min(n, len(o))] += o[:n]
        return babble

    signals: list[np.ndarray] = []
    for clip in clips:
        peak = np.abs(clip).max() + 1e-9
        for level_db in (-45.0, -25.0, -12.0, -3.0):
            signals.append(clip / peak * 10 ** (level_db / 20))
        speech = clip / peak * 10 ** (-12 / 20)
        for kind, snr_db in itertools.product(("white", "pink", "babble"), (20.0, 10.0, 0.0)):
            n = noise(kind, len(speech))
            n *= np.sqrt(np.mean(speech**2) / (np.mean(n**2) + 1e-12)) / 10 ** (snr_db / 20)
            signals.append(np.clip(speech + n, -1, 1))
    signals += [noise("white", rate) * 0.01, noise("pink", rate) * 0.05, np.zeros(rate)]
    windows = []
    for s in signals:
        mel = log_mel(s.astype(np.float32), manifest.features)
        for start in rng.integers(0, max(1, len(mel) - manifest.window_frames), 6):
            windows.append(mel[start : start + manifest.window_frames])
    return np.stack(windows).astype(np.float32)


def _calibration_feeds(manifest: Manifest, windows: np.ndarray, size: int,
                       image: np.ndarray | None = None, geometry: np.ndarray | None = None
                       ) -> dict[str, np.ndarray]:
    n = len(windows)
    rng = np.random.default_rng(1)
    if image is None or geometry is None:
        from inference.images import load_default_avatar
        from inference.portrait import prepare_portrait

        p = prepare_portrait(load_default_avatar(), size=size)
        image, geometry = p.image, p.geometry
    chw = (image.transpose(2, 0, 1).astype(np.float32) / 255.0)[None]
    return {
        "mel": windows,
        "portrait": np.repeat(chw, n, axis=0),
        "geometry": np.repeat(np.asarray(geometry, np.float32)[None], n, axis=0),
        "knobs": rng.uniform(0.5, 1.5, (n, len(manifest.knob_names))).astype(np.float32),
        "clock": np.stack([rng.uniform(0, 600, n), rng.uniform(0, 10, n)], 1).astype(np.float32),
    }


def _toposort(nodes: list[Any], available: set[str]) -> list[Any]:
    """Order nodes so every input is produced first (ONNX requires it)."""
    ready, pending, out = set(available) | {""}, list(nodes), []
    while pending:
        rest = []
        for node in pending:
            if all(i in ready for i in node.input):
                out.append(node)
                ready.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise ValueError(f"graph has a cycle or a missing input near {rest[0].name}")
        pending = rest
    return out


def calibrate(manifest: Manifest, size: int = 256, windows: np.ndarray | None = None,
              tol: float = INT8_COEFF_TOL, image: np.ndarray | None = None,
              geometry: np.ndarray | None = None) -> tuple[bytes, dict[str, Any]]:
    """Explicit INT8: insert Q/DQ on activation inputs of Conv/MatMul nodes (per-tensor
    symmetric, amax = 99.99th percentile of |x| over the calibration set),
    keeping only the activations whose quantisation leaves the coefficients within ``tol``
    and the frames within 8 grey levels (mean 1), checked in onnxruntime against FP32 on the
    calibration set. Weights stay FP16 (this model's weights are tiny; its cost is the
    per-pixel warp, which INT8 does not speed up). Returns the Q/DQ ONNX and a report.
    """
    import onnx
    from onnx import helper, numpy_helper

    windows = calibration_windows(manifest) if windows is None else windows
    base = Path(manifest.onnx).read_bytes()
    model = onnx.load_from_string(base)
    feeds = _calibration_feeds(manifest, windows[:256], size, image, geometry)
    initializers = {i.name for i in model.graph.initializer}
    candidates = sorted({n.input[0] for n in model.graph.node
                         if n.op_type in ("Conv", "MatMul") and n.input[0] not in initializers})
    probe = onnx.load_from_string(base)
    probe.graph.output.extend(helper.make_empty_tensor_value_info(c) for c in candidates)
    values = _run_ort(probe.SerializeToString(), feeds, ["coefficients", "frame", *candidates])
    reference, ref_frames = values[0], values[1].astype(np.int16)
    acts = dict(zip(candidates, values[2:], strict=True))

    def quantised(chosen: list[str]) -> onnx.ModelProto:
        q = onnx.load_from_string(base)
        nodes: list[onnx.NodeProto] = []
        for name in chosen:
            amax = float(np.percentile(np.abs(acts[name]), 99.99)) or 1e-8
            scale, zero = f"{name}__scale", f"{name}__zero"
            q.graph.initializer.extend([
                numpy_helper.from_array(np.array(amax / 127.0, np.float32), scale),
                numpy_helper.from_array(np.array(0, np.int8), zero)])
            nodes += [helper.make_node("QuantizeLinear", [name, scale, zero], [f"{name}__q"]),
                      helper.make_node("DequantizeLinear", [f"{name}__q", scale, zero],
                                       [f"{name}__dq"])]
        for node in q.graph.node:
            if node.op_type in ("Conv", "MatMul") and node.input[0] in chosen:
                node.input[0] = f"{node.input[0]}__dq"
        ordered = _toposort([*nodes, *q.graph.node],
                            {i.name for i in q.graph.input} | {i.name for i in q.graph.initializer})
        del q.graph.node[:]
        q.graph.node.extend(ordered)
        return q

    chosen: list[str] = []
    report: dict[str, Any] = {"size": size, "windows": len(feeds["mel"]), "tol": tol,
                              "tensors": {}}
    for name in candidates:
        trial = quantised([*chosen, name])
        coeffs, frames = _run_ort(trial.SerializeToString(), feeds, ["coefficients", "frame"])
        err = float(np.abs(coeffs - reference).max())
        grey = np.abs(frames.astype(np.int16) - ref_frames)
        keep = err <= tol and int(grey.max()) <= 8 and float(grey.mean()) <= 1.0
        report["tensors"][name] = {"max_coeff_err": err, "max_grey": int(grey.max()),
                                   "mean_grey": float(grey.mean()), "kept": keep}
        if keep:
            chosen.append(name)
    final = quantised(chosen)
    onnx.checker.check_model(final)
    report["quantised"] = chosen
    return final.SerializeToString(), report


# ---------------------------------------------------------------------- build
def build_engines(manifest_path: Path, *, precision: str, sizes: Sequence[int],
                  batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, max_slots: int = 256,
                  cache_dir: Path = CACHE_DIR, workspace_gib: float = 4.0) -> list[Path]:
    """Build (or find cached) one engine per frame size, one profile per batch size."""
    trt = import_tensorrt()
    manifest = Manifest.load(manifest_path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger = trt.Logger(trt.Logger.WARNING)
    gpu, cc = gpu_identity()
    source = model_bytes(manifest, precision, cache_dir)
    wrapped = slot_gather_onnx(source)
    timing_path = cache_dir / f"timing-{gpu.replace(' ', '_')}-{cc}-trt{trt.__version__}.cache"
    built = []
    for size in sizes:
        key = engine_key(source, trt.__version__, gpu, cc, precision, size, batch_sizes,
                         max_slots)
        path = engine_path(cache_dir, manifest.name, size, precision, key)
        if path.exists():
            print(f"cached: {path}")
            built.append(path)
            continue
        builder = trt.Builder(logger)
        network = builder.create_network(0)  # TensorRT 10: always explicit batch
        parser = trt.OnnxParser(network, logger)
        if not parser.parse(wrapped):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"ONNX parse failed: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
        if precision in ("fp16", "int8"):
            config.set_flag(trt.BuilderFlag.FP16)
        if precision == "int8":
            config.set_flag(trt.BuilderFlag.INT8)  # Q/DQ nodes carry the scales
        timing = config.create_timing_cache(timing_path.read_bytes()
                                            if timing_path.exists() else b"")
        config.set_timing_cache(timing, ignore_mismatch=False)
        g = len(manifest.geometry_names)
        for b in batch_sizes:
            profile = builder.create_optimization_profile()
            fixed = {"mel": (b, manifest.window_frames, manifest.features.n_mels),
                     "knobs": (b, len(manifest.knob_names)), "clock": (b, 2), "slot": (b,)}
            for name, shape in fixed.items():
                profile.set_shape(name, shape, shape, shape)
            profile.set_shape("portrait_bank", (1, 3, size, size), (max_slots, 3, size, size),
                              (max_slots, 3, size, size))
            profile.set_shape("geometry_bank", (1, g), (max_slots, g), (max_slots, g))
            config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise RuntimeError(f"TensorRT build failed for {size}x{size} {precision}")
        path.write_bytes(bytes(serialized))
        timing_path.write_bytes(bytes(config.get_timing_cache().serialize()))
        path.with_suffix(".json").write_text(json.dumps({
            "onnx_sha256": hashlib.sha256(source).hexdigest(), "tensorrt": trt.__version__,
            "gpu": gpu, "compute_capability": cc, "precision": precision, "size": size,
            "batch_sizes": list(batch_sizes), "max_slots": max_slots}, indent=2))
        print(f"built: {path}")
        built.append(path)
    return built


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m inference.runtimes.tensorrt_build",
                                     description="Build TensorRT engines ahead of serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or find cached) engines")
    cal = sub.add_parser("calibrate", help="write the INT8 Q/DQ ONNX (no TensorRT needed)")
    for p in (build, cal):
        p.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
        p.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    build.add_argument("--precision", choices=PRECISIONS, default="fp16")
    build.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    build.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES))
    build.add_argument("--max-slots", type=int, default=256)
    build.add_argument("--workspace-gib", type=float, default=4.0)
    cal.add_argument("--size", type=int, default=256)
    cal.add_argument("--tol", type=float, default=INT8_COEFF_TOL)
    args = parser.parse_args(argv)
    if args.command == "calibrate":
        manifest = Manifest.load(args.manifest)
        qdq, report = calibrate(manifest, size=args.size, tol=args.tol)
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        out = args.cache_dir / f"{manifest.name}-int8-qdq.onnx"
        out.write_bytes(qdq)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
        print(f"wrote {out}")
        return
    if args.precision == "int8" and not (args.cache_dir / "sonic-lite-int8-qdq.onnx").exists():
        main(["calibrate", "--manifest", str(args.manifest), "--cache-dir", str(args.cache_dir)])
    build_engines(args.manifest, precision=args.precision, sizes=args.sizes,
                  batch_sizes=args.batches, max_slots=args.max_slots,
                  cache_dir=args.cache_dir, workspace_gib=args.workspace_gib)


if __name__ == "__main__":
    main()
