"""The inference wire without a spawned process: the core serves a fake service (standing
in for the scheduler and the engine) on a real Unix socket in this process, a real
``RemoteInference`` talks to it through a real shared ring, and every message crosses a
real pipe unchanged. The real engine behind a real process is ``test_inference_process``."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from multiprocessing import Pipe
from pathlib import Path

import numpy as np
import pytest

from inference.child_process import Ready, Stop, until_stopped
from inference.engine import NO_PICTURE, FrameInput, Manifest, PreparedPortrait
from inference.pixels import I420, frame_shape
from inference.process import InferenceProcessError
from inference.process.client import RemoteInference
from inference.process.core import InferenceCore
from inference.process.messages import (
    Batch,
    Capacity,
    Done,
    Drop,
    Hello,
    Prepare,
    Refused,
    Release,
    Reply,
    Ring,
    Stopping,
    Submit,
    ToCore,
    ToFrontDoor,
    ToWorker,
    WarmUp,
)
from inference.process.outbox import Outbox
from inference.process.ring import RingLayout
from inference.scheduler import FrameResult

pytestmark = pytest.mark.unit

MANIFEST = Manifest.load(Path(__file__).resolve().parent.parent / "engines" / "sonic-lite.json")
KEY = b"the key of these tests"
SIDES = (64, 32)  # small portraits: the ring stays a few hundred kilobytes


def pattern(side: int, seed: int) -> np.ndarray:
    """An I420 frame no other seed or side gives, so a frame cut short or crossed with
    another's shows."""
    height, width = frame_shape(I420, side)
    return ((np.arange(height * width).reshape(height, width) + 7 * seed) % 251
            ).astype(np.uint8)


def coefficients(seed: int) -> np.ndarray:
    return np.arange(len(MANIFEST.coefficient_names), dtype=np.float32) + seed


class FakeService:
    """Stands in for the scheduler and the engine: answers each frame on the loop's next
    round (or, while ``holding``, when the test calls ``answer_held``; or drops it, while
    ``dropping``) with a picture and coefficients made from its clock, so each answer is
    known; refuses a released portrait's frames with KeyError, as the scheduler does."""

    def __init__(self, *, max_batch: int = 4) -> None:
        self.max_batch = max_batch
        self.dropping = False
        self.holding = False
        self.held: list[Callable[[], None]] = []
        self.portraits: dict[int, int] = {}  # slot -> side
        self.released: list[int] = []
        self.capacity: dict[int, float] = {NO_PICTURE: 900.0}
        self.batch_ran: Callable[[], None] = lambda: None  # the core's, once it exists
        self._slots = itertools.count(1)

    def submit(self, frame: FrameInput, deadline: float, *, picture: bool = True
               ) -> asyncio.Future[FrameResult | None]:
        side = self.portraits[frame.slot] if picture else 0
        seed = int(frame.clock[0])
        answer = None if self.dropping else FrameResult(
            pattern(side, seed) if side else np.empty((0, 0), np.uint8),
            coefficients(seed))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[FrameResult | None] = loop.create_future()

        def finish() -> None:
            future.set_result(answer)
            self.batch_ran()

        if self.holding:
            self.held.append(finish)
        else:
            loop.call_soon(finish)
        return future

    def answer_held(self) -> None:
        held, self.held = self.held, []
        for finish in held:
            finish()

    async def prepare(self, portrait: PreparedPortrait) -> int:
        if portrait.geometry.shape != (3,):
            raise ValueError(f"portrait geometry of shape {portrait.geometry.shape}")
        slot = next(self._slots)
        self.portraits[slot] = portrait.size
        return slot

    def release(self, slot: int) -> None:
        del self.portraits[slot]
        self.released.append(slot)

    async def warm_up(self, batch: list[FrameInput], *, picture: bool = True) -> None:
        size = self.portraits[batch[0].slot] if picture else NO_PICTURE
        self.capacity[size] = 100.0 * len(batch)

    def capacity_fps(self, frame_size: int) -> float:
        return self.capacity.get(frame_size, 0.0)


def portrait(side: int, geometry: int = 3) -> PreparedPortrait:
    return PreparedPortrait(np.zeros((side, side, 3), np.uint8), np.zeros(geometry, np.float32))


def frame(slot: int, seed: int) -> FrameInput:
    return FrameInput(slot, np.full((MANIFEST.window_frames, MANIFEST.features.n_mels), seed,
                                    np.float32),
                      np.ones(len(MANIFEST.knob_names), np.float32),
                      np.array([seed, 0.0], np.float32))


@dataclasses.dataclass
class Wire:
    core: InferenceCore
    service: FakeService
    address: str
    drops: list[str]

    async def connect(self, *, pending: int = 4, motion_pending: int = 0) -> RemoteInference:
        client = RemoteInference(MANIFEST, self.address, KEY, pending=pending,
                                 motion_pending=motion_pending, max_side=max(SIDES),
                                 on_drop=self.drops.append)
        await client.start()
        return client


@pytest.fixture
def address() -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="sonic-wire-")  # short: a socket's path has 107 bytes
    yield str(Path(folder) / "core.sock")
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
async def wire(address: str) -> AsyncIterator[Wire]:
    service = FakeService()
    core = InferenceCore(service)
    service.batch_ran = core.batch_ran
    core.listen(address, KEY)
    yield Wire(core, service, address, [])
    core.close()


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until ``condition`` holds (the other side acts on the loop's next rounds)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def deadline() -> float:
    return asyncio.get_running_loop().time() + 10


# ---------------------------------------------------------------------- through the core
async def test_frames_come_back_whole_through_the_ring(wire):
    client = await wire.connect(motion_pending=2)
    try:
        large, small = [await client.prepare(portrait(side)) for side in SIDES]
        assert client.frame_size(large) == 64 and client.frame_size(small) == 32
        inputs = [(large, 1), (small, 2), (large, 3), (small, 4)]
        answers = await asyncio.gather(*(client.submit(frame(slot, seed), deadline())
                                         for slot, seed in inputs),
                                       client.submit(frame(small, 5), deadline(),
                                                     picture=False))
    finally:
        await client.stop()
    for (slot, seed), answer in zip(inputs, answers, strict=False):
        side = 64 if slot == large else 32
        assert answer is not None
        np.testing.assert_array_equal(answer.frame, pattern(side, seed))
        np.testing.assert_array_equal(answer.coefficients, coefficients(seed))
    motion = answers[-1]
    assert motion is not None and motion.frame.size == 0
    np.testing.assert_array_equal(motion.coefficients, coefficients(5))
    assert wire.drops == []


async def test_a_dropped_frame_is_answered_none_and_frees_its_slot(wire):
    client = await wire.connect(pending=2)  # 2 + two batches of 4: 10 slots
    try:
        slot = await client.prepare(portrait(32))
        wire.service.dropping = True
        for _ in range(3):  # more frames than slots, one ring's worth at a time
            answers = await asyncio.gather(*(client.submit(frame(slot, i), deadline())
                                             for i in range(10)))
            assert answers == [None] * 10
        wire.service.dropping = False
        answer = await client.submit(frame(slot, 7), deadline())
    finally:
        await client.stop()
    assert answer is not None
    np.testing.assert_array_equal(answer.frame, pattern(32, 7))
    assert wire.drops == []  # the scheduler counts its drops; no slot ever overflowed


async def test_a_released_portraits_frames_are_answered_none(wire):
    client = await wire.connect()
    try:
        kept, released = [await client.prepare(portrait(32)) for _ in range(2)]
        client.release(released)
        with pytest.raises(KeyError, match="released"):
            client.frame_size(released)
        gone, kept_answer = await asyncio.gather(client.submit(frame(released, 1), deadline()),
                                                 client.submit(frame(kept, 2), deadline()))
    finally:
        await client.stop()
    assert gone is None and kept_answer is not None
    assert wire.service.released == [released]


async def test_a_worker_that_disconnects_frees_its_portraits(wire):
    leaving = await wire.connect()
    staying = await wire.connect()
    try:
        theirs = [await leaving.prepare(portrait(32)) for _ in range(2)]
        mine = await staying.prepare(portrait(32))
        await leaving.stop()
        await eventually(lambda: len(wire.core.workers) == 1)
        assert sorted(wire.service.released) == sorted(theirs)
        assert list(wire.service.portraits) == [mine]
        assert await staying.submit(frame(mine, 1), deadline()) is not None
    finally:
        await staying.stop()


async def test_a_vanished_workers_ring_is_let_go_once_its_frames_leave_the_engine(wire):
    wire.service.holding = True
    client = await wire.connect()
    slot = await client.prepare(portrait(32))
    (worker,) = wire.core.workers
    waiting = client.submit(frame(slot, 1), deadline())
    await eventually(lambda: worker.in_flight == 1)
    # The worker dies without a word: its connection closes under the frame in flight.
    assert client._conn is not None
    asyncio.get_running_loop().remove_reader(client._conn.fileno())
    client._conn.close()
    client._conn = None
    await eventually(lambda: worker.gone)
    assert worker.shm is not None  # the engine may still write into it
    wire.service.answer_held()
    await eventually(lambda: worker.in_flight == 0)
    assert worker.shm is None and wire.service.released == [slot]
    await client.stop()
    assert await waiting is None


@dataclasses.dataclass(frozen=True, slots=True)
class Unheard:
    """A call the core does not know (a worker of another version would send one)."""

    call_id: int


async def test_an_unknown_message_is_refused_and_the_worker_served_on(wire, caplog):
    client = await wire.connect()
    try:
        with pytest.raises(InferenceProcessError, match="takes no Unheard"):
            await client._call(Unheard(next(client._call_ids)))  # type: ignore[arg-type]
        with caplog.at_level(logging.ERROR, logger="inference.process.client"):
            client._send(("submit", []))  # type: ignore[arg-type]  # the old wire's tuple
            slot = await client.prepare(portrait(32))
            answer = await client.submit(frame(slot, 1), deadline())
    finally:
        await client.stop()
    assert answer is not None
    assert [r.getMessage() for r in caplog.records if r.name == "inference.process.client"] \
        == ["the inference process refused a message: the inference process takes no tuple"]


async def test_a_failed_call_is_refused_with_its_reason(wire):
    client = await wire.connect()
    try:
        with pytest.raises(InferenceProcessError, match="ValueError: portrait geometry"):
            await client.prepare(portrait(32, geometry=5))
        assert await client.prepare(portrait(32)) == 1
    finally:
        await client.stop()


async def test_capacity_figures_reach_the_client(wire):
    client = await wire.connect()
    try:
        assert client.max_batch == wire.service.max_batch
        assert client.capacity_fps(NO_PICTURE) == 900.0  # told on connecting
        slot = await client.prepare(portrait(32))
        await client.warm_up([frame(slot, 1), frame(slot, 2)])
        assert client.capacity_fps(32) == 200.0  # the warm-up's answer
        wire.service.capacity[32] = 321.0
        await client.submit(frame(slot, 3), deadline())  # a batch ran: the figures follow
        await eventually(lambda: client.capacity_fps(32) == 321.0)
    finally:
        await client.stop()


async def test_a_core_closing_in_order_tells_its_workers_it_stopped(wire, caplog):
    client = await wire.connect()
    slot = await client.prepare(portrait(32))
    with caplog.at_level(logging.INFO, logger="inference.process.client"):
        wire.core.close()
        await eventually(lambda: client.dead)
    try:
        assert await client.submit(frame(slot, 1), deadline()) is None
        with pytest.raises(InferenceProcessError, match="stopped"):
            await client.prepare(portrait(32))
    finally:
        await client.stop()
    said = [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "inference.process.client"]
    assert ("INFO", "the inference process stopped; its frames are dropped") in said
    assert not [m for level, m in said if level == "ERROR"]


async def test_a_connection_gone_mid_handshake_leaves_the_core_accepting(wire, caplog):
    def refused() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "inference.process.core"]

    with caplog.at_level(logging.WARNING, logger="inference.process.core"):
        with socket.socket(socket.AF_UNIX) as stranger:
            stranger.connect(wire.address)
        client = await wire.connect()
        with pytest.raises(InferenceProcessError, match="cannot reach"):
            await RemoteInference(MANIFEST, wire.address, b"not the key", pending=1,
                                  max_side=32).start()
        try:
            slot = await client.prepare(portrait(32))
            assert await client.submit(frame(slot, 1), deadline()) is not None
            assert len(wire.core.workers) == 1
            await eventually(lambda: len(refused()) == 2)
        finally:
            await client.stop()
    assert all(m.startswith("refused a connection") for m in refused()), refused()


# ---------------------------------------------------------------------- the messages
LAYOUT = RingLayout(slots=2, window=(32, 80), knobs=2, coefficients=16, max_side=64)
SAMPLES = [Ring("sonic-ring", LAYOUT), Submit([(0, 1, 12.5), (1, 2, 12.54)]), Release(3),
           Hello(8, {0: 900.0, 256: 400.0}), Done([(0, 256), (1, None), (2, 0)]),
           Capacity({256: 380.0}), Reply(4, 7), Refused(5, "ValueError: no face"),
           Refused(None, "the inference process takes no tuple"), Stopping(),
           Batch(8, 0.012), Drop("late"), Ready(8), Stop()]


def test_every_message_crosses_a_pipe_unchanged():
    sender, receiver = Pipe()
    with sender, receiver:
        for message in SAMPLES:
            sender.send(message)
            assert receiver.recv() == message
        sent = Prepare(1, portrait(32))
        sender.send(sent)
        got = receiver.recv()
        assert isinstance(got, Prepare) and got.call_id == 1
        np.testing.assert_array_equal(got.portrait.image, sent.portrait.image)
        sender.send(WarmUp(2, [frame(1, 3)], False))
        match receiver.recv():
            case WarmUp(2, [FrameInput(slot=1, clock=clock)], False):
                assert clock.tolist() == [3.0, 0.0]
            case other:
                pytest.fail(f"not the warm-up sent: {other!r}")


def test_the_samples_cover_every_message_and_each_is_frozen_and_slotted():
    kinds = {*ToCore.__args__, *ToWorker.__args__, *ToFrontDoor.__args__, Ready, Stop}
    assert kinds - {Prepare, WarmUp} == {type(m) for m in SAMPLES}
    for message in [*SAMPLES, Prepare(1, portrait(32)), WarmUp(2, [frame(1, 3)], True)]:
        assert type(message).__dataclass_params__.frozen  # type: ignore[union-attr]
        assert not hasattr(message, "__dict__"), message  # slots: no dict a message
    with pytest.raises(dataclasses.FrozenInstanceError):
        Release(3).slot = 4  # type: ignore[misc]


async def test_items_put_in_one_round_leave_as_one_message():
    sent: list[Submit] = []
    outbox: Outbox[tuple[int, int, float], Submit] = Outbox(Submit, sent.append)
    for index in range(3):
        outbox.put((index, 1, 0.5))
    assert sent == []  # not before the round ends
    await asyncio.sleep(0)
    outbox.put((3, 1, 0.5))
    await asyncio.sleep(0)
    assert sent == [Submit([(0, 1, 0.5), (1, 1, 0.5), (2, 1, 0.5)]), Submit([(3, 1, 0.5)])]


async def test_a_child_stops_on_stop_and_on_nothing_else():
    parent, child = Pipe()
    with parent, child:
        stopped = asyncio.get_running_loop().create_task(until_stopped(child))
        parent.send(Batch(1, 0.01))  # not for it to act on
        await asyncio.sleep(0.05)
        assert not stopped.done()
        parent.send(Stop())
        await asyncio.wait_for(stopped, 5)

