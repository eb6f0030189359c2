"""The front door's parts, each alone with fake workers in this process: admission's
reservations, the supervisor's restarts and their backoff, the uploads a replaced worker
is taught. (The whole front door with real workers: ``test_front_door.py``.)"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest

from server.config import load_settings
from server.front_door.admission import LOAD_PATH, Admission, limits
from server.front_door.placement import Refused
from server.front_door.supervisor import Backoff, Layout, Supervisor, UploadReplay
from server.metrics import FrontDoorMetrics
from server.worker.handle import WorkerSpec
from server.worker.report import WorkerReport

pytestmark = pytest.mark.unit

_pids = itertools.count(50_000)


def _report(sessions: dict[int, int] | None = None, answering: dict[int, int] | None = None,
            capacity: float = 1000.0) -> WorkerReport:
    return WorkerReport(sessions=sessions or {}, answering=answering or {}, motion={},
                        motion_answering={}, capacity_fps={256: capacity, 512: capacity / 4,
                                                           0: capacity * 40},
                        loop_load=0.05, settled_cost=0.0, loop_idle=0.02, loop_unit=0.05)


@dataclass
class FakeWorker:
    """A media worker as the front door sees one: a handle that starts, stops, answers
    requests and may die."""

    spec: Any
    on_exit: Any = None
    report: WorkerReport = field(default_factory=_report)
    requests: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    ready: bool = False
    pid: int | None = None
    exitcode: int | None = None
    answers: bool = True

    @property
    def index(self) -> int:
        return int(self.spec.index)

    @property
    def name(self) -> str:
        return f"media worker {self.index}"

    async def start(self) -> None:
        self.ready, self.pid = True, next(_pids)

    async def stop(self) -> None:
        self.ready = False

    def die(self, code: int = -9) -> None:
        self.ready, self.exitcode = False, code
        self.on_exit(self)

    async def request(self, method: str, path: str, **kwargs: Any
                      ) -> tuple[int, bytes, dict[str, str]]:
        self.requests.append((method, path, kwargs))
        if not self.answers:
            raise ConnectionError(f"{self.name} is not running")
        if path == LOAD_PATH:
            return 200, self.report.to_json().encode(), {}
        return 201, b"{}", {}


@dataclass
class FakeInference:
    gpu: int
    on_exit: Any
    pid: int | None = None
    alive: bool = False
    max_batch: int = 8
    starts: int = 0

    async def start(self) -> int:
        self.starts += 1
        self.alive, self.pid = True, next(_pids)
        return self.max_batch

    async def stop(self) -> None:
        self.alive = False

    def die(self, code: int = 70) -> None:
        self.alive = False
        self.on_exit(code)


@dataclass(frozen=True)
class Spec:
    index: int
    gpu: int = 0


def _admission(workers: list[FakeWorker], **overrides: Any) -> Admission:
    settings = load_settings(overrides={"session.max_sessions": 8, **overrides})

    class Busy:
        value = 0.1

    return Admission(settings, limits(settings, len(workers)), cores=16,
                     cores_busy=Busy(), workers=lambda: workers)  # type: ignore[arg-type]


async def test_an_offer_being_answered_counts_once_on_its_worker():
    """A placed offer counts as a session of its worker until the worker reports it, then
    only as the worker's: never twice, never not at all."""
    worker = FakeWorker(Spec(0))
    admission = _admission([worker])
    async with admission.placed(256) as chosen:
        assert chosen is worker
        (load,) = await admission.loads()
        assert load.sessions == {256: 1}  # reserved, not reported yet
        worker.report = _report({256: 1}, answering={256: 1})  # made, answer on its way
        (load,) = await admission.loads()
        assert load.sessions == {256: 1}
    worker.report = _report({256: 1})
    (load,) = await admission.loads()
    assert load.sessions == {256: 1}


async def test_offers_placed_at_once_never_fill_a_worker_past_its_share():
    """Placements are made one at a time against what is reserved, so a burst of offers
    cannot all see the same free place."""
    workers = [FakeWorker(Spec(0)), FakeWorker(Spec(1))]
    admission = _admission(workers, **{"session.max_sessions": 2})
    assert admission.limits.worker_sessions == 2
    release = asyncio.Event()
    placed: list[int] = []
    refused: list[str] = []

    async def one() -> None:
        try:
            async with admission.placed(256) as worker:
                placed.append(worker.index)
                await release.wait()
        except Refused as exc:
            refused.append(str(exc))

    tasks = [asyncio.create_task(one()) for _ in range(4)]
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.gather(*tasks)
    assert sorted(placed) == [0, 1]  # spread by least cost, not both on one
    assert len(refused) == 2 and all("maximum of 2 sessions" in r for r in refused)


async def test_a_worker_that_does_not_answer_is_left_out_of_placement():
    silent, answering = FakeWorker(Spec(0), answers=False), FakeWorker(Spec(1))
    admission = _admission([silent, answering])
    assert [load.index for load in await admission.loads()] == [1]
    async with admission.placed(256) as worker:
        assert worker is answering


def test_restarts_wait_longer_after_each_failure_and_forget_them_once_started():
    backoff = Backoff(first_s=0.5, most_s=4.0)
    assert [backoff.failed("worker-0") for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert backoff.failed("worker-1") == 0.5  # each process counts its own
    backoff.started("worker-0")
    assert backoff.failed("worker-0") == 0.5


async def test_uploads_are_kept_newest_first_up_to_the_limit_and_taught_again():
    uploads = UploadReplay(limit=2)
    for name in ("a", "b", "c"):
        uploads.remember(name, {"data": name.encode()})
    uploads.remember("b", {"data": b"b2"})
    uploads.forget("missing")
    worker = FakeWorker(Spec(0))
    await uploads.replay(worker)  # type: ignore[arg-type]
    assert [(m, p, k["data"]) for m, p, k in worker.requests] == [
        ("POST", "/avatars", b"c"), ("POST", "/avatars", b"b2")]


async def _supervisor(backoff: Backoff) -> tuple[Supervisor, dict[str, list[Any]]]:
    made: dict[str, list[Any]] = {"workers": [], "inference": []}

    def make_worker(spec: WorkerSpec, on_exit: Any) -> FakeWorker:
        made["workers"].append(FakeWorker(spec, on_exit))
        return made["workers"][-1]

    def make_inference(gpu: int, address: str, authkey: bytes, on_exit: Any) -> FakeInference:
        made["inference"].append(FakeInference(gpu, on_exit))
        return made["inference"][-1]

    settings = load_settings(overrides={"session.max_sessions": 8})
    uploads = UploadReplay(limit=4)
    uploads.remember("face", {"data": b"png"})
    supervisor = Supervisor(settings, Layout("onnxruntime", gpus=1, workers=2,
                                             worker_sessions=8, worker_motion_sessions=8),
                            FrontDoorMetrics(), uploads, make_worker=make_worker,  # type: ignore[arg-type]
                            make_inference=make_inference, backoff=backoff)  # type: ignore[arg-type]
    await supervisor.start()
    return supervisor, made


async def _until(condition: Any, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "never happened"
        await asyncio.sleep(0.005)


async def test_a_dead_worker_is_replaced_after_its_pause_and_taught_the_uploads():
    supervisor, made = await _supervisor(Backoff(first_s=0.2))
    try:
        first, other = made["workers"]
        first.die()
        assert [w.index for w in supervisor.live_workers()] == [1]
        await asyncio.sleep(0.1)
        assert len(made["workers"]) == 2  # still in its pause
        await _until(lambda: len(made["workers"]) == 3 and made["workers"][2].ready)
        fresh = made["workers"][2]
        assert supervisor.workers == [fresh, other] and fresh.spec.index == 0
        assert fresh.spec.ring_name != first.spec.ring_name  # a ring of its own
        await _until(lambda: fresh.requests)
        assert fresh.requests == [("POST", "/avatars", {"data": b"png"})]
        assert other.requests == []  # the living are left alone
    finally:
        await supervisor.stop()


async def test_a_dead_inference_process_is_started_again_with_the_workers_of_its_gpu():
    supervisor, made = await _supervisor(Backoff(first_s=0.01))
    try:
        (engine,) = made["inference"]
        engine.die()
        await _until(lambda: len(made["inference"]) == 2 and made["inference"][1].alive)
        await _until(lambda: len(made["workers"]) == 4
                     and all(w.ready for w in made["workers"][2:]))
        assert supervisor.inference == [made["inference"][1]]
        assert sorted(w.spec.index for w in supervisor.workers) == [0, 1]
        assert not any(w.ready for w in made["workers"][:2])  # the old ones were stopped
    finally:
        await supervisor.stop()


async def test_nothing_is_restarted_once_the_server_stops():
    supervisor, made = await _supervisor(Backoff(first_s=0.01))
    await supervisor.stop()
    made["workers"][0].die()
    made["inference"][0].die()
    await asyncio.sleep(0.05)
    assert len(made["workers"]) == 2 and len(made["inference"]) == 1
