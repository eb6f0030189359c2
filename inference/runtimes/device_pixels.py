"""RGB frames to I420 where the engine made them, as ``inference.pixels`` defines I420.

On a GPU one Triton kernel reads each RGB byte once and writes the planes. Measured on
an H200 at 512x512, batch 128: as a chain of torch ops it took 1.6 ms, about what copying
back half the bytes saves; compiled with the model, the compiler recomputed the renderer
for each plane (GPU time x1.5); compiled alone with dynamic shapes, 4.8 ms. Where Triton
is missing, and on the CPU, the same arithmetic runs as torch ops. Both round as OpenCV's
conversion does, to within one level.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from inference.pixels import BT601, BT601_OFFSET

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch ships no Triton
    triton = None

log = logging.getLogger(__name__)

_Y, _U, _V = (tuple(float(c) for c in row) for row in BT601)
_OFFSET = tuple(float(c) + 0.5 for c in BT601_OFFSET)  # + 0.5: round, then truncate


def _plane(rgb: tuple[torch.Tensor, torch.Tensor, torch.Tensor], row: tuple[float, ...],
           offset: float) -> torch.Tensor:
    r, g, b = rgb
    return (r * row[0] + g * row[1] + b * row[2] + offset).clamp(0, 255).to(torch.uint8)


def i420_torch(frames: torch.Tensor) -> torch.Tensor:
    """(B, S, S, 3) uint8 RGB as (B, 3S/2, S) I420, in torch ops (constants only: nothing
    to copy from the host inside a captured CUDA graph)."""
    n, h, w, _ = frames.shape
    pixels = frames.float().unbind(-1)
    corners = frames[:, ::2, ::2].float().unbind(-1)  # chroma: top-left of each 2x2 block
    out = torch.empty((n, h * 3 // 2, w), dtype=torch.uint8, device=frames.device)
    out[:, :h] = _plane(pixels, _Y, _OFFSET[0])
    chroma = out[:, h:].view(n, 2, h // 2, w // 2)
    chroma[:, 0] = _plane(corners, _U, _OFFSET[1])
    chroma[:, 1] = _plane(corners, _V, _OFFSET[2])
    return out


if triton is not None:
    _YR, _YG, _YB = (tl.constexpr(c) for c in _Y)
    _UR, _UG, _UB = (tl.constexpr(c) for c in _U)
    _VR, _VG, _VB = (tl.constexpr(c) for c in _V)
    _YO, _UO, _VO = (tl.constexpr(c) for c in _OFFSET)

    @triton.jit
    def _i420_kernel(src, dst, height, width, s_n, s_h, s_w, s_c, BLOCK: tl.constexpr):
        """One program per frame and row pair: Y of both rows, then U and V of the pair."""
        n = tl.program_id(0).to(tl.int64)
        pair = tl.program_id(1)
        frame = src + n * s_n
        plane = height * width
        out = dst + n * (plane + plane // 2)
        x = tl.arange(0, BLOCK)
        inside = x < width
        for dy in tl.static_range(2):
            row = 2 * pair + dy
            at = frame + row * s_h + x * s_w
            r = tl.load(at, mask=inside, other=0).to(tl.float32)
            g = tl.load(at + s_c, mask=inside, other=0).to(tl.float32)
            b = tl.load(at + 2 * s_c, mask=inside, other=0).to(tl.float32)
            y = r * _YR + g * _YG + b * _YB + _YO
            y = tl.minimum(tl.maximum(y, 0.0), 255.0)
            tl.store(out + row * width + x, y.to(tl.uint8), mask=inside)
        half = tl.arange(0, BLOCK // 2)
        inside = half < width // 2
        at = frame + 2 * pair * s_h + 2 * half * s_w
        r = tl.load(at, mask=inside, other=0).to(tl.float32)
        g = tl.load(at + s_c, mask=inside, other=0).to(tl.float32)
        b = tl.load(at + 2 * s_c, mask=inside, other=0).to(tl.float32)
        u = tl.minimum(tl.maximum(r * _UR + g * _UG + b * _UB + _UO, 0.0), 255.0)
        v = tl.minimum(tl.maximum(r * _VR + g * _VG + b * _VB + _VO, 0.0), 255.0)
        chroma = out + plane + pair * (width // 2) + half
        tl.store(chroma, u.to(tl.uint8), mask=inside)
        tl.store(chroma + plane // 4, v.to(tl.uint8), mask=inside)


def i420_triton(frames: torch.Tensor) -> torch.Tensor:
    """``i420_torch`` in one kernel; ``frames`` may be any strided view (the renderer's
    frames are an NHWC view of NCHW planes)."""
    n, h, w, _ = frames.shape
    out = torch.empty((n, h * 3 // 2, w), dtype=torch.uint8, device=frames.device)
    if n:
        with torch.cuda.device(frames.device):  # Triton launches on the current device
            _i420_kernel[(n, h // 2)](frames, out, h, w, *frames.stride(),
                                      BLOCK=max(2, triton.next_power_of_2(w)))
    return out


class DeviceI420:
    """RGB to I420 for one engine: the Triton kernel where the engine runs on a GPU and
    Triton imports, else torch ops. Should the kernel fail (Triton builds a launcher with
    the host's C compiler at first use), it says so once and the torch ops take over, as
    the engine's uncompiled model takes over from a failed ``torch.compile``."""

    def __init__(self, on_gpu: bool,
                 kernel: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if kernel is None and on_gpu and triton is not None:
            kernel = i420_triton
        self.kernel = kernel

    def __call__(self, frames: torch.Tensor) -> torch.Tensor:
        """(B, S, S, 3) uint8 RGB as (B, 3S/2, S) I420 on the frames' device."""
        if self.kernel is not None:
            try:
                return self.kernel(frames)
            except Exception:
                log.exception("the I420 kernel failed; converting with torch ops from now on")
                self.kernel = None
        return i420_torch(frames)
