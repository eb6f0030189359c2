"""What the media side needs of inference, whichever process the engine runs in.

Sessions submit one frame's inputs with a deadline and get the frame back (or ``None``:
repeat the last one), in I420 as their video encoders take it (``inference.pixels``);
avatars put portraits into the engine's slots. ``InlineInference`` runs the shared
scheduler and the engine in this process, on a thread; ``inference.process`` runs
them in a process of their own, fed through shared memory, so the engine's Python
side never waits for the media side's GIL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from inference.engine import Engine, FrameInput, Manifest, PreparedPortrait
from inference.pixels import I420
from inference.runtimes import create_engine
from inference.scheduler import FrameResult, Scheduler

#: On the CPU a batch costs its frames' sum: larger ones only add latency.
CPU_MAX_BATCH = 8


def default_max_batch(engine: Engine, configured: int) -> int:
    """``configured``, or 0: the engine's largest batch profile, or ``CPU_MAX_BATCH``."""
    profiles = tuple(getattr(engine, "batch_sizes", ()) or ())
    return configured or max(profiles, default=CPU_MAX_BATCH)


class Inference(Protocol):
    manifest: Manifest
    max_batch: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def prepare(self, portrait: PreparedPortrait) -> int:
        """Keep the portrait in the engine; returns its slot."""
        ...

    def release(self, slot: int) -> None: ...

    def frame_size(self, slot: int) -> int: ...

    def submit(self, frame: FrameInput, deadline: float, *, picture: bool = True
               ) -> asyncio.Future[FrameResult | None]:
        """The frame, or None when it could not be made by ``deadline`` (loop time). Without
        ``picture`` only its coefficients need come back (its picture may be empty)."""
        ...

    async def warm_up(self, batch: list[FrameInput], *, picture: bool = True) -> None:
        """Run a batch shape (``picture`` or coefficients alone) untimed, then into the
        capacity estimate."""
        ...

    def capacity_fps(self, frame_size: int) -> float: ...


@dataclass(frozen=True)
class InferenceConfig:
    """What the shared scheduler and its engine are built from, in whichever process."""

    runtime: str
    manifest_path: str
    engine_opts: dict[str, Any] = field(default_factory=dict)
    max_batch: int = 0
    max_wait_ms: float = 5.0
    max_pending: int = 256
    device: int | None = None  # the CUDA device an inference process owns


class InlineInference:
    """The shared scheduler and the engine in this process, the engine on its own thread."""

    def __init__(self, engine: Engine, *, max_batch: int, max_wait_ms: float,
                 max_pending: int, on_batch: Callable[[int, float], None] | None = None,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.manifest = engine.manifest
        self.max_batch = default_max_batch(engine, max_batch)
        self.scheduler = Scheduler(engine, max_batch=self.max_batch, max_wait_ms=max_wait_ms,
                                   max_pending=max_pending, on_batch=on_batch,
                                   on_drop=on_drop)

    async def start(self) -> None:
        await self.scheduler.start()

    async def stop(self) -> None:
        await self.scheduler.stop()

    async def prepare(self, portrait: PreparedPortrait) -> int:
        return await asyncio.to_thread(self.engine.prepare, portrait)

    def release(self, slot: int) -> None:
        self.engine.release(slot)

    def frame_size(self, slot: int) -> int:
        return self.engine.frame_size(slot)

    def submit(self, frame: FrameInput, deadline: float, *, picture: bool = True
               ) -> asyncio.Future[FrameResult | None]:
        return self.scheduler.submit(frame, deadline, picture=picture)

    async def warm_up(self, batch: list[FrameInput], *, picture: bool = True) -> None:
        await self.scheduler.warm_up(batch, picture=picture)

    def capacity_fps(self, frame_size: int) -> float:
        return self.scheduler.capacity_fps(frame_size)


async def start_inline(config: InferenceConfig, *,
                       on_batch: Callable[[int, float], None] | None = None,
                       on_drop: Callable[[str], None] | None = None) -> InlineInference:
    """Load the engine (off the loop) and start its scheduler on this process's loop. Its
    frames are I420: the sessions' encoders take nothing else."""
    engine = await asyncio.to_thread(create_engine, config.runtime, config.manifest_path,
                                     pixels=I420, **config.engine_opts)
    inference = InlineInference(engine, max_batch=config.max_batch,
                                max_wait_ms=config.max_wait_ms,
                                max_pending=config.max_pending, on_batch=on_batch,
                                on_drop=on_drop)
    await inference.start()
    return inference
