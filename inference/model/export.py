"""Export sonic-lite to ``engines/sonic-lite.onnx`` plus its manifest, and its motion graph
(the coefficients alone, for motion-only sessions) to ``engines/sonic-lite-motion.onnx``.

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
from inference.model.audio_head import HEAD_WEIGHTS, AudioHead
from inference.model.sonic_lite import COEFFICIENT_NAMES, MotionGraph, SonicLite
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
#: The motion graph: the same model without its portrait and renderer.
MOTION_INPUTS = ("mel", "knobs", "clock")
MOTION_OUTPUTS = ("coefficients",)
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
    return SonicLite(TIMING, head=AudioHead.from_weights(HEAD_WEIGHTS)).eval()


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


def manifest(onnx_name: str, motion_name: str) -> dict[str, object]:
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
        "motion_onnx": motion_name,
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
        "motion_inputs": list(MOTION_INPUTS),
        "motion_outputs": list(MOTION_OUTPUTS),
        "portrait_sizes": list(PORTRAIT_SIZES),
        "exported_with": {"torch": torch.__version__, "onnx": onnx.__version__},
    }


def _export_graph(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                  input_names: list[str], output_names: list[str], path: Path) -> None:
    """Trace ``module`` to ONNX at ``path``, checked, byte-for-byte deterministic."""
    dynamic = {
        name: {i: str(d) for i, d in enumerate(shape) if isinstance(d, str)}
        for name, shape in {**INPUTS, **OUTPUTS}.items()
        if name in input_names or name in output_names
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer chatter about shape-dependent arange
        torch.onnx.export(
            module,
            inputs,
            str(path),
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic,
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
        )
    model = onnx.load(str(path))
    model.doc_string = "sonic-lite talking head (Apache-2.0)"
    for node in model.graph.node:
        node.doc_string = ""
        # The tracer writes omitted optional inputs as trailing empty names; a Pad with one
        # is not fused into the Conv that reads it (onnxruntime's PadFusion).
        while node.input and not node.input[-1]:
            del node.input[-1]
    onnx.checker.check_model(model, full_check=True)
    path.write_bytes(model.SerializeToString(deterministic=True))


def export(out_dir: Path) -> tuple[Path, Path, Path]:
    """Write ``<NAME>.onnx``, ``<NAME>-motion.onnx`` and ``<NAME>.json`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = out_dir / f"{NAME}.onnx"
    motion_path = out_dir / f"{NAME}-motion.onnx"
    json_path = out_dir / f"{NAME}.json"
    model = build_model()
    inputs = example_inputs()
    _export_graph(model, inputs, list(INPUTS), list(OUTPUTS), onnx_path)
    named = dict(zip(INPUTS, inputs, strict=True))
    _export_graph(MotionGraph(model), tuple(named[k] for k in MOTION_INPUTS),
                  list(MOTION_INPUTS), list(MOTION_OUTPUTS), motion_path)
    json_path.write_text(json.dumps(manifest(onnx_path.name, motion_path.name), indent=2) + "\n")
    return onnx_path, motion_path, json_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=Path("engines"))
    args = parser.parse_args()
    for path in export(args.out_dir):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
