"""Offline render: one portrait and one audio file in, a talking MP4 (H.264 + AAC) out.

Runs the same engine and features as the live server, frame by frame on the audio's
own timeline, so a clip rendered here is what a live session would have shown.

    python -m inference.render --audio speech.wav --image portrait.jpg --out talking.mp4
"""

from __future__ import annotations

import argparse
import fractions
import itertools
import random
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import av
import numpy as np

from inference.engine import KNOBS, Engine, FrameInput, Manifest
from inference.features import FrameWindows
from inference.images import PortraitError, decode_image, load_default_avatar
from inference.mp4 import Mp4Writer
from inference.portrait import prepare_portrait
from inference.runtimes import RUNTIMES, create_engine

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MANIFEST = REPO_ROOT / "engines" / "sonic-lite.json"


class AudioError(ValueError):
    """The speech file cannot be read; the message names the file and why."""


def read_audio(path: str | Path, rate: int) -> np.ndarray:
    """Any audio file PyAV can decode, as mono float32 at ``rate`` (first channel)."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    chunks: list[np.ndarray] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise AudioError(f"{path}: no audio stream")
            for frame in container.decode(audio=0):
                chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(frame))
            chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    except (OSError, av.FFmpegError) as exc:
        raise AudioError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from exc
    return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


def render_frames(engine: Engine, slot: int, samples: np.ndarray, *,
                  knobs: Mapping[str, float] | None = None, batch: int = 8,
                  phase: float | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (frames, coefficients) batches for 16 kHz mono ``samples``: one frame per
    40 ms the audio starts, cut exactly as a live session cuts them. ``knobs`` by name;
    each unset one takes its default."""
    manifest = engine.manifest
    vector = manifest.knob_vector(knobs or {})
    phase = random.uniform(0, 1000) if phase is None else phase
    windows = FrameWindows(manifest)
    windows.push(samples)
    inputs = (FrameInput.for_frame(slot, i, manifest.fps, mel, vector, phase)
              for i, mel in itertools.chain(windows.ready(), windows.finish()))
    while chunk := list(itertools.islice(inputs, batch)):  # a long clip never sits in memory
        output = engine.run(chunk)
        yield output.frames, output.coefficients


def render(audio_path: str | Path, out_path: str | Path, *, image: np.ndarray, size: int = 256,
           expand_ratio: float = 0.5, runtime: str = "onnxruntime",
           manifest_path: str | Path = DEFAULT_MANIFEST,
           knobs: Mapping[str, float] | None = None) -> int:
    """Render to ``out_path``; returns the number of video frames written."""
    engine = create_engine(runtime, manifest_path)
    manifest = engine.manifest
    samples = read_audio(audio_path, manifest.features.sample_rate)
    speech_48k = read_audio(audio_path, 48000)
    slot = engine.prepare(prepare_portrait(image, size=size, expand_ratio=expand_ratio))
    writer = Mp4Writer(out_path, size=size, fps=manifest.fps)
    try:
        for frames, _ in render_frames(engine, slot, samples, knobs=knobs):
            for frame in frames:
                writer.video(frame, writer.frames, fractions.Fraction(1, manifest.fps))
        writer.audio(speech_48k, 0)
    finally:
        writer.close()
    written = writer.frames
    engine.release(slot)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference.render", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Render a talking clip offline: one portrait and one speech file in, an "
                    "MP4\n(H.264 + AAC) out, through the same engine and features as the live "
                    "server.")
    parser.add_argument("--audio", required=True, metavar="FILE",
                        help="the speech: WAV or anything FFmpeg decodes")
    parser.add_argument("--image", metavar="FILE",
                        help="portrait JPEG or PNG with one front-facing face (default: the "
                             "shipped astronaut)")
    parser.add_argument("--out", required=True, metavar="FILE.mp4", help="the clip to write")
    parser.add_argument("--size", type=int, default=256,
                        help="frame side in pixels, one the model was made for (default 256)")
    parser.add_argument("--expand-ratio", type=float, default=0.5, metavar="R",
                        help="margin around the face, as a fraction of the face box on each "
                             "side (default 0.5)")
    for knob in KNOBS:
        parser.add_argument(f"--{knob.name.replace('_', '-')}", type=float,
                            default=knob.default, metavar="X",
                            help=f"{knob.doc} (in [{knob.low:g}, {knob.high:g}], default "
                                 f"{knob.default:g})")
    parser.add_argument("--runtime", default="onnxruntime", choices=RUNTIMES,
                        help="runtime to run the model on (default onnxruntime, the CPU)")
    parser.add_argument("--manifest", default=str(DEFAULT_MANIFEST), metavar="FILE",
                        help="model manifest (default: the shipped sonic-lite)")
    args = parser.parse_args(argv)
    knobs = {knob.name: getattr(args, knob.name) for knob in KNOBS}
    for knob in KNOBS:
        if not knob.low <= knobs[knob.name] <= knob.high:
            parser.error(f"--{knob.name.replace('_', '-')} {knobs[knob.name]:g} must be in "
                         f"[{knob.low:g}, {knob.high:g}]")
    try:
        manifest = Manifest.load(args.manifest)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"--manifest {args.manifest}: {exc}")
    if args.size not in manifest.portrait_sizes:
        parser.error(f"--size {args.size}: {manifest.name} is made for "
                     f"{', '.join(map(str, manifest.portrait_sizes))}")
    if not 0.0 <= args.expand_ratio <= 4.0:
        parser.error(f"--expand-ratio {args.expand_ratio:g} must be in [0, 4]")
    try:
        image = decode_image(Path(args.image).read_bytes()) if args.image \
            else load_default_avatar()
    except (OSError, PortraitError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"render failed: --image {args.image}: {reason}", file=sys.stderr)
        return 2
    try:
        frames = render(args.audio, args.out, image=image, size=args.size,
                        expand_ratio=args.expand_ratio, runtime=args.runtime,
                        manifest_path=args.manifest, knobs=knobs)
    except PortraitError as exc:
        print(f"render failed: --image {args.image or 'astronaut'}: {exc}", file=sys.stderr)
        return 2
    except AudioError as exc:
        print(f"render failed: --audio {exc}", file=sys.stderr)
        return 2
    except (OSError, av.FFmpegError) as exc:
        print(f"render failed: --out {args.out}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {frames} frames to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
