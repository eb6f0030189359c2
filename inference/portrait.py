"""Turn an uploaded photo into a :class:`PreparedPortrait`: decode safely, find the face, crop.

Everything here runs once per upload, off the event loop, so it favours robustness over
speed, but stays well under ~50 ms for a 512x512 photo on a small CPU. The decoder reads
the declared size from the file header before decoding, so a decompression bomb is refused
without allocating; faces are found with OpenCV's bundled Haar cascades (no model download).

Run ``python -m inference.portrait [image] [out.png]`` to time detection and write a check
image with the geometry drawn on the crop.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from inference.engine import GEOMETRY_NAMES, PreparedPortrait

__all__ = [
    "DEFAULT_AVATAR_PATH",
    "FaceBox",
    "PortraitError",
    "decode_image",
    "detect_face",
    "draw_geometry",
    "load_default_avatar",
    "prepare_portrait",
]

DEFAULT_AVATAR_PATH = Path(__file__).resolve().parents[1] / "static" / "avatars" / "astronaut.png"

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"
#: IEND chunk: zero length, type, and its (constant) CRC; a PNG without it was cut short.
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"
#: Formats we recognise only to name them in the error (so clients get "unsupported", not
#: "not an image").
_OTHER_MAGICS: tuple[tuple[bytes, str], ...] = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"\xff\x0a", "JPEG XL"),
    (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
)


class PortraitError(ValueError):
    """A portrait upload we refuse; ``code`` is machine-readable, the message is for humans.

    Codes: ``not_an_image``, ``unsupported_format``, ``image_too_large``, ``corrupt_image``,
    ``no_face``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"PortraitError({self.code!r}, {self.message!r})"


# --------------------------------------------------------------------------- decoding


def _sniff_other_format(data: bytes) -> str | None:
    for magic, name in _OTHER_MAGICS:
        if data.startswith(magic):
            return name
    # Two-byte magics also start ordinary text ("BMW", "P1 ..."), so look a little further.
    if data[:2] == b"BM" and data[14:18] in (b"\x0c\0\0\0", b"(\0\0\0", b"l\0\0\0", b"|\0\0\0"):
        return "BMP"
    if data[:1] == b"P" and data[1:2] in b"123456" and data[2:3] in (b" ", b"\n", b"\r", b"\t"):
        return "PNM"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[4:8] == b"ftyp":  # ISO-BMFF: HEIC / AVIF photos from phones
        brand = data[8:12]
        if brand in (b"avif", b"avis"):
            return "AVIF"
        if brand in (b"heic", b"heix", b"hevc", b"hevx", b"mif1", b"msf1"):
            return "HEIC"
    return None


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which the PNG spec requires to come first."""
    if len(data) < 33 or data[12:16] != b"IHDR":
        raise PortraitError("corrupt_image", "The PNG file has no valid header (IHDR).")
    width, height = struct.unpack(">II", data[16:24])
    if width == 0 or height == 0:
        raise PortraitError("corrupt_image", "The PNG file declares an empty image.")
    return width, height


# SOFn markers carry the frame size; C4 (DHT), C8 (JPG) and CC (DAC) share the range.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers that stand alone, with no length field.
_JPEG_STANDALONE = frozenset({0x01, 0xD8, *range(0xD0, 0xD8)})


def _jpeg_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the first SOFn segment, walking marker segments from the start.

    Also checks that the scan data is followed by an EOI marker: libjpeg silently returns a
    grey-filled image for a truncated file, so this is how we catch one. Entropy-coded data
    cannot contain FF D9 (0xFF is byte-stuffed), so the first FF D9 after SOS is the EOI.
    """
    n = len(data)
    i = 2
    size: tuple[int, int] | None = None
    while True:
        while i < n and data[i] != 0xFF:  # tolerate stray bytes between segments, as libjpeg
            i += 1
        while i < n and data[i] == 0xFF:  # fill bytes
            i += 1
        if i >= n:
            raise PortraitError("corrupt_image", "The JPEG file ends before its image data.")
        marker = data[i]
        i += 1
        if marker in _JPEG_STANDALONE:
            continue
        if marker == 0xD9:
            raise PortraitError("corrupt_image", "The JPEG file has no image data.")
        if i + 2 > n:
            raise PortraitError("corrupt_image", "The JPEG file is truncated.")
        (length,) = struct.unpack(">H", data[i : i + 2])
        if length < 2:
            raise PortraitError("corrupt_image", "The JPEG file has a malformed segment.")
        if marker == 0xDA:  # start of scan: the header is over
            if size is None:
                raise PortraitError("corrupt_image", "The JPEG file has no frame header.")
            if data.find(b"\xff\xd9", i + length) < 0:
                raise PortraitError("corrupt_image", "The JPEG file is truncated.")
            return size
        if marker in _JPEG_SOF and size is None:
            if length < 8 or i + 7 > n:
                raise PortraitError("corrupt_image", "The JPEG frame header is truncated.")
            height, width = struct.unpack(">HH", data[i + 3 : i + 7])
            if width == 0:
                raise PortraitError("corrupt_image", "The JPEG file declares an empty image.")
            if height == 0:  # height given later by a DNL marker; OpenCV cannot decode it
                raise PortraitError(
                    "unsupported_format", "JPEG files whose height is set by DNL are not supported."
                )
            size = (width, height)
        i += length


def _check_size(width: int, height: int, max_side: int, max_pixels: int) -> None:
    if width > max_side or height > max_side or width * height > max_pixels:
        raise PortraitError(
            "image_too_large",
            f"The image is {width}x{height}; the limit is {max_side} pixels a side "
            f"and {max_pixels} pixels in all.",
        )


def _to_rgb8(img: np.ndarray) -> np.ndarray:
    """Any OpenCV decode result (gray, gray+alpha, BGR, BGRA; 8 or 16 bit) -> RGB uint8."""
    if img.dtype == np.uint16:
        img = ((img.astype(np.uint32) + 128) // 257).astype(np.uint8)
    elif img.dtype != np.uint8:
        raise PortraitError("unsupported_format", f"Unsupported pixel type {img.dtype}.")
    if img.ndim == 2:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
    channels = img.shape[2]
    if channels == 1:
        return cv2.cvtColor(img[:, :, 0], cv2.COLOR_GRAY2RGB)
    if channels == 2:  # gray + alpha (OpenCV usually expands this to BGRA itself)
        gray = _over_white(img[:, :, :1], img[:, :, 1])
        return cv2.cvtColor(gray, cv2.COLOR_GRAY2RGB)
    if channels == 3:
        return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    if channels == 4:
        return cv2.cvtColor(_over_white(img[:, :, :3], img[:, :, 3]), cv2.COLOR_BGR2RGB)
    raise PortraitError("unsupported_format", f"Unsupported channel count {channels}.")


def _over_white(color: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Composite over white: transparent pixels often hold black or junk colour underneath,
    and a cut-out portrait is meant to be seen on a light page."""
    if alpha.min() == 255:
        return np.ascontiguousarray(color)
    a = alpha.astype(np.float32)[:, :, None] * (1.0 / 255.0)
    out = color.astype(np.float32) * a + 255.0 * (1.0 - a)
    return np.clip(out + 0.5, 0, 255).astype(np.uint8)


def decode_image(data: bytes, *, max_side: int = 4096, max_pixels: int = 16_000_000) -> np.ndarray:
    """Decode an uploaded JPEG or PNG into RGB uint8 ``(H, W, 3)``, refusing anything unsafe.

    The declared size is read from the header and checked against the limits *before*
    decoding, so a tiny file declaring a huge image never allocates. JPEG EXIF orientation
    is applied (phone photos rely on it); PNG transparency is composited over white.

    Raises :class:`PortraitError` with code ``not_an_image``, ``unsupported_format``,
    ``image_too_large`` or ``corrupt_image``.
    """
    data = bytes(data)
    if data.startswith(_PNG_MAGIC):
        width, height = _png_size(data)
        flags = cv2.IMREAD_UNCHANGED  # keep alpha, so we can composite it properly
        if data.rfind(_PNG_IEND) < 0:
            _check_size(width, height, max_side, max_pixels)
            raise PortraitError("corrupt_image", "The PNG file is truncated (no IEND chunk).")
    elif data.startswith(_JPEG_MAGIC):
        width, height = _jpeg_size(data)
        flags = cv2.IMREAD_COLOR  # applies EXIF orientation, converts gray/CMYK to BGR
    else:
        other = _sniff_other_format(data)
        if other is not None:
            raise PortraitError(
                "unsupported_format", f"{other} images are not supported; upload a JPEG or PNG."
            )
        raise PortraitError("not_an_image", "The upload is not an image; upload a JPEG or PNG.")
    _check_size(width, height, max_side, max_pixels)

    try:
        img = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flags)
    except cv2.error as exc:  # some decoder failures raise instead of returning None
        raise PortraitError("corrupt_image", "The image could not be decoded.") from exc
    if img is None or img.size == 0:
        raise PortraitError("corrupt_image", "The image could not be decoded.")
    # EXIF rotation may swap the sides; anything else means the header lied.
    if img.shape[:2] not in ((height, width), (width, height)):
        raise PortraitError("corrupt_image", "The decoded image does not match its header.")
    _check_size(img.shape[1], img.shape[0], max_side, max_pixels)
    return _to_rgb8(img)


def load_default_avatar() -> np.ndarray:
    """The bundled default portrait (public-domain NASA photo) as RGB uint8."""
    return decode_image(DEFAULT_AVATAR_PATH.read_bytes())


# --------------------------------------------------------------------------- detection

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


def _check_rgb(rgb: np.ndarray) -> None:
    if not (
        isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.ndim == 3
        and rgb.shape[2] == 3
    ):
        raise TypeError("expected an RGB uint8 array of shape (H, W, 3)")


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
    _check_rgb(rgb)
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


# --------------------------------------------------------------------------- cropping

#: Crop centre sits this far (fraction of face height) below the face box centre, so the
#: chin and a little neck fit: Haar boxes run from mid-forehead to just below the mouth.
_CROP_SHIFT_DOWN = 0.12
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


def _face_points(face: FaceBox) -> dict[str, tuple[float, float]]:
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
    crops to the Haar box itself and the default 0.5 gives a crop twice the box's size
    (head, hair and a little neck). The crop is centred on the box centre moved down by
    12% of the box height, because Haar boxes stop just below the mouth. Parts of the crop
    outside the photo are filled by edge replication, so there is no hard, flat border for
    the model to warp. ``face`` skips detection when the caller already has it.

    Geometry (see ``GEOMETRY_NAMES``) is in the crop's normalised [-1, 1] frame
    (grid-sample, align_corners=False), clipped to [-1, 1]. Raises ``PortraitError("no_face")``.
    """
    _check_rgb(rgb)
    if not 16 <= size <= 4096:
        raise ValueError(f"size must be in [16, 4096], got {size}")
    if not 0.0 <= expand_ratio <= 4.0:
        raise ValueError(f"expand_ratio must be in [0, 4], got {expand_ratio}")
    if face is None:
        face = detect_face(rgb)

    H, W = rgb.shape[:2]
    side = max(2, round(max(face.w, face.h) * (1.0 + 2.0 * expand_ratio)))
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
    from inference.face_geometry import portrait_geometry  # it imports this module

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
    detect_face(rgb)  # warm-up: cascade loading is a one-off cost
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
