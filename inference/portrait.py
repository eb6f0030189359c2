"""Turn a decoded photo into a :class:`PreparedPortrait`: find the face, crop around it,
measure its geometry.

Everything here runs once per upload, off the event loop, so it favours robustness over
speed, but stays well under ~50 ms for a 512x512 photo on a small CPU. Decoding lives in
:mod:`inference.images`, detection in :mod:`inference.face_detect`, the geometry in
:mod:`inference.face_geometry`; imports run that way only.

Run ``python -m inference.portrait [image] [out.png]`` to time detection and write a check
image with the geometry drawn on the crop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from inference.engine import GEOMETRY_NAMES, PreparedPortrait
from inference.face_detect import FaceBox, detect_face
from inference.face_geometry import portrait_geometry
from inference.images import (
    DEFAULT_AVATAR_PATH,
    check_rgb,
    decode_image,
    image_size,
    jpeg_reduction,
)

__all__ = ["PortraitSource", "decode_portrait_source", "draw_geometry", "prepare_portrait"]

#: Crop centre sits this far (fraction of face height) below the face box centre, so a
#: little neck shows: the detector's box runs from the forehead to the chin.
_CROP_SHIFT_DOWN = 0.03


@dataclass(frozen=True)
class PortraitSource:
    """An upload decoded for its portraits, and the face found in it."""

    image: np.ndarray  # RGB: the upload, or the upload scaled down while it was decoded
    face: FaceBox  # in ``image``'s pixels
    width: int  # the upload's own size, after any EXIF rotation
    height: int


def crop_side(face: FaceBox, expand_ratio: float) -> int:
    """The side, in the image's pixels, of the square a portrait is cropped to."""
    return max(2, round(max(face.w, face.h) * (1.0 + 2.0 * expand_ratio)))


def decode_portrait_source(data: bytes, *, largest: int, expand_ratio: float = 0.5,
                           **limits: int) -> PortraitSource:
    """Decode an upload only as finely as its portraits need (``limits`` as for
    ``decode_image``). A large JPEG is decoded scaled down first, its shorter side kept at
    least twice the ``largest`` portrait side; only if the face found there is too small
    for that portrait's crop is it decoded again, as finely as the crop needs. A
    4000x3000 photo then decodes in about a quarter of the time and memory."""
    reduction = jpeg_reduction(data, 2 * largest)
    image = decode_image(data, reduction=reduction, **limits)
    face = detect_face(image)
    side = crop_side(face, expand_ratio)
    if reduction > 1 and side < largest:
        reduction = max((r for r in (2, 4) if r < reduction and side * reduction // r >= largest),
                        default=1)
        image = decode_image(data, reduction=reduction, **limits)
        face = detect_face(image)
    width, height = image_size(data)
    if (image.shape[1] > image.shape[0]) != (width > height):  # EXIF turned it
        width, height = height, width
    return PortraitSource(image, face, width, height)


def prepare_portrait(
    rgb: np.ndarray,
    *,
    size: int = 256,
    expand_ratio: float = 0.5,
    face: FaceBox | None = None,
) -> PreparedPortrait:
    """Crop a square around the face, resize it to ``size``, and measure its geometry.

    ``expand_ratio`` is the margin added on *each* side of the face box, as a fraction of
    the box's longer side: the crop side is ``max(w, h) * (1 + 2 * expand_ratio)``, so 0
    crops to the face box itself and the default 0.5 gives a crop twice the box's size
    (head, hair and a little neck). The crop is centred on the box centre moved down by
    3% of the box height, so a little neck shows. Parts of the crop
    outside the photo are filled by edge replication, so there is no hard, flat border for
    the model to warp. ``face`` skips detection when the caller already has it.

    Geometry (see ``GEOMETRY_NAMES``) is in the crop's normalised [-1, 1] frame
    (grid-sample, align_corners=False), clipped to [-1, 1]. Raises ``PortraitError("no_face")``.
    """
    check_rgb(rgb)
    if not 16 <= size <= 4096:
        raise ValueError(f"size must be in [16, 4096], got {size}")
    if not 0.0 <= expand_ratio <= 4.0:
        raise ValueError(f"expand_ratio must be in [0, 4], got {expand_ratio}")
    if face is None:
        face = detect_face(rgb)

    H, W = rgb.shape[:2]
    side = crop_side(face, expand_ratio)
    cx, cy = face.centre
    cy += _CROP_SHIFT_DOWN * face.h
    x0, y0 = round(cx - 0.5 * side), round(cy - 0.5 * side)
    x1, y1 = x0 + side, y0 + side

    inner = rgb[max(0, y0) : min(H, y1), max(0, x0) : min(W, x1)]
    if inner.size == 0:  # only possible with a hand-made FaceBox outside the image
        raise ValueError("the face box lies outside the image")
    crop = cv2.copyMakeBorder(
        inner, max(0, -y0), max(0, y1 - H), max(0, -x0), max(0, x1 - W), cv2.BORDER_REPLICATE
    )
    if side != size:
        interp = cv2.INTER_AREA if side > size else cv2.INTER_CUBIC
        crop = cv2.resize(crop, (size, size), interpolation=interp)
    crop = np.ascontiguousarray(crop)

    # The face box in the crop's pixels seeds the landmark model and is its fallback.
    k = size / side

    def in_crop(point: tuple[float, float] | None) -> tuple[float, float] | None:
        return None if point is None else ((point[0] - x0) * k, (point[1] - y0) * k)

    crop_face = FaceBox(x=(face.x - x0) * k, y=(face.y - y0) * k, w=face.w * k, h=face.h * k,
                        left_eye=in_crop(face.left_eye), right_eye=in_crop(face.right_eye))
    geometry, source = portrait_geometry(crop, crop_face)
    return PreparedPortrait(image=crop, geometry=geometry, source=source)


def draw_geometry(portrait: PreparedPortrait) -> np.ndarray:
    """The crop with its geometry drawn on (RGB): eyes green, mouth red, chin blue."""
    img = portrait.image.copy()
    s = portrait.size
    g = dict(zip(GEOMETRY_NAMES, portrait.geometry.tolist(), strict=True))

    def px(n: float) -> int:
        return round((n + 1.0) * 0.5 * s - 0.5)

    r = max(2, s // 128)
    for name in ("eye_left", "eye_right"):
        cv2.circle(img, (px(g[f"{name}_x"]), px(g[f"{name}_y"])), r, (0, 255, 0), -1)
    mx, my = px(g["mouth_x"]), px(g["mouth_y"])
    hw = round(g["mouth_half_width"] * 0.5 * s)
    cv2.line(img, (mx - hw, my), (mx + hw, my), (255, 0, 0), max(1, r // 2))
    cv2.circle(img, (mx, my), r, (255, 0, 0), -1)
    cv2.circle(img, (mx, px(g["chin_y"])), r, (0, 0, 255), -1)
    return img


def _main(argv: list[str]) -> None:
    import sys
    import time

    src = Path(argv[0]) if argv else DEFAULT_AVATAR_PATH
    out = Path(argv[1]) if len(argv) > 1 else Path("/tmp/portrait_check.png")
    rgb = decode_image(src.read_bytes())
    detect_face(rgb)  # warm-up: loading the detector is a one-off cost
    times = []
    for _ in range(10):
        t = time.perf_counter()
        face = detect_face(rgb)
        portrait = prepare_portrait(rgb, face=face)
        times.append(time.perf_counter() - t)
    print(f"{src.name} {rgb.shape[1]}x{rgb.shape[0]}: {face}", file=sys.stderr)
    print(f"detect+prepare median {1000 * sorted(times)[len(times) // 2]:.1f} ms", file=sys.stderr)
    for name, value in zip(GEOMETRY_NAMES, portrait.geometry.tolist(), strict=True):
        print(f"  {name:18s} {value:+.3f}", file=sys.stderr)
    big = prepare_portrait(rgb, size=512, face=face)
    cv2.imwrite(str(out), cv2.cvtColor(draw_geometry(big), cv2.COLOR_RGB2BGR))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
