"""What preparing an uploaded photo costs: decoded in full, or only as finely as its
portraits need (``inference.portrait.decode_portrait_source``).

A 4000x3000 JPEG of the default portrait is decoded, its face found and both portraits
(256 and 512) cropped, five times; each way runs in a process of its own, given only the
file, so its peak memory can be read. Prints the median time and how far the process's
peak RSS grew.

    python -m benchmarks.uploads
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

from inference.face_detect import detect_face
from inference.images import decode_image, load_default_avatar
from inference.portrait import decode_portrait_source, prepare_portrait


def _photo() -> bytes:
    big = cv2.resize(load_default_avatar(), (4000, 4000), interpolation=cv2.INTER_CUBIC)
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(big[500:3500], cv2.COLOR_RGB2BGR),
                           [cv2.IMWRITE_JPEG_QUALITY, 92])
    assert ok
    return buf.tobytes()


def measure(way: str, path: str) -> None:
    data = Path(path).read_bytes()
    detect_face(load_default_avatar())  # the detector is loaded before measuring
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(5):
        start = time.perf_counter()
        if way == "full":
            image = decode_image(data)
            face = detect_face(image)
        else:
            source = decode_portrait_source(data, largest=512)
            image, face = source.image, source.face
        for size in (256, 512):
            prepare_portrait(image, size=size, face=face)
        times.append(time.perf_counter() - start)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(f"{way:8s} {len(data) // 1024:5d} kB  decoded {image.shape[1]}x{image.shape[0]}  "
          f"median {1000 * np.median(times):4.0f} ms  peak RSS +{grown:.0f} MB")


def main() -> None:
    if len(sys.argv) > 2:
        measure(sys.argv[1], sys.argv[2])
        return
    with tempfile.NamedTemporaryFile(suffix=".jpg") as photo:
        photo.write(_photo())
        photo.flush()
        for way in ("full", "as_needed"):
            subprocess.run([sys.executable, "-m", "benchmarks.uploads", way, photo.name],
                           check=True)


if __name__ == "__main__":
    main()
