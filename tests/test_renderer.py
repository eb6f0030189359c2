"""The landmark-anchored renderer on a real face: each shape does what its name says, and
the ONNX export matches (landmarks and geometry: tests/test_face_geometry.py)."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import cv2
import numpy as np
import pytest

from inference.engine import GEOMETRY_NAMES
from inference.face_geometry import portrait_geometry

torch = pytest.importorskip("torch", reason="the model is defined in PyTorch (the dev extra)")

from inference.images import DEFAULT_AVATAR_PATH, decode_image
from inference.model.blendshapes import ALL
from inference.model.renderer import Renderer
from inference.portrait import prepare_portrait

pytestmark = pytest.mark.unit

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
    # Below where the smile's upper teeth end, the mouth opens dark.
    bite = _px(geometry[G["upper_lip_inner_y"]] + 0.75 * (
        geometry[G["lower_lip_inner_y"]] - geometry[G["upper_lip_inner_y"]]))
    x = _px(geometry[G["mouth_x"]])
    box = slice(round(bite), round(bite) + 10), slice(round(x - 10), round(x + 10))
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


# --------------------------------------------------------------------------- the mouth

HOPPER = Path(__file__).parent / "data" / "grace_hopper.jpg"  # lips closed (NOTICE there)
OPEN_SMILE = Path(__file__).parent / "data" / "open_smile.jpg"  # lips parted on teeth


@pytest.fixture(scope="module")
def closed_crop() -> np.ndarray:
    return prepare_portrait(decode_image(HOPPER.read_bytes()), size=SIZE).image


@pytest.fixture(scope="module")
def closed_geometry(closed_crop: np.ndarray) -> np.ndarray:
    geo, _ = portrait_geometry(closed_crop)
    assert geo[G["lower_lip_inner_y"]] - geo[G["upper_lip_inner_y"]] < 0.01  # really closed
    return geo


def _opening_box(geo: np.ndarray, hw: float) -> tuple[slice, slice]:
    """Columns about the mouth centre, rows from the upper inner lip to 40 px below it."""
    x, top = _px(geo[G["mouth_x"]]), _px(geo[G["upper_lip_inner_y"]])
    return slice(round(top), round(top) + 40), slice(round(x - hw), round(x + hw))


@pytest.fixture(scope="module")
def open_smile() -> tuple[np.ndarray, np.ndarray]:
    other = prepare_portrait(decode_image(OPEN_SMILE.read_bytes()), size=SIZE).image
    return other, portrait_geometry(other)[0]


@pytest.fixture(scope="module", params=["default avatar", "open smile"])
def smile(request: pytest.FixtureRequest, crop: np.ndarray, geometry: np.ndarray,
          open_smile: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Portraits that smile with their teeth showing: the shipped avatar and another face."""
    return (crop, geometry) if request.param == "default avatar" else open_smile


@pytest.fixture(scope="module", params=["default avatar", "open smile", "closed mouth"])
def mouth(request: pytest.FixtureRequest, crop: np.ndarray, geometry: np.ndarray,
          open_smile: tuple[np.ndarray, np.ndarray], closed_crop: np.ndarray,
          closed_geometry: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The three portraits of the mouth sheet: two smiles and a closed mouth."""
    return {"default avatar": (crop, geometry), "open smile": open_smile,
            "closed mouth": (closed_crop, closed_geometry)}[request.param]


def test_a_smile_keeps_its_upper_teeth_while_the_lower_drop_with_the_jaw(
    renderer: Renderer, smile: tuple[np.ndarray, np.ndarray]
) -> None:
    """A smile's upper teeth stay with the skull; the lower drop with the jaw."""
    crop, geometry = smile
    ui, li = _px(geometry[G["upper_lip_inner_y"]]), _px(geometry[G["lower_lip_inner_y"]])
    assert li - ui > 6  # parted in the portrait
    frame = _render(renderer, crop, geometry, jawOpen=0.7)
    x = _px(geometry[G["mouth_x"]])
    upper = _track(crop, frame, x, ui + 0.3 * (li - ui), half=4)
    lower = _track(crop, frame, x, li + 2, half=4)
    assert abs(upper[1]) <= 1 and abs(upper[0]) <= 1, upper
    assert lower[1] >= 4, lower


def test_the_inside_of_the_mouth_takes_the_portraits_colours(
    renderer: Renderer, crop: np.ndarray, geometry: np.ndarray
) -> None:
    """Throat and tongue come from the lips: a portrait with red and blue swapped gets a
    bluish mouth, not the same dark red pasted on."""
    frame = _render(renderer, crop, geometry, jawOpen=1.0)
    swapped = _render(renderer, crop[:, :, ::-1].copy(), geometry, jawOpen=1.0)
    box = _opening_box(geometry, 6)
    inside, inside_swapped = (f[box].reshape(-1, 3).astype(np.float32) for f in (frame, swapped))
    cavity = inside[inside.sum(1) < np.percentile(inside.sum(1), 40)].mean(0)
    cavity_swapped = inside_swapped[inside_swapped.sum(1) < np.percentile(
        inside_swapped.sum(1), 40)].mean(0)
    assert cavity[0] > cavity[2] + 10 and cavity_swapped[2] > cavity_swapped[0] + 10
    assert cavity.max() > 30  # shaded, not black


def test_a_closed_mouth_opens_onto_teeth_and_leaves_no_line_when_almost_shut(
    renderer: Renderer, closed_crop: np.ndarray, closed_geometry: np.ndarray
) -> None:
    box = _box(closed_geometry, "mouth_x", "mouth_y", 30, 12)
    # At rest, and barely open: the portrait's own lips, moved at most a pixel, and nothing
    # drawn darker than the darkest of the portrait within two rows (its own lip line).
    gray = _gray(closed_crop)
    rows = np.pad(gray, ((2, 2), (0, 0)), mode="edge")
    darkest_near = np.lib.stride_tricks.sliding_window_view(rows, 5, axis=0).min(-1)
    for jaw in (0.0, 0.02):
        frame = _render(renderer, closed_crop, closed_geometry, jawOpen=jaw)
        darker = darkest_near[box] - _gray(frame[box])
        assert darker.max() < 5, (jaw, darker.max())
        if jaw == 0.0:
            assert np.abs(gray[box] - _gray(frame[box])).max() < 2
    frame = _render(renderer, closed_crop, closed_geometry, jawOpen=1.0)
    column = _gray(frame[_opening_box(closed_geometry, 3)]).mean(1)  # down the centre
    lit, dark = column[:12].max(), column.min()
    assert lit > dark + 60  # teeth under the upper lip, then the cavity


@pytest.mark.parametrize(("jaw", "close"), [(1.0, 0.0), (1.0, 0.5), (0.7, 1.0)])
def test_a_wide_open_jaw_never_folds_the_skin_under_the_lips(
    renderer: Renderer, mouth: tuple[np.ndarray, np.ndarray],
    monkeypatch: pytest.MonkeyPatch, jaw: float, close: float
) -> None:
    """Down every column the warp samples the portrait from rows that keep descending:
    where the chin's travel ramped in faster than the rows below the lips, the skin
    beside the lens folded over on itself and showed as vertical streaks."""
    grids: list[torch.Tensor] = []
    sample = torch.nn.functional.grid_sample

    def keep(image: torch.Tensor, grid: torch.Tensor, *args: object, **kw: object
             ) -> torch.Tensor:
        grids.append(grid)
        return sample(image, grid, *args, **kw)

    monkeypatch.setattr(torch.nn.functional, "grid_sample", keep)
    _render(renderer, *mouth, jawOpen=jaw, mouthClose=close)
    rows = _px(grids[0][0, :, :, 1].numpy())  # the warp's grid (the first sampled)
    assert np.diff(rows, axis=0).min() > 0.0


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
