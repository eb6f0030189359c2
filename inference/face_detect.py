"""Find the face in a portrait with MediaPipe's BlazeFace detectors: the face box, its
eyes and its mouth.

The models (``engines/face_detection_*_range.tflite``, Apache-2.0, see engines/NOTICE) run
on ai-edge-litert like the face mesh, so neither OpenCV's Haar cascades nor any particular
OpenCV build is needed. The short-range model (128 px input) sees faces that fill much of
the picture, the full-range one (192 px) smaller ones; both look at the whole picture, and
where neither finds a face the full-range one looks again at overlapping quarters of it,
for a face too small to see whole (a person across a room).

Run ``python -m inference.portrait [image] [out.png]`` to time detection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np

from inference.images import PortraitError, check_rgb
from inference.tflite import TfliteModel

__all__ = ["FaceBox", "detect_face", "face_points"]

#: Standard eye positions within a face box (fractions of w, h), for boxes made by hand
#: (no detector's eyes): measured on the default avatar and Grace Hopper.
_EYE_X = (0.29, 0.71)
_EYE_Y = 0.37
#: Weighted non-maximum suppression: detections overlapping the best by more than this
#: (intersection over union) are averaged into it (MediaPipe's own threshold).
_NMS_IOU = 0.3
#: The whole picture is looked at through one copy shrunk to at most this side (a 12
#: megapixel photo is shrunk once, not once per model).
_OVERVIEW_SIDE = 768
#: MediaPipe's keypoint order: the eye on the image's left (the subject's right), the
#: other eye, the nose tip, the mouth centre, then the ears.
_KP_LEFT_EYE, _KP_RIGHT_EYE, _KP_MOUTH = 0, 1, 3


@dataclass(frozen=True)
class FaceBox:
    """A detected face in image pixels (continuous coordinates: pixel i spans [i, i+1]).

    ``left_eye`` / ``right_eye`` are eye centres (x, y) on the image's left / right and
    ``mouth`` the mouth's centre, or ``None`` for a box made by hand; :meth:`eye_centres`
    then fills in standard proportions.
    """

    x: float
    y: float
    w: float
    h: float
    left_eye: tuple[float, float] | None = None
    right_eye: tuple[float, float] | None = None
    mouth: tuple[float, float] | None = None

    @property
    def centre(self) -> tuple[float, float]:
        return (self.x + 0.5 * self.w, self.y + 0.5 * self.h)

    def eye_centres(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """The detector's eye centres, or standard proportions of the box where one is
        missing (with one eye known, the other takes its height)."""
        ey = self.y + _EYE_Y * self.h
        left = self.left_eye
        right = self.right_eye
        if left is None:
            left = (self.x + _EYE_X[0] * self.w, right[1] if right is not None else ey)
        if right is None:
            right = (self.x + _EYE_X[1] * self.w, left[1] if self.left_eye is not None else ey)
        return left, right


def _anchor_centres(side: int, layers: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Anchor centres (x, y in [0, 1]) of MediaPipe's SSD anchors with a fixed anchor size:
    per layer, ``per_cell`` anchors at the centre of each cell of a grid at ``stride``."""
    out = []
    for stride, per_cell in layers:
        cells = side // stride
        ys, xs = np.mgrid[0:cells, 0:cells]
        centres = (np.stack([xs, ys], axis=-1).reshape(-1, 2) + 0.5) / cells
        out.append(np.repeat(centres, per_cell, axis=0))
    return np.concatenate(out).astype(np.float32)


@dataclass(frozen=True)
class _Detector:
    model: TfliteModel
    anchors: np.ndarray
    min_score: float  # MediaPipe's threshold for each model

    @property
    def side(self) -> int:
        return self.model.input_side


_SHORT_RANGE = _Detector(TfliteModel("face_detection_short_range.tflite", 128),
                         _anchor_centres(128, ((8, 2), (16, 6))), 0.5)
_FULL_RANGE = _Detector(TfliteModel("face_detection_full_range.tflite", 192),
                        _anchor_centres(192, ((4, 1),)), 0.6)


@dataclass(frozen=True, eq=False)  # compared by identity: its fields are arrays
class _Detection:
    score: float
    box: np.ndarray  # float64 (4,): x0, y0, x1, y1 in image pixels
    keypoints: np.ndarray  # float64 (6, 2) in image pixels


def _detect(rgb: np.ndarray, detector: _Detector, x0: int = 0, y0: int = 0,
            scale: float = 1.0) -> list[_Detection]:
    """Faces in ``rgb`` (letterboxed into the model's square input), in the pixels of the
    image it was cut from at (x0, y0) and then scaled by ``scale``."""
    h, w = rgb.shape[:2]
    side = detector.side
    s = side / max(h, w)
    rw, rh = max(1, round(w * s)), max(1, round(h * s))
    small = cv2.resize(rgb, (rw, rh), interpolation=cv2.INTER_AREA if s < 1 else cv2.INTER_LINEAR)
    ox, oy = (side - rw) // 2, (side - rh) // 2
    square = np.zeros((side, side, 3), np.float32)
    square[oy:oy + rh, ox:ox + rw] = small
    outputs = detector.model.run((square * (1.0 / 127.5) - 1.0)[None])
    if outputs is None:
        raise RuntimeError(f"the face detector cannot run: {detector.model.failed}")
    regressors = next(o for o in outputs if o.shape[-1] == 16).reshape(-1, 16)
    logits = next(o for o in outputs if o.shape[-1] == 1).reshape(-1)
    scores = 1.0 / (1.0 + np.exp(-np.clip(logits.astype(np.float64), -80.0, 80.0)))
    found = []
    for i in np.flatnonzero(scores >= detector.min_score):
        r = regressors[i].astype(np.float64) / side
        cx, cy = r[0] + detector.anchors[i, 0], r[1] + detector.anchors[i, 1]
        points = np.array([[cx - 0.5 * r[2], cy - 0.5 * r[3]], [cx + 0.5 * r[2], cy + 0.5 * r[3]],
                           *(r[4:].reshape(6, 2) + detector.anchors[i])])
        # Input [0, 1] -> letterbox pixels -> image pixels.
        points = (points * side - (ox, oy)) / (s * scale) + (x0, y0)
        found.append(_Detection(float(scores[i]), points[:2].reshape(4), points[2:]))
    return found


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _merge(detections: list[_Detection]) -> list[_Detection]:
    """MediaPipe's weighted non-maximum suppression: each face is the score-weighted mean
    of the detections overlapping its best one."""
    left = sorted(detections, key=lambda d: -d.score)
    faces = []
    while left:
        best = left[0]
        group = [d for d in left if _iou(best.box, d.box) > _NMS_IOU]
        weights = np.array([d.score for d in group])[:, None]
        faces.append(_Detection(
            best.score,
            (np.stack([d.box for d in group]) * weights).sum(0) / weights.sum(),
            (np.stack([d.keypoints for d in group]) * weights[:, :, None]).sum(0)
            / weights.sum()))
        left = [d for d in left if d not in group]
    return faces


def _tiles(h: int, w: int) -> list[tuple[int, int, int]]:
    """(x0, y0, side) of squares half the shorter side, overlapping by half, covering it."""
    side = max(1, min(h, w) // 2)
    step = max(1, side // 2)

    def starts(n: int) -> list[int]:
        return sorted({*range(0, n - side + 1, step), n - side})

    return [(x, y, side) for y in starts(h) for x in starts(w)]


def _refined(rgb: np.ndarray, face: _Detection) -> _Detection:
    """The face found again in a square about three times its size: a face seen small in a
    large picture is then seen large enough for its eyes and mouth to be placed well."""
    h, w = rgb.shape[:2]
    x0, y0, x1, y1 = face.box
    half = 1.5 * max(x1 - x0, y1 - y0)
    cx, cy = 0.5 * (x0 + x1), 0.5 * (y0 + y1)
    left, top = max(0, math.floor(cx - half)), max(0, math.floor(cy - half))
    right, bottom = min(w, math.ceil(cx + half)), min(h, math.ceil(cy + half))
    if right - left < 8 or bottom - top < 8:
        return face
    crop = rgb[top:bottom, left:right]
    again = [d for d in _merge(_detect(crop, _SHORT_RANGE, left, top)
                               + _detect(crop, _FULL_RANGE, left, top))
             if _iou(d.box, face.box) > _NMS_IOU]
    return max(again, key=lambda d: _iou(d.box, face.box), default=face)


def detect_face(rgb: np.ndarray) -> FaceBox:
    """Find the largest face (its eyes and mouth too) in an RGB uint8 image.

    Raises ``PortraitError("no_face")``, or RuntimeError where the detector cannot run
    (ai-edge-litert missing: a broken install, not a bad picture).
    """
    check_rgb(rgb)
    h, w = rgb.shape[:2]
    scale = min(1.0, _OVERVIEW_SIDE / max(h, w))
    overview = rgb if scale == 1.0 else cv2.resize(
        rgb, (max(1, round(w * scale)), max(1, round(h * scale))), interpolation=cv2.INTER_AREA)
    faces = _merge(_detect(overview, _SHORT_RANGE, scale=scale)
                   + _detect(overview, _FULL_RANGE, scale=scale))
    if not faces:
        faces = _merge([d for x, y, side in _tiles(h, w)
                        for d in _detect(rgb[y:y + side, x:x + side], _FULL_RANGE, x, y)])
    if not faces:
        raise PortraitError(
            "no_face",
            "No face was found; upload a well-lit, front-facing photo with one face.",
        )
    face = _refined(rgb, max(faces, key=lambda f: (f.box[2] - f.box[0]) * (f.box[3] - f.box[1])))
    x0, y0, x1, y1 = face.box.tolist()

    def point(k: int) -> tuple[float, float]:
        return float(face.keypoints[k, 0]), float(face.keypoints[k, 1])

    return FaceBox(x=x0, y=y0, w=x1 - x0, h=y1 - y0, left_eye=point(_KP_LEFT_EYE),
                   right_eye=point(_KP_RIGHT_EYE), mouth=point(_KP_MOUTH))


#: Where the detector gives no mouth (a box made by hand), vertical distances are in a
#: "face unit": the mean of the inter-eye distance and 0.42 x the box height, which agree
#: on a typical face; the mouth lies 1 unit below the eye line. The chin lies 0.7 unit
#: (the eye-to-mouth distance) below the mouth, and the mouth's half-width is 0.47 x the
#: inter-eye distance. Measured on the default avatar (eyes ~(202, 102)/(246, 104), mouth
#: ~(224, 144), chin ~186; smiling) and Grace Hopper (eyes ~(220, 187)/(302, 186), mouth
#: ~(262, 278), chin ~328).
_UNIT_BOX_H = 0.42
_MOUTH_BELOW_EYES = 1.0
_CHIN_BELOW_MOUTH = 0.7
_MOUTH_HALF_WIDTH = 0.47


def face_points(face: FaceBox) -> dict[str, tuple[float, float]]:
    """Eye, mouth and chin positions (image pixels) plus the mouth half-width (as a pair):
    the detector's own eyes and mouth, proportions for the rest."""
    (lx, ly), (rx, ry) = face.eye_centres()
    dx, dy = rx - lx, ry - ly
    dist = math.hypot(dx, dy) or 1.0
    # "Down" the face is perpendicular to the eye line, so a tilted head keeps its mouth
    # under the eyes rather than straight below in image terms.
    down_x, down_y = -dy / dist, dx / dist
    mx, my = 0.5 * (lx + rx), 0.5 * (ly + ry)
    if face.mouth is not None:
        mouth = face.mouth
        unit = max(1.0, (mouth[0] - mx) * down_x + (mouth[1] - my) * down_y)
    else:
        unit = 0.5 * (dist + _UNIT_BOX_H * face.h)
        mouth = (mx + down_x * _MOUTH_BELOW_EYES * unit, my + down_y * _MOUTH_BELOW_EYES * unit)
    d_chin = _CHIN_BELOW_MOUTH * unit
    return {
        "eye_left": (lx, ly),
        "eye_right": (rx, ry),
        "mouth": mouth,
        "chin": (mouth[0] + down_x * d_chin, mouth[1] + down_y * d_chin),
        "half_width": (_MOUTH_HALF_WIDTH * dist, 0.0),
    }
