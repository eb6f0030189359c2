"""The engine on PyTorch + CUDA: the torch model itself, FP16, CUDA graphs, device-resident slots.

Why not the ONNX graph: the model is defined in PyTorch (``inference.model.export``), so the
GPU runs that very module and needs no exporter or TensorRT. What makes it fast:

* **Device-resident portraits.** ``prepare()`` uploads a portrait once into a per-frame-size
  slot bank on the GPU (FP16 unless ``precision="fp32"``). Per frame only the mel window, knobs,
  clock and the bank row cross the bus (one packed FP32 row, ~5 KB); the graph gathers the
  portraits by row on the device.
* **CUDA graphs per batch size.** For each frame size one graph is captured per size in
  ``batch_sizes`` (largest first, sharing one memory pool); a batch is padded up to the next
  captured size (padding rows only cost compute, they are never copied back), and a batch
  larger than the largest size runs as several chunks. Replaying a graph costs one launch
  instead of a few hundred eager kernels. On CUDA the unpacking, the gather and the model
  also go through ``torch.compile`` (fused kernels; ``compile=False`` to skip it) before
  capture: twice the frames/s of graphs alone on an H200, for ~20 s of compiling once.
* **Dense convolutions for an ensemble's members.** Convolutions of a few groups run as
  dense ones with block-diagonal weights (``ungroup_convolutions``): the same sums, and
  cuDNN's grouped kernels are slow at these sizes.
* **Pinned output, no host copies.** Frames come back as uint8 (RGB, or I420 converted on
  the device for the server's encoders: half the bytes) straight into pinned host
  memory (torch's caching host allocator recycles the buffer once the caller drops the
  arrays), so ``run()`` returns views, never copies.

What overlaps (``run`` is synchronous, so batch N+1 is unknown while batch N runs): inside
one ``run`` the inputs go up once on the compute stream, then the batch runs as chunks
(``max_chunk`` frames, default the largest captured size); the copy-back of chunk *i* runs
on a separate copy stream while chunk *i + 1* computes, and the next replay of a graph
waits only for the copy-back of that graph's own outputs. Across ``run`` calls nothing
overlaps: the call returns when its last frame is in host memory.

Precision (measured on an H200, see benchmarks/results/2026-11-29-gpu-engine-h200.md):
``fp16`` (the default) keeps the
portrait bank in FP16 (half the bytes to store and gather; at most 0.06 grey levels of
rounding) and does the math in FP32. ``amp`` also runs the model under CUDA autocast, and
that is NOT fine for sonic-lite: its audio head adds 1e-9 to an FP16 matmul output of mel
power, which flushes to zero, so a silent window gives log10(0) = -inf and NaN motion. The
engine then recomputes those rows in eager FP32 (so ``amp`` never returns a NaN frame) but
is slower than ``fp16``; it is kept for models whose every stage tolerates FP16. ``fp32``
keeps the bank in FP32 too (the exact reference).

On a CPU (``device="cpu"``, for tests and machines without CUDA) the same code runs eagerly
in FP32 without graphs or streams.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from inference.engine import (
    BatchOutput,
    FrameInput,
    Manifest,
    PreparedPortrait,
    coefficients_by_rendering,
)
from inference.pixels import I420, RGB, check, frame_shape
from inference.runtimes.device_pixels import DeviceI420
from inference.runtimes.slots import batch_slots

log = logging.getLogger(__name__)

#: Captured batch profiles by default; the scheduler's ``max_batch`` should be one of them.
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
#: fp16: FP16 portrait bank, FP32 math; amp: FP16 bank and autocast math; fp32: all FP32.
PRECISIONS: tuple[str, ...] = ("fp16", "amp", "fp32")


def ungroup_convolutions(model: nn.Module, most_groups: int = 4) -> None:
    """Turn convolutions of a few groups (an ensemble's members side by side, as in
    sonic-lite's audio head) into dense ones with block-diagonal weights, in place.

    The sums are the same (the zeros add exactly nothing) at ``groups`` times the MACs,
    which a GPU does not notice at these sizes, while cuDNN's grouped kernels are slow
    there: on an H100 the two-member head's motion graph ran 1.4x faster at batch 32
    (benchmarks/results/2026-12-06-motion-graph-cost.md). Depthwise convolutions (many
    groups) are left alone.
    """
    for conv in model.modules():
        if not isinstance(conv, nn.Conv1d | nn.Conv2d) or not 1 < conv.groups <= most_groups:
            continue
        weight, groups = conv.weight.data, conv.groups
        rows, cols = weight.shape[0] // groups, weight.shape[1]
        dense = weight.new_zeros(weight.shape[0], cols * groups, *weight.shape[2:])
        for g in range(groups):
            out, inp = slice(g * rows, (g + 1) * rows), slice(g * cols, (g + 1) * cols)
            dense[out, inp] = weight[out]
        conv.weight = nn.Parameter(dense, requires_grad=False)
        conv.groups = 1


@dataclass
class _Graph:
    """One captured batch profile: static input rows in, static frames/coefficients out."""

    rows: int
    static_in: torch.Tensor
    frames: torch.Tensor
    coefficients: torch.Tensor
    graph: torch.cuda.CUDAGraph
    #: Recorded on the copy stream after this graph's outputs were copied out; the next
    #: replay waits for it, so a replay never overwrites outputs still being copied.
    copied: torch.cuda.Event


@dataclass
class _MotionGraph:
    """One captured batch profile of the coefficients alone (motion-only sessions)."""

    static_in: torch.Tensor
    coefficients: torch.Tensor
    graph: torch.cuda.CUDAGraph


@dataclass
class _Bank:
    """Device-resident portraits of one frame size (one generation; growing makes a new one)."""

    size: int
    portraits: torch.Tensor  # (capacity, 3, S, S), FP16 or FP32
    geometry: torch.Tensor  # (capacity, G) FP32
    free: list[int]
    graphs: dict[int, _Graph] = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return int(self.portraits.shape[0])


@dataclass(frozen=True)
class _Slot:
    size: int
    row: int


@contextlib.contextmanager
def _collector_held_off() -> Iterator[None]:
    """Collect garbage now, then keep Python's cyclic collector off while graphs capture.

    A collection during capture runs finalizers on the capturing thread: freeing another
    engine's pinned buffers, events or graphs there makes CUDA calls that capture forbids,
    and the capture fails with cudaErrorStreamCaptureInvalidated. Engines (and much else
    that holds CUDA memory) are freed by that collector, at whatever allocation it picks;
    PyTorch no longer collects before a capture by default.
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class TorchCudaEngine:
    """Runs ``build_model()`` on one GPU (or the CPU); ``run`` from one worker thread.

    ``prepare``/``release``/``frame_size`` may be called from any thread while a batch
    runs: they take a short lock, never wait for the batch, and a row released while a
    batch uses it is only reused after that batch ends.
    """

    def __init__(
        self,
        manifest: Manifest,
        *,
        device: str | None = None,
        precision: str = "fp16",
        batch_sizes: Sequence[int] | None = DEFAULT_BATCH_SIZES,
        cuda_graphs: bool = True,
        compile: bool | None = None,
        max_chunk: int | None = None,
        initial_slots: int = 64,
        model_factory: Callable[[], nn.Module] | None = None,
        pixels: str = RGB,
    ) -> None:
        self.manifest = manifest
        self.pixels = check(pixels)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self._to_i420 = DeviceI420(self.on_cuda)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        # FP16 and graphs are CUDA features; the CPU path is the FP32 reference.
        self.precision = precision if self.on_cuda else "fp32"
        self.use_graphs = cuda_graphs and self.on_cuda and bool(batch_sizes)
        #: Captured batch profiles (ascending); batches are padded up to one of these.
        #: Empty on the CPU without explicit sizes: batches then run as they come.
        self.batch_sizes: tuple[int, ...] = tuple(sorted(set(batch_sizes or ())))
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be positive, got {self.batch_sizes}")
        self.max_chunk = max_chunk or (self.batch_sizes[-1] if self.batch_sizes else None)
        if self.batch_sizes and self.max_chunk not in self.batch_sizes:
            raise ValueError(f"max_chunk {self.max_chunk} is not one of {self.batch_sizes}")

        if model_factory is None:
            from inference.model.export import build_model  # torch-only import, kept lazy

            model_factory = build_model
        model = model_factory().eval()
        if self.on_cuda and self.precision != "fp32":
            # Dense convolutions run in TF32 where cuDNN picks it (PyTorch's default): fine
            # for fp16 and amp, not for the fp32 reference, which keeps the grouped ones.
            ungroup_convolutions(model)
        model = model.to(self.device)
        for p in model.parameters():
            p.requires_grad_(False)
        self.model: nn.Module = model
        self._compute_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self._compute_rows
        if compile is None:  # measured 2x faster on an H200; ~20 s once, at first capture
            compile = self.on_cuda
        self.compiled = compile
        self._motion_fn: Callable[[torch.Tensor], torch.Tensor] = self._motion_rows
        if compile:
            # dynamic: one compilation serves every batch size (and frame size).
            self._compute_fn = torch.compile(self._compute_rows, dynamic=True)
            self._motion_fn = torch.compile(self._motion_rows, dynamic=True)
        self._motion_graphs: dict[int, _MotionGraph] = {}

        self._window = (manifest.window_frames, manifest.features.n_mels)
        self._n_mel = manifest.window_frames * manifest.features.n_mels
        self._n_knobs = len(manifest.knob_names)
        self._n_geometry = len(manifest.geometry_names)
        self._n_coefficients = len(manifest.coefficient_names)
        # Packed per-frame row: mel | knobs | clock(2) | bank row (exact in FP32 below 2**24).
        self._row_len = self._n_mel + self._n_knobs + 2 + 1
        self._initial_slots = max(1, initial_slots)

        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._slots: dict[int, _Slot] = {}
        self._banks: dict[int, _Bank] = {}
        self._in_use: set[tuple[int, int]] = set()  # (size, row) read by the running batch
        self._deferred: list[tuple[_Bank, int]] = []  # released while in use
        #: Event timings (ms) of the last CUDA ``run`` when ``collect_timings`` is set.
        self.collect_timings = False
        self.last_timings: dict[str, float] = {}

        if self.on_cuda:
            with torch.cuda.device(self.device):
                self._compute = torch.cuda.Stream(self.device)
                self._copy = torch.cuda.Stream(self.device)
                self._upload = torch.cuda.Stream(self.device)
            self._host_in = torch.empty((0, self._row_len), dtype=torch.float32)
            self._dev_in = torch.empty((0, self._row_len), dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------ slots
    def prepare(self, portrait: PreparedPortrait) -> int:
        image = np.ascontiguousarray(portrait.image)
        geometry = np.asarray(portrait.geometry, dtype=np.float32)
        if image.ndim != 3 or image.shape[2] != 3 or image.shape[0] != image.shape[1]:
            raise ValueError(f"portrait must be (S, S, 3) RGB, got {image.shape}")
        if image.dtype != np.uint8:
            raise ValueError(f"portrait must be uint8, got {image.dtype}")
        if geometry.shape != (self._n_geometry,):
            raise ValueError(f"geometry must be ({self._n_geometry},), got {geometry.shape}")
        size = int(image.shape[0])
        with self._lock:
            bank = self._banks.get(size)
            if bank is None or not bank.free:
                bank = self._grow(size, bank)
            row = bank.free.pop(0)
            slot_id = next(self._ids)
        # Off the lock: the row is ours and no batch reads it until the slot id is returned.
        try:
            self._upload_row(bank, row, image, geometry)
        except BaseException:
            with self._lock:
                bank.free.append(row)
            raise
        with self._lock:
            self._slots[slot_id] = _Slot(size, row)
        return slot_id

    def _grow(self, size: int, old: _Bank | None) -> _Bank:
        """A new bank generation with twice the rows (graphs are recaptured for it lazily,
        since they hold the old bank's addresses); a batch running on the old generation
        keeps it alive until it ends. Called with the lock held."""
        capacity = self._initial_slots if old is None else 2 * old.capacity
        dtype = torch.float32 if self.precision == "fp32" else torch.float16
        portraits = torch.zeros((capacity, 3, size, size), dtype=dtype, device=self.device)
        geometry = torch.zeros((capacity, self._n_geometry), dtype=torch.float32,
                               device=self.device)
        free = list(range(capacity))
        if old is not None:
            log.warning("slot bank for %dx%d full (%d); growing to %d rows, graphs recaptured",
                        size, size, old.capacity, capacity)
            self._copy_rows(old, portraits, geometry)
            free = [r for r in free if r >= old.capacity] + sorted(old.free)
        bank = _Bank(size, portraits, geometry, free)
        self._banks[size] = bank
        return bank

    def _copy_rows(self, old: _Bank, portraits: torch.Tensor, geometry: torch.Tensor) -> None:
        if self.on_cuda:
            with torch.cuda.stream(self._upload):
                portraits[: old.capacity].copy_(old.portraits)
                geometry[: old.capacity].copy_(old.geometry)
            self._upload.synchronize()
        else:
            portraits[: old.capacity].copy_(old.portraits)
            geometry[: old.capacity].copy_(old.geometry)

    def _upload_row(self, bank: _Bank, row: int, image: np.ndarray, geometry: np.ndarray) -> None:
        """uint8 goes up (a third of the FP32 bytes); [0, 1] scaling happens on the device
        with the same FP32 multiply as the ONNX runtime's."""
        pixels = torch.from_numpy(image)
        geo = torch.from_numpy(geometry.copy())
        scale = torch.tensor(1.0 / 255.0, dtype=torch.float32)
        with torch.no_grad():
            if self.on_cuda:
                with torch.cuda.stream(self._upload):
                    dev = pixels.to(self.device, non_blocking=False)
                    chw = dev.permute(2, 0, 1).to(torch.float32) * scale.to(self.device)
                    bank.portraits[row].copy_(chw)
                    bank.geometry[row].copy_(geo.to(self.device))
                self._upload.synchronize()
            else:
                bank.portraits[row].copy_(pixels.permute(2, 0, 1).to(torch.float32) * scale)
                bank.geometry[row].copy_(geo)

    def release(self, slot: int) -> None:
        """Forget a slot; unknown or already released slots are a no-op."""
        with self._lock:
            entry = self._slots.pop(slot, None)
            if entry is None:
                return
            bank = self._banks[entry.size]
            if (entry.size, entry.row) in self._in_use:
                self._deferred.append((bank, entry.row))
            else:
                bank.free.append(entry.row)

    def frame_size(self, slot: int) -> int:
        with self._lock:
            try:
                return self._slots[slot].size
            except KeyError:
                raise KeyError(f"unknown or released portrait slot {slot}") from None

    # ------------------------------------------------------------------ compute
    def _forward(self, rows: torch.Tensor, bank: _Bank, amp: bool | None = None,
                 compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Run packed rows against one bank generation (compiled unless told otherwise)."""
        amp = self.precision == "amp" if amp is None else amp
        fn = self._compute_fn if compiled else self._compute_rows
        frames, coefficients = fn(rows, bank.portraits, bank.geometry, amp)
        if self.pixels == I420:  # outside the compiled region: see device_pixels
            frames = self._to_i420(frames)
        return frames, coefficients

    def _compute_rows(self, rows: torch.Tensor, portraits: torch.Tensor, geometry: torch.Tensor,
                      amp: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpack rows, gather portraits from the bank on the device, run the model."""
        n = rows.shape[0]
        size = portraits.shape[-1]
        mel = rows[:, : self._n_mel].unflatten(1, self._window)
        a = self._n_mel + self._n_knobs
        knobs, clock = rows[:, self._n_mel : a], rows[:, a : a + 2]
        index = rows[:, a + 2].to(torch.long)
        portrait = portraits.index_select(0, index)
        if not amp:
            portrait = portrait.float()
        geo = geometry.index_select(0, index)
        # No autocast weight cache: a cache cleared during CUDA graph capture invalidates it.
        with torch.autocast(self.device.type, dtype=torch.float16, enabled=amp,
                            cache_enabled=False):
            frames, coefficients = self.model(mel, portrait, geo, knobs, clock)
        return frames.reshape(n, size, size, 3), coefficients.float()

    def capture(self, size: int) -> None:
        """Capture (and compile, if asked) every batch profile for one frame size now.

        ``run`` does this on first use of a size; call it ahead (e.g. at start-up, after
        the first ``prepare`` of that size) to keep the capture off the request path.
        """
        with self._lock:
            bank = self._banks.get(size)
        if bank is None:
            raise KeyError(f"no portrait of size {size} prepared")
        if self.use_graphs:
            self._ensure_graphs(bank)
        else:
            with torch.no_grad():
                self._forward(torch.zeros((1, self._row_len), device=self.device), bank)

    def _ensure_graphs(self, bank: _Bank) -> None:
        if bank.graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        graphs: dict[int, _Graph] = {}
        with torch.no_grad(), torch.cuda.device(self.device), _collector_held_off():
            for rows in sorted(self.batch_sizes, reverse=True):  # largest first: pool reuse
                static_in = torch.zeros((rows, self._row_len), dtype=torch.float32,
                                        device=self.device)
                with torch.cuda.stream(self._compute):
                    self._warm_up(static_in, bank)
                self._compute.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: prepare() may upload from another thread during capture.
                with torch.cuda.graph(graph, pool=pool, stream=self._compute,
                                      capture_error_mode="thread_local"):
                    frames, coefficients = self._forward(static_in, bank)
                graphs[rows] = _Graph(rows, static_in, frames, coefficients, graph,
                                      torch.cuda.Event())
            torch.cuda.synchronize(self.device)
        bank.graphs = graphs
        log.info("captured %d CUDA graphs for %dx%d (%s)", len(graphs), bank.size, bank.size,
                 self.precision)

    def _warm_up(self, static_in: torch.Tensor, bank: _Bank) -> None:
        """Compile, create cuBLAS handles, warm the allocator; if compiling fails (no
        Triton, an op the compiler rejects), fall back to the uncompiled model."""
        try:
            for _ in range(3):
                self._forward(static_in, bank)
        except Exception:
            if not self.compiled:
                raise
            log.exception("torch.compile failed; running the model uncompiled")
            self.compiled = False
            self._compute_fn = self._compute_rows
            for _ in range(3):
                self._forward(static_in, bank)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """(frames, rows run) per chunk: each chunk is padded up to the next captured size."""
        if not self.batch_sizes:
            return [(n, n)]
        chunk = self.max_chunk or self.batch_sizes[-1]
        out = []
        while n > 0:
            k = min(n, chunk)
            out.append((k, next(b for b in self.batch_sizes if b >= k)))
            n -= k
        return out

    def _pack(self, batch: list[FrameInput], rows: list[int], out: np.ndarray) -> None:
        n = len(batch)
        a = self._n_mel + self._n_knobs
        np.stack([np.asarray(i.mel, np.float32).reshape(-1) for i in batch],
                 out=out[:n, : self._n_mel])
        np.stack([np.asarray(i.knobs, np.float32) for i in batch], out=out[:n, self._n_mel : a])
        np.stack([np.asarray(i.clock, np.float32) for i in batch], out=out[:n, a : a + 2])
        out[:n, a + 2] = rows

    def _check_windows(self, batch: list[FrameInput]) -> None:
        if not batch:
            raise ValueError("empty batch")
        for item in batch:
            if item.mel.shape != self._window:
                raise ValueError(f"mel window must be {self._window}, got {item.mel.shape}")

    def run_motion(self, batch: list[FrameInput]) -> np.ndarray:
        """The model's ``motion`` alone, in FP32 (its audio head needs FP32; see the
        module's notes on ``amp``): no portrait and no renderer, but the same packed rows,
        compilation, CUDA graphs per batch size and chunks as ``run``."""
        if getattr(self.model, "motion", None) is None:
            return coefficients_by_rendering(self, batch)
        self._check_windows(batch)
        n = len(batch)
        with torch.no_grad():
            if not self.on_cuda:
                packed = np.empty((n, self._row_len), np.float32)
                self._pack(batch, [0] * n, packed)
                return self._motion_rows(torch.from_numpy(packed)).numpy()
            return self._run_motion_cuda(batch)

    def _motion_rows(self, rows: torch.Tensor) -> torch.Tensor:
        mel = rows[:, : self._n_mel].unflatten(1, self._window)
        a = self._n_mel + self._n_knobs
        return self.model.motion(mel, rows[:, self._n_mel : a], rows[:, a : a + 2]).float()

    def _ensure_motion_graphs(self) -> None:
        if self._motion_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad(), torch.cuda.device(self.device), _collector_held_off():
            for rows in sorted(self.batch_sizes, reverse=True):  # largest first: pool reuse
                static_in = torch.zeros((rows, self._row_len), dtype=torch.float32,
                                        device=self.device)
                with torch.cuda.stream(self._compute):
                    try:
                        for _ in range(3):  # compile, warm the allocator
                            self._motion_fn(static_in)
                    except Exception:
                        if self._motion_fn == self._motion_rows:
                            raise
                        log.exception("torch.compile failed; running the motion uncompiled")
                        self._motion_fn = self._motion_rows
                        self._motion_fn(static_in)
                self._compute.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=self._compute,
                                      capture_error_mode="thread_local"):
                    coefficients = self._motion_fn(static_in)
                self._motion_graphs[rows] = _MotionGraph(static_in, coefficients, graph)
            torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs for the motion alone", len(self._motion_graphs))

    def _run_motion_cuda(self, batch: list[FrameInput]) -> np.ndarray:
        n = len(batch)
        if self.use_graphs:
            self._ensure_motion_graphs()
        host_in, dev_in = self._staging(n)
        self._pack(batch, [0] * n, host_in.numpy())
        out = torch.empty((n, self._n_coefficients), dtype=torch.float32, pin_memory=True)
        with torch.cuda.device(self.device), torch.cuda.stream(self._compute):
            dev_in[:n].copy_(host_in[:n], non_blocking=True)
            done = 0
            for k, padded in self._chunks(n):
                if self.use_graphs:
                    g = self._motion_graphs[padded]
                    g.static_in[:k].copy_(dev_in[done : done + k])
                    g.graph.replay()
                    coefficients = g.coefficients
                else:
                    coefficients = self._motion_fn(dev_in[done : done + k])
                # On the stream that replays: the next chunk's replay waits for this copy.
                out[done : done + k].copy_(coefficients[:k], non_blocking=True)
                done += k
            self._compute.synchronize()
        return out.numpy()

    def run(self, batch: list[FrameInput]) -> BatchOutput:
        self._check_windows(batch)
        with self._lock:
            slots, size = batch_slots(self._slots, batch, lambda slot: slot.size)
            bank = self._banks[size]
            used = {(size, s.row) for s in slots}
            self._in_use |= used
        try:
            rows = [s.row for s in slots]
            with torch.no_grad():
                if self.on_cuda:
                    return self._run_cuda(batch, rows, bank)
                return self._run_cpu(batch, rows, bank)
        finally:
            with self._lock:
                self._in_use -= used
                still = [(b, r) for b, r in self._deferred if (b.size, r) in self._in_use]
                for b, r in self._deferred:
                    if (b.size, r) not in self._in_use:
                        b.free.append(r)
                self._deferred = still

    def _run_cpu(self, batch: list[FrameInput], rows: list[int], bank: _Bank) -> BatchOutput:
        n = len(batch)
        packed = np.empty((n, self._row_len), np.float32)
        self._pack(batch, rows, packed)
        frames = np.empty((n, *frame_shape(self.pixels, bank.size)), np.uint8)
        coefficients = np.empty((n, self._n_coefficients), np.float32)
        done = 0
        for k, padded in self._chunks(n):
            chunk = np.zeros((padded, self._row_len), np.float32)
            chunk[:k] = packed[done : done + k]
            chunk[k:, -1] = rows[0]  # padding rows read a valid bank row
            f, c = self._forward(torch.from_numpy(chunk), bank)
            frames[done : done + k] = f[:k].numpy()
            coefficients[done : done + k] = c[:k].numpy()
            done += k
        return BatchOutput(frames=frames, coefficients=coefficients)

    def _staging(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pinned host and device input rows, grown to ``n`` (reused across calls: ``run`` is
        synchronous, so the last upload has finished before the next one overwrites)."""
        if self._host_in.shape[0] < n:
            rows = max(n, 2 * self._host_in.shape[0], self.max_chunk or 1)
            self._host_in = torch.empty((rows, self._row_len), dtype=torch.float32,
                                        pin_memory=True)
            self._dev_in = torch.empty((rows, self._row_len), dtype=torch.float32,
                                       device=self.device)
        return self._host_in, self._dev_in

    def _run_cuda(self, batch: list[FrameInput], rows: list[int], bank: _Bank) -> BatchOutput:
        n = len(batch)
        size = bank.size
        if self.use_graphs:
            self._ensure_graphs(bank)
        host_in, dev_in = self._staging(n)
        self._pack(batch, rows, host_in.numpy())
        frames = torch.empty((n, *frame_shape(self.pixels, size)), dtype=torch.uint8,
                             pin_memory=True)
        coefficients = torch.empty((n, self._n_coefficients), dtype=torch.float32,
                                   pin_memory=True)
        timing = self.collect_timings
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if timing else []
        with torch.cuda.device(self.device):
            compute, copy = self._compute, self._copy
            with torch.cuda.stream(compute):
                if timing:
                    marks[0].record(compute)
                dev_in[:n].copy_(host_in[:n], non_blocking=True)
                if timing:
                    marks[1].record(compute)
            done = 0
            for k, padded in self._chunks(n):
                with torch.cuda.stream(compute):
                    if self.use_graphs:
                        g = bank.graphs[padded]
                        compute.wait_event(g.copied)
                        g.static_in[:k].copy_(dev_in[done : done + k])
                        if k < padded:  # padding rows: a valid bank row, outputs ignored
                            g.static_in[k:, -1] = float(rows[0])
                        g.graph.replay()
                        out_f, out_c = g.frames, g.coefficients
                    else:
                        out_f, out_c = self._forward(dev_in[done : done + k], bank)
                    ready = torch.cuda.Event()
                    ready.record(compute)
                with torch.cuda.stream(copy):
                    copy.wait_event(ready)
                    frames[done : done + k].copy_(out_f[:k], non_blocking=True)
                    coefficients[done : done + k].copy_(out_c[:k], non_blocking=True)
                    if self.use_graphs:
                        g.copied.record(copy)
                    else:  # eager outputs came from compute's allocator pool
                        out_f.record_stream(copy)
                        out_c.record_stream(copy)
                done += k
            if timing:
                marks[2].record(copy)
            copy.synchronize()
        if timing:
            self.last_timings = {"upload_ms": marks[0].elapsed_time(marks[1]),
                                 "compute_and_copy_ms": marks[1].elapsed_time(marks[2])}
        coeffs = coefficients.numpy()
        if self.precision == "amp" and not np.isfinite(coeffs).all():
            self._fp32_fallback(frames, coefficients, dev_in[:n], bank)
        return BatchOutput(frames=frames.numpy(), coefficients=coefficients.numpy())

    def _fp32_fallback(self, frames: torch.Tensor, coefficients: torch.Tensor,
                       dev_in: torch.Tensor, bank: _Bank) -> None:
        """Recompute rows whose autocast coefficients are not finite, in eager FP32."""
        bad = np.flatnonzero(~np.isfinite(coefficients.numpy()).all(axis=1))
        log.warning("FP16 gave non-finite coefficients for %d frames; recomputing in FP32",
                    len(bad))
        with torch.cuda.device(self.device), torch.cuda.stream(self._compute):
            index = torch.from_numpy(bad).to(self.device)
            f, c = self._forward(dev_in.index_select(0, index), bank, amp=False, compiled=False)
            frames[torch.from_numpy(bad)] = f.cpu()
            coefficients[torch.from_numpy(bad)] = c.cpu()
        self._compute.synchronize()
