"""Decode an uploaded JPEG or PNG safely: the declared size is read from the file header and
checked before decoding, so a decompression bomb is refused without allocating.
"""

from __future__ import annotations

import struct
from pathlib import Path

import cv2
import numpy as np

__all__ = [
    "DEFAULT_AVATAR_PATH",
    "PortraitError",
    "check_rgb",
    "decode_image",
    "load_default_avatar",
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


#: Decoded channels by PNG colour type (palette images decode to BGRA at worst).
_PNG_CHANNELS = {0: 1, 2: 3, 3: 4, 4: 2, 6: 4}


def _png_decoded_bytes(data: bytes, width: int, height: int) -> int:
    """What decoding allocates: IHDR's bit depth and colour type say how deep a pixel is
    (a 16-bit RGBA pixel is 8 bytes where the portrait needs 3)."""
    depth, colour = data[24], data[25]
    return width * height * _PNG_CHANNELS.get(colour, 4) * (2 if depth == 16 else 1)


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


def _check_size(width: int, height: int, max_side: int, max_pixels: int,
                decoded: int = 0, max_decoded: int | None = None) -> None:
    if width > max_side or height > max_side or width * height > max_pixels:
        raise PortraitError(
            "image_too_large",
            f"The image is {width}x{height}; the limit is {max_side} pixels a side "
            f"and {max_pixels} pixels in all.",
        )
    if max_decoded is not None and decoded > max_decoded:
        raise PortraitError(
            "image_too_large",
            f"The {width}x{height} image decodes to {decoded / 2**20:.0f} MB; the limit is "
            f"{max_decoded / 2**20:.0f} MB (save it as an 8-bit JPEG or PNG).",
        )


def _to_rgb8(img: np.ndarray) -> np.ndarray:
    """Any OpenCV decode result (gray, gray+alpha, BGR, BGRA; 8 or 16 bit) -> RGB uint8."""
    if img.dtype == np.uint16:
        img = (img >> 8).astype(np.uint8)  # in place of a 4-byte-per-channel copy
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


#: OpenCV's flags for a JPEG decoded scaled down by 2, 4 or 8 (EXIF orientation applied).
_REDUCED = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
            8: cv2.IMREAD_REDUCED_COLOR_8}


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) a JPEG or PNG declares, before any EXIF rotation; (0, 0) otherwise."""
    data = bytes(data)
    if data.startswith(_PNG_MAGIC):
        return _png_size(data)
    if data.startswith(_JPEG_MAGIC):
        return _jpeg_size(data)
    return 0, 0


def jpeg_reduction(data: bytes, min_side: int) -> int:
    """The largest of 1, 2, 4 and 8 that a JPEG can be decoded scaled down by with its
    shorter side still at least ``min_side``: libjpeg scales while it decodes, so a large
    photo costs a fraction of the time and memory. 1 for anything else."""
    if not bytes(data[:3]).startswith(_JPEG_MAGIC):
        return 1
    shorter = min(_jpeg_size(bytes(data)))
    return max(r for r in _REDUCED if r == 1 or shorter // r >= min_side)


def decode_image(data: bytes, *, max_side: int = 4096, max_pixels: int = 16_000_000,
                 max_decoded_bytes: int = 64 * 2**20, reduction: int = 1) -> np.ndarray:
    """Decode an uploaded JPEG or PNG into RGB uint8 ``(H, W, 3)``, refusing anything unsafe.

    The declared size, and what decoding it would allocate, are read from the header and
    checked against the limits *before* decoding, so a tiny file declaring a huge or deep
    image never allocates. JPEG EXIF orientation
    is applied (phone photos rely on it); PNG transparency is composited over white.
    A JPEG is decoded scaled down by ``reduction`` (see :func:`jpeg_reduction`).

    Raises :class:`PortraitError` with code ``not_an_image``, ``unsupported_format``,
    ``image_too_large`` or ``corrupt_image``.
    """
    data = bytes(data)
    shrink = 1
    if data.startswith(_PNG_MAGIC):
        width, height = _png_size(data)
        decoded = _png_decoded_bytes(data, width, height)
        flags = cv2.IMREAD_UNCHANGED  # keep alpha, so we can composite it properly
        if data.rfind(_PNG_IEND) < 0:
            _check_size(width, height, max_side, max_pixels)
            raise PortraitError("corrupt_image", "The PNG file is truncated (no IEND chunk).")
    elif data.startswith(_JPEG_MAGIC):
        width, height = _jpeg_size(data)
        shrink = reduction
        decoded = width * height * 4 // shrink**2  # CMYK at worst, before it becomes BGR
        flags = _REDUCED[reduction]  # applies EXIF orientation, converts gray/CMYK to BGR
    else:
        other = _sniff_other_format(data)
        if other is not None:
            raise PortraitError(
                "unsupported_format", f"{other} images are not supported; use a JPEG or PNG."
            )
        raise PortraitError("not_an_image", "This is not an image; use a JPEG or PNG.")
    _check_size(width, height, max_side, max_pixels, decoded, max_decoded_bytes)

    try:
        img = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flags)
    except cv2.error as exc:  # some decoder failures raise instead of returning None
        raise PortraitError("corrupt_image", "The image could not be decoded.") from exc
    if img is None or img.size == 0:
        raise PortraitError("corrupt_image", "The image could not be decoded.")
    # EXIF rotation may swap the sides; anything else means the header lied.
    w, h = -(-width // shrink), -(-height // shrink)
    if img.shape[:2] not in ((h, w), (w, h)):
        raise PortraitError("corrupt_image", "The decoded image does not match its header.")
    return _to_rgb8(img)


def load_default_avatar() -> np.ndarray:
    """The bundled default portrait (public-domain NASA photo) as RGB uint8."""
    return decode_image(DEFAULT_AVATAR_PATH.read_bytes())


def check_rgb(rgb: np.ndarray) -> None:
    """Refuse anything but an RGB uint8 ``(H, W, 3)`` array (a programming error)."""
    if not (
        isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.ndim == 3
        and rgb.shape[2] == 3
    ):
        raise TypeError("expected an RGB uint8 array of shape (H, W, 3)")
