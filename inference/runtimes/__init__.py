"""Runtimes that execute a shipped model; imported lazily so the server only pays for one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference.engine import Engine, Manifest

RUNTIMES: tuple[str, ...] = ("onnxruntime",)


def create_engine(runtime: str, manifest_path: str | Path, **opts: Any) -> Engine:
    """Load ``manifest_path`` and open it on ``runtime`` (``opts`` go to its constructor)."""
    manifest = Manifest.load(manifest_path)
    if runtime == "onnxruntime":
        from inference.runtimes.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(manifest, **opts)
    raise ValueError(f"unknown runtime {runtime!r}; available: {', '.join(RUNTIMES)}")
