"""The Scheduler class itself, on a fake engine whose time the test controls: each request
gets its own frame, engine time is measured where the engine runs, a second batch waits
in the engine's thread, and the overflow, error, late and stop paths answer every request."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from inference.engine import NO_PICTURE, BatchOutput, FrameInput
from inference.model.timing import TIMING
from inference.scheduler import Scheduler

pytestmark = pytest.mark.unit

WINDOW = TIMING.window_frames  # mel frames per window, as the engine takes them

SIZE = 256


class FakeEngine:
    """Takes ``seconds`` a batch; its frames carry each input's clock value, so a test can
    tell whose frame came back. Closing ``gate`` holds every batch until it is opened."""

    def __init__(self, seconds: float = 0.005, first: tuple[float, ...] = ()) -> None:
        self.seconds = seconds
        self.first = list(first)  # the seconds of the first runs, before ``seconds``
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.batches: list[int] = []  # sizes, as each batch started running
        self.motion_batches: list[int] = []  # ... of run_motion's batches
        self.released: set[int] = set()  # portrait slots released, as a session ends

    def frame_size(self, slot: int) -> int:
        if slot in self.released:
            raise KeyError(f"unknown or released portrait slot {slot}")
        return SIZE

    def run(self, batch: list[FrameInput]) -> BatchOutput:
        for f in batch:
            self.frame_size(f.slot)  # as a real engine, it refuses a released portrait
        self.batches.append(len(batch))
        assert self.gate.wait(10)
        time.sleep(self.first.pop(0) if self.first else self.seconds)
        if self.fail:
            raise RuntimeError("engine fault")
        marks = [int(f.clock[0]) for f in batch]
        frames = np.stack([np.full((2, 2, 3), m % 256, np.uint8) for m in marks])
        return BatchOutput(frames, np.array([[m] for m in marks], np.float32))

    def run_motion(self, batch: list[FrameInput]) -> np.ndarray:
        for f in batch:
            self.frame_size(f.slot)
        self.motion_batches.append(len(batch))
        time.sleep(self.seconds / 10)  # no renderer: far cheaper
        return np.array([[int(f.clock[0])] for f in batch], np.float32)


def frame(mark: int, slot: int = 0) -> FrameInput:
    return FrameInput(slot=slot, mel=np.zeros((WINDOW, 80), np.float32),
                      knobs=np.ones(2, np.float32),
                      clock=np.array([mark, 0.0], np.float32))


async def started(engine: FakeEngine, **kwargs) -> tuple[Scheduler, list[str]]:  # type: ignore[no-untyped-def]
    drops: list[str] = []
    scheduler = Scheduler(engine, max_batch=kwargs.pop("max_batch", 8),
                          max_wait_ms=kwargs.pop("max_wait_ms", 1.0), on_drop=drops.append,
                          **kwargs)
    await scheduler.start()
    return scheduler, drops


async def until(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def soon(seconds: float = 5.0) -> float:
    return asyncio.get_running_loop().time() + seconds


async def test_each_request_gets_its_own_frame() -> None:
    scheduler, drops = await started(FakeEngine())
    futures = [scheduler.submit(frame(i), soon()) for i in range(40)]
    results = await asyncio.gather(*futures)
    await scheduler.stop()
    assert drops == []
    assert [int(r.coefficients[0]) for r in results] == list(range(40))
    assert [int(r.frame[0, 0, 0]) for r in results] == list(range(40))


async def test_coefficient_only_requests_batch_apart_and_skip_the_renderer() -> None:
    engine = FakeEngine()
    scheduler, drops = await started(engine)
    await scheduler.warm_up([frame(0)] * 2, picture=False)
    runs_before = list(engine.batches)
    futures = [scheduler.submit(frame(i), soon(), picture=i % 2 == 0) for i in range(40)]
    results = await asyncio.gather(*futures)
    await scheduler.stop()
    assert drops == [] and runs_before == []  # warming the motion path rendered nothing
    assert [int(r.coefficients[0]) for r in results] == list(range(40))
    assert all(r.frame.shape == (2, 2, 3) for r in results[::2])
    assert all(r.frame.shape == (0, 0, 3) for r in results[1::2])
    assert sum(engine.batches) == 20 and sum(engine.motion_batches) == 20 + 2 * 6
    # Their engine time is kept apart, so admission sees how cheap they are.
    assert scheduler.capacity_fps(NO_PICTURE) > 3 * scheduler.capacity_fps(SIZE) > 0


async def test_engine_time_is_measured_where_the_engine_runs() -> None:
    engine = FakeEngine(seconds=0.010)
    scheduler, _ = await started(engine)
    for i in range(3):
        future = scheduler.submit(frame(i), soon())
        await until(lambda n=i + 1: len(engine.batches) == n)  # the engine has the batch ...
        time.sleep(0.080)  # ... and the event loop stays busy long after it finished
        await future
    await scheduler.stop()
    # The loop resumed 80 ms late each time; the engine took 10 ms.
    assert 0.009 <= scheduler.estimate.seconds(SIZE, 1) < 0.030


async def test_capacity_at_warm_up_is_not_set_by_one_slow_run() -> None:
    # The untimed first run, then a run slowed 20x (a busy core at start-up), then normal.
    engine = FakeEngine(seconds=0.010, first=(0.010, 0.200))
    scheduler, _ = await started(engine)
    await scheduler.warm_up([frame(0)])
    await scheduler.stop()
    assert 60 < scheduler.capacity_fps(SIZE) <= 100


async def test_a_second_batch_waits_in_the_engine_thread_while_the_first_runs() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    scheduler, _ = await started(engine, max_batch=4)
    first = scheduler.submit(frame(0), soon())
    await until(lambda: engine.batches == [1])
    more = [scheduler.submit(frame(i), soon()) for i in range(1, 4)]
    await until(lambda: scheduler.in_flight == 2)
    rest = [scheduler.submit(frame(i), soon()) for i in range(4, 9)]
    await asyncio.sleep(0.05)
    assert scheduler.in_flight == 2 and engine.batches == [1]  # the third batch waits
    engine.gate.set()
    results = await asyncio.gather(first, *more, *rest)
    await scheduler.stop()
    assert [int(r.coefficients[0]) for r in results] == list(range(9))
    assert engine.batches[:2] == [1, 3] and sum(engine.batches) == 9


async def test_overflow_answers_the_oldest_request_with_none() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    scheduler, drops = await started(engine, max_batch=1, max_pending=3)
    held = [scheduler.submit(frame(i), soon()) for i in range(2)]
    await until(lambda: scheduler.in_flight == 2)
    waiting = [scheduler.submit(frame(i), soon()) for i in range(2, 7)]
    assert [f.done() for f in waiting] == [True, True, False, False, False]
    assert [f.result() for f in waiting[:2]] == [None, None] and drops == ["overflow"] * 2
    engine.gate.set()
    results = await asyncio.gather(*held, *waiting[2:])
    await scheduler.stop()
    assert [int(r.coefficients[0]) for r in results] == [0, 1, 4, 5, 6]


async def test_an_engine_error_drops_that_batch_and_the_next_one_runs() -> None:
    engine = FakeEngine()
    engine.fail = True
    scheduler, drops = await started(engine)
    assert await scheduler.submit(frame(1), soon()) is None
    assert drops == ["error"] and scheduler.in_flight == 0
    engine.fail = False
    result = await scheduler.submit(frame(2), soon())
    await scheduler.stop()
    assert result is not None and int(result.coefficients[0]) == 2


async def test_a_request_that_cannot_be_on_time_is_dropped_as_late() -> None:
    engine = FakeEngine(seconds=0.050)
    scheduler, drops = await started(engine)
    await scheduler.warm_up([frame(0)])  # the scheduler now knows a frame takes 50 ms
    assert await scheduler.submit(frame(1), soon(0.020)) is None
    assert drops == ["late"]
    assert await scheduler.submit(frame(2), soon(1.0)) is not None
    await scheduler.stop()


async def test_stop_answers_every_request_and_can_be_repeated() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    scheduler, drops = await started(engine, max_batch=1)
    futures = [scheduler.submit(frame(i), soon()) for i in range(5)]
    await until(lambda: scheduler.in_flight == 2)
    threading.Timer(0.05, engine.gate.set).start()  # the running batches end meanwhile
    await scheduler.stop()
    await scheduler.stop()
    assert all(f.done() for f in futures) and scheduler.exited.is_set()
    answered = [f.result() for f in futures]
    assert answered[2:] == [None] * 3 and drops == ["stopped"] * 3
    assert scheduler.in_flight == 0


async def test_a_batch_that_overruns_is_abandoned_and_the_engine_serves_on_after() -> None:
    engine = FakeEngine(seconds=0.010)
    scheduler, drops = await started(engine)
    await scheduler.warm_up([frame(0)])  # a frame is now expected to take 10 ms
    engine.gate.clear()  # ... and this one hangs until the gate opens
    assert await scheduler.submit(frame(1), soon(0.1)) is None  # once past its deadline
    assert drops == ["hung"] and not engine.gate.is_set()  # answered while still stuck
    await until(lambda: scheduler.stalled_s() > 0.05)
    engine.gate.set()
    result = await scheduler.submit(frame(2), soon())
    await scheduler.stop()
    assert result is not None and int(result.coefficients[0]) == 2
    assert scheduler.stalled_s() == 0.0 and drops == ["hung"]


async def test_batches_abandoned_in_a_burst_are_logged_once_with_their_count(caplog) -> None:
    """Under overload abandoned batches come by the hundred a minute: one line per report
    interval, not one per batch (every one is still counted in the drops)."""
    engine = FakeEngine(seconds=0.010)
    scheduler, drops = await started(engine)
    await scheduler.warm_up([frame(0)])
    with caplog.at_level("WARNING", logger="inference.scheduler"):
        for i in (1, 2):
            engine.gate.clear()
            assert await scheduler.submit(frame(i), soon(0.05)) is None
            engine.gate.set()
            await until(lambda: scheduler.in_flight == 0)
    await scheduler.stop()
    assert drops == ["hung", "hung"]
    (record,) = [r for r in caplog.records if "abandoned" in r.getMessage()]
    assert record.getMessage().startswith("1 engine batch(es) abandoned")


async def test_a_session_ending_while_its_frame_waits_fails_no_one_else_in_the_batch() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    scheduler, drops = await started(engine, max_batch=4)
    first = scheduler.submit(frame(0), soon())
    await until(lambda: engine.batches == [1])
    ended, other = scheduler.submit(frame(1, slot=1), soon()), \
        scheduler.submit(frame(2, slot=2), soon())
    await until(lambda: scheduler.in_flight == 2)  # both wait in the engine's thread
    engine.released.add(1)  # slot 1's session ends meanwhile
    engine.gate.set()
    results = await asyncio.gather(first, ended, other)
    await scheduler.stop()
    assert results[1] is None and drops == ["released"]
    assert int(results[0].coefficients[0]) == 0 and int(results[2].coefficients[0]) == 2
    assert engine.batches == [1, 1]
