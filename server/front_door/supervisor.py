"""The server's processes, kept running: one inference process per GPU (the shared
scheduler and the engine) and the media workers, each feeding one GPU.

A worker that dies is replaced (its sessions end; the others run on) and taught again the
portraits uploaded before (``UploadReplay``). An inference process that dies is started
again, and the workers of its GPU with it. One that keeps dying is started again after a
growing pause (``Backoff``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Coroutine
from typing import Any

from inference.process.handle import InferenceProcess
from inference.process.ring import unlink_ring
from inference.runtimes import GPU_RUNTIMES
from server.config import Settings
from server.engine_settings import inference_config
from server.metrics import FrontDoorMetrics
from server.worker.handle import WorkerProcess, WorkerSpec

log = logging.getLogger(__name__)

#: A process that keeps dying is started again after a pause that doubles, up to this.
MAX_RESTART_DELAY_S = 30.0


class Backoff:
    """How long to wait before starting a process again: 0.5 s after its first failure,
    doubling with each failure in a row, at most ``MAX_RESTART_DELAY_S``; a start that
    succeeds forgets its failures."""

    def __init__(self, first_s: float = 0.5, most_s: float = MAX_RESTART_DELAY_S) -> None:
        self.first_s, self.most_s = first_s, most_s
        self._failures = collections.Counter[str]()

    def failed(self, what: str) -> float:
        """``what`` failed again: the pause before its next start."""
        self._failures[what] += 1
        return min(self.most_s, self.first_s * 2 ** (self._failures[what] - 1))

    def started(self, what: str) -> None:
        self._failures[what] = 0


class UploadReplay:
    """The portrait uploads the workers hold, kept (up to ``limit``, the oldest let go) so a
    worker started in place of one that died is taught the same avatars."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._uploads: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()

    def remember(self, avatar_id: str, upload: dict[str, Any]) -> None:
        self._uploads[avatar_id] = upload
        self._uploads.move_to_end(avatar_id)
        while len(self._uploads) > self.limit:
            self._uploads.popitem(last=False)

    def forget(self, avatar_id: str) -> None:
        self._uploads.pop(avatar_id, None)

    async def replay(self, worker: WorkerProcess) -> None:
        for upload in list(self._uploads.values()):
            try:
                await worker.request("POST", "/avatars", **upload)
            except OSError as exc:
                log.warning("worker %d: replaying an avatar upload failed: %s",
                            worker.index, exc)


WorkerFactory = Callable[[WorkerSpec, Callable[[WorkerProcess], None]], WorkerProcess]
InferenceFactory = Callable[[int, str, bytes, Callable[[int | None], None]], InferenceProcess]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How many of each process, and the share of the session limits each worker holds
    (its part of the frame ring)."""

    runtime: str
    gpus: int
    workers: int
    worker_sessions: int
    worker_motion_sessions: int
    host_prefix: str = ""  # in a cluster, how this host's session ids begin (cluster.ids)


class Supervisor:
    def __init__(self, settings: Settings, layout: Layout, metrics: FrontDoorMetrics,
                 uploads: UploadReplay, *, make_worker: WorkerFactory | None = None,
                 make_inference: InferenceFactory | None = None,
                 backoff: Backoff | None = None) -> None:
        self.settings = settings
        self.layout = layout
        self.metrics = metrics
        self.uploads = uploads
        self.backoff = backoff or Backoff()
        self._make_worker = make_worker or (lambda spec, on_exit: WorkerProcess(
            spec, on_exit=on_exit))
        self._make_inference = make_inference or self._inference_process
        self._dir = tempfile.mkdtemp(prefix="sonic-")
        self._authkey = secrets.token_bytes(32)
        self.inference: list[InferenceProcess] = []
        self.workers: list[WorkerProcess] = []
        self._generation = collections.Counter[int]()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False

    def pids(self) -> list[int]:
        """The server's processes: this one, its inference processes and workers."""
        return [os.getpid(), *(p.pid for p in [*self.inference, *self.workers]
                               if p.pid is not None)]

    def live_workers(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.ready]

    async def start(self) -> None:
        self.inference = [self._make_inference(
            g, self._address(g), self._authkey, lambda code, g=g: self._inference_died(g, code))
            for g in range(self.layout.gpus)]
        await asyncio.gather(*(p.start() for p in self.inference))
        self.workers = [self._worker(i) for i in range(self.layout.workers)]
        await asyncio.gather(*(w.start() for w in self.workers))
        self.metrics.workers_alive.set(len(self.workers))

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)
        await asyncio.gather(*(p.stop() for p in self.inference), return_exceptions=True)
        for worker in self.workers:
            unlink_ring(worker.spec.ring_name)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ starting
    def _address(self, gpu: int) -> str:
        return os.path.join(self._dir, f"inference-{gpu}.sock")

    def _inference_process(self, gpu: int, address: str, authkey: bytes,
                           on_exit: Callable[[int | None], None]) -> InferenceProcess:
        on_gpu = self.layout.runtime in GPU_RUNTIMES
        return InferenceProcess(
            inference_config(self.settings, self.layout.runtime,
                             device=gpu if on_gpu else None),
            address, authkey, on_batch=self.metrics.on_batch, on_drop=self.metrics.on_drop,
            on_exit=on_exit)

    def _worker(self, index: int) -> WorkerProcess:
        self._generation[index] += 1
        gpu = index % self.layout.gpus
        settings = dataclasses.replace(
            self.settings,
            session=dataclasses.replace(
                self.settings.session, max_sessions=self.layout.worker_sessions,
                max_motion_sessions=self.layout.worker_motion_sessions),
            # A worker answers the front door only, which calls it "worker" (handle.py).
            http=dataclasses.replace(self.settings.http, allowed_hosts=["worker"]))
        spec = WorkerSpec(
            index=index, gpu=gpu, settings=settings, runtime=self.layout.runtime,
            socket_path=os.path.join(self._dir, f"worker-{index}.sock"),
            inference_address=self._address(gpu), authkey=self._authkey,
            ring_name=f"sonic-{os.getpid()}-w{index}-{self._generation[index]}",
            ring_pending=4 * self.layout.worker_sessions,
            ring_motion_pending=4 * self.layout.worker_motion_sessions,
            host_prefix=self.layout.host_prefix)
        return self._make_worker(spec, self._worker_died)

    def _later(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ recovering
    def _worker_died(self, worker: WorkerProcess) -> None:
        if self._stopping:
            return
        log.error("worker %d (pid %s) died with exit code %s; its sessions are gone; "
                  "replacing it", worker.index, worker.pid, worker.exitcode)
        self.metrics.worker_restarts.inc()
        self.metrics.workers_alive.set(len(self.live_workers()))
        unlink_ring(worker.spec.ring_name)
        self._later(self._replace_worker(worker))

    async def _replace_worker(self, worker: WorkerProcess) -> None:
        what = f"worker-{worker.index}"
        await asyncio.sleep(self.backoff.failed(what))
        await worker.stop()
        fresh = self._worker(worker.index)
        self.workers[worker.index] = fresh
        try:
            await fresh.start()
        except Exception:  # noqa: BLE001 - retried: the exit handler schedules it again
            log.exception("worker %d failed to start", worker.index)
            self._later(self._replace_worker(fresh))
            return
        self.backoff.started(what)
        await self.uploads.replay(fresh)
        self.metrics.workers_alive.set(len(self.live_workers()))
        log.info("worker %d replaced (pid %s)", fresh.index, fresh.pid)

    def _inference_died(self, gpu: int, code: int | None) -> None:
        if self._stopping:
            return
        log.error("the inference process of GPU %d died (exit code %s); restarting it and "
                  "its workers", gpu, code)
        self.metrics.inference_restarts.inc()
        self._later(self._restart_gpu(gpu))

    async def _restart_gpu(self, gpu: int) -> None:
        mine = [w for w in self.workers if w.spec.gpu == gpu]
        # Their sessions can make no more frames: end them cleanly.
        await asyncio.gather(*(w.stop() for w in mine))
        what = f"inference-{gpu}"
        await asyncio.sleep(self.backoff.failed(what))
        process = self._make_inference(gpu, self._address(gpu), self._authkey,
                                       lambda code: self._inference_died(gpu, code))
        self.inference[gpu] = process
        try:
            await process.start()
        except Exception:  # noqa: BLE001
            log.exception("the inference process of GPU %d failed to start", gpu)
            self._later(self._restart_gpu(gpu))
            return
        self.backoff.started(what)
        for worker in mine:
            unlink_ring(worker.spec.ring_name)
            self._later(self._replace_worker(worker))
