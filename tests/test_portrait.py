"""Portrait upload handling on real images: safe decoding, face detection, crop geometry."""

from __future__ import annotations

import io
import math
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
import pytest
from PIL import Image

from inference.engine import GEOMETRY_NAMES, PreparedPortrait
from inference.face_detect import FaceBox, detect_face
from inference.images import PortraitError, decode_image, load_default_avatar
from inference.portrait import decode_portrait_source, prepare_portrait

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def astronaut() -> np.ndarray:
    return load_default_avatar()


def _encode(rgb: np.ndarray, ext: str, params: list[int] | None = None) -> bytes:
    ok, buf = cv2.imencode(ext, cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), params or [])
    assert ok
    return buf.tobytes()


def _pil_bytes(img: Image.Image, fmt: str, **kw: object) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def _gray_png(width: int, height: int, idat: bytes) -> bytes:
    """A well-formed 8-bit grayscale PNG with the given dimensions and compressed data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def _code(data: bytes, **kw: int) -> str:
    with pytest.raises(PortraitError) as info:
        decode_image(data, **kw)
    assert str(info.value)  # a human message, too
    return info.value.code


def _geometry(p: PreparedPortrait) -> dict[str, float]:
    return dict(zip(GEOMETRY_NAMES, p.geometry.tolist(), strict=True))


# --------------------------------------------------------------------------- decoding


def test_default_avatar_loads(astronaut: np.ndarray) -> None:
    assert astronaut.shape == (512, 512, 3)
    assert astronaut.dtype == np.uint8


def test_png_and_jpeg_of_same_photo_decode_alike(astronaut: np.ndarray) -> None:
    from_png = decode_image(_encode(astronaut, ".png"))
    from_jpg = decode_image(_encode(astronaut, ".jpg", [cv2.IMWRITE_JPEG_QUALITY, 92]))
    progressive = decode_image(_encode(astronaut, ".jpg", [cv2.IMWRITE_JPEG_PROGRESSIVE, 1]))
    np.testing.assert_array_equal(from_png, astronaut)  # lossless, and RGB order kept
    for img in (from_jpg, progressive):
        assert img.shape == (512, 512, 3) and img.dtype == np.uint8
        assert np.abs(img.astype(np.int16) - astronaut).mean() < 4.0


def test_gray_alpha_and_16_bit_become_rgb8(astronaut: np.ndarray) -> None:
    pil = Image.fromarray(astronaut)
    gray = decode_image(_pil_bytes(pil.convert("L"), "PNG"))
    assert gray.shape == (512, 512, 3) and gray.dtype == np.uint8
    assert np.array_equal(gray[..., 0], gray[..., 2])
    assert decode_image(_pil_bytes(pil.convert("L"), "JPEG")).shape == (512, 512, 3)
    assert decode_image(_pil_bytes(pil.convert("P"), "PNG")).shape == (512, 512, 3)

    # Fully transparent pixels are composited over white, whatever colour they hide.
    rgba = np.dstack([astronaut, np.zeros((512, 512), np.uint8)])
    assert (decode_image(_pil_bytes(Image.fromarray(rgba), "PNG")) == 255).all()
    rgba[..., 3] = 255
    np.testing.assert_array_equal(decode_image(_pil_bytes(Image.fromarray(rgba), "PNG")), astronaut)

    deep = cv2.cvtColor(astronaut, cv2.COLOR_RGB2BGR).astype(np.uint16) * 257
    ok, buf = cv2.imencode(".png", deep)
    assert ok
    np.testing.assert_array_equal(decode_image(buf.tobytes()), astronaut)


def test_jpeg_exif_orientation_is_applied(astronaut: np.ndarray) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": a phone held upright
    stored = Image.fromarray(np.ascontiguousarray(np.rot90(astronaut, 1)))
    upright = decode_image(_pil_bytes(stored, "JPEG", exif=exif.tobytes(), quality=95))
    assert np.abs(upright.astype(np.int16) - astronaut).mean() < 5.0


@pytest.mark.parametrize(
    "data", [b"", b"hello, world", b"BMW 3 series", b"%PDF-1.7\n%\xe2\xe3", b"\x00" * 64]
)
def test_not_an_image(data: bytes) -> None:
    assert _code(data) == "not_an_image"


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "WEBP", "TIFF"])
def test_other_formats_are_unsupported(astronaut: np.ndarray, fmt: str) -> None:
    assert _code(_pil_bytes(Image.fromarray(astronaut), fmt)) == "unsupported_format"


@pytest.mark.parametrize("ext", [".png", ".jpg"])
def test_truncated_files_are_corrupt(astronaut: np.ndarray, ext: str) -> None:
    data = _encode(astronaut, ext)
    for cut in (len(data) // 2, len(data) - 3, 40, 12):
        assert _code(data[:cut]) == "corrupt_image", cut


def test_damaged_png_is_corrupt(astronaut: np.ndarray) -> None:
    data = bytearray(_encode(astronaut, ".png"))
    data[len(data) // 2] ^= 0xFF  # breaks the IDAT CRC / deflate stream
    assert _code(bytes(data)) == "corrupt_image"


def test_png_bomb_is_refused_from_the_header() -> None:
    # 100000 x 100000 declared, a few dozen bytes on disk: OpenCV alone would try (and
    # fail) to decode it; we must refuse it as too large before any decoding starts.
    bomb = _gray_png(100_000, 100_000, zlib.compress(b"\x00" * 1024))
    assert len(bomb) < 200
    start = time.perf_counter()
    assert _code(bomb) == "image_too_large"
    assert time.perf_counter() - start < 0.05


def test_png_bomb_just_over_the_limit_is_real_but_refused() -> None:
    # A valid 4097x4097 PNG of ~17 KB that would inflate to 17 MB of pixels (50 MB as RGB).
    side = 4097
    bomb = _gray_png(side, side, zlib.compress(b"\x00" * ((side + 1) * side), 9))
    assert len(bomb) < 40_000
    assert _code(bomb) == "image_too_large"
    assert _code(bomb, max_side=5000) == "image_too_large"  # the pixel-count limit
    # The limits, not the file, are what stop it: with them raised it decodes.
    assert decode_image(bomb, max_side=side, max_pixels=side * side).shape == (side, side, 3)


def test_jpeg_with_huge_declared_size_is_refused(astronaut: np.ndarray) -> None:
    data = bytearray(_encode(astronaut, ".jpg"))
    sof = data.find(b"\xff\xc0")
    assert sof > 0
    # SOF0: marker, length(2), precision(1), height(2), width(2).
    assert struct.unpack(">HH", data[sof + 5 : sof + 9]) == (512, 512)
    data[sof + 5 : sof + 9] = struct.pack(">HH", 65_000, 65_000)
    assert _code(bytes(data)) == "image_too_large"
    data[sof + 5 : sof + 9] = struct.pack(">HH", 512, 8000)  # one side too long
    assert _code(bytes(data)) == "image_too_large"


def test_limits_are_configurable(astronaut: np.ndarray) -> None:
    data = _encode(astronaut, ".png")
    assert _code(data, max_side=511) == "image_too_large"
    assert _code(data, max_pixels=512 * 512 - 1) == "image_too_large"
    assert decode_image(data, max_side=512, max_pixels=512 * 512).shape == (512, 512, 3)


def test_portrait_error_is_a_value_error() -> None:
    err = PortraitError("no_face", "No face.")
    assert isinstance(err, ValueError)
    assert (err.code, err.message, str(err)) == ("no_face", "No face.", "No face.")


# --------------------------------------------------------------------------- detection


def test_astronaut_face_and_eyes(astronaut: np.ndarray) -> None:
    face = detect_face(astronaut)
    assert isinstance(face, FaceBox)
    # Her face (forehead to mouth) lies around x 175-275, y 60-165 of the 512 px photo.
    cx, cy = face.centre
    assert 200 < cx < 250 and 90 < cy < 140
    assert 70 < face.w < 130
    assert face.left_eye is not None and face.right_eye is not None
    (lx, ly), (rx, ry) = face.eye_centres()
    assert abs(lx - 202) < 6 and abs(ly - 102) < 6
    assert abs(rx - 246) < 6 and abs(ry - 104) < 6


@pytest.mark.parametrize("degrees", [-30, 30])
def test_a_tilted_head_is_found_with_its_eyes_along_the_tilt(astronaut: np.ndarray,
                                                           degrees: float) -> None:
    turn = cv2.getRotationMatrix2D((224, 115), degrees, 1.0)  # counterclockwise on screen
    tilted = cv2.warpAffine(astronaut, turn, (512, 512), borderMode=cv2.BORDER_REPLICATE)
    face = detect_face(tilted)
    (lx, ly), (rx, ry) = face.eye_centres()
    upright = math.degrees(math.atan2(104 - 102, 246 - 202))
    assert math.degrees(math.atan2(ry - ly, rx - lx)) == pytest.approx(upright - degrees, abs=5)
    mouth = turn @ np.array([224.0, 144.0, 1.0])
    assert math.dist(face.mouth, mouth) < 8


def test_largest_face_is_picked(astronaut: np.ndarray) -> None:
    small = cv2.resize(astronaut, (256, 256), interpolation=cv2.INTER_AREA)
    canvas = np.full((768, 1024, 3), 200, np.uint8)
    canvas[:512, :512] = astronaut
    canvas[400:656, 700:956] = small
    face = detect_face(canvas)
    assert face.w > 70 and face.x < 400


def test_small_face_in_a_large_photo(astronaut: np.ndarray) -> None:
    # The face is ~6% of the short side: seen small whole, then found again around itself.
    big = cv2.copyMakeBorder(astronaut, 500, 500, 700, 700, cv2.BORDER_REPLICATE)
    face = detect_face(big)
    assert abs(face.centre[0] - (700 + 225)) < 20 and abs(face.centre[1] - (500 + 115)) < 25


def test_a_face_too_small_to_see_whole_is_found_in_a_quarter(astronaut: np.ndarray) -> None:
    # 64 px of face in a 3000 px picture: 16 px in the shrunk overview, which the models
    # miss; the overlapping quarters (1000 px squares) show it larger.
    canvas = np.full((2000, 3000, 3), 200, np.uint8)
    canvas[1200:1520, 2000:2320] = cv2.resize(astronaut, (320, 320), interpolation=cv2.INTER_AREA)
    face = detect_face(canvas)
    mouth_x, mouth_y = 2000 + 224 * 320 / 512, 1200 + 144 * 320 / 512
    assert math.dist(face.mouth, (mouth_x, mouth_y)) < 6
    assert 40 < face.w < 90


@pytest.mark.parametrize("kind", ["grey", "noise"])
def test_no_face(kind: str) -> None:
    if kind == "grey":
        img = np.full((512, 512, 3), 128, np.uint8)
    else:
        img = np.random.default_rng(0).integers(0, 256, (512, 512, 3), dtype=np.uint8)
    with pytest.raises(PortraitError) as info:
        detect_face(img)
    assert info.value.code == "no_face"
    with pytest.raises(PortraitError) as info:
        prepare_portrait(img)
    assert info.value.code == "no_face"


def test_detection_is_thread_safe(astronaut: np.ndarray) -> None:
    # Uploads are prepared on worker threads; the shared detectors must not mix them up.
    expected = detect_face(astronaut)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: detect_face(astronaut), range(8)))
    assert all(r == expected for r in results)


def test_rejects_non_rgb_arrays(astronaut: np.ndarray) -> None:
    with pytest.raises(TypeError):
        detect_face(astronaut.astype(np.float32))
    with pytest.raises(TypeError):
        detect_face(astronaut[..., 0])


# --------------------------------------------------------------------------- cropping


def _check_plausible(p: PreparedPortrait, size: int) -> dict[str, float]:
    assert p.image.shape == (size, size, 3) and p.image.dtype == np.uint8
    assert p.geometry.shape == (len(GEOMETRY_NAMES),) and p.geometry.dtype == np.float32
    assert np.all(np.abs(p.geometry) <= 1.0)
    g = _geometry(p)
    assert g["eye_left_x"] < g["mouth_x"] < g["eye_right_x"]
    assert abs(g["mouth_x"]) < 0.15  # face centred horizontally
    eye_y = 0.5 * (g["eye_left_y"] + g["eye_right_y"])
    assert eye_y < g["mouth_y"] < g["chin_y"]
    assert abs(g["eye_left_y"] - g["eye_right_y"]) < 0.1
    assert 0.1 < g["mouth_half_width"] < 0.5
    return g


@pytest.mark.parametrize("size", [256, 512])
def test_astronaut_geometry(astronaut: np.ndarray, size: int) -> None:
    p = prepare_portrait(astronaut, size=size)
    g = _check_plausible(p, size)
    # Calibrated by eye: eyes ~0.25 above centre, mouth ~0.2 below, chin ~0.5 below.
    assert -0.35 < g["eye_left_y"] < -0.15
    assert 0.1 < g["mouth_y"] < 0.3
    assert 0.35 < g["chin_y"] < 0.65
    # Map back to photo pixels through the eyes (found at ~(202, 102) and ~(246, 104)) and
    # compare with the mouth and chin located by eye: mouth ~(224, 144), chin ~186.
    k = (g["eye_right_x"] - g["eye_left_x"]) / (246.0 - 202.0)
    eye_y = 0.5 * (g["eye_left_y"] + g["eye_right_y"])
    mid_x = 0.5 * (g["eye_left_x"] + g["eye_right_x"])
    assert 224 + (g["mouth_x"] - mid_x) / k == pytest.approx(224, abs=8)
    assert 103 + (g["mouth_y"] - eye_y) / k == pytest.approx(144, abs=8)
    assert 103 + (g["chin_y"] - eye_y) / k == pytest.approx(186, abs=18)
    assert g["mouth_half_width"] / k == pytest.approx(21, abs=5)


def test_geometry_does_not_depend_on_output_size(astronaut: np.ndarray) -> None:
    face = detect_face(astronaut)
    a = prepare_portrait(astronaut, size=256, face=face).geometry
    b = prepare_portrait(astronaut, size=512, face=face).geometry
    np.testing.assert_allclose(a, b, atol=5e-3)  # landmarks measured on each resized crop


def test_geometry_follows_the_photo(astronaut: np.ndarray) -> None:
    """Flipping the photo mirrors the geometry (the model relies on left meaning left)."""
    g = _geometry(prepare_portrait(astronaut))
    f = _geometry(prepare_portrait(np.ascontiguousarray(astronaut[:, ::-1])))
    assert abs(f["mouth_x"] + g["mouth_x"]) < 0.1
    assert abs(f["eye_left_x"] + g["eye_right_x"]) < 0.1
    assert abs(f["mouth_y"] - g["mouth_y"]) < 0.1


def test_jpeg_upload_end_to_end(astronaut: np.ndarray) -> None:
    data = _encode(astronaut, ".jpg", [cv2.IMWRITE_JPEG_QUALITY, 80])
    _check_plausible(prepare_portrait(decode_image(data), size=256), 256)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b) ** 2)
    return float(10 * np.log10(255.0**2 / mse))


def test_a_large_jpeg_is_decoded_scaled_down_to_the_same_portrait(astronaut: np.ndarray
                                                                   ) -> None:
    large = cv2.resize(astronaut, (3072, 3072), interpolation=cv2.INTER_CUBIC)
    data = _encode(large, ".jpg", [cv2.IMWRITE_JPEG_QUALITY, 95])
    source = decode_portrait_source(data, largest=512)
    assert source.image.shape == (1536, 1536, 3)  # decoded at half size, a quarter the pixels
    assert (source.width, source.height) == (3072, 3072)
    face = source.face
    doubled = FaceBox(x=2 * face.x, y=2 * face.y, w=2 * face.w, h=2 * face.h,
                      left_eye=face.left_eye and (2 * face.left_eye[0], 2 * face.left_eye[1]),
                      right_eye=face.right_eye and (2 * face.right_eye[0],
                                                    2 * face.right_eye[1]))
    scaled = prepare_portrait(source.image, size=512, face=face)
    full = prepare_portrait(decode_image(data), size=512, face=doubled)  # the same crop
    assert _psnr(scaled.image, full.image) > 35


def test_a_small_face_in_a_large_jpeg_is_decoded_finely_enough_for_its_crop(
        astronaut: np.ndarray) -> None:
    canvas = np.full((3072, 4096, 3), 255, np.uint8)
    head = cv2.resize(astronaut, (1536, 1536), interpolation=cv2.INTER_CUBIC)
    canvas[800:2336, 1200:2736] = head  # its crop is about 600 pixels of 12 megapixels
    data = _encode(canvas, ".jpg", [cv2.IMWRITE_JPEG_QUALITY, 95])
    source = decode_portrait_source(data, largest=512)
    assert source.image.shape == (3072, 4096, 3)  # its crop needs every pixel
    assert (source.width, source.height) == (4096, 3072)
    full = prepare_portrait(decode_image(data), size=512)
    assert np.array_equal(prepare_portrait(source.image, size=512, face=source.face).image,
                          full.image)


def test_larger_expand_ratio_gives_smaller_face(astronaut: np.ndarray) -> None:
    face = detect_face(astronaut)
    tight = _geometry(prepare_portrait(astronaut, expand_ratio=0.3, face=face))
    wide = _geometry(prepare_portrait(astronaut, expand_ratio=1.0, face=face))
    tight_eyes = tight["eye_right_x"] - tight["eye_left_x"]
    wide_eyes = wide["eye_right_x"] - wide["eye_left_x"]
    # Crop side is max(w, h) * (1 + 2 * expand_ratio), so features scale by 1.6 / 3.
    assert wide_eyes == pytest.approx(tight_eyes * 1.6 / 3.0, rel=0.03)
    assert wide["mouth_half_width"] < tight["mouth_half_width"]


def test_crop_beyond_the_photo_replicates_edges(astronaut: np.ndarray) -> None:
    # A face near the top edge: the crop must extend above the photo and be edge-filled.
    top = np.ascontiguousarray(astronaut[50:, :])
    p = prepare_portrait(top, size=256, expand_ratio=1.0)
    _check_plausible(p, 256)
    # About 60 output rows lie above the photo: copies of its first row, not a flat colour.
    np.testing.assert_allclose(p.image[0], p.image[40], atol=2)
    assert p.image[0].std() > 5.0


def test_bad_arguments(astronaut: np.ndarray) -> None:
    with pytest.raises(ValueError):
        prepare_portrait(astronaut, size=8)
    with pytest.raises(ValueError):
        prepare_portrait(astronaut, expand_ratio=-0.1)


def test_detect_and_prepare_are_fast(astronaut: np.ndarray) -> None:
    prepare_portrait(astronaut)  # loads the detector and the mesh
    times = []
    for _ in range(5):
        start = time.perf_counter()
        prepare_portrait(astronaut, size=256)
        times.append(time.perf_counter() - start)
    # ~25 ms on two cores; generous so a busy CI box does not flake.
    assert min(times) < 0.25


def test_an_image_is_refused_by_what_decoding_it_would_take() -> None:
    # 3000x3000 16-bit RGBA: 72 MB decoded, from a file of a few kB.
    ok, deep = cv2.imencode(".png", np.zeros((3000, 3000, 4), np.uint16))
    assert ok and len(deep) < 200_000
    with pytest.raises(PortraitError, match="decodes to 69 MB; the limit is 64 MB") as info:
        decode_image(deep.tobytes())
    assert info.value.code == "image_too_large"
    # The same picture in 8 bits (36 MB) is within the limit; a tighter limit refuses it.
    ok, shallow = cv2.imencode(".png", np.zeros((3000, 3000, 4), np.uint8))
    assert decode_image(shallow.tobytes()).shape == (3000, 3000, 3)
    assert _code(shallow.tobytes(), max_decoded_bytes=30 * 2**20) == "image_too_large"
