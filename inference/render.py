"""Offline render: one portrait and one audio file in, a talking MP4 (H.264 + AAC) out.

Runs the same engine and features as the live server, frame by frame on the audio's
own timeline, so a clip rendered here is what a live session would have shown.

    python -m inference.render --audio speech.wav --image portrait.jpg --out talking.mp4
"""

from __future__ import annotations

import argparse
import fractions
import random
import sys
from pathlib import Path

import av
import numpy as np

from inference.engine import Engine, FrameInput
from inference.features import log_mel
from inference.portrait import PortraitError, decode_image, load_default_avatar, prepare_portrait
from inference.runtimes import create_engine

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MANIFEST = REPO_ROOT / "engines" / "sonic-lite.json"


def read_audio(path: str | Path, rate: int) -> np.ndarray:
    """Any audio file PyAV can decode, as mono float32 at ``rate`` (first channel)."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    chunks: list[np.ndarray] = []
    with av.open(str(path)) as container:
        if not container.streams.audio:
            raise ValueError(f"{path} has no audio stream")
        for frame in container.decode(audio=0):
            chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(frame))
        chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


def render_frames(engine: Engine, slot: int, samples: np.ndarray, *, motion_scale: float = 1.0,
                  dynamic_scale: float = 1.0, batch: int = 8, phase: float | None = None):
    """Yield (frames, coefficients) batches for 16 kHz mono ``samples``."""
    manifest = engine.manifest
    spec = manifest.features
    n_frames = int(np.ceil(len(samples) * manifest.fps / spec.sample_rate))
    # Silence after the end so the last frames have their look-ahead.
    pad = np.zeros(spec.n_fft + spec.hop_length * (manifest.lookahead_frames + 1), np.float32)
    mel = log_mel(np.concatenate([samples.astype(np.float32), pad]), spec)
    silence = np.log10(spec.floor)
    knobs = np.array([motion_scale, dynamic_scale], np.float32)
    phase = random.uniform(0, 1000) if phase is None else phase
    for first in range(0, n_frames, batch):
        inputs = []
        for i in range(first, min(first + batch, n_frames)):
            start = manifest.window_start(i)
            window = np.full((manifest.window_frames, spec.n_mels), silence, np.float32)
            lo, hi = max(start, 0), min(start + manifest.window_frames, len(mel))
            window[lo - start:hi - start] = mel[lo:hi]
            inputs.append(FrameInput(slot=slot, mel=window, knobs=knobs,
                                     clock=np.array([i / manifest.fps, phase], np.float32)))
        output = engine.run(inputs)
        yield output.frames, output.coefficients


def render(audio_path: str | Path, out_path: str | Path, *, image: np.ndarray, size: int = 256,
           expand_ratio: float = 0.5, runtime: str = "onnxruntime",
           manifest_path: str | Path = DEFAULT_MANIFEST, motion_scale: float = 1.0,
           dynamic_scale: float = 1.0) -> int:
    """Render to ``out_path``; returns the number of video frames written."""
    engine = create_engine(runtime, manifest_path)
    manifest = engine.manifest
    slot = engine.prepare(prepare_portrait(image, size=size, expand_ratio=expand_ratio))
    samples = read_audio(audio_path, manifest.features.sample_rate)
    speech_48k = read_audio(audio_path, 48000)
    written = 0
    with av.open(str(out_path), "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=manifest.fps)
        video.width = video.height = size
        video.pix_fmt = "yuv420p"
        video.options = {"crf": "20", "preset": "veryfast"}
        audio = container.add_stream("aac", rate=48000)
        audio.layout = "mono"
        for frames, _ in render_frames(engine, slot, samples, motion_scale=motion_scale,
                                       dynamic_scale=dynamic_scale):
            for frame in frames:
                out = av.VideoFrame.from_ndarray(frame, format="rgb24")
                out.pts = written
                out.time_base = fractions.Fraction(1, manifest.fps)
                container.mux(video.encode(out))
                written += 1
        container.mux(video.encode(None))
        chunk = 1024
        for start in range(0, len(speech_48k), chunk):
            piece = speech_48k[start:start + chunk].reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(piece), format="flt",
                                               layout="mono")
            frame.sample_rate = 48000
            frame.pts = start
            container.mux(audio.encode(frame))
        container.mux(audio.encode(None))
    engine.release(slot)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.render", description=__doc__)
    parser.add_argument("--audio", required=True, help="speech file (WAV or anything FFmpeg reads)")
    parser.add_argument("--image", help="portrait JPEG/PNG (default: the shipped astronaut)")
    parser.add_argument("--out", required=True, help="output .mp4")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--expand-ratio", type=float, default=0.5)
    parser.add_argument("--motion-scale", type=float, default=1.0)
    parser.add_argument("--dynamic-scale", type=float, default=1.0)
    parser.add_argument("--runtime", default="onnxruntime")
    parser.add_argument("--manifest", default=str(DEFAULT_MANIFEST))
    args = parser.parse_args(argv)
    try:
        image = decode_image(Path(args.image).read_bytes()) if args.image \
            else load_default_avatar()
        frames = render(args.audio, args.out, image=image, size=args.size,
                        expand_ratio=args.expand_ratio, runtime=args.runtime,
                        manifest_path=args.manifest, motion_scale=args.motion_scale,
                        dynamic_scale=args.dynamic_scale)
    except (OSError, ValueError, PortraitError, av.FFmpegError) as exc:
        print(f"render failed: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {frames} frames to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
