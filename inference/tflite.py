"""The TFLite models shipped in ``engines/`` (MediaPipe's face detectors and face mesh, see
engines/NOTICE), each loaded once on ``ai-edge-litert``'s interpreter (Apache-2.0).

An interpreter is not safe to share between threads (uploads are prepared on several), so
each model runs under a lock of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ENGINES_DIR", "TfliteModel"]

log = logging.getLogger(__name__)

ENGINES_DIR = Path(__file__).resolve().parent.parent / "engines"


@contextlib.contextmanager
def _native_stderr_to_log() -> Iterator[None]:
    """Route what native code writes to stderr meanwhile into this module's log: TFLite
    announces its XNNPACK delegate with a bare "INFO:" line that no setting silences."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines():
                info = line.startswith("INFO: ")
                log.log(logging.DEBUG if info else logging.WARNING, "TFLite: %s",
                        line.removeprefix("INFO: "))


class TfliteModel:
    """One shipped model, loaded on first use; ``run`` returns its outputs in the model's
    order, or None where it cannot run (the reason logged once, then kept in ``failed``)."""

    def __init__(self, filename: str, input_side: int) -> None:
        self.path = ENGINES_DIR / filename
        self.input_side = input_side
        self._lock = threading.Lock()
        self._interpreter: Any = None
        self.failed: str | None = None

    def _load(self) -> Any:
        """Lock held."""
        if self._interpreter is not None or self.failed is not None:
            return self._interpreter
        try:
            if not self.path.is_file():
                raise FileNotFoundError(f"no model at {self.path}")
            from ai_edge_litert.interpreter import Interpreter

            interpreter = Interpreter(model_path=str(self.path), num_threads=1)
            with _native_stderr_to_log():
                interpreter.allocate_tensors()  # where TFLite prints its delegate notice
            shape = tuple(interpreter.get_input_details()[0]["shape"])
            if shape != (1, self.input_side, self.input_side, 3):
                raise ValueError(f"unexpected input shape {shape}")
            self._interpreter = interpreter
        except Exception as exc:  # noqa: BLE001 - every cause means "cannot run here"
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("%s cannot run (%s); is ai-edge-litert installed?", self.path.name,
                        self.failed)
        return self._interpreter

    def available(self) -> bool:
        with self._lock:
            return self._load() is not None

    def run(self, tensor: np.ndarray) -> list[np.ndarray] | None:
        """``tensor``: float32 (1, side, side, 3), scaled as the model expects."""
        with self._lock:
            interpreter = self._load()
            if interpreter is None:
                return None
            interpreter.set_tensor(interpreter.get_input_details()[0]["index"], tensor)
            interpreter.invoke()
            return [np.array(interpreter.get_tensor(d["index"]))
                    for d in interpreter.get_output_details()]
