"""A media worker's ring of frame slots in shared memory, laid out the same way by the
worker that creates it and the inference process that attaches to it."""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from inference.pixels import I420, frame_shape

#: Every field starts on a cache line of its own.
ALIGN = 64


@dataclass(frozen=True)
class RingLayout:
    """Where each slot's inputs and outputs lie in a worker's shared ring: ``slots`` slots
    with room for an I420 frame (the top left of the field, for a side below
    ``max_side``), then ``motion_slots`` without (motion-only sessions need only
    the coefficients back, so thousands of them fit in a few megabytes)."""

    slots: int
    window: tuple[int, int]  # (mel frames, mel bins)
    knobs: int
    coefficients: int
    max_side: int  # the largest frame side a slot holds
    motion_slots: int = 0

    def _fields(self, side: int) -> list[tuple[str, np.dtype[Any], tuple[int, ...]]]:
        return [("mel", np.dtype(np.float32), self.window),
                ("knobs", np.dtype(np.float32), (self.knobs,)),
                ("clock", np.dtype(np.float32), (2,)),
                ("coefficients", np.dtype(np.float32), (self.coefficients,)),
                ("frame", np.dtype(np.uint8), frame_shape(I420, side))]

    @staticmethod
    def _aligned(nbytes: int) -> int:
        return -(-nbytes // ALIGN) * ALIGN

    def slot_bytes(self, side: int) -> int:
        return sum(self._aligned(int(np.prod(shape)) * dtype.itemsize)
                   for _, dtype, shape in self._fields(side))

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes(self.max_side) + \
            self.motion_slots * self.slot_bytes(0)

    def views(self, buffer: memoryview) -> list[dict[str, np.ndarray]]:
        """Arrays over each slot's fields, made once: a frame then costs no allocation."""
        out = []
        offset = 0
        for index in range(self.slots + self.motion_slots):
            fields = {}
            for name, dtype, shape in self._fields(self.max_side if index < self.slots else 0):
                fields[name] = np.ndarray(shape, dtype, buffer=buffer, offset=offset)
                offset += self._aligned(int(np.prod(shape)) * dtype.itemsize)
            out.append(fields)
        return out


def unlink_ring(name: str) -> bool:
    """Remove a ring whose worker died without removing it; False if it was gone."""
    try:
        ring = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    ring.close()
    ring.unlink()
    return True
