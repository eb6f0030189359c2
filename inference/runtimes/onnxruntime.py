"""The engine on onnxruntime's CPU provider: the default, torch-free server runtime."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from inference.engine import (
    BatchOutput,
    FrameInput,
    Manifest,
    PreparedPortrait,
    coefficients_by_rendering,
)
from inference.pixels import RGB, as_pixels, check
from inference.runtimes.slots import batch_slots

_INPUTS = ("mel", "portrait", "geometry", "knobs", "clock")
_OUTPUTS = ("frame", "coefficients")
_MOTION_INPUTS = ("mel", "knobs", "clock")


@dataclass(frozen=True)
class _Slot:
    chw: np.ndarray  # float32 (3, S, S) in [0, 1], converted once at prepare()
    geometry: np.ndarray  # float32 (len(geometry_names),)

    @property
    def size(self) -> int:
        return int(self.chw.shape[1])


def _open(path: str, options: ort.SessionOptions, inputs: tuple[str, ...],
          outputs: tuple[str, ...]) -> ort.InferenceSession:
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    got_in = tuple(i.name for i in session.get_inputs())
    got_out = tuple(o.name for o in session.get_outputs())
    if sorted(got_in) != sorted(inputs) or sorted(got_out) != sorted(outputs):
        raise ValueError(f"{path}: expected I/O {inputs} -> {outputs}, got {got_in} -> {got_out}")
    return session


class OnnxRuntimeEngine:
    """Runs a manifest's ONNX graph; ``run`` from one worker thread, the rest from anywhere.

    Only the slot table is locked: ``prepare``/``release`` from the event loop never wait
    for a batch in flight, and a slot released mid-batch stays alive until that batch ends
    (its arrays are immutable and referenced by the batch).
    """

    def __init__(self, manifest: Manifest, intra_op_threads: int = 1, pixels: str = RGB) -> None:
        self.manifest = manifest
        self.pixels = check(pixels)
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = _open(manifest.onnx, options, _INPUTS, _OUTPUTS)
        self.motion_session = None if manifest.motion_onnx is None else \
            _open(manifest.motion_onnx, options, _MOTION_INPUTS, ("coefficients",))
        self._mel_shape = (manifest.window_frames, manifest.features.n_mels)
        self._slots: dict[int, _Slot] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def prepare(self, portrait: PreparedPortrait) -> int:
        image, geometry = portrait.image, np.asarray(portrait.geometry, dtype=np.float32)
        if image.ndim != 3 or image.shape[2] != 3 or image.shape[0] != image.shape[1]:
            raise ValueError(f"portrait must be (S, S, 3) RGB, got {image.shape}")
        wanted = len(self.manifest.geometry_names)
        if geometry.ndim != 1 or geometry.shape[0] < wanted:
            raise ValueError(f"geometry must have at least {wanted} values, got {geometry.shape}")
        geometry = geometry[:wanted]  # the model's own prefix of GEOMETRY_NAMES
        chw = np.empty((3, image.shape[0], image.shape[1]), dtype=np.float32)
        np.multiply(image.transpose(2, 0, 1), np.float32(1.0 / 255.0), out=chw)
        chw.flags.writeable = False
        geometry = geometry.copy()
        geometry.flags.writeable = False
        slot = _Slot(chw, geometry)
        with self._lock:
            slot_id = next(self._ids)
            self._slots[slot_id] = slot
        return slot_id

    def release(self, slot: int) -> None:
        """Forget a slot; releasing an unknown or already released slot is a no-op."""
        with self._lock:
            self._slots.pop(slot, None)

    def frame_size(self, slot: int) -> int:
        return self._slot(slot).size

    def _slot(self, slot: int) -> _Slot:
        with self._lock:
            try:
                return self._slots[slot]
            except KeyError:
                raise KeyError(f"unknown or released portrait slot {slot}") from None

    def _check_windows(self, batch: list[FrameInput]) -> None:
        for item in batch:
            if item.mel.shape != self._mel_shape:
                raise ValueError(f"mel window must be {self._mel_shape}, got {item.mel.shape}")

    def run_motion(self, batch: list[FrameInput]) -> np.ndarray:
        if self.motion_session is None:
            return coefficients_by_rendering(self, batch)
        if not batch:
            raise ValueError("empty batch")
        self._check_windows(batch)
        feeds = {name: np.stack([getattr(item, name) for item in batch]).astype(
            np.float32, copy=False) for name in _MOTION_INPUTS}
        return self.motion_session.run(["coefficients"], feeds)[0]

    def run(self, batch: list[FrameInput]) -> BatchOutput:
        with self._lock:
            slots, _ = batch_slots(self._slots, batch, lambda slot: slot.size)
        self._check_windows(batch)
        if len(slots) == 1:
            portrait = slots[0].chw[None]  # a view, no copy
        else:
            portrait = np.stack([s.chw for s in slots])
        feeds = {
            "mel": np.stack([item.mel for item in batch]).astype(np.float32, copy=False),
            "portrait": portrait,
            "geometry": np.stack([s.geometry for s in slots]),
            "knobs": np.stack([item.knobs for item in batch]).astype(np.float32, copy=False),
            "clock": np.stack([item.clock for item in batch]).astype(np.float32, copy=False),
        }
        frames, coefficients = self.session.run(list(_OUTPUTS), feeds)
        return BatchOutput(frames=as_pixels(frames, self.pixels), coefficients=coefficients)
