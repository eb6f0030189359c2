"""Where the front door puts a new session: the worker with the least media cost whose
worker and GPU have room, or a refusal that names the limit reached."""

from __future__ import annotations

import pytest

from inference.engine import NO_PICTURE
from server.costs import session_cost
from server.front_door.placement import (
    HostLoad,
    Limits,
    Refused,
    WorkerLoad,
    engine_loads,
    place,
)
from server.load import CostModel

pytestmark = pytest.mark.unit

LIMITS = Limits(max_sessions=10, worker_sessions=4, max_engine_load=0.9, fps=25)
CAPACITY = {256: 250.0, 512: 100.0}  # frames/s: a 256 session takes 10%, a 512 one 25%


def load(index: int, gpu: int = 0, **sessions: int) -> WorkerLoad:
    return WorkerLoad(index, gpu, {int(k[1:]): n for k, n in sessions.items()}, CAPACITY)


def test_the_worker_with_the_least_media_cost_gets_the_session():
    # A 512 session costs about 1.7 of a 256 one: two small ones weigh more than one large.
    assert place([load(0, s256=2), load(1, s512=1)], 256, LIMITS) == 1
    assert place([load(0, s256=1), load(1, s512=1)], 256, LIMITS) == 0
    assert place([load(0), load(1)], 512, LIMITS) == 0  # ties go to the lower index


def test_each_gpu_has_its_own_engine_load():
    loads = [load(0, gpu=0, s512=3), load(1, gpu=1, s256=1), load(2, gpu=0)]
    assert engine_loads(loads, 25) == pytest.approx({0: 0.75, 1: 0.1})
    # Worker 2 has no sessions, but its GPU could not take another 512 (0.75 + 0.25).
    assert place(loads, 512, LIMITS) == 1


def test_refusals_name_the_limit_reached():
    with pytest.raises(Refused, match="maximum of 10 sessions"):
        place([load(0, s256=4), load(1, s256=4), load(2, s256=2)], 256, LIMITS)
    with pytest.raises(Refused, match="every media worker holds its maximum of 4"):
        place([load(0, s256=4), load(1, s256=4)], 256, LIMITS)
    with pytest.raises(Refused, match="max_engine_load"):
        place([load(0, s512=3), load(1, s256=1)], 512, LIMITS)
    with pytest.raises(Refused, match="no media worker"):
        place([], 256, LIMITS)


def test_an_engine_not_yet_measured_does_not_refuse():
    unmeasured = WorkerLoad(0, 0, {512: 3}, {})
    assert place([unmeasured], 512, LIMITS) == 0


def test_motion_only_sessions_have_their_own_caps_and_load_the_engine_by_their_own_cost():
    limits = Limits(max_sessions=2, worker_sessions=1, max_engine_load=0.9, fps=25,
                    max_motion_sessions=5, worker_motion_sessions=3)
    full_of_video = [WorkerLoad(0, 0, {256: 1}, CAPACITY), WorkerLoad(1, 0, {256: 1}, CAPACITY)]
    # No room for video, room for motion-only: they count apart ...
    with pytest.raises(Refused, match="maximum of 2 sessions"):
        place(full_of_video, 256, limits)
    assert place(full_of_video, 256, limits, motion_only=True) == 0
    motion = [WorkerLoad(0, 0, {}, CAPACITY, motion={256: 3}),
              WorkerLoad(1, 0, {}, CAPACITY, motion={256: 1})]
    assert place(motion, 256, limits, motion_only=True) == 1
    with pytest.raises(Refused, match="every media worker holds its maximum of 3 motion-only"):
        place([motion[0]], 256, limits, motion_only=True)
    with pytest.raises(Refused, match="maximum of 5 motion-only sessions"):
        place([motion[0], WorkerLoad(1, 0, {}, CAPACITY, motion={256: 2})], 256, limits,
              motion_only=True)
    # ... and load the engine by what their coefficients alone cost it (or nothing before
    # that is measured).
    assert engine_loads(motion, 25) == pytest.approx({0: 0.0})
    cheap = {**CAPACITY, NO_PICTURE: 1000.0}  # a motion-only session takes 2.5%
    motion = [WorkerLoad(0, 0, {}, cheap, motion={256: 3}),
              WorkerLoad(1, 0, {}, cheap, motion={512: 1})]
    assert engine_loads(motion, 25) == pytest.approx({0: 0.1})
    roomy = Limits(max_sessions=10, worker_sessions=10, max_engine_load=0.9, fps=25,
                   max_motion_sessions=20, worker_motion_sessions=20)
    assert place([WorkerLoad(0, 0, {512: 3}, cheap, motion={256: 5})], 512, roomy,
                 motion_only=True) == 0  # 0.75 + 6 x 0.025 = 0.9
    with pytest.raises(Refused, match="max_engine_load"):
        place([WorkerLoad(0, 0, {512: 3}, cheap, motion={256: 6})], 256, roomy,
              motion_only=True)


def test_a_worker_whose_event_loop_would_pass_its_limit_is_passed_over():
    limits = Limits(max_sessions=100, worker_sessions=50, max_engine_load=0.9, fps=25,
                    max_worker_load=0.8)
    # Worker 0: its loop costs 0.02 idle and 0.15 a 256 session, four of them measured at
    # 62%: one more 256 brings it to 77%, one more 512 (1.41 units) to 83%, past the limit.
    busy = WorkerLoad(0, 0, {256: 4}, CAPACITY, loop_load=0.62, loop_idle=0.02,
                      loop_unit=0.15)
    assert busy.loop_load_with(1.0) == pytest.approx(0.77)
    assert place([busy], 256, limits) == 0
    with pytest.raises(Refused, match="max_worker_load=0.8"):
        place([busy], 512, limits)
    # Offers placed but not yet showing in the measure are charged at the model's cost.
    burst = WorkerLoad(1, 0, {256: 5}, CAPACITY, loop_load=0.05, loop_idle=0.02,
                       loop_unit=0.15)
    assert burst.loop_load_with(1.0) == pytest.approx(0.92)
    assert place([busy, WorkerLoad(1, 1, {256: 2}, CAPACITY, loop_load=0.3, loop_idle=0.02,
                                   loop_unit=0.15)], 512, limits) == 1


def test_a_motion_only_session_costs_half_a_video_one_in_cores_and_most_of_one_on_its_loop():
    """It has no encoder (most of a video session's cores, run off the loop), but its
    audio, features and data channel run on the loop (H200 host, 2026-12-02: 0.056
    against 0.107 cores; 0.054 against 0.061 of a loop)."""
    assert session_cost(256, motion_only=True) == pytest.approx(0.55)
    assert session_cost(256, motion_only=True, loop=True) == pytest.approx(0.9)
    assert session_cost(512) == pytest.approx(2 ** 0.75)
    assert session_cost(512, loop=True) == pytest.approx(2 ** 0.5)
    limits = Limits(max_sessions=100, worker_sessions=50, max_engine_load=0.9, fps=25,
                    max_motion_sessions=100, worker_motion_sessions=50,
                    max_worker_load=0.8, max_host_load=0.8)
    # Ten motion-only sessions on a loop that costs 0.07 a unit: 0.02 + 11 x 0.9 x 0.07 =
    # 0.71; the host, at 0.1 cores a unit, would be 0.5 + 11 x 0.55 x 0.1 = 1.1 of 2 cores.
    worker = WorkerLoad(0, 0, {}, CAPACITY, motion={256: 10}, loop_idle=0.02, loop_unit=0.07)
    host = HostLoad(cores=2, busy=0.5, idle=0.5, unit=0.1)
    assert place([worker], 256, limits, motion_only=True, host=host) == 0
    # Two more on the loop (0.02 + 13 x 0.063 = 0.84) pass its limit, though the cores
    # (0.5 + 13 x 0.055 = 1.2 of 1.6) have room.
    fuller = WorkerLoad(0, 0, {}, CAPACITY, motion={256: 12}, loop_idle=0.02, loop_unit=0.07)
    with pytest.raises(Refused, match="max_worker_load"):
        place([fuller], 256, limits, motion_only=True, host=host)


def test_a_loop_measured_just_after_sessions_left_is_not_charged_to_the_one_that_stayed():
    """The loop's smoothed reading lags: a second after two sessions ended it still holds
    some of their load. Scaling that reading by the one session left (three times its real
    cost) refused a newcomer on a loop half idle; the loop's model, learnt only while every
    session was settled, does not."""
    limits = Limits(max_sessions=100, worker_sessions=50, max_engine_load=0.9, fps=25,
                    max_worker_load=0.8)
    after = WorkerLoad(0, 0, {256: 1}, CAPACITY, loop_load=0.45, settled_cost=1.0,
                       loop_idle=0.02, loop_unit=0.15)
    assert after.loop_load_with(1.0) == pytest.approx(0.6)
    assert place([after], 256, limits) == 0


def test_the_servers_cores_bound_admission_even_before_any_session_is_measured():
    limits = Limits(max_sessions=1000, worker_sessions=500, max_engine_load=0.9, fps=25,
                    max_host_load=0.85)
    workers = [WorkerLoad(0, 0, {256: 60}, {256: 1e5}), WorkerLoad(1, 1, {256: 60}, {256: 1e5})]
    # A burst: 120 sessions placed, their load not yet showing (1 core busy), so each is
    # charged 0.11 cores: 0.5 + 121 x 0.11 = 13.8 cores, past 0.85 x 16 = 13.6.
    host = HostLoad(cores=16, busy=1.0, idle=0.5, unit=0.11)
    with pytest.raises(Refused, match="16 cores would be 13.8 busy.*max_host_load=0.85"):
        place(workers, 256, limits, host=host)
    assert place(workers[:1], 256, limits, host=host) == 0  # 0.5 + 61 x 0.11 = 7.2
    # What is measured counts when it is more: sessions costlier than thought.
    assert HostLoad(cores=16, busy=13.0, idle=0.5, unit=0.11).busy_with(60, 1) == 13.11


def test_the_host_model_does_not_learn_from_a_reading_that_still_holds_sessions_gone():
    """Sessions leave at once; the smoothed reading lags (halving each second). Neither
    the cost of the sessions left nor the idle server's takes the load of those gone."""
    model = CostModel(prior=0.11)
    for _ in range(30):
        model.observe(busy=8.0, total_cost=80, settled_cost=80)
    assert model.unit == pytest.approx(0.1, abs=1e-3)
    busy = 8.0
    for total in (10, 0, 0, 0, 0):  # 70 leave, then the last 10
        busy /= 2
        model.observe(busy=busy, total_cost=total, settled_cost=total)
    assert model.unit == pytest.approx(0.1, abs=1e-3) and model.idle == 0.0
    for _ in range(20):
        busy /= 2
        model.observe(busy=busy, total_cost=0, settled_cost=0)
    assert model.idle < 0.01 and model.unit == pytest.approx(0.1, abs=1e-3)


def test_the_host_model_keeps_learning_as_sessions_come_and_go_one_at_a_time():
    """Churn on a busy server (one of 100 sessions leaves every other second) holds too
    little of the sessions gone to stop the model learning that they cost more now."""
    model = CostModel(prior=0.1)
    for second in range(60):
        total = 100 - (second % 2)
        model.observe(busy=12.0 * total / 100, total_cost=total, settled_cost=total)
    assert model.unit == pytest.approx(0.12, abs=2e-3)


def test_the_host_model_learns_from_steady_states_only():
    model = CostModel(prior=0.11)
    model.observe(busy=0.6, total_cost=0, settled_cost=0)  # no session: idle
    assert model.idle == pytest.approx(0.18) and model.unit == 0.11
    model.observe(busy=5.0, total_cost=50, settled_cost=20)  # some still starting: ignored
    assert model.unit == 0.11
    for _ in range(30):
        model.observe(busy=5.0 + model.idle, total_cost=50, settled_cost=50)
    assert model.unit == pytest.approx(0.1, abs=1e-3)  # 5 cores for 50
