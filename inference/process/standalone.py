"""An inference process of its own with its one client, for benchmarks and tests."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inference.engine import Manifest
from inference.process.client import RemoteInference
from inference.process.handle import InferenceProcess
from inference.service import InferenceConfig


class EngineProcess(RemoteInference):
    """An inference process of its own with one client: the engine out of this process's
    GIL without the front door (benchmarks, tests)."""

    def __init__(self, runtime: str, manifest_path: str | Path, *,
                 engine_opts: dict[str, Any] | None = None, max_batch: int, max_wait_ms: float,
                 max_pending: int, max_side: int, start_timeout_s: float = 600.0,
                 on_batch: Callable[[int, float], None] | None = None,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="sonic-engine-")
        authkey = secrets.token_bytes(16)
        address = os.path.join(self._dir, "inference.sock")
        super().__init__(Manifest.load(manifest_path), address, authkey, pending=max_pending,
                         max_side=max_side, on_drop=on_drop)
        config = InferenceConfig(runtime, str(manifest_path), engine_opts or {}, max_batch,
                                 max_wait_ms, max_pending)
        self.process = InferenceProcess(config, address, authkey, on_batch=on_batch,
                                        on_drop=on_drop, start_timeout_s=start_timeout_s)

    async def start(self) -> None:
        await self.process.start()
        try:
            await super().start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await super().stop()
        await self.process.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
