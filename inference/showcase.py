"""A clip and a contact sheet for people to look at: the default avatar speaking a sentence.

Each frame shows the rendered face beside the motion coefficients the engine used and the
speech waveform around that moment, so lip sync can be judged by eye.

    python -m inference.showcase --out-dir out/showcase
"""

from __future__ import annotations

import argparse
import fractions
from pathlib import Path

import av
import cv2
import numpy as np

from inference.images import load_default_avatar
from inference.portrait import prepare_portrait
from inference.render import DEFAULT_MANIFEST, render_frames
from inference.runtimes import create_engine
from inference.tts import espeak, silence

SENTENCE = "Hello! My name is Eileen. Would you like to fly to the moon with me?"


def _panel(coefficients: np.ndarray, names: tuple[str, ...], samples: np.ndarray, t: float,
           height: int, rate: int) -> np.ndarray:
    """Coefficient bars and 0.6 s of waveform centred on ``t``, as an RGB image."""
    width = height
    panel = np.full((height, width, 3), 250, np.uint8)
    rows = len(names)
    bar_area = int(height * 0.72)
    step = bar_area / rows
    scale = height / 512
    for i, (name, value) in enumerate(zip(names, coefficients, strict=False)):
        y = int(i * step + step * 0.2)
        h = max(2, int(step * 0.6))
        x0 = int(width * 0.45)
        magnitude = float(np.clip(abs(value) * (6 if name.startswith("head") else 1), 0, 1))
        cv2.rectangle(panel, (x0, y), (x0 + int(magnitude * (width * 0.5)), y + h),
                      (70, 120, 200), -1)
        cv2.putText(panel, name, (4, y + h), cv2.FONT_HERSHEY_SIMPLEX, 0.38 * scale,
                    (40, 40, 40), 1, cv2.LINE_AA)
    top, span = bar_area + 4, height - bar_area - 8
    half = int(0.3 * rate)
    centre = int(t * rate)
    window = np.zeros(2 * half, np.float32)
    lo, hi = max(0, centre - half), min(len(samples), centre + half)
    if hi > lo:
        window[lo - (centre - half):hi - (centre - half)] = samples[lo:hi]
    xs = np.linspace(0, width - 1, window.size).astype(np.int32)
    ys = (top + span / 2 - window * span / 2).astype(np.int32)
    cv2.polylines(panel, [np.stack([xs, ys], axis=1)], False, (90, 90, 90), 1, cv2.LINE_AA)
    cv2.line(panel, (width // 2, top), (width // 2, top + span), (200, 60, 60), 1)
    return panel


def showcase(out_dir: Path, size: int = 256, manifest: Path = DEFAULT_MANIFEST) -> tuple[Path,
                                                                                         Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = create_engine("onnxruntime", manifest)
    spec = engine.manifest.features
    pcm = np.concatenate([silence(0.5), espeak(SENTENCE), silence(0.8)])
    samples = pcm.astype(np.float32) / 32768.0
    slot = engine.prepare(prepare_portrait(load_default_avatar(), size=size))
    frames, coefficients = [], []
    for batch_frames, batch_coefficients in render_frames(engine, slot, samples, phase=3.0):
        frames.extend(batch_frames)
        coefficients.extend(batch_coefficients)
    names = engine.manifest.coefficient_names
    fps = engine.manifest.fps
    composed = [np.concatenate([f, _panel(c, names, samples, (i + 0.5) / fps, size,
                                          spec.sample_rate)], axis=1)
                for i, (f, c) in enumerate(zip(frames, coefficients, strict=True))]
    clip = out_dir / "showcase.mp4"
    with av.open(str(clip), "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height = composed[0].shape[1], composed[0].shape[0]
        video.pix_fmt = "yuv420p"
        audio = container.add_stream("aac", rate=spec.sample_rate)
        audio.layout = "mono"
        for i, image in enumerate(composed):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts, frame.time_base = i, fractions.Fraction(1, fps)
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        for start in range(0, len(samples), 1024):
            piece = np.ascontiguousarray(samples[start:start + 1024].reshape(1, -1))
            frame = av.AudioFrame.from_ndarray(piece, format="flt", layout="mono")
            frame.sample_rate, frame.pts = spec.sample_rate, start
            container.mux(audio.encode(frame))
        container.mux(audio.encode(None))
    picks = composed[int(0.5 * fps):][::2][:24]
    rows = [np.concatenate(picks[r * 4:(r + 1) * 4], axis=1) for r in range(len(picks) // 4)]
    sheet = out_dir / "showcase.png"
    grid = np.concatenate(rows, axis=0)
    grid = cv2.resize(grid, (grid.shape[1] // 2, grid.shape[0] // 2), interpolation=cv2.INTER_AREA)
    cv2.imwrite(str(sheet), cv2.cvtColor(grid, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_PNG_COMPRESSION, 9])
    engine.release(slot)
    return clip, sheet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("out/showcase"))
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()
    clip, sheet = showcase(args.out_dir, args.size)
    print(f"wrote {clip} and {sheet}")


if __name__ == "__main__":
    main()
