"""Face landmarks and the renderer's geometry on a real face (no PyTorch needed)."""

from __future__ import annotations

import numpy as np
import pytest

from inference import landmarks as lm_mod
from inference.engine import GEOMETRY_NAMES
from inference.face_detect import detect_face
from inference.face_geometry import portrait_geometry
from inference.images import load_default_avatar
from inference.portrait import prepare_portrait
from inference.tflite import TfliteModel

pytestmark = pytest.mark.unit

G = {name: i for i, name in enumerate(GEOMETRY_NAMES)}


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    return load_default_avatar()


@pytest.fixture(scope="module")
def crop(photo: np.ndarray) -> np.ndarray:
    return prepare_portrait(photo, size=256).image


def test_landmarks_on_astronaut(photo: np.ndarray) -> None:
    assert lm_mod.landmarks_available()  # ai-edge-litert and the shipped model: required
    face = detect_face(photo)
    lm = lm_mod.find_landmarks(photo, face)
    assert lm is not None and lm.source == "landmarks" and lm.score > 0.9
    assert lm.points.shape == (468, 2)
    left, right = lm["mouth_corner_left"], lm["mouth_corner_right"]
    centre_x = 0.5 * (lm["eye_left_inner"][0] + lm["eye_right_inner"][0])
    assert left[0] < centre_x < right[0]
    nose, chin = lm["nose_tip"][1], lm["chin"][1]
    for name in ("upper_lip_outer", "upper_lip_inner", "lower_lip_inner", "lower_lip_outer"):
        assert nose < lm[name][1] < chin, name
    assert lm["upper_lip_outer"][1] < lm["upper_lip_inner"][1] <= lm["lower_lip_inner"][1]
    for eye in ("eye_left_upper", "eye_right_upper", "eye_left_lower", "eye_right_lower"):
        assert lm[eye][1] < nose < left[1]
    assert lm["eye_left_upper"][1] < lm["eye_left_lower"][1]
    # Inside the detector's box's neighbourhood: the mesh found this face, not another.
    assert face.x - 0.2 * face.w < left[0] and right[0] < face.x + 1.2 * face.w


def test_geometry_v2_keeps_the_first_eight(crop: np.ndarray, photo: np.ndarray) -> None:
    geo, source = portrait_geometry(crop)
    assert source == "landmarks"
    assert geo.shape == (len(GEOMETRY_NAMES),) and geo.dtype == np.float32
    rough, rough_source = portrait_geometry(crop, use_landmarks=False)
    assert rough_source == "detector" and not np.allclose(geo, rough)
    # The first eight mean the same from either source: the detector's agree roughly.
    assert np.abs(geo[:8] - rough[:8]).max() < 0.12, (geo[:8], rough[:8])
    assert geo[G["mouth_corner_left_x"]] < geo[G["mouth_x"]] < geo[G["mouth_corner_right_x"]]
    assert geo[G["nose_y"]] < geo[G["upper_lip_outer_y"]] < geo[G["lower_lip_outer_y"]]
    assert geo[G["lower_lip_outer_y"]] < geo[G["chin_y"]]


def test_the_detectors_eyes_and_mouth_when_the_mesh_cannot_run(
    crop: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lm_mod, "MODEL", TfliteModel("no_such_model.tflite", 192))
    face = detect_face(crop)
    assert lm_mod.find_landmarks(crop, face) is None
    geo, source = portrait_geometry(crop, face)
    assert source == "detector"
    assert geo[G["mouth_corner_left_x"]] < geo[G["mouth_x"]] < geo[G["mouth_corner_right_x"]]
    assert geo[G["eye_left_y"]] < geo[G["nose_y"]] < geo[G["mouth_y"]] < geo[G["chin_y"]]
    # The mouth is where the detector saw it, not a proportion of the box.
    assert geo[G["mouth_y"]] == pytest.approx(2 * face.mouth[1] / crop.shape[0] - 1, abs=1e-5)
    geo2, source2 = portrait_geometry(crop, face, use_landmarks=False)
    assert source2 == "detector" and np.allclose(geo, geo2)
