"""The engine contract: what every talking-head model and runtime must honour.

A model is shipped as an ONNX graph plus a JSON manifest in ``engines/``. Per output
video frame it takes a log-mel window around that frame (with a small look-ahead), the
session's prepared portrait and its face geometry, the knobs, and the session clock;
it returns the frame (uint8 RGB) and the motion coefficients it used. The graph is a
pure function of its inputs, so frames of different sessions batch freely.
"""

from __future__ import annotations

import json
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

#: Per-request knobs, in input order.
KNOB_NAMES: tuple[str, ...] = ("motion_scale", "dynamic_scale")


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
class Manifest:
    """What a shipped model declares about itself (``engines/<name>.json``)."""

    name: str
    onnx: str
    fps: int
    features: FeatureSpec
    #: Mel frames per window, and how many of them lie after the end of the video frame.
    window_frames: int
    lookahead_frames: int
    coefficient_names: tuple[str, ...]
    geometry_names: tuple[str, ...] = GEOMETRY_NAMES
    knob_names: tuple[str, ...] = KNOB_NAMES
    extra: dict[str, object] = field(default_factory=dict)

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

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        path = Path(path)
        raw = json.loads(path.read_text())
        known = {"name", "onnx", "fps", "features", "window_frames", "lookahead_frames",
                 "coefficient_names", "geometry_names", "knob_names"}
        return cls(
            name=raw["name"],
            onnx=str(path.parent / raw["onnx"]),
            fps=int(raw["fps"]),
            features=FeatureSpec(**raw["features"]),
            window_frames=int(raw["window_frames"]),
            lookahead_frames=int(raw["lookahead_frames"]),
            coefficient_names=tuple(raw["coefficient_names"]),
            geometry_names=tuple(raw.get("geometry_names", GEOMETRY_NAMES)),
            knob_names=tuple(raw.get("knob_names", KNOB_NAMES)),
            extra={k: v for k, v in raw.items() if k not in known},
        )


@dataclass(frozen=True)
class PreparedPortrait:
    """A portrait cropped around its face, ready for the engine."""

    image: np.ndarray  # uint8 RGB, (size, size, 3)
    geometry: np.ndarray  # float32, (len(GEOMETRY_NAMES),)
    source: str = "haar"  # what placed the geometry: "landmarks" or "haar" proportions

    @property
    def size(self) -> int:
        return int(self.image.shape[0])


@dataclass(frozen=True)
class FrameInput:
    """Everything one video frame needs; the unit the scheduler batches."""

    slot: int
    mel: np.ndarray  # float32, (window_frames, n_mels)
    knobs: np.ndarray  # float32, (len(KNOB_NAMES),)
    clock: np.ndarray  # float32, (2,): session time in seconds, session phase


@dataclass(frozen=True)
class BatchOutput:
    frames: np.ndarray  # uint8, (B, H, W, 3) RGB
    coefficients: np.ndarray  # float32, (B, len(coefficient_names))


class Engine(Protocol):
    """One model on one runtime. ``run`` is blocking and called from one worker thread."""

    manifest: Manifest

    def prepare(self, portrait: PreparedPortrait) -> int:
        """Keep the portrait where the runtime wants it; returns its slot."""
        ...

    def release(self, slot: int) -> None: ...

    def frame_size(self, slot: int) -> int: ...

    def run(self, batch: list[FrameInput]) -> BatchOutput:
        """Render one frame per input; all inputs share one frame size."""
        ...
