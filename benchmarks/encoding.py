"""Video encoding cost per frame: aiortc's own VP8 path against the server's.

Encodes 100 frames of the default portrait (moving, with a changing mouth patch) at one
size, one thread, and prints CPU ms per frame (colour conversion included) and PSNR of
the decoded frames at a fixed bitrate. aiortc's path converts RGB to YUV with swscale and
runs libvpx with its noise filter; the server converts once with OpenCV and encodes with
``server.media.encoding.RealtimeVp8Encoder``'s settings.

    python -m benchmarks.encoding --size 512
    python -m benchmarks.encoding --size 256 --rendered --bitrate 500000 800000 1500000
    python -m benchmarks.encoding --size 512 --rendered --bitrate 1500000 \
        --static-threshold 0 300 500 800 --no-aiortc

``--rendered`` encodes 8 s of the engine's own frames of the default avatar speaking
instead (what a session sends; what ``video.max_bitrate_kbps`` was chosen on). PSNR is
given over the whole frame and over its moving part (the 5% of pixels that change most
across the frames: the mouth and jaw when it speaks), where skipped macroblocks would
show first.
"""

from __future__ import annotations

import argparse
import fractions
import functools
import time

import av
import cv2
import numpy as np
from aiortc.codecs import vpx

from inference.images import load_default_avatar
from inference.portrait import prepare_portrait
from server.media.encoding import RealtimeVp8Encoder, Vp8Tuning


def _frames(size: int, count: int = 100) -> list[np.ndarray]:
    image = prepare_portrait(load_default_avatar(), size=size).image
    out = []
    for i in range(count):
        frame = np.roll(image, int(4 * np.sin(i / 5)), axis=0).copy()
        frame[size * 6 // 10:size * 6 // 10 + size // 16, size * 4 // 10:size * 6 // 10] = \
            (i * 3) % 255
        out.append(frame)
    return out


def _rendered(size: int, seconds: float = 8.0) -> list[np.ndarray]:
    from inference.render import DEFAULT_MANIFEST, render_frames
    from inference.runtimes import create_engine
    from inference.tts import conversation

    engine = create_engine("onnxruntime", DEFAULT_MANIFEST)
    slot = engine.prepare(prepare_portrait(load_default_avatar(), size=size))
    samples = conversation()[:int(16000 * seconds)].astype(np.float32) / 32768.0
    return [f for frames, _ in render_frames(engine, slot, samples, phase=3.0) for f in frames]


def _moving(frames: list[np.ndarray]) -> np.ndarray:
    """The pixels that change most across ``frames`` (a mask of 5% of them)."""
    spread = np.std(np.stack(frames).astype(np.float32), axis=0).sum(axis=-1)
    return spread >= np.quantile(spread, 0.95)


def _run(encoder: vpx.Vp8Encoder, frames: list[np.ndarray], convert: str
         ) -> tuple[float, float, float, float]:
    """CPU ms per frame, kbit/s, PSNR (dB) of what decodes, and of its moving part."""
    decoder = av.CodecContext.create("libvpx", "r")
    decoded, sent = [], 0
    cpu = 0.0
    for i, rgb in enumerate(frames):
        start = time.process_time()
        if convert == "opencv":
            frame = av.VideoFrame.from_ndarray(cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV_I420),
                                               format="yuv420p")
        else:  # the encoder converts (swscale), as aiortc does with RGB frames
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
        frame.pts, frame.time_base = i, fractions.Fraction(1, 25)
        payloads, _ = encoder.encode(frame, force_keyframe=i == 0)
        cpu += time.process_time() - start
        data = b"".join(vpx.vp8_depayload(p) for p in payloads)
        sent += len(data)
        decoded += [f.to_ndarray(format="rgb24") for f in decoder.decode(av.Packet(data))]
    errors = [(d.astype(np.float64) - f) ** 2
              for d, f in zip(decoded[10:], frames[10:], strict=False)]
    moving = _moving(frames)
    return 1000 * cpu / len(frames), sent * 8 * 25 / len(frames) / 1000, \
        10 * np.log10(255**2 / np.mean(errors)), \
        10 * np.log10(255**2 / np.mean([e[moving] for e in errors]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--bitrate", type=int, nargs="+", default=[500_000],
                        help="bits/s (aiortc starts at 500 kbit/s)")
    parser.add_argument("--rendered", action="store_true",
                        help="the engine's frames of speech, not a moving still")
    parser.add_argument("--speed", type=int, default=Vp8Tuning.speed,
                        help="the server's encoder speed")
    parser.add_argument("--static-threshold", type=int, nargs="+",
                        default=[Vp8Tuning.static_threshold],
                        help="the server's static thresholds to compare")
    parser.add_argument("--no-aiortc", action="store_true", help="the server's encoder only")
    args = parser.parse_args()
    frames = _rendered(args.size) if args.rendered else _frames(args.size)
    paths = [] if args.no_aiortc else \
        [("aiortc (swscale, noise filter, cpu-used -6)", vpx.Vp8Encoder, "swscale")]
    paths += [(f"server (OpenCV, cpu-used -{args.speed}, static-thresh {t})",
               functools.partial(RealtimeVp8Encoder, Vp8Tuning(args.speed, t)), "opencv")
              for t in args.static_threshold]
    for bitrate in args.bitrate:
        print(f"{args.size}x{args.size}, {bitrate / 1000:.0f} kbit/s, one thread")
        for name, make, convert in paths:
            runs = []
            for _ in range(3):
                encoder = make()
                encoder.target_bitrate = bitrate
                runs.append(_run(encoder, frames, convert))
            ms, kbps, psnr, moving = np.median(np.array(runs), axis=0)
            print(f"  {name:48s} {ms:6.2f} ms/frame  {kbps:6.0f} kbit/s  PSNR {psnr:5.2f} "
                  f"dB, moving part {moving:5.2f} dB")


if __name__ == "__main__":
    main()
