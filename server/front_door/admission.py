"""Whether a new session is taken, and on which worker: each worker's load as it reports
it (``server.worker.report``), the offers placed and not yet answered, and the host's
cores with what a session has been measured to cost them. The decision itself is
``server.front_door.placement.place``; this carries it out, one placement at a time."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Sequence

from server.config import Settings
from server.front_door.placement import (
    HostLoad,
    Limits,
    Refused,
    WorkerLoad,
    gpu_capacity_fps,
    one_more,
    place,
)
from server.load import CoresBusy, CostModel
from server.worker.handle import WorkerProcess
from server.worker.report import WorkerReport

#: The worker route its load is read from (``server.worker.api.health``).
LOAD_PATH = "/internal/load"


def limits(settings: Settings, workers: int) -> Limits:
    """The session limits of the whole server and of each of its ``workers`` (a worker may
    hold twice its even share, so one busy worker does not refuse what another has room
    for)."""
    s = settings.session
    return Limits(
        max_sessions=s.max_sessions,
        worker_sessions=min(s.max_sessions, math.ceil(2 * s.max_sessions / workers)),
        max_engine_load=s.max_engine_load, fps=settings.video.fps,
        max_motion_sessions=s.max_motion_sessions, max_worker_load=s.max_worker_load,
        max_host_load=s.max_host_load,
        worker_motion_sessions=min(s.max_motion_sessions,
                                   math.ceil(2 * s.max_motion_sessions / workers)))


class Admission:
    def __init__(self, settings: Settings, limits: Limits, cores: int, cores_busy: CoresBusy,
                 workers: Callable[[], Sequence[WorkerProcess]]) -> None:
        self.settings = settings
        self.limits = limits
        self.cores = cores
        self.cores_busy = cores_busy
        self.host_model = CostModel(settings.session.cores_per_session)
        self._workers = workers
        # Per worker, the (frame side, motion-only) of offers placed on it, not yet answered.
        self._reserved = collections.defaultdict[int, collections.Counter[tuple[int, bool]]](
            collections.Counter)
        self._placing = asyncio.Lock()
        #: The loads as last read (each second at least): what health answers with, so it
        #: answers at once whatever the workers are doing.
        self.recent: list[WorkerLoad] = []
        self.names: dict[str, str] = {}  # the named sessions, as last read

    async def reports(self) -> list[tuple[WorkerProcess, WorkerReport]]:
        """Each live worker's load as it reports it; one that does not answer is left out."""
        workers = list(self._workers())
        answers = await asyncio.gather(*(w.request("GET", LOAD_PATH) for w in workers),
                                       return_exceptions=True)
        return [(w, WorkerReport.from_json(body)) for w, answer in zip(workers, answers,
                                                                        strict=True)
                if not isinstance(answer, BaseException)
                for status, body, _ in [answer] if status == 200]

    async def loads(self) -> list[WorkerLoad]:
        """Each live worker's load, counting the offers placed on it and not yet answered
        as its sessions (less those it already counts: none is counted twice)."""
        out, names = [], {}
        for worker, report in await self.reports():
            names.update(report.names)
            counts = {}
            for motion, sessions, answering in ((False, report.sessions, report.answering),
                                                (True, report.motion,
                                                 report.motion_answering)):
                sessions = dict(sessions)
                for (size, m), placed in self._reserved[worker.index].items():
                    if m == motion:
                        sessions[size] = sessions.get(size, 0) + \
                            max(0, placed - answering.get(size, 0))
                counts[motion] = sessions
            out.append(WorkerLoad(worker.index, worker.spec.gpu, counts[False],
                                  report.capacity_fps, motion=counts[True],
                                  loop_load=report.loop_load,
                                  settled_cost=report.settled_cost,
                                  loop_idle=report.loop_idle, loop_unit=report.loop_unit))
        self.recent, self.names = out, names
        return out

    def room(self, loads: Sequence[WorkerLoad], size: int, motion_only: bool = False,
             most: int = 4096) -> int:
        """How many more sessions of this kind ``place`` would take now, one after
        another: what a cluster compares hosts by."""
        loads, host = list(loads), self.host()
        for count in range(most):
            try:
                index = place(loads, size, self.limits, motion_only=motion_only, host=host)
            except Refused:
                return count
            loads = [one_more(load, size, motion_only) if load.index == index else load
                     for load in loads]
        return most

    def session_capacity(self, loads: Sequence[WorkerLoad]) -> int:
        """Sessions at the default frame side that the engines' measured capacity admits
        (``session.max_engine_load``), at most ``session.max_sessions``."""
        s, video = self.settings.session, self.settings.video
        return min(s.max_sessions, int(sum(c * s.max_engine_load // video.fps for c in
                                           gpu_capacity_fps(loads, video.size).values())))

    def host(self) -> HostLoad:
        return HostLoad(self.cores, self.cores_busy.value, self.host_model.idle,
                        self.host_model.unit)

    @contextlib.asynccontextmanager
    async def placed(self, size: int, motion_only: bool = False
                     ) -> AsyncIterator[WorkerProcess]:
        """A worker for a new session, its place reserved while the offer is answered
        there; raises ``placement.Refused``."""
        async with self._placing:
            loads = await self.loads()
            index = place(loads, size, self.limits, motion_only=motion_only, host=self.host())
            self._reserved[index][size, motion_only] += 1
        try:
            yield next(w for w in self._workers() if w.index == index)
        finally:
            self._reserved[index][size, motion_only] -= 1

    async def learn_host_cost(self, interval: float = 1.0) -> None:
        """Feeds the host's cost model each second, whether or not offers come: offers
        come in bursts, so a model fed only at an offer never sees a burst's sessions
        settled, and the next burst would be charged the prior again."""
        while True:
            await asyncio.sleep(interval)
            loads = await self.loads()
            self.host_model.observe(self.cores_busy.value,
                                    sum(load.media_cost for load in loads),
                                    sum(load.settled_cost for load in loads))

