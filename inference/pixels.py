"""How an engine's frames are laid out: RGB, or I420 as the server's video encoders take it.

A served frame goes from the engine to a VP8 encoder that takes I420 (planar YUV 4:2:0).
Converting there, on a media worker, cost a colour conversion per new frame of every
session; converting where the frame is made costs the GPU next to nothing, and halves the
bytes that cross back from the device, the shared-memory ring and the worker's copy.

I420 here is exactly OpenCV's ``COLOR_RGB2YUV_I420``, so every runtime's frames and the
worker's idle portrait look alike: BT.601 studio range (Y 16-235, U/V 16-240), each
chroma sample taken from the top-left pixel of its 2x2 block, the planes one after
another in a (3H/2, W) array (Y; then U and V, each H/4 rows of W bytes).
"""

from __future__ import annotations

import cv2
import numpy as np

RGB = "rgb"
I420 = "i420"
PIXELS: tuple[str, ...] = (RGB, I420)

#: Rows Y, U, V of the BT.601 studio-range transform of RGB in 0-255, and its offsets.
BT601 = np.array([[65.481, 128.553, 24.966],
                  [-37.797, -74.203, 112.0],
                  [112.0, -93.786, -18.214]], np.float32) / 255.0
BT601_OFFSET = np.array([16.0, 128.0, 128.0], np.float32)


def check(pixels: str) -> str:
    if pixels not in PIXELS:
        raise ValueError(f"pixels={pixels!r}; one of {', '.join(PIXELS)}")
    return pixels


def frame_shape(pixels: str, side: int) -> tuple[int, ...]:
    """One square frame's array shape."""
    return (side * 3 // 2, side) if pixels == I420 else (side, side, 3)


def frame_side(pixels: str, frame: np.ndarray) -> int:
    """The side of the square picture ``frame`` holds (0: no picture)."""
    return int(frame.shape[1]) if pixels == I420 else int(frame.shape[0])


def rgb_to_i420(frames: np.ndarray) -> np.ndarray:
    """(B, H, W, 3) RGB frames as (B, 3H/2, W) I420 (or one (H, W, 3) frame as one)."""
    if frames.ndim == 3:
        return cv2.cvtColor(frames, cv2.COLOR_RGB2YUV_I420)
    n, h, w, _ = frames.shape
    out = np.empty((n, h * 3 // 2, w), np.uint8)
    for frame, planes in zip(frames, out, strict=True):
        cv2.cvtColor(frame, cv2.COLOR_RGB2YUV_I420, dst=planes)
    return out


def as_pixels(frames: np.ndarray, pixels: str) -> np.ndarray:
    """RGB frames from a model, in the layout ``pixels`` names."""
    return rgb_to_i420(frames) if pixels == I420 and frames.shape[1] else frames
