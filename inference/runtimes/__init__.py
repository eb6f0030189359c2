"""Runtimes that execute a shipped model; imported lazily so the server only pays for one."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from inference.engine import Engine, Manifest

RUNTIMES: tuple[str, ...] = ("onnxruntime", "torch-cuda", "tensorrt", "auto")
#: Runtimes whose frames have been checked against the ONNX reference on real hardware
#: (tests/test_gpu_runtimes.py). TensorRT's builder cannot be installed where this project
#: is built, so no TensorRT engine has ever been built or run: "auto" never picks it.
VERIFIED: frozenset[str] = frozenset({"onnxruntime", "torch-cuda"})
#: Runtimes whose engine runs on a GPU, one inference process per device.
GPU_RUNTIMES: frozenset[str] = frozenset({"torch-cuda", "tensorrt"})


def cuda_device_count() -> int:
    """GPUs visible to torch, or 0 where torch (or its CUDA build) is absent."""
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_runtime(runtime: str) -> str:
    """Map ``auto`` to a concrete, verified runtime: torch-cuda where PyTorch sees a GPU,
    else onnxruntime on the CPU. TensorRT runs only when asked for by name."""
    if runtime != "auto":
        return runtime
    return "torch-cuda" if cuda_device_count() else "onnxruntime"


def create_engine(runtime: str, manifest_path: str | Path, **opts: Any) -> Engine:
    """Load ``manifest_path`` and open it on ``runtime`` (``opts`` go to its constructor)."""
    manifest = Manifest.load(manifest_path)
    runtime = resolve_runtime(runtime)
    if runtime == "onnxruntime":
        from inference.runtimes.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(manifest, **opts)
    if runtime == "torch-cuda":
        from inference.runtimes.torch_cuda import TorchCudaEngine

        return TorchCudaEngine(manifest, **opts)
    if runtime == "tensorrt":
        from inference.runtimes.tensorrt import TensorRtEngine

        return TensorRtEngine(manifest, **opts)
    raise ValueError(f"unknown runtime {runtime!r}; available: {', '.join(RUNTIMES)}")
