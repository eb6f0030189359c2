"""Export sonic-lite to ``engines/sonic-lite.onnx`` plus its manifest.

Run ``python -m inference.model.export`` (needs the ``dev`` extra: torch, onnx). The
output is byte-for-byte deterministic, so a re-export only shows up in a diff when the
model changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

import onnx
import torch

from inference.engine import GEOMETRY_NAMES, KNOB_NAMES
from inference.face_detect import FaceBox
from inference.face_geometry import geometry_from_face_box
from inference.model.audio_head import HEAD_WEIGHTS
from inference.model.sonic_lite import COEFFICIENT_NAMES, SonicLite
from inference.model.timing import TIMING

NAME = "sonic-lite"
OPSET = 17
PORTRAIT_SIZES = (256, 512)

INPUTS: dict[str, list[str | int]] = {
    "mel": ["batch", TIMING.window_frames, TIMING.features.n_mels],
    "portrait": ["batch", 3, "height", "width"],
    "geometry": ["batch", len(GEOMETRY_NAMES)],
    "knobs": ["batch", len(KNOB_NAMES)],
    "clock": ["batch", 2],
}
OUTPUTS: dict[str, list[str | int]] = {
    "frame": ["batch", "height", "width", 3],
    "coefficients": ["batch", len(COEFFICIENT_NAMES)],
}
DTYPES = {
    "mel": "float32",
    "portrait": "float32",
    "geometry": "float32",
    "knobs": "float32",
    "clock": "float32",
    "frame": "uint8",
    "coefficients": "float32",
}


def build_model() -> SonicLite:
    """The shipped model: fixed DSP/renderer tensors plus the trained audio head's weights
    (``python -m inference.training.train`` makes them)."""
    model = SonicLite(TIMING)
    model.head.load_state_dict(torch.load(HEAD_WEIGHTS, map_location="cpu", weights_only=True))
    return model.eval()


def example_inputs(batch: int = 2, size: int = 64) -> tuple[torch.Tensor, ...]:
    """Tracing inputs; the values only need to be plausible."""
    face = FaceBox(x=0.25 * size, y=0.2 * size, w=0.5 * size, h=0.5 * size)
    geometry = torch.from_numpy(geometry_from_face_box(face, size)).repeat(batch, 1)
    return (
        torch.full((batch, TIMING.window_frames, TIMING.features.n_mels), -4.0),
        torch.full((batch, 3, size, size), 0.5),
        geometry,
        torch.ones(batch, len(KNOB_NAMES)),
        torch.tensor([[1.0, 0.0]]).repeat(batch, 1),
    )


def manifest(onnx_name: str) -> dict[str, object]:
    return {
        "name": NAME,
        "description": (
            "Real-time talking head: a small trained audio encoder maps the log-mel window "
            "to 11 ARKit mouth blendshapes; the clock drives blinks and head sway; one "
            "grid_sample anchored on face-mesh landmarks warps the portrait and the mouth "
            "interior is drawn where the lips part."
        ),
        "audio_head": json.loads(HEAD_WEIGHTS.with_suffix(".json").read_text()),
        "onnx": onnx_name,
        "fps": TIMING.fps,
        "features": dataclasses.asdict(TIMING.features),
        "window_frames": TIMING.window_frames,
        "lookahead_frames": TIMING.lookahead_frames,
        "coefficient_names": list(COEFFICIENT_NAMES),
        "geometry_names": list(GEOMETRY_NAMES),
        "knob_names": list(KNOB_NAMES),
        "opset": OPSET,
        "inputs": [{"name": k, "dtype": DTYPES[k], "shape": v} for k, v in INPUTS.items()],
        "outputs": [{"name": k, "dtype": DTYPES[k], "shape": v} for k, v in OUTPUTS.items()],
        "portrait_sizes": list(PORTRAIT_SIZES),
        "exported_with": {"torch": torch.__version__, "onnx": onnx.__version__},
    }


def export(out_dir: Path) -> tuple[Path, Path]:
    """Write ``<NAME>.onnx`` and ``<NAME>.json`` into ``out_dir``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = out_dir / f"{NAME}.onnx"
    json_path = out_dir / f"{NAME}.json"
    dynamic = {
        name: {i: str(d) for i, d in enumerate(shape) if isinstance(d, str)}
        for name, shape in {**INPUTS, **OUTPUTS}.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer chatter about shape-dependent arange
        torch.onnx.export(
            build_model(),
            example_inputs(),
            str(onnx_path),
            input_names=list(INPUTS),
            output_names=list(OUTPUTS),
            dynamic_axes=dynamic,
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
        )
    model = onnx.load(str(onnx_path))
    model.doc_string = "sonic-lite talking head (Apache-2.0)"
    for node in model.graph.node:
        node.doc_string = ""
    onnx.checker.check_model(model, full_check=True)
    onnx_path.write_bytes(model.SerializeToString(deterministic=True))
    json_path.write_text(json.dumps(manifest(onnx_path.name), indent=2) + "\n")
    return onnx_path, json_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=Path("engines"))
    args = parser.parse_args()
    for path in export(args.out_dir):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
