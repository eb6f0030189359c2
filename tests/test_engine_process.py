"""The scheduler and the real engine in a child process, fed through shared memory: the
frames that come back are the engine's own, a bad call is a clear error, and a child that
dies answers every waiting frame and leaks no shared memory."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from inference.engine import FrameInput, Manifest, PreparedPortrait
from inference.engine_process import EngineProcess, EngineProcessError
from inference.images import load_default_avatar
from inference.portrait import prepare_portrait
from inference.runtimes.onnxruntime import OnnxRuntimeEngine

MANIFEST = Path(__file__).resolve().parent.parent / "engines" / "sonic-lite.json"


@pytest.fixture(scope="module")
def portraits() -> dict[int, PreparedPortrait]:
    photo = load_default_avatar()
    return {size: prepare_portrait(photo, size=size) for size in (256, 512)}


def frames(slot: int, count: int) -> list[FrameInput]:
    rng = np.random.default_rng(3)
    return [FrameInput(slot, (rng.standard_normal((16, 80)) - 3).astype(np.float32),
                       np.array([1.0 + 0.1 * i, 1.0], np.float32),
                       np.array([0.4 * i, 7.0], np.float32)) for i in range(count)]


def process(**kwargs) -> EngineProcess:  # type: ignore[no-untyped-def]
    return EngineProcess("onnxruntime", MANIFEST, engine_opts={"intra_op_threads": 1},
                         max_batch=kwargs.pop("max_batch", 4), max_wait_ms=1.0,
                         max_pending=16, max_side=512, **kwargs)


def shm_path(inference: EngineProcess) -> Path:
    assert inference._shm is not None
    return Path("/dev/shm") / inference._shm.name.lstrip("/")


async def test_frames_cross_shared_memory_intact(portraits):
    drops: list[str] = []
    batches: list[int] = []
    inference = process(on_drop=drops.append, on_batch=lambda n, s: batches.append(n))
    await inference.start()
    ring = shm_path(inference)
    try:
        assert ring.exists() and inference.max_batch == 4
        small = await inference.prepare(portraits[256])
        large = await inference.prepare(portraits[512])
        assert inference.frame_size(small) == 256 and inference.frame_size(large) == 512
        await inference.warm_up(frames(small, 2))
        assert inference.capacity_fps(256) > 0
        loop = asyncio.get_running_loop()
        inputs = frames(small, 6) + frames(large, 3)
        results = await asyncio.gather(*(inference.submit(f, loop.time() + 10) for f in inputs))
        with pytest.raises(EngineProcessError, match="geometry"):
            await inference.prepare(PreparedPortrait(portraits[256].image, np.zeros(3)))
        inference.release(large)
        with pytest.raises(KeyError, match="released"):
            inference.frame_size(large)
    finally:
        await inference.stop()
    assert not ring.exists()  # the ring is unlinked
    assert drops == [] and sum(batches) >= 9
    reference = OnnxRuntimeEngine(Manifest.load(MANIFEST))
    for size, chunk in ((256, slice(0, 6)), (512, slice(6, 9))):
        slot = reference.prepare(portraits[size])
        want = reference.run([FrameInput(slot, f.mel, f.knobs, f.clock) for f in inputs[chunk]])
        got = results[chunk]
        assert all(r is not None and r.frame.shape == (size, size, 3) for r in got)
        np.testing.assert_array_equal(np.stack([r.frame for r in got]), want.frames)
        np.testing.assert_allclose(np.stack([r.coefficients for r in got]), want.coefficients,
                                   atol=1e-6)


async def test_a_dead_engine_process_answers_every_frame_and_leaks_nothing(portraits):
    drops: list[str] = []
    inference = process(on_drop=drops.append, max_batch=1)
    await inference.start()
    ring = shm_path(inference)
    try:
        slot = await inference.prepare(portraits[512])
        loop = asyncio.get_running_loop()
        waiting = [inference.submit(f, loop.time() + 10) for f in frames(slot, 12)]
        assert inference._process is not None
        os.kill(inference._process.pid, 9)
        answered = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        assert answered.count(None) >= 1 and inference.dead
        assert await inference.submit(frames(slot, 1)[0], loop.time() + 10) is None
        with pytest.raises(EngineProcessError, match="died"):
            await inference.prepare(portraits[256])
    finally:
        await inference.stop()
    assert not ring.exists()
    assert "error" in drops
