"""The scheduler and the real engine in an inference process, fed through shared memory:
the frames that come back are the engine's own, one batch spans several workers, a bad
call is a clear error, a worker that leaves takes its portraits with it, a process that
dies answers every waiting frame and leaks no shared memory, and one stopped in order is
not taken for dead."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from inference.engine import FrameInput, Manifest, PreparedPortrait
from inference.images import load_default_avatar
from inference.model.timing import TIMING
from inference.pixels import rgb_to_i420
from inference.portrait import prepare_portrait
from inference.process import InferenceProcessError
from inference.process.client import RemoteInference
from inference.process.messages import Done, Submit
from inference.process.ring import unlink_ring
from inference.process.standalone import EngineProcess
from inference.runtimes.onnxruntime import OnnxRuntimeEngine

pytestmark = pytest.mark.e2e

WINDOW = TIMING.window_frames  # mel frames per window, as the engine takes them

MANIFEST = Path(__file__).resolve().parent.parent / "engines" / "sonic-lite.json"


@pytest.fixture(scope="module")
def portraits() -> dict[int, PreparedPortrait]:
    photo = load_default_avatar()
    return {size: prepare_portrait(photo, size=size) for size in (256, 512)}


def frames(slot: int, count: int) -> list[FrameInput]:
    rng = np.random.default_rng(3)
    return [FrameInput(slot, (rng.standard_normal((WINDOW, 80)) - 3).astype(np.float32),
                       np.array([1.0 + 0.1 * i, 1.0], np.float32),
                       np.array([0.4 * i, 7.0], np.float32)) for i in range(count)]


def process(**kwargs) -> EngineProcess:  # type: ignore[no-untyped-def]
    return EngineProcess("onnxruntime", MANIFEST, engine_opts={"intra_op_threads": 1},
                         max_batch=kwargs.pop("max_batch", 4),
                         max_wait_ms=kwargs.pop("max_wait_ms", 1.0),
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
        with pytest.raises(InferenceProcessError, match="geometry"):
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
        # I420 (the encoders' layout), converted in the inference process.
        assert all(r is not None and r.frame.shape == (size * 3 // 2, size) for r in got)
        np.testing.assert_array_equal(np.stack([r.frame for r in got]),
                                      rgb_to_i420(want.frames))
        np.testing.assert_allclose(np.stack([r.coefficients for r in got]), want.coefficients,
                                   atol=1e-6)


async def test_frames_submitted_together_cross_as_one_message_each_way(portraits):
    """Sessions on one instant of the media grid submit their frames in one round of the
    loop: those cross to the inference process as one message, run as one batch, and
    their answers come back as one message, not a message each."""
    batches: list[int] = []
    inference = process(on_batch=lambda n, s: batches.append(n), max_batch=8)
    await inference.start()
    try:
        slot = await inference.prepare(portraits[256])
        await inference.warm_up(frames(slot, 4))
        conn = inference._conn
        assert conn is not None
        sent: list[type] = []
        received: list[type] = []
        send, on_message = conn.send, inference._on_message
        conn.send = lambda message: (sent.append(type(message)), send(message))  # type: ignore
        inference._on_message = lambda message: (  # type: ignore[method-assign]
            received.append(type(message)), on_message(message))
        batches.clear()
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(inference.submit(f, loop.time() + 10)
                                         for f in frames(slot, 4)))
    finally:
        await inference.stop()
    assert all(r is not None for r in results)
    assert sent == [Submit] and batches == [4] and received.count(Done) == 1, \
        (sent, batches, received)


async def test_a_dead_engine_process_answers_every_frame_and_leaks_nothing(portraits):
    drops: list[str] = []
    inference = process(on_drop=drops.append, max_batch=1)
    await inference.start()
    ring = shm_path(inference)
    try:
        slot = await inference.prepare(portraits[512])
        loop = asyncio.get_running_loop()
        waiting = [inference.submit(f, loop.time() + 10) for f in frames(slot, 12)]
        inference.process.kill()
        answered = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        assert answered.count(None) >= 1 and inference.dead
        assert await inference.submit(frames(slot, 1)[0], loop.time() + 10) is None
        with pytest.raises(InferenceProcessError, match="died"):
            await inference.prepare(portraits[256])
    finally:
        await inference.stop()
    assert not ring.exists()
    assert "error" in drops


async def test_an_inference_process_stopped_in_order_is_not_reported_as_dead(portraits, caplog):
    """A server shutting down stops its inference process: its workers hear that it
    stopped, and log no error that it died."""
    inference = process()
    await inference.start()
    try:
        slot = await inference.prepare(portraits[256])
        with caplog.at_level("INFO", logger="inference.process.client"):
            await inference.process.stop()
            for _ in range(100):
                if inference.dead:
                    break
                await asyncio.sleep(0.05)
        assert inference.dead
        assert await inference.submit(frames(slot, 1)[0], asyncio.get_running_loop().time()
                                      + 10) is None
        with pytest.raises(InferenceProcessError, match="stopped"):
            await inference.prepare(portraits[256])
    finally:
        await inference.stop()
    said = [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "inference.process.client"]
    assert ("INFO", "the inference process stopped; its frames are dropped") in said
    assert not [m for level, m in said if level == "ERROR"]


async def test_one_batch_spans_two_workers_and_a_leaving_worker_frees_its_portraits(portraits):
    batches: list[int] = []
    # Two workers' messages reach the inference process one after the other: the scheduler
    # waits long enough for the second before it starts the batch.
    first = process(on_batch=lambda n, s: batches.append(n), max_batch=8, max_wait_ms=100.0)
    await first.start()
    manifest = Manifest.load(MANIFEST)
    second = RemoteInference(manifest, first.process.address, first.process.authkey,
                             pending=8, max_side=256, ring_name=f"sonic-test-{id(first)}")
    await second.start()
    try:
        ring = Path("/dev/shm") / str(second.ring_name)
        assert ring.exists()
        a = await first.prepare(portraits[256])
        b = await second.prepare(portraits[256])
        assert a != b
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        # Submitted together, both workers' frames are ready at once: a batch of more than
        # one worker's 4 frames spans both.
        results = await asyncio.gather(*(first.submit(f, deadline) for f in frames(a, 4)),
                                       *(second.submit(f, deadline) for f in frames(b, 4)))
        assert all(r is not None for r in results)
        assert max(batches) > 4, batches
        # The same inputs on the same portrait give the same frames, whichever worker.
        for x, y in zip(results[:4], results[4:], strict=True):
            np.testing.assert_array_equal(x.frame, y.frame)
        # A worker that vanishes without a word: its portrait leaves the engine, and the
        # front door can still remove its ring.
        assert second._conn is not None
        loop.remove_reader(second._conn.fileno())
        second._conn.close()
        second._conn = None
        second.dead = True
        await asyncio.sleep(0.5)
        again = RemoteInference(manifest, first.process.address, first.process.authkey,
                                pending=4, max_side=256)
        await again.start()
        try:
            own = await again.prepare(portraits[256])
            deadline = loop.time() + 10
            assert await again.submit(frames(b, 1)[0], deadline) is None  # b was released
            assert await again.submit(frames(own, 1)[0], deadline) is not None
        finally:
            await again.stop()
        assert unlink_ring(str(second.ring_name)) and not ring.exists()
        assert not unlink_ring(str(second.ring_name))
    finally:
        await second.stop()
        await first.stop()


async def test_a_worker_with_the_wrong_key_is_refused(portraits):
    first = process()
    await first.start()
    try:
        stranger = RemoteInference(Manifest.load(MANIFEST), first.process.address,
                                   b"not the key", pending=4, max_side=256)
        with pytest.raises(InferenceProcessError, match="cannot reach"):
            await stranger.start()
        slot = await first.prepare(portraits[256])  # the process serves on
        loop = asyncio.get_running_loop()
        assert await first.submit(frames(slot, 1)[0], loop.time() + 10) is not None
    finally:
        await first.stop()
