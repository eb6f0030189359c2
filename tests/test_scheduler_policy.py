"""The scheduler's decisions, on plain requests: no engine, no clock but the one we pass."""

import asyncio

import numpy as np
import pytest

from inference.engine import FrameInput
from inference.model.timing import TIMING
from inference.scheduler import (
    FrameRequest,
    PendingQueue,
    RuntimeEstimate,
    choose_batch,
    dispatch_delay,
    plan_batch,
)

pytestmark = pytest.mark.unit

WINDOW = TIMING.window_frames  # mel frames per window, as the engine takes them


def _request(loop: asyncio.AbstractEventLoop, deadline: float, size: int = 256,
             submitted: float = 0.0) -> FrameRequest:
    frame = FrameInput(slot=0, mel=np.zeros((WINDOW, 80), np.float32),
                       knobs=np.ones(2, np.float32), clock=np.zeros(2, np.float32))
    return FrameRequest(frame, size, deadline, submitted, loop.create_future())


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _plan(requests: list[FrameRequest], *args, **kwargs):  # type: ignore[no-untyped-def]
    return plan_batch(PendingQueue(requests), *args, **kwargs)


def _delay(requests: list[FrameRequest], *args, **kwargs):  # type: ignore[no-untyped-def]
    return dispatch_delay(PendingQueue(requests), *args, **kwargs)


def _estimate(per_frame: float, size: int = 256) -> RuntimeEstimate:
    estimate = RuntimeEstimate()
    estimate.update(size, 1, per_frame, at=0.0)
    return estimate


def test_batch_is_earliest_deadline_first_and_capped(loop):
    pending = [_request(loop, d) for d in (0.5, 0.1, 0.3, 0.2, 0.4)]
    plan = _plan(pending, now=0.0, max_batch=3, estimate=_estimate(0.01))
    assert [r.deadline for r in plan.run] == [0.1, 0.2, 0.3]
    assert plan.drop == []


def test_request_that_cannot_be_on_time_is_dropped(loop):
    late, fine = _request(loop, 0.005), _request(loop, 0.5)
    plan = _plan([late, fine], now=0.0, max_batch=8, estimate=_estimate(0.01))
    assert plan.drop == [late]
    assert plan.run == [fine]


def test_batch_only_mixes_one_frame_size(loop):
    small, big, small2 = _request(loop, 0.1, 256), _request(loop, 0.2, 512), _request(loop, 0.3)
    plan = _plan([big, small2, small], now=0.0, max_batch=8, estimate=_estimate(0.001))
    assert plan.run == [small, small2]


def test_batch_shrinks_rather_than_make_the_most_urgent_late(loop):
    urgent = _request(loop, 0.025)
    others = [_request(loop, 1.0) for _ in range(5)]
    plan = _plan([urgent, *others], now=0.0, max_batch=8, estimate=_estimate(0.01))
    # 0.01 s per frame: only two frames fit before the urgent deadline.
    assert plan.run[0] is urgent
    assert len(plan.run) == 2


def test_dispatch_waits_for_a_batch_but_not_past_max_wait(loop):
    pending = [_request(loop, 1.0, submitted=0.0)]
    assert _delay(pending, 0.0, 4, 0.005, _estimate(0.001)) == pytest.approx(0.005)
    assert _delay(pending, 0.004, 4, 0.005, _estimate(0.001)) == pytest.approx(0.001)
    assert _delay(pending, 0.006, 4, 0.005, _estimate(0.001)) == 0.0


def test_dispatch_runs_a_full_batch_at_once(loop):
    pending = [_request(loop, 1.0) for _ in range(4)]
    assert _delay(pending, 0.0, 4, 0.005, _estimate(0.001)) == 0.0


def test_dispatch_never_waits_past_the_deadline_slack(loop):
    # 25 ms to the deadline, 20 ms for a batch of two (it waits for a second frame): the
    # 5 ms of slack cap the 50 ms max wait.
    pending = [_request(loop, 0.025)]
    assert _delay(pending, 0.0, 4, 0.050, _estimate(0.010)) == pytest.approx(0.005)
    # Less than a batch of two's time left: run now.
    assert _delay([_request(loop, 0.012)], 0.0, 4, 0.050, _estimate(0.010)) == 0.0


def test_runtime_estimate_scales_from_nearest_batch():
    estimate = RuntimeEstimate()
    assert estimate.seconds(256, 4) == 0.0
    estimate.update(256, 2, 0.010)
    assert estimate.seconds(256, 4) == pytest.approx(0.020)
    assert estimate.frames_per_second(256) == pytest.approx(200.0)
    assert estimate.frames_per_second(512) == 0.0


def test_one_slow_run_does_not_poison_the_estimate():
    estimate = RuntimeEstimate()
    for seconds in (0.5, 0.010, 0.011, 0.009):
        estimate.update(512, 1, seconds)
    assert estimate.seconds(512, 1) == pytest.approx(0.0105)
    assert estimate.fastest(512, 1) == pytest.approx(0.009)


def test_only_surely_lost_requests_are_dropped(loop):
    estimate = RuntimeEstimate()
    for seconds in (0.040, 0.040, 0.012):  # usually slow, once fast
        estimate.update(256, 1, seconds)
    tight = _request(loop, 0.020)
    plan = _plan([tight], now=0.0, max_batch=8, estimate=estimate)
    assert plan.run == [tight]  # it might still make it: run it, and keep measuring


def test_a_stale_pessimistic_estimate_is_probed_not_trusted_forever(loop):
    estimate = RuntimeEstimate()
    estimate.update(512, 1, 0.040, at=0.0)  # one slow run at start-up
    soon, later = _request(loop, 5.02, 512), _request(loop, 5.03, 512)
    plan = _plan([soon, later], now=5.0, max_batch=1, estimate=estimate)
    assert plan.run == [soon]  # probed: nothing of this size ran for a second
    assert plan.drop == [later]
    estimate.update(512, 1, 0.040, at=5.0)
    plan = _plan([_request(loop, 5.03, 512)], now=5.001, max_batch=1, estimate=estimate)
    assert plan.run == []  # a fresh estimate is trusted


def test_a_plan_leaves_what_it_does_not_take_in_the_queue(loop):
    estimate = _estimate(0.010)
    urgent = _request(loop, 0.025)
    others = [_request(loop, 1.0 + i, submitted=0.001 * i) for i in range(5)]
    big = _request(loop, 9.0, 512)  # another frame size, never run: taken as a probe ...
    pending = PendingQueue([urgent, *others, big])
    plan = plan_batch(pending, now=0.0, max_batch=8, estimate=estimate)
    assert plan.run == [urgent, others[0]] and plan.drop == []  # ... and put back
    assert len(pending) == 5 and pending.count(256) == 4 and pending.count(512) == 1
    assert pending.urgent() is others[1] and pending.oldest() is others[1]
    assert pending.urgent(512) is big
    assert sorted(map(id, pending.drain())) == sorted(map(id, [*others[1:], big]))
    assert len(pending) == 0 and pending.urgent() is None and pending.oldest() is None


def test_queue_answers_in_deadline_and_arrival_order_at_scale(loop):
    rng = np.random.default_rng(0)
    requests = [_request(loop, float(d), submitted=float(i))
                for i, d in enumerate(rng.uniform(0, 1, 2000))]
    pending = PendingQueue(requests)
    for r in requests[:500]:  # overflow-style removals from anywhere
        pending.take(r)
    assert pending.oldest() is requests[500] and len(pending) == 1500
    popped = [pending.pop_urgent(256) for _ in range(1500)]
    assert [r.deadline for r in popped] == sorted(r.deadline for r in requests[500:])
    assert pending.pop_urgent(256) is None


def _cost(batch: int) -> float:
    """A GPU-like engine: 2 ms a call, plus 0.05 ms a frame."""
    return 0.002 + 0.00005 * batch


def test_with_slack_behind_it_the_batch_shrinks_to_save_the_most_urgent():
    deadlines = [0.0021] + [0.050 + 0.001 * i for i in range(100)]
    skip, take = choose_batch(deadlines, 0.0, 64, _cost)
    assert (skip, take) == (0, 2)  # 2 frames fit by 2.1 ms; the next batch is still early


def test_under_overload_the_batch_puts_the_most_frames_on_time():
    # A backlog due within 6 ms: serving the nearly late first in batches of two would
    # make the rest late too (the domino effect); one large batch saves the most.
    deadlines = list(np.linspace(0.0021, 0.0060, 200))
    skip, take = choose_batch(deadlines, 0.0, 64, _cost)
    finish = _cost(64)
    assert take > 32 and skip == sum(d < finish for d in deadlines)
    assert all(d >= finish for d in deadlines[skip:skip + take])
