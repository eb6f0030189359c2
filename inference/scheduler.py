"""One scheduler shared by every session: micro-batches frame requests into engine calls.

Decisions and execution are kept apart: ``plan_batch`` and ``dispatch_delay`` are pure
policies (earliest deadline first, drop what cannot be on time, wait a little for a
batch to fill), and ``Scheduler`` only applies them and runs the engine on one worker
thread, off the event loop. A dropped request is answered with ``None`` so the session
repeats its previous frame instead of falling behind.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from inference.engine import Engine, FrameInput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrameResult:
    frame: np.ndarray  # uint8 (H, W, 3) RGB
    coefficients: np.ndarray  # float32 (K,)


@dataclass(eq=False)
class FrameRequest:
    input: FrameInput
    size: int  # frame side: only requests of one size batch together
    deadline: float  # loop time by which the frame must be ready
    submitted: float
    future: asyncio.Future[FrameResult | None] = field(repr=False)


@dataclass(frozen=True)
class BatchPlan:
    run: list[FrameRequest]
    drop: list[FrameRequest]


class RuntimeEstimate:
    """Engine seconds per batch, by frame size and batch size: the median of the last few
    runs, so one slow call (a first run, a busy core) cannot make every deadline look
    unreachable and starve the estimate of fresh runs."""

    def __init__(self, keep: int = 9) -> None:
        self._runs: dict[tuple[int, int], deque[float]] = {}
        self._keep = keep
        self._last_update: dict[int, float] = {}

    def update(self, frame_size: int, batch: int, seconds: float, at: float = 0.0) -> None:
        self._runs.setdefault((frame_size, batch), deque(maxlen=self._keep)).append(seconds)
        self._last_update[frame_size] = at

    def last_update(self, frame_size: int) -> float:
        """Loop time of the last run of this frame size (-inf if none)."""
        return self._last_update.get(frame_size, float("-inf"))

    def _median(self, key: tuple[int, int]) -> float:
        return float(np.median(self._runs[key]))

    def seconds(self, frame_size: int, batch: int) -> float:
        """Estimate for a batch; scales the closest known batch linearly, 0 if none known."""
        known = [b for (f, b) in self._runs if f == frame_size]
        if not known:
            return 0.0
        b = min(known, key=lambda k: abs(k - batch))
        s = self._median((frame_size, b))
        return s * max(batch, 1) / b if b != batch else s

    def fastest(self, frame_size: int, batch: int) -> float:
        """The quickest recent run of this shape: below it, a deadline is surely lost."""
        runs = self._runs.get((frame_size, batch))
        return min(runs) if runs else self.seconds(frame_size, batch)

    def frames_per_second(self, frame_size: int) -> float:
        rates = [b / self._median((f, b)) for (f, b) in self._runs if f == frame_size]
        return max((r for r in rates if np.isfinite(r)), default=0.0)


PROBE_AFTER_S = 1.0


def plan_batch(pending: list[FrameRequest], now: float, max_batch: int,
               estimate: RuntimeEstimate) -> BatchPlan:
    """Earliest deadline first; the batch takes the most urgent request's frame size.

    A request that would miss its deadline even if run alone now, at the fastest speed seen
    recently, is dropped: only surely lost work is shed. But when a frame size has not run
    for ``PROBE_AFTER_S`` (the estimate may be stale, say from a busy start-up), its most
    urgent unexpired request runs anyway as a probe, so the estimate can recover.
    """
    probes = set()
    for size in {r.size for r in pending}:
        if now - estimate.last_update(size) > PROBE_AFTER_S:
            fresh = [r for r in pending if r.size == size and not r.future.done()
                     and r.deadline > now]
            if fresh:
                probes.add(id(min(fresh, key=lambda r: r.deadline)))
    drop, live = [], []
    for r in pending:
        lost = r.future.done() or (
            id(r) not in probes and now + estimate.fastest(r.size, 1) > r.deadline)
        (drop if lost else live).append(r)
    if not live:
        return BatchPlan(run=[], drop=drop)
    live.sort(key=lambda r: r.deadline)
    size = live[0].size
    run = [r for r in live if r.size == size][:max_batch]
    # Shrink the batch rather than make its most urgent member late: the largest batch
    # that still finishes by that deadline (estimates grow with the batch).
    lo, hi = 1, len(run)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if now + estimate.seconds(size, mid) <= run[0].deadline:
            lo = mid
        else:
            hi = mid - 1
    return BatchPlan(run=run[:lo], drop=drop)


def dispatch_delay(pending: list[FrameRequest], now: float, max_batch: int, max_wait: float,
                   estimate: RuntimeEstimate) -> float:
    """Seconds to keep collecting before running; 0 means run now.

    Run at once when a full batch is waiting; otherwise wait for others to join, but no
    longer than ``max_wait`` after the oldest request and never past the point where the
    most urgent request would miss its deadline.
    """
    if not pending:
        return max_wait
    urgent = min(pending, key=lambda r: r.deadline)
    same_size = sum(1 for r in pending if r.size == urgent.size)
    if same_size >= max_batch:
        return 0.0
    oldest = min(r.submitted for r in pending)
    slack = urgent.deadline - now - estimate.seconds(urgent.size, same_size + 1)
    return max(0.0, min(oldest + max_wait - now, slack))


class Scheduler:
    """Collects ``FrameRequest``s from all sessions and runs them on one engine."""

    def __init__(self, engine: Engine, *, max_batch: int, max_wait_ms: float,
                 max_pending: int = 256,
                 on_batch: Callable[[int, float], None] | None = None,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.max_pending = max_pending
        self.estimate = RuntimeEstimate()
        self._on_batch = on_batch or (lambda size, seconds: None)
        self._on_drop = on_drop or (lambda reason: None)
        self._pending: list[FrameRequest] = []
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._task: asyncio.Task[None] | None = None
        self.started = asyncio.Event()
        self.exited = asyncio.Event()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
            await self.started.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for request in self._pending:
            if not request.future.done():
                request.future.set_result(None)
        self._pending.clear()
        self._executor.shutdown(wait=True)

    async def warm_up(self, batch: list[FrameInput]) -> None:
        """Run a batch shape once untimed (first runs allocate), then once into the estimate."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.engine.run, batch)
        start = loop.time()
        await loop.run_in_executor(self._executor, self.engine.run, batch)
        self.estimate.update(self.engine.frame_size(batch[0].slot), len(batch),
                             loop.time() - start, at=loop.time())

    def submit(self, frame: FrameInput, deadline: float) -> asyncio.Future[FrameResult | None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[FrameResult | None] = loop.create_future()
        if len(self._pending) >= self.max_pending:
            oldest = min(self._pending, key=lambda r: r.submitted)
            self._pending.remove(oldest)
            self._finish_dropped(oldest, "overflow")
        size = self.engine.frame_size(frame.slot)
        self._pending.append(FrameRequest(frame, size, deadline, loop.time(), future))
        self._wakeup.set()
        return future

    def capacity_fps(self, frame_size: int) -> float:
        """Frames per second this engine has sustained at its best batch size so far."""
        return self.estimate.frames_per_second(frame_size)

    def _finish_dropped(self, request: FrameRequest, reason: str) -> None:
        if not request.future.done():
            request.future.set_result(None)
            self._on_drop(reason)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        self.started.set()
        try:
            while True:
                if not self._pending:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                delay = dispatch_delay(self._pending, loop.time(), self.max_batch,
                                       self.max_wait, self.estimate)
                if delay > 0:
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), delay)
                    except TimeoutError:
                        pass
                    continue
                plan = plan_batch(self._pending, loop.time(), self.max_batch, self.estimate)
                taken = {id(r) for r in plan.drop} | {id(r) for r in plan.run}
                self._pending = [r for r in self._pending if id(r) not in taken]
                for request in plan.drop:
                    self._finish_dropped(request, "late")
                if plan.run:
                    await self._execute(plan.run)
        finally:
            self.exited.set()

    async def _execute(self, batch: list[FrameRequest]) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            output = await loop.run_in_executor(
                self._executor, self.engine.run, [r.input for r in batch])
        except Exception:
            log.exception("engine failed on a batch of %d; dropping it", len(batch))
            for request in batch:
                self._finish_dropped(request, "error")
            return
        seconds = loop.time() - start
        self.estimate.update(batch[0].size, len(batch), seconds, at=loop.time())
        self._on_batch(len(batch), seconds)
        for i, request in enumerate(batch):
            if not request.future.done():
                request.future.set_result(
                    FrameResult(output.frames[i], output.coefficients[i]))
