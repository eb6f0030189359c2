"""The engine on TensorRT 10+: prebuilt engines, device-resident slots, pinned I/O.

UNVERIFIED: written against the documented TensorRT 10 Python API (tensor-name I/O,
``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``) and cuda-python's
``cuda.bindings.runtime``; the TensorRT builder cannot be installed on the machines this was
written on, so no engine has been built or run. What IS verified (on the CPU, with
onnxruntime): the slot-gather ONNX wrapper and the INT8 calibration/Q-DQ insertion
(``calibrate``), whose accuracy check runs the quantised graph in onnxruntime.

Build engines ahead of time, never on a request::

    python -m inference.runtimes.tensorrt build --precision fp16 --sizes 256 512
    python -m inference.runtimes.tensorrt build --precision int8 --sizes 256 512

At serve time a missing engine is an error naming that command. Engines live in
``engines/cache/`` (git-ignored), keyed by the ONNX hash, TensorRT version, GPU name and
compute capability, precision, frame size, batch profiles and slot capacity; a timing cache
per GPU and TensorRT version makes rebuilds fast.

Device-resident sessions: the built graph is the shipped ONNX wrapped with two Gathers, so
it takes ``portrait_bank`` (slots, 3, S, S), ``geometry_bank`` (slots, G) and ``slot``
(batch,) instead of per-frame portraits: ``prepare()`` uploads a portrait once, and per
frame only the mel window, knobs, clock and slot index cross the bus. One optimisation
profile per batch size (the scheduler's sizes, ``batch_sizes``); a batch is padded up to the
next profile. Outputs go to pinned host memory on a copy stream, overlapping the next
chunk's execution; returned arrays view pooled pinned buffers that return to the pool when
the caller drops them.

INT8 uses explicit quantization (Q/DQ nodes; the implicit-calibrator API is deprecated in
TensorRT 10): activation ranges come from mel windows of varied voices, levels and noise
(a clean read-speech set makes the mouth jitter on noisy input), and a tensor is quantised
only if the quantised graph keeps the coefficients within ``INT8_COEFF_TOL`` on that set.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib
import itertools
import json
import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.engine import BatchOutput, FrameInput, Manifest, PreparedPortrait
from inference.runtimes.slots import batch_slots

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MANIFEST = REPO / "engines" / "sonic-lite.json"
CACHE_DIR = REPO / "engines" / "cache"
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
PRECISIONS: tuple[str, ...] = ("fp16", "int8", "fp32")
#: Largest coefficient change INT8 may cause on the calibration set (mouth jitter bound).
INT8_COEFF_TOL = 0.02
BUILD_HINT = "python -m inference.runtimes.tensorrt build --precision {precision} --sizes {size}"


def _trt() -> Any:
    """Import TensorRT lazily, so this module imports (and its CPU parts run) without it."""
    try:
        return importlib.import_module("tensorrt")
    except ImportError as exc:
        raise RuntimeError(
            "TensorRT is not installed (pip install tensorrt, on a machine with the full "
            "builder); use --runtime torch-cuda instead") from exc


def _cudart() -> Any:
    from cuda.bindings import runtime as cudart

    return cudart


def _check(result: Any) -> Any:
    """Unwrap a cuda-python ``(err, *values)`` tuple, raising on any error."""
    cudart = _cudart()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA error {err}")
    return values[0] if len(values) == 1 else tuple(values)


# ---------------------------------------------------------------------- ONNX preparation
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
        from inference.portrait import load_default_avatar, prepare_portrait

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
def gpu_identity(device: int = 0) -> tuple[str, str]:
    """(GPU name, compute capability) through the CUDA runtime."""
    cudart = _cudart()
    prop = _check(cudart.cudaGetDeviceProperties(device))
    name = prop.name.decode() if isinstance(prop.name, bytes) else str(prop.name)
    return name.strip("\x00 "), f"{prop.major}.{prop.minor}"


def engine_key(onnx_bytes: bytes, trt_version: str, gpu: str, capability: str,
               precision: str, size: int, batch_sizes: Sequence[int], max_slots: int) -> str:
    """Cache key: any change of model, TensorRT, GPU or build settings is a new engine."""
    h = hashlib.sha256(onnx_bytes)
    h.update(json.dumps([trt_version, gpu, capability, precision, size, list(batch_sizes),
                         max_slots]).encode())
    return h.hexdigest()[:24]


def engine_path(cache_dir: Path, name: str, size: int, precision: str, key: str) -> Path:
    return cache_dir / f"{name}-{size}-{precision}-{key}.plan"


def _model_bytes(manifest: Manifest, precision: str, cache_dir: Path) -> bytes:
    """The graph to build: the shipped ONNX, or its calibrated Q/DQ version for INT8."""
    if precision != "int8":
        return Path(manifest.onnx).read_bytes()
    qdq = cache_dir / f"{manifest.name}-int8-qdq.onnx"
    if not qdq.exists():
        raise FileNotFoundError(
            f"{qdq} missing: run `python -m inference.runtimes.tensorrt calibrate` first")
    return qdq.read_bytes()


def build_engines(manifest_path: Path, *, precision: str, sizes: Sequence[int],
                  batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, max_slots: int = 256,
                  cache_dir: Path = CACHE_DIR, workspace_gib: float = 4.0) -> list[Path]:
    """Build (or find cached) one engine per frame size, one profile per batch size."""
    trt = _trt()
    manifest = Manifest.load(manifest_path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger = trt.Logger(trt.Logger.WARNING)
    gpu, cc = gpu_identity()
    source = _model_bytes(manifest, precision, cache_dir)
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


# ---------------------------------------------------------------------- runtime
class _PinnedPool:
    """Pinned host buffers of one byte size; an array handed out returns its buffer to the
    pool when the last view of it is garbage collected (so ``run`` never copies frames)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[int] = []
        self._lock = threading.Lock()

    def take(self) -> tuple[int, np.ndarray]:
        with self._lock:
            ptr = self._free.pop() if self._free else None
        if ptr is None:
            ptr = int(_check(_cudart().cudaMallocHost(self.nbytes)))
        owner = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(ptr))
        weakref.finalize(owner, self._give_back, ptr)
        return ptr, owner

    def _give_back(self, ptr: int) -> None:
        with self._lock:
            self._free.append(ptr)


@dataclass
class _SizeEngine:
    size: int
    engine: Any
    contexts: dict[int, Any]  # batch profile -> execution context
    bank: int  # device pointer, (max_slots, 3, S, S) float32
    geometry: int  # device pointer, (max_slots, G) float32
    free: list[int]


class TensorRtEngine:
    """Prebuilt TensorRT engines per frame size; ``run`` from one worker thread (UNVERIFIED)."""

    _INPUTS = ("mel", "knobs", "clock", "slot")

    def __init__(self, manifest: Manifest, *, precision: str = "fp16",
                 sizes: Sequence[int] = (256, 512),
                 batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, max_slots: int = 256,
                 cache_dir: Path = CACHE_DIR, device: int = 0) -> None:
        trt = _trt()
        cudart = _cudart()
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}")
        self.manifest = manifest
        self.batch_sizes: tuple[int, ...] = tuple(sorted(batch_sizes))
        self.max_slots = max_slots
        _check(cudart.cudaSetDevice(device))
        gpu, cc = gpu_identity(device)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        source = _model_bytes(manifest, precision, cache_dir)
        self._g = len(manifest.geometry_names)
        self._k = len(manifest.coefficient_names)
        self._mel = manifest.window_frames * manifest.features.n_mels
        self._sizes: dict[int, _SizeEngine] = {}
        for size in sizes:
            key = engine_key(source, trt.__version__, gpu, cc, precision, size,
                             self.batch_sizes, max_slots)
            path = engine_path(cache_dir, manifest.name, size, precision, key)
            if not path.exists():
                raise FileNotFoundError(
                    f"no TensorRT engine for {size}x{size} {precision} on {gpu} "
                    f"(TensorRT {trt.__version__}): {path}. Build it ahead with: "
                    + BUILD_HINT.format(precision=precision, size=size))
            engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
            contexts = {}
            for index, b in enumerate(self.batch_sizes):
                context = engine.create_execution_context()
                contexts[b] = (context, index)
            bank = int(_check(cudart.cudaMalloc(max_slots * 3 * size * size * 4)))
            geo = int(_check(cudart.cudaMalloc(max_slots * self._g * 4)))
            self._sizes[size] = _SizeEngine(size, engine, contexts, bank, geo,
                                            list(range(max_slots)))
        self._stream = _check(cudart.cudaStreamCreate())
        self._copy_stream = _check(cudart.cudaStreamCreate())
        self._upload_stream = _check(cudart.cudaStreamCreate())
        top = self.batch_sizes[-1]
        row_bytes = {"mel": self._mel * 4, "knobs": len(manifest.knob_names) * 4,
                     "clock": 8, "slot": 4}
        self._in_host = {n: int(_check(cudart.cudaMallocHost(top * b)))
                         for n, b in row_bytes.items()}
        self._in_dev = {n: int(_check(cudart.cudaMalloc(top * b))) for n, b in row_bytes.items()}
        self._row_bytes = row_bytes
        biggest = max(sizes)
        self._out_dev = {"frame": int(_check(cudart.cudaMalloc(top * biggest**2 * 3))),
                         "coefficients": int(_check(cudart.cudaMalloc(top * self._k * 4)))}
        self._pools: dict[int, _PinnedPool] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._slots: dict[int, tuple[int, int]] = {}
        for size, se in self._sizes.items():
            for b, (context, index) in se.contexts.items():
                context.set_optimization_profile_async(index, self._stream)
                context.set_input_shape("portrait_bank", (max_slots, 3, size, size))
                context.set_input_shape("geometry_bank", (max_slots, self._g))
                context.set_tensor_address("portrait_bank", se.bank)
                context.set_tensor_address("geometry_bank", se.geometry)
                for name in self._INPUTS:
                    shape = {"mel": (b, manifest.window_frames, manifest.features.n_mels),
                             "knobs": (b, len(manifest.knob_names)), "clock": (b, 2),
                             "slot": (b,)}[name]
                    context.set_input_shape(name, shape)
        _check(cudart.cudaStreamSynchronize(self._stream))

    def prepare(self, portrait: PreparedPortrait) -> int:
        cudart = _cudart()
        size = portrait.size
        if size not in self._sizes:
            raise ValueError(f"no engine for {size}x{size}; built: {sorted(self._sizes)}")
        geometry = np.ascontiguousarray(portrait.geometry, np.float32)
        if geometry.shape != (self._g,):
            raise ValueError(f"geometry must be ({self._g},), got {geometry.shape}")
        chw = np.ascontiguousarray(portrait.image.transpose(2, 0, 1), np.float32)
        chw *= np.float32(1.0 / 255.0)
        se = self._sizes[size]
        with self._lock:
            if not se.free:
                raise RuntimeError(f"all {self.max_slots} slots of {size}x{size} are in use")
            row = se.free.pop(0)
        kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        _check(cudart.cudaMemcpyAsync(se.bank + row * chw.nbytes, chw.ctypes.data, chw.nbytes,
                                      kind, self._upload_stream))
        _check(cudart.cudaMemcpyAsync(se.geometry + row * geometry.nbytes,
                                      geometry.ctypes.data, geometry.nbytes, kind,
                                      self._upload_stream))
        _check(cudart.cudaStreamSynchronize(self._upload_stream))
        with self._lock:
            slot = next(self._ids)
            self._slots[slot] = (size, row)
        return slot

    def release(self, slot: int) -> None:
        # A row is only reused by a later prepare(); run() holds no rows across calls, and
        # the worker thread's batch in flight finishes before the event loop's next batch.
        with self._lock:
            entry = self._slots.pop(slot, None)
            if entry is not None:
                self._sizes[entry[0]].free.append(entry[1])

    def frame_size(self, slot: int) -> int:
        with self._lock:
            if slot not in self._slots:
                raise KeyError(f"unknown or released portrait slot {slot}")
            return self._slots[slot][0]

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        out, top = [], self.batch_sizes[-1]
        while n > 0:
            k = min(n, top)
            out.append((k, next(b for b in self.batch_sizes if b >= k)))
            n -= k
        return out

    def run(self, batch: list[FrameInput]) -> BatchOutput:
        cudart = _cudart()
        with self._lock:
            entries, size = batch_slots(self._slots, batch, lambda entry: entry[0])
        se, n = self._sizes[size], len(batch)
        frame_bytes = size * size * 3
        pool = self._pools.setdefault(n * frame_bytes, _PinnedPool(n * frame_bytes))
        frames_ptr, frames_owner = pool.take()
        coeff_pool = self._pools.setdefault(-n * self._k * 4, _PinnedPool(n * self._k * 4))
        coeff_ptr, coeff_owner = coeff_pool.take()
        h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        d2h = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        done = 0
        for k, padded in self._chunks(n):
            items = batch[done : done + k]
            rows = [entries[done + i][1] for i in range(k)] + [entries[done][1]] * (padded - k)
            host = {name: np.ctypeslib.as_array(
                        (ctypes.c_uint8 * (padded * self._row_bytes[name])).from_address(ptr))
                    for name, ptr in self._in_host.items()}
            # The previous chunk's inputs are consumed once the compute stream passes them.
            _check(cudart.cudaStreamSynchronize(self._stream))
            mel = host["mel"].view(np.float32).reshape(padded, -1)
            mel[:k] = np.stack([np.asarray(i.mel, np.float32).reshape(-1) for i in items])
            host["knobs"].view(np.float32).reshape(padded, -1)[:k] = np.stack(
                [i.knobs for i in items])
            host["clock"].view(np.float32).reshape(padded, 2)[:k] = np.stack(
                [i.clock for i in items])
            host["slot"].view(np.int32)[:] = rows
            for name, ptr in self._in_host.items():
                _check(cudart.cudaMemcpyAsync(self._in_dev[name], ptr,
                                              padded * self._row_bytes[name], h2d, self._stream))
            context, _ = se.contexts[padded]
            for name in self._INPUTS:
                context.set_tensor_address(name, self._in_dev[name])
            context.set_tensor_address("frame", self._out_dev["frame"])
            context.set_tensor_address("coefficients", self._out_dev["coefficients"])
            # The copy stream must have drained the previous chunk's outputs first.
            _check(cudart.cudaStreamSynchronize(self._copy_stream))
            if not context.execute_async_v3(self._stream):
                raise RuntimeError("TensorRT execute_async_v3 failed")
            event = _check(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming))
            _check(cudart.cudaEventRecord(event, self._stream))
            _check(cudart.cudaStreamWaitEvent(self._copy_stream, event, 0))
            _check(cudart.cudaMemcpyAsync(frames_ptr + done * frame_bytes, self._out_dev["frame"],
                                          k * frame_bytes, d2h, self._copy_stream))
            _check(cudart.cudaMemcpyAsync(coeff_ptr + done * self._k * 4,
                                          self._out_dev["coefficients"], k * self._k * 4, d2h,
                                          self._copy_stream))
            _check(cudart.cudaEventDestroy(event))
            done += k
        _check(cudart.cudaStreamSynchronize(self._copy_stream))
        frames = frames_owner[: n * frame_bytes].reshape(n, size, size, 3)
        coefficients = coeff_owner.view(np.float32)[: n * self._k].reshape(n, self._k)
        return BatchOutput(frames=frames, coefficients=coefficients)


# ---------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build TensorRT engines ahead of serving.")
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
