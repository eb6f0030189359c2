"""468-point face mesh landmarks, offline, from MediaPipe's face-mesh model.

The renderer anchors every mouth and eye shape on real lip and lid positions, which the
face detector's box and keypoints only approximate. The model is Google's MediaPipe face
mesh (``engines/face_landmark.tflite``, Apache-2.0), run on ai-edge-litert like the face
detector (``inference.tflite``).

When the model cannot run or sees no face, :func:`find_landmarks` returns ``None``;
callers then fall back to the detector's eyes and mouth (``inference.face_geometry``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

import cv2
import numpy as np

from inference.tflite import TfliteModel

__all__ = ["MESH", "Landmarks", "find_landmarks", "landmarks_available"]

log = logging.getLogger(__name__)

#: Mesh indices used downstream. "left"/"right" here are the IMAGE's left/right (MediaPipe
#: indexes the subject: its 61 is the subject's right mouth corner, seen on the image's left).
MESH: dict[str, int] = {
    "mouth_corner_left": 61,
    "mouth_corner_right": 291,
    "mouth_inner_corner_left": 78,
    "mouth_inner_corner_right": 308,
    "upper_lip_outer": 0,
    "upper_lip_inner": 13,
    "lower_lip_inner": 14,
    "lower_lip_outer": 17,
    "chin": 152,
    "jaw_left": 172,
    "jaw_right": 397,
    "face_left": 234,
    "face_right": 454,
    "forehead": 10,
    "nose_tip": 1,
    "eye_left_outer": 33,
    "eye_left_inner": 133,
    "eye_left_upper": 159,
    "eye_left_lower": 145,
    "eye_right_inner": 362,
    "eye_right_outer": 263,
    "eye_right_upper": 386,
    "eye_right_lower": 374,
}

_INPUT = 192  # the model's square input side (checked against the model when loaded)
_MIN_PRESENCE = 0.5  # sigmoid of the face-flag output; MediaPipe's own threshold
#: The first pass crops around the detector's box as MediaPipe does: 1.5x the box, turned
#: upright along the detector's eye line.
_DETECTION_SCALE = 1.5
#: The second pass crops around the first pass's landmarks, upright along the eye line, at
#: MediaPipe's tracking scale (1.5x the landmark box), which is what the model was trained on.
_REFINE_SCALE = 1.5

MODEL = TfliteModel("face_landmark.tflite", _INPUT)


@dataclass(frozen=True)
class Landmarks:
    """Face mesh points in image pixels (continuous coords: pixel i spans [i, i+1])."""

    points: np.ndarray  # float32 (468, 2): x, y
    depth: np.ndarray  # float32 (468,): relative z, in the same pixel scale (smaller: nearer)
    score: float  # face presence, in [0, 1]
    source: str = "landmarks"

    def __getitem__(self, name: str) -> tuple[float, float]:
        x, y = self.points[MESH[name]]
        return float(x), float(y)


class _BoxLike(Protocol):
    x: float
    y: float
    w: float
    h: float

    def eye_centres(self) -> tuple[tuple[float, float], tuple[float, float]]: ...


def landmarks_available() -> bool:
    """Whether the landmark model can run here (loads it on first call)."""
    return MODEL.available()


def _run(rgb: np.ndarray, cx: float, cy: float, side: float, angle: float) -> Landmarks | None:
    """Crop a ``side`` square centred on (cx, cy), rotated by ``angle`` (radians, the face's
    roll on screen), run the mesh, and map the points back to image pixels."""
    s = _INPUT / side
    c, n = math.cos(angle) * s, math.sin(angle) * s
    # Image -> model input: rotate by -angle about the centre, scale, move to the input centre.
    m = np.array(
        [[c, n, 0.5 * _INPUT - (c * cx + n * cy)], [-n, c, 0.5 * _INPUT - (-n * cx + c * cy)]],
        dtype=np.float64,
    )
    # warpAffine samples pixel centres at integers; our coords put them at +0.5.
    shift = m.copy()
    shift[:, 2] += m[:, :2].sum(axis=1) * 0.5 - 0.5
    crop = cv2.warpAffine(
        rgb, shift, (_INPUT, _INPUT), flags=cv2.INTER_AREA if s < 1 else cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_REPLICATE,
    )
    outputs = MODEL.run((crop.astype(np.float32) * (1.0 / 255.0))[None])
    if outputs is None:
        return None
    raw = outputs[0].astype(np.float64).reshape(-1)
    flag = float(outputs[1].reshape(-1)[-1])
    score = 1.0 / (1.0 + math.exp(-flag))
    if score < _MIN_PRESENCE or raw.size < 468 * 3:
        return None
    pts = raw[: 468 * 3].reshape(468, 3)
    inv = cv2.invertAffineTransform(m)
    xy = pts[:, :2] @ inv[:, :2].T + inv[:, 2]
    return Landmarks(
        points=xy.astype(np.float32),
        depth=(pts[:, 2] / s).astype(np.float32),
        score=score,
    )


def find_landmarks(rgb: np.ndarray, face_box: _BoxLike) -> Landmarks | None:
    """The 468 mesh points of the face in ``face_box`` (a detector's
    :class:`~inference.face_detect.FaceBox`), or None when the model is unavailable or sees
    no face.

    Two passes, as MediaPipe tracks: a crop around the detector's box, then an upright crop
    around the first landmarks, which the model localises much more precisely.
    """
    if not (isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.ndim == 3):
        raise TypeError("expected an RGB uint8 array of shape (H, W, 3)")
    (lx, ly), (rx, ry) = face_box.eye_centres()
    try:
        first = _run(rgb, face_box.x + 0.5 * face_box.w, face_box.y + 0.5 * face_box.h,
                     _DETECTION_SCALE * max(face_box.w, face_box.h), math.atan2(ry - ly, rx - lx))
        if first is None:
            return None
        p = first.points
        (lx, ly), (rx, ry) = p[MESH["eye_left_outer"]], p[MESH["eye_right_outer"]]
        angle = math.atan2(float(ry - ly), float(rx - lx))
        lo, hi = p.min(axis=0), p.max(axis=0)
        side2 = _REFINE_SCALE * float(max(hi - lo))
        mid = 0.5 * (lo + hi)
        second = _run(rgb, float(mid[0]), float(mid[1]), side2, angle)
    except Exception:  # noqa: BLE001 - a model failure must not fail the upload
        log.exception("face landmark model failed; using the detector's eyes and mouth")
        return None
    return second if second is not None else first
