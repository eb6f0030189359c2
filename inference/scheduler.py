"""One scheduler shared by every session: micro-batches frame requests into engine calls.

Decisions and execution are kept apart: ``plan_batch`` and ``dispatch_delay`` are pure
policies (earliest deadline first, drop what cannot be on time, wait a little for a
batch to fill), and ``Scheduler`` only applies them and runs the engine on one worker
thread, off the event loop, timing each batch there. A dropped request is answered with
``None`` so the session repeats its previous frame instead of falling behind.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from inference.engine import NO_PICTURE, BatchOutput, Engine, FrameInput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrameResult:
    frame: np.ndarray  # uint8 (H, W, 3) RGB; (0, 0, 3) for a request without a picture
    coefficients: np.ndarray  # float32 (K,)


@dataclass(eq=False)
class FrameRequest:
    input: FrameInput
    size: int  # frame side (NO_PICTURE: coefficients only): one size to a batch
    deadline: float  # loop time by which the frame must be ready
    submitted: float
    future: asyncio.Future[FrameResult | None] = field(repr=False)
    queued: bool = field(default=True, repr=False)  # still waiting in a PendingQueue


class PendingQueue:
    """The requests waiting for the engine, indexed for what the scheduler asks many times
    a second with thousands waiting: the most urgent of each frame size (a heap by
    deadline), how many of a size wait, and which came first. Each is O(log n), not a scan.

    Taking a request out marks it; the heaps and the arrival order skip marked ones lazily.
    """

    def __init__(self, requests: Iterable[FrameRequest] = ()) -> None:
        self._heaps: dict[int, list[tuple[float, int, FrameRequest]]] = {}
        self._arrivals: deque[FrameRequest] = deque()
        self._counts: dict[int, int] = {}
        self._seq = itertools.count()
        for request in requests:
            self.push(request)

    def __len__(self) -> int:
        return sum(self._counts.values())

    def push(self, request: FrameRequest) -> None:
        request.queued = True
        heapq.heappush(self._heaps.setdefault(request.size, []),
                       (request.deadline, next(self._seq), request))
        self._arrivals.append(request)
        self._counts[request.size] = self._counts.get(request.size, 0) + 1

    def count(self, size: int) -> int:
        return self._counts.get(size, 0)

    def _top(self, size: int) -> FrameRequest | None:
        heap = self._heaps.get(size, [])
        while heap and not heap[0][2].queued:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def sizes(self) -> list[int]:
        return [size for size, n in self._counts.items() if n]

    def urgent(self, size: int | None = None) -> FrameRequest | None:
        """The request with the earliest deadline (of one frame size, if given)."""
        tops = [self._top(s) for s in ([size] if size is not None else self.sizes())]
        return min((t for t in tops if t is not None), key=lambda r: r.deadline, default=None)

    def oldest(self) -> FrameRequest | None:
        """The request waiting longest."""
        while self._arrivals and not self._arrivals[0].queued:
            self._arrivals.popleft()
        return self._arrivals[0] if self._arrivals else None

    def take(self, request: FrameRequest) -> FrameRequest:
        """Take a waiting request out, wherever it is (its heap entry goes lazily)."""
        request.queued = False
        self._counts[request.size] -= 1
        return request

    def pop_urgent(self, size: int) -> FrameRequest | None:
        top = self._top(size)
        if top is None:
            return None
        heapq.heappop(self._heaps[size])
        return self.take(top)

    def put_back(self, request: FrameRequest) -> None:
        """Return a request ``pop_urgent`` took while planning this batch: it goes back in
        deadline order, and it never left the arrival order."""
        request.queued = True
        heapq.heappush(self._heaps[request.size], (request.deadline, next(self._seq), request))
        self._counts[request.size] += 1

    def drain(self) -> list[FrameRequest]:
        """Everything still waiting, taken out."""
        waiting = [r for heap in self._heaps.values() for _, _, r in heap if r.queued]
        for request in waiting:
            self.take(request)
        self._heaps.clear()
        self._arrivals.clear()
        return waiting


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
        self._medians: dict[tuple[int, int], float] = {}  # asked for far more than updated
        self._keep = keep
        self._last_update: dict[int, float] = {}

    def update(self, frame_size: int, batch: int, seconds: float, at: float = 0.0) -> None:
        runs = self._runs.setdefault((frame_size, batch), deque(maxlen=self._keep))
        runs.append(seconds)
        self._medians[(frame_size, batch)] = float(np.median(runs))
        self._last_update[frame_size] = at

    def last_update(self, frame_size: int) -> float:
        """Loop time of the last run of this frame size (-inf if none)."""
        return self._last_update.get(frame_size, float("-inf"))

    def _median(self, key: tuple[int, int]) -> float:
        return self._medians[key]

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
#: Timed runs of each batch shape at start-up.
WARM_UP_RUNS = 5
#: The next batch is handed to the engine's thread this long before the engine is expected
#: to free, so the event loop's own delays do not leave the engine idle.
DISPATCH_LEAD_S = 0.003


def plan_batch(pending: PendingQueue, now: float, max_batch: int,
               estimate: RuntimeEstimate) -> BatchPlan:
    """Earliest deadline first; the batch takes the most urgent request's frame size. The
    plan's requests leave ``pending``; the rest stay.

    A request that would miss its deadline even if run alone now, at the fastest speed seen
    recently, is dropped: only surely lost work is shed. But when a frame size has not run
    for ``PROBE_AFTER_S`` (the estimate may be stale, say from a busy start-up), its most
    urgent unexpired request runs anyway as a probe, so the estimate can recover. As the
    heaps keep deadline order, the lost requests of a size are the ones at its top.
    """
    drop: list[FrameRequest] = []
    probes: dict[int, FrameRequest] = {}
    for size in pending.sizes():
        probing = now - estimate.last_update(size) > PROBE_AFTER_S
        surely_lost_before = now + estimate.fastest(size, 1)
        while (top := pending.urgent(size)) is not None:
            if probing and size not in probes and top.deadline > now \
                    and not top.future.done():
                probes[size] = top
            elif not (top.future.done() or top.deadline < surely_lost_before):
                break
            else:
                drop.append(top)
            pending.pop_urgent(size)
    first = min([r for r in (pending.urgent(), *probes.values()) if r is not None],
                key=lambda r: r.deadline, default=None)
    if first is None:
        return BatchPlan(run=[], drop=drop)
    size = first.size
    for other, probe in probes.items():  # a probe of another size waits for its own turn
        if other != size:
            pending.put_back(probe)
    probe = probes.get(size)
    # Enough candidates, in deadline order, to weigh this batch against the next one.
    horizon = now + 2 * estimate.seconds(size, max_batch)
    candidates = [probe] if probe is not None else []
    while (top := pending.urgent(size)) is not None and (
            len(candidates) < 2 * max_batch or top.deadline < horizon):
        pending.pop_urgent(size)
        (drop if top.future.done() else candidates).append(top)
    deadlines = [r.deadline for r in candidates]
    skip, take = choose_batch(deadlines, now, max_batch, lambda b: estimate.seconds(size, b),
                              keep_first=probe is not None)
    drop += candidates[:skip]
    for request in candidates[skip + take:]:
        pending.put_back(request)
    return BatchPlan(run=candidates[skip:skip + take], drop=drop)


def choose_batch(deadlines: Sequence[float], now: float, max_batch: int,
                 seconds: Callable[[int], float], keep_first: bool = False) -> tuple[int, int]:
    """Of requests sorted by deadline: skip (drop) the first ``skip``, run the next ``take``.

    Normally the batch shrinks rather than make its most urgent member late: the largest
    batch that still finishes by that deadline. But under overload, always serving the
    nearly late first in tiny batches is the domino effect of earliest-deadline-first:
    throughput falls and everything behind turns late too. So the shrunk batch is weighed,
    together with the batch that would follow it, against the one batch that puts the
    most frames on time now, dropping what that batch cannot save; the shrink wins ties.
    ``keep_first`` (a probe of a stale estimate) always runs the first request.
    """
    n = len(deadlines)
    if n == 0:
        return 0, 0
    sizes = sorted({min(max_batch, 2 ** k) for k in range(max_batch.bit_length() + 1)})

    def most_on_time(first: int, start: float) -> tuple[int, int, int]:
        """(frames on time, skip, take) of the best single batch from ``first`` on."""
        best = (0, 0, 0)
        for b in sizes:
            if b > n - first and best[0]:
                break
            lost = bisect.bisect_left(deadlines, start + seconds(b), first) - first
            take = min(b, n - first - lost)
            if take > best[0]:
                best = (take, lost, take)
        return best

    # Shrink (estimates grow with the batch); at least one: a request that is not surely
    # lost may still make it, and running it keeps the estimate fresh.
    shrunk, hi = 1, min(max_batch, n)
    while shrunk < hi:
        mid = (shrunk + hi + 1) // 2
        if now + seconds(mid) <= deadlines[0]:
            shrunk = mid
        else:
            hi = mid - 1
    if keep_first:
        return 0, shrunk
    after, _, _ = most_on_time(shrunk, now + seconds(shrunk))
    on_time, skip, take = most_on_time(0, now)
    return (0, shrunk) if shrunk + after >= on_time else (skip, take)


def dispatch_delay(pending: PendingQueue, now: float, max_batch: int, max_wait: float,
                   estimate: RuntimeEstimate) -> float:
    """Seconds to keep collecting before running; 0 means run now.

    Run at once when a full batch is waiting; otherwise wait for others to join, but no
    longer than ``max_wait`` after the oldest request and never past the point where the
    most urgent request would miss its deadline.
    """
    urgent, oldest = pending.urgent(), pending.oldest()
    if urgent is None or oldest is None:
        return max_wait
    same_size = pending.count(urgent.size)
    if same_size >= max_batch:
        return 0.0
    slack = urgent.deadline - now - estimate.seconds(urgent.size, same_size + 1)
    return max(0.0, min(oldest.submitted + max_wait - now, slack))


@dataclass(frozen=True)
class BatchRun:
    """What came back from the engine's thread: the output of the frames that ran (their
    indices in the batch) and the engine's own time for them."""

    output: BatchOutput | None
    ran: list[int]
    seconds: float


def _has_portrait(engine: Engine, slot: int) -> bool:
    try:
        engine.frame_size(slot)
    except KeyError:
        return False
    return True


def timed_run(engine: Engine, batch: list[FrameInput], picture: bool = True) -> BatchRun:
    """Run a batch (``run``, or ``run_motion`` without ``picture``) and time it where it
    runs (the engine's thread): seconds measured on the event loop would add the loop's own
    delay in resuming, and a busy loop would then make the engine look slow, shrink every
    batch and drop frames that were never late.

    Frames whose portrait was released while the batch waited (their session ended) are
    left out, so one session ending cannot fail a batch it shares with others."""
    ran = [i for i, frame in enumerate(batch) if _has_portrait(engine, frame.slot)]
    inputs = [batch[i] for i in ran]
    start = time.perf_counter()
    output = None
    if ran:
        output = engine.run(inputs) if picture else \
            BatchOutput.motion(engine.run_motion(inputs))
    return BatchRun(output, ran, time.perf_counter() - start)


#: A batch running past ``HANG_FACTOR`` times its expected time, and past every one of its
#: frames' deadlines, is abandoned: its frames are answered None (their sessions have
#: repeated the last frame already) rather than kept waiting. Before its deadlines a slow
#: batch is only slow: under load a batch can take tens of milliseconds more than usual
#: (the engine thread waits for the GIL) and its frames still leave on time.
HANG_FACTOR = 1.5
#: A batch shape never timed (its first run allocates or compiles) is given this long.
HANG_UNTIMED_S = 5.0
#: Abandoned batches are logged at most this often, with how many there were since: under
#: overload they come by the hundred a minute, and the count is in the metrics anyway.
ABANDON_LOG_EVERY_S = 10.0


@dataclass(eq=False)
class _Flight:
    """A batch handed to the engine thread, how long it is expected to take, and when it
    started running (None while it waits behind another batch in the thread)."""

    requests: list[FrameRequest]
    expected: float
    started: float | None = None
    abandoned: bool = False

    @property
    def overdue_at(self) -> float:
        """Loop time past which this batch counts as hung (inf until it starts)."""
        if self.started is None:
            return float("inf")
        if self.expected <= 0:
            return self.started + HANG_UNTIMED_S
        return max(self.started + HANG_FACTOR * self.expected,
                   max(r.deadline for r in self.requests))


class Scheduler:
    """Collects ``FrameRequest``s from all sessions and runs them on one engine.

    Up to ``max_in_flight`` batches are handed to the engine's thread at once, so the next
    batch is waiting when the engine frees: the engine never idles while the event loop
    gets round to it. The next batch is formed ``DISPATCH_LEAD_S`` before the engine is
    expected to free, from everything pending by then, and planned as if it starts then.
    """

    def __init__(self, engine: Engine, *, max_batch: int, max_wait_ms: float,
                 max_pending: int = 256, max_in_flight: int = 2,
                 on_batch: Callable[[int, float], None] | None = None,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.max_pending = max_pending
        self.max_in_flight = max_in_flight
        self.estimate = RuntimeEstimate()
        self._on_batch = on_batch or (lambda size, seconds: None)
        self._on_drop = on_drop or (lambda reason: None)
        self._pending = PendingQueue()
        self._in_flight: deque[_Flight] = deque()
        self._free_at = float("-inf")  # loop time the engine is expected to be free
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._task: asyncio.Task[None] | None = None
        self.started = asyncio.Event()
        self.exited = asyncio.Event()
        self._abandoned_unlogged = 0
        self._abandon_logged_at = float("-inf")

    @property
    def in_flight(self) -> int:
        """Batches handed to the engine's thread and not yet finished."""
        return len(self._in_flight)

    def stalled_s(self) -> float:
        """How long the running batch has been overdue (0 if none is): an engine stuck for
        good shows here, and only replacing its process frees the GPU."""
        if not self._in_flight:
            return 0.0
        return max(0.0, asyncio.get_running_loop().time() - self._in_flight[0].overdue_at)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
            await self.started.wait()

    async def stop(self) -> None:
        """Stop dispatching; answer every request still waiting with None (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for request in self._pending.drain():
            self._finish_dropped(request, "stopped")
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._executor.shutdown(wait=True))
        for flight in list(self._in_flight):
            for request in flight.requests:
                self._finish_dropped(request, "stopped")
        self._in_flight.clear()

    async def warm_up(self, batch: list[FrameInput], runs: int = WARM_UP_RUNS, *,
                      picture: bool = True) -> None:
        """Run a batch shape once untimed (first runs allocate), then ``runs`` times into
        the estimate, whose median then sets the capacity admission starts from: a single
        run on a busy core made it differ by half from one start to the next."""
        loop = asyncio.get_running_loop()
        size = self.engine.frame_size(batch[0].slot) if picture else NO_PICTURE
        await loop.run_in_executor(self._executor, timed_run, self.engine, batch, picture)
        for _ in range(runs):
            run = await loop.run_in_executor(self._executor, timed_run, self.engine, batch,
                                             picture)
            self.estimate.update(size, len(batch), run.seconds, at=loop.time())

    def submit(self, frame: FrameInput, deadline: float, *, picture: bool = True
               ) -> asyncio.Future[FrameResult | None]:
        """Queue one frame (without ``picture``, its coefficients alone); raises KeyError
        for a portrait slot that is not (or no longer) in the engine."""
        loop = asyncio.get_running_loop()
        size = self.engine.frame_size(frame.slot)
        if not picture:
            size = NO_PICTURE
        future: asyncio.Future[FrameResult | None] = loop.create_future()
        if len(self._pending) >= self.max_pending:
            oldest = self._pending.oldest()
            if oldest is not None:
                self._finish_dropped(self._pending.take(oldest), "overflow")
        self._pending.push(FrameRequest(frame, size, deadline, loop.time(), future))
        self._wakeup.set()
        return future

    def capacity_fps(self, frame_size: int) -> float:
        """Frames per second this engine has sustained at its best batch size so far."""
        return self.estimate.frames_per_second(frame_size)

    def _finish_dropped(self, request: FrameRequest, reason: str) -> None:
        if not request.future.done():
            request.future.set_result(None)
            self._on_drop(reason)

    async def _sleep(self, seconds: float | None) -> None:
        """Until ``seconds`` pass, or sooner if a request or a finished batch comes in."""
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), seconds)
        except TimeoutError:
            pass

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        self.started.set()
        try:
            while True:
                now = loop.time()
                if not len(self._pending) or len(self._in_flight) >= self.max_in_flight:
                    await self._sleep(None)
                    continue
                start = max(now, self._free_at)  # when a batch handed over now would start
                if start - now > DISPATCH_LEAD_S:
                    await self._sleep(start - now - DISPATCH_LEAD_S)
                    continue
                delay = dispatch_delay(self._pending, start, self.max_batch, self.max_wait,
                                       self.estimate)
                if delay > 0:
                    await self._sleep(start + delay - now)
                    continue
                plan = plan_batch(self._pending, start, self.max_batch, self.estimate)
                for request in plan.drop:
                    self._finish_dropped(request, "late")
                if plan.run:
                    self._dispatch(plan.run, start)
        finally:
            self.exited.set()

    def _dispatch(self, requests: list[FrameRequest], start: float) -> None:
        loop = asyncio.get_running_loop()
        flight = _Flight(requests, self.estimate.seconds(requests[0].size, len(requests)))
        self._in_flight.append(flight)
        self._free_at = start + flight.expected
        if len(self._in_flight) == 1:
            self._started(flight, loop.time())
        future = loop.run_in_executor(self._executor, timed_run, self.engine,
                                      [r.input for r in requests],
                                      requests[0].size != NO_PICTURE)
        future.add_done_callback(lambda done: self._finished(flight, done))

    def _started(self, flight: _Flight, now: float) -> None:
        flight.started = now
        asyncio.get_running_loop().call_at(flight.overdue_at, self._abandon_if_running, flight)

    def _abandon_if_running(self, flight: _Flight) -> None:
        """The batch overran: answer its frames now; its results, if they ever come, are
        thrown away. The engine thread stays busy until it returns."""
        if flight not in self._in_flight or flight.abandoned:
            return
        flight.abandoned = True
        self._abandoned_unlogged += 1
        now = asyncio.get_running_loop().time()
        if now - self._abandon_logged_at >= ABANDON_LOG_EVERY_S:
            log.warning("%d engine batch(es) abandoned past their frames' deadlines since "
                        "the last report (the latest: %d frames, %.0f ms running, %.0f ms "
                        "expected); their frames are repeated", self._abandoned_unlogged,
                        len(flight.requests), 1000 * (now - (flight.started or now)),
                        1000 * flight.expected)
            self._abandoned_unlogged, self._abandon_logged_at = 0, now
        for request in flight.requests:
            self._finish_dropped(request, "hung")

    def _finished(self, flight: _Flight, done: asyncio.Future[BatchRun]) -> None:
        if flight not in self._in_flight:
            return  # stopped meanwhile: its requests were answered then
        self._in_flight.remove(flight)
        now = asyncio.get_running_loop().time()
        # The next batch in the thread starts now: re-anchor the expected free time.
        self._free_at = now + sum(f.expected for f in self._in_flight)
        if self._in_flight:
            self._started(self._in_flight[0], now)
        self._wakeup.set()
        requests = flight.requests
        if done.cancelled() or done.exception() is not None:
            log.error("engine failed on a batch of %d; dropping it", len(requests),
                      exc_info=None if done.cancelled() else done.exception())
            for request in requests:
                self._finish_dropped(request, "error")
            return
        run = done.result()
        if run.output is not None:
            self.estimate.update(requests[0].size, len(run.ran), run.seconds, at=now)
            self._on_batch(len(run.ran), run.seconds)
            for row, i in enumerate(run.ran):
                if not requests[i].future.done():
                    requests[i].future.set_result(
                        FrameResult(run.output.frames[row], run.output.coefficients[row]))
        for request in requests:
            self._finish_dropped(request, "released")  # those that did not run
