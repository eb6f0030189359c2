"""The renderer's face geometry (``GEOMETRY_NAMES``), measured on a prepared portrait crop.

Each mouth and eye shape is anchored on where the lips, lids and jaw really are, so the
geometry comes from the face mesh (:mod:`inference.landmarks`) when it can run, and from the
face detector's eyes and mouth (:mod:`inference.face_detect`) and proportions otherwise
(``source`` says which). This module
does not import torch: the server computes geometry without the model's build tools.

Coordinates follow the engine's convention: normalised to [-1, 1] in the crop
(grid-sample, align_corners=False), x to the right, y down. "left"/"right" in the names are
the IMAGE's left/right, as in ``GEOMETRY_NAMES`` (the subject's right eye is ``eye_left``).
"""

from __future__ import annotations

import math

import numpy as np

from inference.engine import GEOMETRY_NAMES
from inference.face_detect import FaceBox, detect_face, face_points
from inference.images import PortraitError
from inference.landmarks import find_landmarks

__all__ = ["geometry_from_landmarks", "portrait_geometry"]

def _to_vector(values: dict[str, float], size: int) -> np.ndarray:
    """Pixel values (crop of ``size``) -> normalised vector; names ending in ``half_width``
    are lengths, everything else a coordinate."""
    k = 2.0 / size
    out = []
    for name in GEOMETRY_NAMES:
        v = values[name]
        out.append(v * k if name.endswith("half_width") else v * k - 1.0)
    return np.clip(np.asarray(out, np.float32), -1.0, 1.0)


def geometry_from_landmarks(points: np.ndarray, size: int) -> np.ndarray:
    """``GEOMETRY_NAMES`` from 468 mesh points given in pixels of a ``size`` crop."""
    p = np.asarray(points, np.float64)

    def pt(i: int) -> tuple[float, float]:
        return float(p[i, 0]), float(p[i, 1])

    def eye(outer: int, inner: int, upper: int, lower: int) -> tuple[float, ...]:
        xs = [pt(i)[0] for i in (outer, inner)]
        ys = [pt(i)[1] for i in (outer, inner, upper, lower)]
        return 0.5 * sum(xs), sum(ys) / 4.0, 0.5 * abs(xs[1] - xs[0])

    lx, ly, lhw = eye(33, 133, 159, 145)
    rx, ry, rhw = eye(263, 362, 386, 374)
    ui, li = pt(13), pt(14)
    (clx, cly), (crx, cry) = pt(61), pt(291)
    values = {
        "mouth_x": 0.5 * (ui[0] + li[0]),
        "mouth_y": 0.5 * (ui[1] + li[1]),
        "mouth_half_width": 0.5 * math.hypot(crx - clx, cry - cly),
        "chin_y": pt(152)[1],
        "eye_left_x": lx,
        "eye_left_y": ly,
        "eye_right_x": rx,
        "eye_right_y": ry,
        "mouth_corner_left_x": clx,
        "mouth_corner_left_y": cly,
        "mouth_corner_right_x": crx,
        "mouth_corner_right_y": cry,
        "mouth_inner_half_width": 0.5 * math.dist(pt(78), pt(308)),
        "upper_lip_outer_y": pt(0)[1],
        "upper_lip_inner_y": ui[1],
        "lower_lip_inner_y": max(li[1], ui[1]),
        "lower_lip_outer_y": pt(17)[1],
        "chin_x": pt(152)[0],
        "jaw_left_x": pt(172)[0],
        "jaw_left_y": pt(172)[1],
        "jaw_right_x": pt(397)[0],
        "jaw_right_y": pt(397)[1],
        "eye_left_upper_y": pt(159)[1],
        "eye_left_lower_y": pt(145)[1],
        "eye_left_half_width": lhw,
        "eye_right_upper_y": pt(386)[1],
        "eye_right_lower_y": pt(374)[1],
        "eye_right_half_width": rhw,
        "nose_x": pt(1)[0],
        "nose_y": pt(1)[1],
        "face_left_x": pt(234)[0],
        "face_right_x": pt(454)[0],
        "forehead_y": pt(10)[1],
    }
    return _to_vector(values, size)


#: Fallback proportions, in the "face unit" u = (chin - mouth) / 0.7 of
#: ``inference.face_detect`` (the eye-to-mouth distance) and the inter-eye distance d;
#: read off the landmarks of the astronaut and Grace Hopper.
_PROPORTIONS = {
    "upper_outer": 0.22,  # above the mouth line, x u
    "lower_outer": 0.25,  # below the mouth line, x u
    "inner_half_width": 0.8,  # x mouth half-width
    "jaw_dx": 1.55,  # x mouth half-width, from the mouth centre
    "jaw_dy": 0.45,  # x u, below the mouth line
    "lid": 0.055,  # x d, above / below the eye centre
    "eye_half_width": 0.22,  # x d
    "nose_dy": 0.6,  # x u, below the eye line
    "face_dx": 1.0,  # x d, from the eyes' midpoint
    "forehead_dy": 1.1,  # x u, above the eye line
}


def geometry_from_face_box(face: FaceBox, size: int) -> np.ndarray:
    """``GEOMETRY_NAMES`` from a detector's face box, eyes and mouth in pixels of a ``size``
    crop, and proportions for the rest (upright-face approximations: the renderer's shapes
    stay plausible, not exact)."""
    pts = face_points(face)
    (lx, ly), (rx, ry) = pts["eye_left"], pts["eye_right"]
    mx, my = pts["mouth"]
    chin_y = pts["chin"][1]
    hw = pts["half_width"][0]
    d = math.hypot(rx - lx, ry - ly) or 1.0
    u = max(1.0, (chin_y - my) / 0.7)
    eye_y = 0.5 * (ly + ry)
    h = _PROPORTIONS
    values = {
        "mouth_x": mx,
        "mouth_y": my,
        "mouth_half_width": hw,
        "chin_y": chin_y,
        "eye_left_x": lx,
        "eye_left_y": ly,
        "eye_right_x": rx,
        "eye_right_y": ry,
        "mouth_corner_left_x": mx - hw,
        "mouth_corner_left_y": my,
        "mouth_corner_right_x": mx + hw,
        "mouth_corner_right_y": my,
        "mouth_inner_half_width": h["inner_half_width"] * hw,
        "upper_lip_outer_y": my - h["upper_outer"] * u,
        "upper_lip_inner_y": my,
        "lower_lip_inner_y": my,
        "lower_lip_outer_y": my + h["lower_outer"] * u,
        "chin_x": pts["chin"][0],
        "jaw_left_x": mx - h["jaw_dx"] * hw,
        "jaw_left_y": my + h["jaw_dy"] * u,
        "jaw_right_x": mx + h["jaw_dx"] * hw,
        "jaw_right_y": my + h["jaw_dy"] * u,
        "eye_left_upper_y": ly - h["lid"] * d,
        "eye_left_lower_y": ly + h["lid"] * d,
        "eye_left_half_width": h["eye_half_width"] * d,
        "eye_right_upper_y": ry - h["lid"] * d,
        "eye_right_lower_y": ry + h["lid"] * d,
        "eye_right_half_width": h["eye_half_width"] * d,
        "nose_x": 0.5 * (lx + rx),
        "nose_y": eye_y + h["nose_dy"] * u,
        "face_left_x": 0.5 * (lx + rx) - h["face_dx"] * d,
        "face_right_x": 0.5 * (lx + rx) + h["face_dx"] * d,
        "forehead_y": eye_y - h["forehead_dy"] * u,
    }
    return _to_vector(values, size)


def portrait_geometry(
    crop_rgb: np.ndarray, face: FaceBox | None = None, *, use_landmarks: bool = True
) -> tuple[np.ndarray, str]:
    """(``GEOMETRY_NAMES`` vector, ``"landmarks"`` or ``"detector"``) of a prepared square
    crop.

    ``face`` is the detector's face in the crop's pixels (found on the crop when omitted); it seeds
    the landmark model and is the fallback when the model is unavailable or sees no face.
    Raises ``PortraitError("no_face")`` only when neither finds a face.
    """
    if crop_rgb.ndim != 3 or crop_rgb.shape[0] != crop_rgb.shape[1]:
        raise ValueError("expected a square RGB crop")
    size = int(crop_rgb.shape[0])
    guessed = False
    if face is None:
        try:
            face = detect_face(crop_rgb)
        except PortraitError:
            guessed = True
            # A tight crop can defeat the detector; the mesh still sees the face when
            # seeded with the middle of the crop, where prepare_portrait puts it.
            face = FaceBox(x=0.25 * size, y=0.2 * size, w=0.5 * size, h=0.5 * size)
            if not use_landmarks:
                raise
    if use_landmarks:
        lm = find_landmarks(crop_rgb, face)
        if lm is not None:
            return geometry_from_landmarks(lm.points, size), lm.source
    if guessed:
        raise PortraitError("no_face", "No face was found in the portrait crop.")
    return geometry_from_face_box(face, size), "detector"
