"""The engine contract: what every talking-head model and runtime must honour.

A model is shipped as an ONNX graph plus a JSON manifest in ``engines/``. Per output
video frame it takes a log-mel window around that frame (with a small look-ahead), the
session's prepared portrait and its face geometry, the knobs, and the session clock;
it returns the frame (uint8 RGB; I420, as the server's encoders take it, from an engine
made with ``pixels="i420"``: ``inference.pixels``) and the motion coefficients it used.
The graph is a pure function of its inputs, so frames of different sessions batch
freely. A model may also ship a motion graph (the coefficients alone, from the mel
window, knobs and clock): motion-only sessions then never pay for the renderer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

#: Face geometry handed to the model, normalised to [-1, 1] (grid-sample convention,
#: x to the right, y downwards) in the prepared portrait's frame; "left"/"right" are the
#: image's sides. Measured from face landmarks (inference/face_geometry.py). A model takes
#: the first ``len(manifest.geometry_names)`` values, so older models keep working.
GEOMETRY_NAMES: tuple[str, ...] = (
    "mouth_x",
    "mouth_y",
    "mouth_half_width",
    "chin_y",
    "eye_left_x",
    "eye_left_y",
    "eye_right_x",
    "eye_right_y",
    "mouth_corner_left_x",
    "mouth_corner_left_y",
    "mouth_corner_right_x",
    "mouth_corner_right_y",
    "mouth_inner_half_width",  # half the distance between the inner lip corners (78/308)
    "upper_lip_outer_y",  # vermilion border of the upper lip (0)
    "upper_lip_inner_y",  # (13)
    "lower_lip_inner_y",  # (14); above upper_lip_inner_y never, equal when lips touch
    "lower_lip_outer_y",  # (17)
    "chin_x",  # (152); chin_y is in the first eight
    "jaw_left_x",  # lower jaw sides (172 / 397)
    "jaw_left_y",
    "jaw_right_x",
    "jaw_right_y",
    "eye_left_upper_y",  # upper / lower lid at the pupil column (159 / 145)
    "eye_left_lower_y",
    "eye_left_half_width",  # half the corner-to-corner width (33 / 133)
    "eye_right_upper_y",  # (386 / 374)
    "eye_right_lower_y",
    "eye_right_half_width",  # (362 / 263)
    "nose_x",  # nose tip (1)
    "nose_y",
    "face_left_x",  # face outline at the cheekbones (234 / 454)
    "face_right_x",
    "forehead_y",  # top of the face outline (10)
)


@dataclass(frozen=True)
class Knob:
    """A per-session control the model takes as an input, defined once: the API validates
    against it, the config's session defaults use it, the page draws its slider from it."""

    name: str
    label: str
    low: float
    high: float
    default: float
    doc: str

    def check(self, value: object) -> float:
        """``value`` as a float in range, or ValueError naming the knob and its range."""
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not self.low <= value <= self.high:
            raise ValueError(f"{self.name}={repr(value)[:64]} must be a number in "
                             f"[{self.low:g}, {self.high:g}]")
        return float(value)

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "label": self.label, "min": self.low, "max": self.high,
                "default": self.default, "doc": self.doc}


#: Per-request knobs, in the engine's input order.
KNOBS: tuple[Knob, ...] = (
    Knob("motion_scale", "Mouth motion", 0.0, 2.0, 1.0,
         "mouth amplitude: 0 keeps the mouth still, 1 as trained, 2 exaggerated"),
    Knob("dynamic_scale", "Head motion", 0.0, 2.0, 1.0,
         "head sway and nods: 0 holds the head still; blinks are not scaled"),
)
KNOB_NAMES: tuple[str, ...] = tuple(k.name for k in KNOBS)
KNOBS_BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}


@dataclass(frozen=True)
class FeatureSpec:
    """How the host computes the log-mel features the model expects."""

    sample_rate: int = 16000
    n_fft: int = 512
    hop_length: int = 160
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float = 8000.0
    #: log10 of the mel power, floored here (so digital silence is log10(floor)).
    floor: float = 1e-10


@dataclass(frozen=True)
class FrameTiming:
    """Which audio a video frame sees: frame rate, features, window and look-ahead.

    The one place this arithmetic lives: live sessions, offline renders, training windows
    and the model's own pooling kernels all cut windows by :meth:`window_start`.
    """

    fps: int
    features: FeatureSpec
    #: Mel frames per window, and how many of them lie after the end of the video frame.
    window_frames: int
    lookahead_frames: int

    @property
    def mel_frames_per_video_frame(self) -> int:
        samples_per_frame = self.features.sample_rate // self.fps
        return samples_per_frame // self.features.hop_length

    @property
    def lookahead_ms(self) -> float:
        return 1000.0 * self.lookahead_frames * self.features.hop_length / self.features.sample_rate

    @property
    def frame_latency_s(self) -> float:
        """From the start of a video frame's audio until its feature window is complete:
        the frame itself, the look-ahead, and the last FFT's reach past its hop."""
        spec = self.features
        reach = (spec.n_fft - spec.hop_length) / 2 / spec.sample_rate
        return 1.0 / self.fps + self.lookahead_ms / 1000.0 + reach

    def window_start(self, frame_index: int) -> int:
        """First mel frame of video frame ``frame_index``'s window (may be negative)."""
        end = (frame_index + 1) * self.mel_frames_per_video_frame + self.lookahead_frames
        return end - self.window_frames


@dataclass(frozen=True)
class Manifest(FrameTiming):
    """What a shipped model declares about itself (``engines/<name>.json``)."""

    name: str
    onnx: str
    coefficient_names: tuple[str, ...]
    #: The motion graph (mel, knobs, clock -> coefficients), if the model ships one.
    motion_onnx: str | None = None
    geometry_names: tuple[str, ...] = GEOMETRY_NAMES
    knob_names: tuple[str, ...] = KNOB_NAMES
    #: Frame sides the model was made for (the renderer's detail is tuned to them).
    portrait_sizes: tuple[int, ...] = (256, 512)
    extra: dict[str, object] = field(default_factory=dict)

    def knob_vector(self, values: Mapping[str, float]) -> np.ndarray:
        """One frame's knob input in this model's order (each knob's default where unset)."""
        return np.array([values.get(name, KNOBS_BY_NAME[name].default)
                         for name in self.knob_names], np.float32)

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        path = Path(path)
        raw = json.loads(path.read_text())
        known = {"name", "onnx", "motion_onnx", "fps", "features", "window_frames",
                 "lookahead_frames", "coefficient_names", "geometry_names", "knob_names",
                 "portrait_sizes"}
        knob_names = tuple(raw.get("knob_names", KNOB_NAMES))
        unknown = [k for k in knob_names if k not in KNOB_NAMES]
        if unknown:
            raise ValueError(f"{path}: knobs {unknown} are not defined by the engine contract "
                             f"(known: {', '.join(KNOB_NAMES)})")
        return cls(
            name=raw["name"],
            onnx=str(path.parent / raw["onnx"]),
            motion_onnx=str(path.parent / raw["motion_onnx"]) if raw.get("motion_onnx") else None,
            fps=int(raw["fps"]),
            features=FeatureSpec(**raw["features"]),
            window_frames=int(raw["window_frames"]),
            lookahead_frames=int(raw["lookahead_frames"]),
            coefficient_names=tuple(raw["coefficient_names"]),
            geometry_names=tuple(raw.get("geometry_names", GEOMETRY_NAMES)),
            knob_names=knob_names,
            portrait_sizes=tuple(int(s) for s in raw.get("portrait_sizes", cls.portrait_sizes)),
            extra={k: v for k, v in raw.items() if k not in known},
        )


@dataclass(frozen=True)
class PreparedPortrait:
    """A portrait cropped around its face, ready for the engine."""

    image: np.ndarray  # uint8 RGB, (size, size, 3)
    geometry: np.ndarray  # float32, (len(GEOMETRY_NAMES),)
    source: str = "detector"  # what placed the geometry: "landmarks", or the face detector

    @property
    def size(self) -> int:
        return int(self.image.shape[0])


@dataclass(frozen=True)
class FrameInput:
    """Everything one video frame needs; the unit the scheduler batches."""

    slot: int
    mel: np.ndarray  # float32, (window_frames, n_mels)
    knobs: np.ndarray  # float32, (len(knob_names),) in the manifest's order
    clock: np.ndarray  # float32, (2,): session time in seconds, session phase

    @classmethod
    def for_frame(cls, slot: int, index: int, fps: int, mel: np.ndarray, knobs: np.ndarray,
                  phase: float) -> FrameInput:
        """Video frame ``index`` of a session whose idle motion is shifted by ``phase``."""
        return cls(slot=slot, mel=mel, knobs=knobs,
                   clock=np.array([index / fps, phase], np.float32))


#: The frame size of a request that needs no picture (a motion-only session's): such
#: requests batch together, whatever their portraits' sizes, and run ``run_motion``.
NO_PICTURE = 0


@dataclass(frozen=True)
class BatchOutput:
    #: uint8, (B, H, W, 3) RGB, or (B, 3H/2, W) I420 from an engine whose ``pixels`` is
    #: "i420"; (B, 0, 0, 3) from ``run_motion``.
    frames: np.ndarray
    coefficients: np.ndarray  # float32, (B, len(coefficient_names))

    @classmethod
    def motion(cls, coefficients: np.ndarray) -> BatchOutput:
        return cls(np.empty((len(coefficients), 0, 0, 3), np.uint8), coefficients)


class Engine(Protocol):
    """One model on one runtime. ``run`` is blocking and called from one worker thread."""

    manifest: Manifest
    #: The frames' layout (``inference.pixels``): "rgb", or "i420" for the server.
    pixels: str

    def prepare(self, portrait: PreparedPortrait) -> int:
        """Keep the portrait where the runtime wants it; returns its slot."""
        ...

    def release(self, slot: int) -> None: ...

    def frame_size(self, slot: int) -> int: ...

    def run(self, batch: list[FrameInput]) -> BatchOutput:
        """Render one frame per input; all inputs share one frame size."""
        ...

    def run_motion(self, batch: list[FrameInput]) -> np.ndarray:
        """Only the coefficients of each input, (B, K), whatever their frame sizes: the
        model's motion graph, or ``coefficients_by_rendering`` where it has none."""
        ...


def coefficients_by_rendering(engine: Engine, batch: list[FrameInput]) -> np.ndarray:
    """``run_motion`` for a model without a motion graph: render, keep the coefficients
    (one run per frame size, since a rendered batch shares one)."""
    by_size: dict[int, list[int]] = {}
    for i, item in enumerate(batch):
        by_size.setdefault(engine.frame_size(item.slot), []).append(i)
    out = np.empty((len(batch), len(engine.manifest.coefficient_names)), np.float32)
    for rows in by_size.values():
        out[rows] = engine.run([batch[i] for i in rows]).coefficients
    return out
