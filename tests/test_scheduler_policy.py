"""The scheduler's decisions, on plain requests: no engine, no clock but the one we pass."""

import asyncio

import numpy as np
import pytest

from inference.engine import FrameInput
from inference.scheduler import FrameRequest, RuntimeEstimate, dispatch_delay, plan_batch


def _request(loop: asyncio.AbstractEventLoop, deadline: float, size: int = 256,
             submitted: float = 0.0) -> FrameRequest:
    frame = FrameInput(slot=0, mel=np.zeros((16, 80), np.float32),
                       knobs=np.ones(2, np.float32), clock=np.zeros(2, np.float32))
    return FrameRequest(frame, size, deadline, submitted, loop.create_future())


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _estimate(per_frame: float, size: int = 256) -> RuntimeEstimate:
    estimate = RuntimeEstimate()
    estimate.update(size, 1, per_frame, at=0.0)
    return estimate


def test_batch_is_earliest_deadline_first_and_capped(loop):
    pending = [_request(loop, d) for d in (0.5, 0.1, 0.3, 0.2, 0.4)]
    plan = plan_batch(pending, now=0.0, max_batch=3, estimate=_estimate(0.01))
    assert [r.deadline for r in plan.run] == [0.1, 0.2, 0.3]
    assert plan.drop == []


def test_request_that_cannot_be_on_time_is_dropped(loop):
    late, fine = _request(loop, 0.005), _request(loop, 0.5)
    plan = plan_batch([late, fine], now=0.0, max_batch=8, estimate=_estimate(0.01))
    assert plan.drop == [late]
    assert plan.run == [fine]


def test_batch_only_mixes_one_frame_size(loop):
    small, big, small2 = _request(loop, 0.1, 256), _request(loop, 0.2, 512), _request(loop, 0.3)
    plan = plan_batch([big, small2, small], now=0.0, max_batch=8, estimate=_estimate(0.001))
    assert plan.run == [small, small2]


def test_batch_shrinks_rather_than_make_the_most_urgent_late(loop):
    urgent = _request(loop, 0.025)
    others = [_request(loop, 1.0) for _ in range(5)]
    plan = plan_batch([urgent, *others], now=0.0, max_batch=8, estimate=_estimate(0.01))
    # 0.01 s per frame: only two frames fit before the urgent deadline.
    assert plan.run[0] is urgent
    assert len(plan.run) == 2


def test_dispatch_waits_for_a_batch_but_not_past_max_wait(loop):
    pending = [_request(loop, 1.0, submitted=0.0)]
    assert dispatch_delay(pending, 0.0, 4, 0.005, _estimate(0.001)) == pytest.approx(0.005)
    assert dispatch_delay(pending, 0.004, 4, 0.005, _estimate(0.001)) == pytest.approx(0.001)
    assert dispatch_delay(pending, 0.006, 4, 0.005, _estimate(0.001)) == 0.0


def test_dispatch_runs_a_full_batch_at_once(loop):
    pending = [_request(loop, 1.0) for _ in range(4)]
    assert dispatch_delay(pending, 0.0, 4, 0.005, _estimate(0.001)) == 0.0


def test_dispatch_never_waits_past_the_deadline_slack(loop):
    # 25 ms to the deadline, 20 ms for a batch of two (it waits for a second frame): the
    # 5 ms of slack cap the 50 ms max wait.
    pending = [_request(loop, 0.025)]
    assert dispatch_delay(pending, 0.0, 4, 0.050, _estimate(0.010)) == pytest.approx(0.005)
    # Less than a batch of two's time left: run now.
    assert dispatch_delay([_request(loop, 0.012)], 0.0, 4, 0.050, _estimate(0.010)) == 0.0


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
    plan = plan_batch([tight], now=0.0, max_batch=8, estimate=estimate)
    assert plan.run == [tight]  # it might still make it: run it, and keep measuring


def test_a_stale_pessimistic_estimate_is_probed_not_trusted_forever(loop):
    estimate = RuntimeEstimate()
    estimate.update(512, 1, 0.040, at=0.0)  # one slow run at start-up
    soon, later = _request(loop, 5.02, 512), _request(loop, 5.03, 512)
    plan = plan_batch([soon, later], now=5.0, max_batch=1, estimate=estimate)
    assert plan.run == [soon]  # probed: nothing of this size ran for a second
    assert plan.drop == [later]
    estimate.update(512, 1, 0.040, at=5.0)
    plan = plan_batch([_request(loop, 5.03, 512)], now=5.001, max_batch=1, estimate=estimate)
    assert plan.run == []  # a fresh estimate is trusted
