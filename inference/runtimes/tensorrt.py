"""The engine on TensorRT 10+: prebuilt engines, device-resident slots, pinned I/O.

UNVERIFIED: written against the documented TensorRT 10 Python API (tensor-name I/O,
``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``) and cuda-python's
``cuda.bindings.runtime``; the TensorRT builder cannot be installed on the machines this was
written on, so no engine has been built or run. ``engine.runtime = "auto"`` never picks it.

Engines are built ahead of time by :mod:`inference.runtimes.tensorrt_build`, never on a
request; a missing engine is an error naming the command that builds it. Engines live in
``engines/cache/`` (git-ignored), keyed by the ONNX hash, TensorRT version, GPU name and
compute capability, precision, frame size, batch profiles and slot capacity.

Device-resident sessions: the built graph is the shipped ONNX wrapped with two Gathers, so
it takes ``portrait_bank`` (slots, 3, S, S), ``geometry_bank`` (slots, G) and ``slot``
(batch,) instead of per-frame portraits: ``prepare()`` uploads a portrait once, and per
frame only the mel window, knobs, clock and slot index cross the bus. One optimisation
profile per batch size (the scheduler's sizes, ``batch_sizes``); a batch is padded up to the
next profile. Outputs go to pinned host memory on a copy stream, overlapping the next
chunk's execution; returned arrays view pooled pinned buffers that return to the pool when
the caller drops them.
"""

from __future__ import annotations

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

from inference.engine import (
    BatchOutput,
    FrameInput,
    Manifest,
    PreparedPortrait,
    coefficients_by_rendering,
)
from inference.pixels import RGB, as_pixels, check
from inference.runtimes.slots import batch_slots

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO / "engines" / "cache"
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
PRECISIONS: tuple[str, ...] = ("fp16", "int8", "fp32")
BUILD_HINT = ("python -m inference.runtimes.tensorrt_build build --precision {precision} "
              "--sizes {size}")


def import_tensorrt() -> Any:
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


# ---------------------------------------------------------------------- engine identity
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


def model_bytes(manifest: Manifest, precision: str, cache_dir: Path) -> bytes:
    """The graph to build: the shipped ONNX, or its calibrated Q/DQ version for INT8."""
    if precision != "int8":
        return Path(manifest.onnx).read_bytes()
    qdq = cache_dir / f"{manifest.name}-int8-qdq.onnx"
    if not qdq.exists():
        raise FileNotFoundError(
            f"{qdq} missing: run `python -m inference.runtimes.tensorrt_build calibrate` first")
    return qdq.read_bytes()


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
                 cache_dir: Path = CACHE_DIR, device: int = 0, pixels: str = RGB) -> None:
        self.pixels = check(pixels)
        trt = import_tensorrt()
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
        source = model_bytes(manifest, precision, cache_dir)
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

    def run_motion(self, batch: list[FrameInput]) -> np.ndarray:
        """Rendered and thrown away: no engine is built from the motion graph yet (no
        TensorRT builder can be installed here to check one)."""
        return coefficients_by_rendering(self, batch)

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
        # I420 on the host: the graph returns RGB (torch-cuda converts on the device).
        return BatchOutput(frames=as_pixels(frames, self.pixels), coefficients=coefficients)
