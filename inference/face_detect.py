"""Find the face in a portrait with OpenCV's bundled Haar cascades (no model download):
the face box, its eyes, and the Haar proportions that place mouth and chin from them.

Run ``python -m inference.portrait [image] [out.png]`` to time detection.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from inference.images import PortraitError, check_rgb

__all__ = ["FaceBox", "detect_face", "face_points"]

#: Longest side of the grayscale copy the face cascade first runs on (speed), and the
#: smallest face that pass looks for, as a fraction of the copy's shorter side.
_DETECT_SIDE = 320
_DETECT_MIN_FRAC = 0.1
#: Second, finer pass for photos where the face is small; only runs when the first finds none.
_DETECT_SIDE_FINE = 800
#: Smallest face any pass reports, in pixels of its copy (the cascade window is 20x20).
_MIN_FACE = 24
#: The upper part of the face box is resized to this width before looking for eyes.
_EYE_FACE_WIDTH = 160

#: Standard eye positions within a Haar frontal-face box (fractions of w, h), measured on
#: the bundled astronaut (0.27/0.73, 0.38) and Grace Hopper (0.29/0.65, 0.36); used where
#: the eye cascade finds nothing usable.
_EYE_X = (0.29, 0.71)
_EYE_Y = 0.37

_cascade_lock = threading.Lock()
_cascades: dict[str, cv2.CascadeClassifier] = {}


def _cascade(name: str) -> cv2.CascadeClassifier:
    """Load an OpenCV-bundled cascade once. Call with ``_cascade_lock`` held."""
    clf = _cascades.get(name)
    if clf is None:
        clf = cv2.CascadeClassifier(str(Path(cv2.data.haarcascades) / name))
        if clf.empty():
            raise RuntimeError(f"OpenCV Haar cascade {name} is missing")
        _cascades[name] = clf
    return clf


@dataclass(frozen=True)
class FaceBox:
    """A detected face in image pixels (continuous coordinates: pixel i spans [i, i+1]).

    ``left_eye`` / ``right_eye`` are eye centres (x, y) on the image's left / right, or
    ``None`` when the eye cascade could not find that eye; :meth:`eye_centres` fills the gap.
    """

    x: float
    y: float
    w: float
    h: float
    left_eye: tuple[float, float] | None = None
    right_eye: tuple[float, float] | None = None

    @property
    def centre(self) -> tuple[float, float]:
        return (self.x + 0.5 * self.w, self.y + 0.5 * self.h)

    def eye_centres(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """Detected eye centres, or standard proportions of the box where one is missing.

        With one eye found, the other keeps its standard x but takes the found eye's height:
        Haar boxes are not centred on the face precisely enough to mirror the found eye.
        """
        ey = self.y + _EYE_Y * self.h
        left = self.left_eye
        right = self.right_eye
        if left is None:
            left = (self.x + _EYE_X[0] * self.w, right[1] if right is not None else ey)
        if right is None:
            right = (self.x + _EYE_X[1] * self.w, left[1] if self.left_eye is not None else ey)
        return left, right


def _detect_faces(
    gray: np.ndarray, side: int, min_size: int, max_size: int = 0
) -> tuple[np.ndarray, float]:
    """Faces (x, y, w, h) found on a copy of ``gray`` shrunk to at most ``side`` (sizes in
    pixels of that copy), and the copy's scale."""
    h, w = gray.shape
    scale = min(1.0, side / max(h, w))
    small = gray
    if scale < 1.0:
        small = cv2.resize(
            gray, (max(1, round(w * scale)), max(1, round(h * scale))),
            interpolation=cv2.INTER_AREA,
        )
    small = cv2.equalizeHist(small)  # evens out exposure; the cascade was trained so
    with _cascade_lock:  # CascadeClassifier is not safe to share between threads
        faces = _cascade("haarcascade_frontalface_alt2.xml").detectMultiScale(
            small, scaleFactor=1.1, minNeighbors=5, minSize=(min_size, min_size),
            maxSize=(max_size, max_size),
        )
    return np.asarray(faces, dtype=np.float64).reshape(-1, 4), scale


def _detect_eyes(
    gray: np.ndarray, fx: float, fy: float, fw: float, fh: float
) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
    """Eye centres inside the upper half of the face box, one per side of the box, or None.

    The band is resized to a fixed face width so the eye cascade's 20 px window always
    matches the eye size, whatever the photo's resolution. It is not equalised: that washes
    out eyes behind glasses. The glasses-tolerant cascade is tried when the plain one misses.
    """
    H, W = gray.shape
    x0, x1 = max(0, int(fx)), min(W, int(math.ceil(fx + fw)))
    y0, y1 = max(0, int(fy + 0.15 * fh)), min(H, int(math.ceil(fy + 0.6 * fh)))
    if x1 - x0 < 8 or y1 - y0 < 8:
        return None, None
    s = _EYE_FACE_WIDTH / fw
    band = cv2.resize(
        gray[y0:y1, x0:x1],
        (max(1, round((x1 - x0) * s)), max(1, round((y1 - y0) * s))),
        interpolation=cv2.INTER_AREA if s < 1.0 else cv2.INTER_LINEAR,
    )
    lo, hi = round(0.10 * _EYE_FACE_WIDTH), round(0.40 * _EYE_FACE_WIDTH)
    cx = fx + 0.5 * fw
    best: dict[str, tuple[float, tuple[float, float]]] = {}
    for name in ("haarcascade_eye.xml", "haarcascade_eye_tree_eyeglasses.xml"):
        with _cascade_lock:
            eyes = _cascade(name).detectMultiScale(
                band, scaleFactor=1.1, minNeighbors=3, minSize=(lo, lo), maxSize=(hi, hi)
            )
        for ex, ey, ew, eh in np.asarray(eyes, dtype=np.float64).reshape(-1, 4):
            px = x0 + (ex + 0.5 * ew) / s
            py = y0 + (ey + 0.5 * eh) / s
            rel_x, rel_y = (px - fx) / fw, (py - fy) / fh
            if not (0.22 <= rel_y <= 0.52 and 0.1 <= rel_x <= 0.9):
                continue  # eyebrows, nostrils, hair
            side = "left" if px < cx else "right"
            # Prefer the candidate nearest the standard eye position for that side.
            want_x = _EYE_X[0] if side == "left" else _EYE_X[1]
            cost = (rel_x - want_x) ** 2 + (rel_y - _EYE_Y) ** 2
            if side not in best or cost < best[side][0]:
                best[side] = (cost, (float(px), float(py)))
        if len(best) == 2:
            break
    left = best["left"][1] if "left" in best else None
    right = best["right"][1] if "right" in best else None
    if left is not None and right is not None:
        dx, dy = right[0] - left[0], right[1] - left[1]
        if not (0.3 * fw <= dx <= 0.6 * fw and abs(dy) <= 0.35 * dx):
            return None, None  # an implausible pair: trust neither
    return left, right


def detect_face(rgb: np.ndarray) -> FaceBox:
    """Find the largest frontal face (and its eyes) in an RGB uint8 image.

    Detection runs on an equalised grayscale copy shrunk to 320 px, looking for faces at
    least a tenth of the shorter side; if that finds none, a finer pass at up to 800 px
    looks for smaller ones. The eyes are searched at full resolution inside the face box.
    Raises ``PortraitError("no_face")``.
    """
    check_rgb(rgb)
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    short = min(gray.shape)
    coarse_scale = min(1.0, _DETECT_SIDE / max(gray.shape))
    coarse_min = max(_MIN_FACE, round(_DETECT_MIN_FRAC * short * coarse_scale))
    faces, scale = _detect_faces(gray, _DETECT_SIDE, coarse_min)
    fine_scale = min(1.0, _DETECT_SIDE_FINE / max(gray.shape))
    # The fine pass only pays off if it can see faces smaller than the coarse pass did.
    coarse_min_fine = coarse_min / coarse_scale * fine_scale
    if len(faces) == 0 and coarse_min_fine > _MIN_FACE:
        faces, scale = _detect_faces(
            gray, _DETECT_SIDE_FINE, _MIN_FACE, math.ceil(1.25 * coarse_min_fine)
        )
    if len(faces) == 0:
        raise PortraitError(
            "no_face",
            "No face was found; upload a well-lit, front-facing photo with one face.",
        )
    fx, fy, fw, fh = (faces[np.argmax(faces[:, 2] * faces[:, 3])] / scale).tolist()
    left, right = _detect_eyes(gray, fx, fy, fw, fh)
    return FaceBox(x=fx, y=fy, w=fw, h=fh, left_eye=left, right_eye=right)


#: Vertical distances are measured in a "face unit": the mean of the inter-eye distance and
#: 0.42 x the box height, which agree on a typical face; averaging damps an error in either.
#: Mouth centre lies 1 unit below the eye line, chin 0.7 unit below the mouth; the mouth
#: half-width is 0.47 x the inter-eye distance. Measured by eye on the astronaut (eyes
#: ~(202, 102)/(246, 104), mouth ~(224, 144), chin ~186, box h ~98; smiling) and Grace
#: Hopper (eyes ~(220, 187)/(302, 186), mouth ~(262, 278), chin ~328, box h 225).
_UNIT_BOX_H = 0.42
_MOUTH_BELOW_EYES = 1.0
_CHIN_BELOW_MOUTH = 0.7
_MOUTH_HALF_WIDTH = 0.47


def face_points(face: FaceBox) -> dict[str, tuple[float, float]]:
    """Eye, mouth and chin positions (image pixels) plus the mouth half-width (as a pair)."""
    (lx, ly), (rx, ry) = face.eye_centres()
    dx, dy = rx - lx, ry - ly
    dist = math.hypot(dx, dy) or 1.0
    unit = 0.5 * (dist + _UNIT_BOX_H * face.h)
    # "Down" the face is perpendicular to the eye line, so a tilted head keeps its mouth
    # under the eyes rather than straight below in image terms.
    down_x, down_y = -dy / dist, dx / dist
    mx, my = 0.5 * (lx + rx), 0.5 * (ly + ry)
    d_mouth = _MOUTH_BELOW_EYES * unit
    d_chin = d_mouth + _CHIN_BELOW_MOUTH * unit
    return {
        "eye_left": (lx, ly),
        "eye_right": (rx, ry),
        "mouth": (mx + down_x * d_mouth, my + down_y * d_mouth),
        "chin": (mx + down_x * d_chin, my + down_y * d_chin),
        "half_width": (_MOUTH_HALF_WIDTH * dist, 0.0),
    }
