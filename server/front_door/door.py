"""The front door: the one HTTP port, in front of the media workers and inference processes.

It keeps the server's processes running (``supervisor``), takes new sessions where the
measured load allows and places each on a worker (``admission``), first measuring what a
session costs this host (``calibration``), and answers every other route by asking the
worker that holds the session, or every worker (``routes``), so clients see one server.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from inference.engine import Manifest
from inference.runtimes import GPU_RUNTIMES, cuda_device_count, resolve_runtime
from server.cluster import ids
from server.cluster.member import ClusterMember, Standing
from server.cluster.records import DRAINING, kind_of
from server.config import Settings
from server.engine_settings import check_model
from server.front_door.admission import Admission, limits
from server.front_door.calibration import Calibration
from server.front_door.placement import engine_loads
from server.front_door.supervisor import Layout, Supervisor, UploadReplay
from server.load import CoresBusy
from server.metrics import FrontDoorMetrics
from server.worker.handle import WorkerProcess, worker_prefix

log = logging.getLogger(__name__)


def default_workers(runtime: str) -> int:
    """One media worker per core where the engine runs on a GPU, one per two cores where it
    shares the CPU. A worker's event loop is one thread: on an H200 host (16 cores) eight
    workers held 128 sessions at 256x256 at 21.7 fps, their loops saturated with cores to
    spare, and sixteen held them at 24.7 fps
    (benchmarks/results/2026-11-30-peers-on-other-cores.md)."""
    cores = len(os.sched_getaffinity(0))
    return max(1, cores if runtime in GPU_RUNTIMES else cores // 2)


class FrontDoor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = FrontDoorMetrics()
        self.runtime = resolve_runtime(settings.engine.runtime)
        gpus = settings.workers.gpus
        if self.runtime in GPU_RUNTIMES:
            gpus = gpus or cuda_device_count()
            if gpus == 0:
                raise RuntimeError(f"engine.runtime={self.runtime} but no GPU is visible")
        workers = settings.workers.count or default_workers(self.runtime)
        self.manifest = Manifest.load(settings.manifest_path)
        check_model(settings, self.manifest)
        self.uploads = UploadReplay(settings.avatar.max_avatars)
        #: This host's place in a cluster (``cluster.redis_url``); None: a host alone.
        self.member = ClusterMember(settings, self.standing) \
            if settings.cluster.redis_url else None
        per_worker = limits(settings, workers)
        self.processes = Supervisor(
            settings, Layout(self.runtime, gpus or 1, workers, per_worker.worker_sessions,
                             per_worker.worker_motion_sessions,
                             self.member.prefix if self.member else ""),
            self.metrics, self.uploads)
        self.cores = len(os.sched_getaffinity(0))
        self.cores_busy = CoresBusy(self.processes.pids)
        self.admission = Admission(settings, per_worker, self.cores, self.cores_busy,
                                   self.processes.live_workers)
        self.calibration = Calibration(settings, self.admission, self.processes.pids)
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        layout = self.processes.layout
        log.info("starting %d inference process(es) on %s and %d media worker(s); loading "
                 "the model and warming it up", layout.gpus, self.runtime, layout.workers)
        await self.processes.start()
        await self.admission.loads()  # health answers from the last reading: one is there
        self._later(self.cores_busy.run())
        self._later(self.admission.learn_host_cost())
        if self.member is not None:
            await self.member.join()
            self._later(self.member.run())
        self._later(self._ready())

    async def _ready(self) -> None:
        """Says so once it takes sessions: at once, or after the start-up calibration."""
        if self.calibration.running:
            await self.calibration.run()
        http = self.settings.http
        log.info("ready: the web page is at http://%s:%d/ (model %s on %s, %d media "
                 "worker(s))", "127.0.0.1" if http.host in ("", "0.0.0.0", "::") else http.host,
                 http.port, self.manifest.name, self.runtime, self.processes.layout.workers)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.member is not None:
            await self.member.leave()
        await self.processes.stop()

    def start_draining(self) -> None:
        """In a cluster, what SIGTERM does: no new session here, the running ones go on
        (``cluster.drain_timeout_s``), then this host leaves and the server stops."""
        self._later(self.drain())

    async def drain(self) -> None:
        if self.member is not None:
            await self.member.drain(self.sessions)

    def _later(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def holder(self, session_id: object) -> WorkerProcess | None:
        """The live worker of this host whose session ids begin as ``session_id`` does, if
        it is a session id of this host at all (``cluster.ids``: nothing else is sent on)."""
        session = ids.parse(session_id)
        if session is None or session.node != (self.member.node if self.member else None) \
                or session.boot != (self.member.boot if self.member else None):
            return None
        return next((w for w in self.processes.live_workers()
                     if session.local.startswith(worker_prefix(w.index))), None)

    def sessions(self) -> int:
        """Video and motion-only sessions running here, as last read."""
        return sum(load.count + load.motion_count for load in self.admission.recent)

    async def standing(self) -> Standing:
        """What this host publishes of itself in a cluster, read now: its sessions, load,
        and the room its own admission has for each kind of session (none while it
        calibrates or drains)."""
        loads = await self.admission.loads()
        open_ = not self.calibration.running and \
            (self.member is None or self.member.state != DRAINING)
        sizes = self.settings.video.allowed_sizes
        room = {kind_of(size, motion): self.admission.room(loads, size, motion) if open_ else 0
                for size, motion in [*((s, False) for s in sizes), (min(sizes), True)]}
        return Standing(sum(load.count for load in loads),
                        sum(load.motion_count for load in loads),
                        round(self.cores_busy.value / self.cores, 3),
                        self.admission.session_capacity(loads), room, dict(self.admission.names),
                        max(engine_loads(loads, self.settings.video.fps).values(), default=0.0),
                        round(self.admission.host_model.unit, 4))


front_door_key: web.AppKey[FrontDoor] = web.AppKey("front_door", FrontDoor)
