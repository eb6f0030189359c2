"""The front door: the one HTTP port, in front of the media workers and inference processes.

It starts one inference process per GPU (the shared scheduler and the engine) and the media
workers (peers, audio, encoding), each worker feeding one GPU. A new session is placed on
a worker by measured load (``server.front_door.placement``) or refused with 503 and ``Retry-After``;
every other route is answered by asking the workers, so clients see one server. A worker
that dies is replaced (its sessions end; the others run on); an inference process that
dies is restarted and the workers of its GPU with it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web

from inference.engine import NO_PICTURE, Manifest
from inference.process.handle import InferenceProcess
from inference.process.ring import unlink_ring
from inference.runtimes import GPU_RUNTIMES, VERIFIED, cuda_device_count, resolve_runtime
from server.client.calibration import HEADERS_ENV, TOKEN_HEADER, PeerPlan
from server.config import Settings
from server.costs import session_cost
from server.front_door.placement import (
    HostLoad,
    Limits,
    Refused,
    WorkerLoad,
    engine_loads,
    gpu_capacity_fps,
    place,
)
from server.http.access import Access
from server.load import CoresBusy, CostModel, cores_used
from server.media.sessions import SETTLED_S
from server.metrics import CONTENT_TYPE, FrontDoorMetrics, merge_expositions
from server.worker.app import STATIC_DIR, check_model, inference_config
from server.worker.process import WorkerProcess, WorkerSpec, worker_prefix
from server.worker.routes import (
    RETRY_AFTER_S,
    allowed_hosts,
    at_capacity,
    config_body,
    cors,
    fail,
    host_check,
    json_errors,
    parse_json_object,
    read_body,
    require_json,
    sdp_endpoint_options,
)
from server.worker.state import access_key, metrics_key, settings_key

log = logging.getLogger(__name__)
routes = web.RouteTableDef()
#: A process that keeps dying is restarted after a growing pause, up to this.
MAX_RESTART_DELAY_S = 30.0
#: The start-up calibration (``server.client.calibration``): the server's idle cores are read over
#: IDLE_S, its sessions' once all have settled over MEASURE_S; it gives up after
#: CALIBRATION_TIMEOUT_S, and the prior stands.
IDLE_S = 1.5
MEASURE_S = 3.0
CALIBRATION_TIMEOUT_S = 60.0
CALIBRATION_SESSIONS = (2, 24)


class CalibrationFailed(RuntimeError):
    pass


def default_workers(runtime: str) -> int:
    """One media worker per core where the engine runs on a GPU, one per two cores where it
    shares the CPU. A worker's event loop is one thread: on an H200 host (16 cores) eight
    workers held 128 sessions at 256x256 at 21.7 fps, their loops saturated with cores to
    spare, and sixteen held them at 24.7 fps (BENCHMARKS.md)."""
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
        self.gpu_count = gpus or 1
        self.worker_count = settings.workers.count or default_workers(self.runtime)
        s = settings.session
        self.limits = Limits(
            max_sessions=s.max_sessions,
            worker_sessions=min(s.max_sessions, math.ceil(2 * s.max_sessions
                                                          / self.worker_count)),
            max_engine_load=s.max_engine_load, fps=settings.video.fps,
            max_motion_sessions=s.max_motion_sessions, max_worker_load=s.max_worker_load,
            max_host_load=s.max_host_load,
            worker_motion_sessions=min(s.max_motion_sessions, math.ceil(
                2 * s.max_motion_sessions / self.worker_count)))
        self.manifest = Manifest.load(settings.manifest_path)
        check_model(settings, self.manifest)
        self._dir = tempfile.mkdtemp(prefix="sonic-")
        self._authkey = secrets.token_bytes(32)
        self.inference: list[InferenceProcess] = []
        self.workers: list[WorkerProcess] = []
        self._generation = collections.Counter[int]()
        self._failures = collections.Counter[str]()
        # Per worker, the (frame side, motion-only) of offers placed on it, not yet answered.
        self._reserved = collections.defaultdict[int, collections.Counter[tuple[int, bool]]](
            collections.Counter)
        self._placing = asyncio.Lock()
        self._uploads: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.cores = len(os.sched_getaffinity(0))
        self.cores_busy = CoresBusy(self.pids)
        self.host_model = CostModel(settings.session.cores_per_session)
        #: While set, only the calibration's own peers (their offers carrying the token)
        #: are given sessions; ``calibration`` then holds what it measured, or why not.
        self.calibrating = settings.session.calibration_sessions >= 0
        self.calibration: dict[str, Any] | None = None
        self._calibration_token = secrets.token_urlsafe(16)

    def pids(self) -> list[int]:
        """The server's processes: this one, its inference processes and workers."""
        return [os.getpid(), *(p.pid for p in [*self.inference, *self.workers]
                               if p.pid is not None)]

    # ------------------------------------------------------------------ life cycle
    def _inference_process(self, gpu: int) -> InferenceProcess:
        on_gpu = self.runtime in GPU_RUNTIMES
        return InferenceProcess(
            inference_config(self.settings, self.runtime, device=gpu if on_gpu else None),
            os.path.join(self._dir, f"inference-{gpu}.sock"), self._authkey,
            on_batch=self.metrics.on_batch, on_drop=self.metrics.on_drop,
            on_exit=lambda code, g=gpu: self._inference_died(g, code))

    def _worker_process(self, index: int) -> WorkerProcess:
        self._generation[index] += 1
        gpu = index % self.gpu_count
        settings = dataclasses.replace(
            self.settings,
            session=dataclasses.replace(
                self.settings.session, max_sessions=self.limits.worker_sessions,
                max_motion_sessions=self.limits.worker_motion_sessions),
            # A worker answers the front door only, which calls it "worker" (worker.py).
            http=dataclasses.replace(self.settings.http, allowed_hosts=["worker"]))
        spec = WorkerSpec(
            index=index, gpu=gpu, settings=settings, runtime=self.runtime,
            socket_path=os.path.join(self._dir, f"worker-{index}.sock"),
            inference_address=self.inference[gpu].address, authkey=self._authkey,
            ring_name=f"sonic-{os.getpid()}-w{index}-{self._generation[index]}",
            ring_pending=4 * self.limits.worker_sessions,
            ring_motion_pending=4 * self.limits.worker_motion_sessions)
        return WorkerProcess(spec, on_exit=self._worker_died)

    async def start(self) -> None:
        log.info("front door: %d inference process(es) on %s, %d media worker(s)",
                 self.gpu_count, self.runtime, self.worker_count)
        self.inference = [self._inference_process(g) for g in range(self.gpu_count)]
        await asyncio.gather(*(p.start() for p in self.inference))
        self.workers = [self._worker_process(i) for i in range(self.worker_count)]
        await asyncio.gather(*(w.start() for w in self.workers))
        self.metrics.workers_alive.set(len(self.workers))
        self._later(self.cores_busy.run())
        self._later(self._learn_host_cost())
        if self.calibrating:
            self._later(self._calibrate())

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

    def _later(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pause_before_restart(self, what: str) -> None:
        self._failures[what] += 1
        await asyncio.sleep(min(MAX_RESTART_DELAY_S, 0.5 * 2 ** (self._failures[what] - 1)))

    def _worker_died(self, worker: WorkerProcess) -> None:
        if self._stopping:
            return
        log.error("worker %d (pid %s) died with exit code %s; its sessions are gone; "
                  "replacing it", worker.index, worker.pid, worker.exitcode)
        self.metrics.worker_restarts.inc()
        self.metrics.workers_alive.set(sum(w.ready for w in self.workers))
        unlink_ring(worker.spec.ring_name)
        self._later(self._replace_worker(worker))

    async def _replace_worker(self, worker: WorkerProcess) -> None:
        await self._pause_before_restart(f"worker-{worker.index}")
        await worker.stop()
        fresh = self._worker_process(worker.index)
        self.workers[worker.index] = fresh
        try:
            await fresh.start()
        except Exception:  # noqa: BLE001 - retried: the exit handler schedules it again
            log.exception("worker %d failed to start", worker.index)
            self._later(self._replace_worker(fresh))
            return
        self._failures[f"worker-{worker.index}"] = 0
        await self._replay_uploads(fresh)
        self.metrics.workers_alive.set(sum(w.ready for w in self.workers))
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
        await self._pause_before_restart(f"inference-{gpu}")
        process = self._inference_process(gpu)
        self.inference[gpu] = process
        try:
            await process.start()
        except Exception:  # noqa: BLE001
            log.exception("the inference process of GPU %d failed to start", gpu)
            self._later(self._restart_gpu(gpu))
            return
        self._failures[f"inference-{gpu}"] = 0
        for worker in mine:
            unlink_ring(worker.spec.ring_name)
            self._later(self._replace_worker(worker))

    # ------------------------------------------------------------------ asking workers
    def live_workers(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.ready]

    async def ask_all(self, method: str, path: str, **kwargs: Any
                      ) -> list[tuple[WorkerProcess, int, bytes, dict[str, str]]]:
        """The same request to every live worker; one that fails to answer is left out."""
        workers = self.live_workers()
        answers = await asyncio.gather(*(w.request(method, path, **kwargs) for w in workers),
                                       return_exceptions=True)
        return [(w, *a) for w, a in zip(workers, answers, strict=True)
                if not isinstance(a, BaseException)]

    async def loads(self) -> list[WorkerLoad]:
        out = []
        for worker, status, body, _ in await self.ask_all("GET", "/healthz"):
            if status != 200:
                continue
            health = json.loads(body)
            counts = {}
            for motion, prefix in ((False, ""), (True, "motion_")):
                sessions = {int(k): v for k, v in health[f"{prefix}sessions_by_size"].items()}
                # Offers placed here and not yet answered, less those the worker already
                # counts (created, their answer on its way): none is counted twice.
                answering = {int(k): v for k, v in
                             health[f"{prefix}answering_by_size"].items()}
                for (size, m), placed in self._reserved[worker.index].items():
                    if m == motion:
                        sessions[size] = sessions.get(size, 0) + \
                            max(0, placed - answering.get(size, 0))
                counts[motion] = sessions
            capacity = {int(k): v for k, v in health["capacity_fps_by_size"].items()}
            capacity[NO_PICTURE] = health["motion_capacity_fps"]
            out.append(WorkerLoad(worker.index, worker.spec.gpu, counts[False], capacity,
                                  motion=counts[True], loop_load=health["loop_load"],
                                  settled_cost=health["settled_cost"],
                                  loop_idle=health["loop_idle"],
                                  loop_unit=health["loop_unit"]))
        return out

    async def _replay_uploads(self, worker: WorkerProcess) -> None:
        for upload in list(self._uploads.values()):
            try:
                await worker.request("POST", "/avatars", **upload)
            except OSError as exc:
                log.warning("worker %d: replaying an avatar upload failed: %s",
                            worker.index, exc)

    def forget_upload(self, avatar_id: str) -> None:
        self._uploads.pop(avatar_id, None)

    def remember_upload(self, avatar_id: str, upload: dict[str, Any]) -> None:
        """Kept so a replacement worker knows the avatars its predecessor knew."""
        self._uploads[avatar_id] = upload
        self._uploads.move_to_end(avatar_id)
        while len(self._uploads) > self.settings.avatar.max_avatars:
            self._uploads.popitem(last=False)

    async def _learn_host_cost(self, interval: float = 1.0) -> None:
        """Feeds the host's cost model each second, whether or not offers come: offers
        come in bursts, so a model fed only at an offer never sees a burst's sessions
        settled, and the next burst would be charged the prior again."""
        while True:
            await asyncio.sleep(interval)
            loads = await self.loads()
            self.host_model.observe(self.cores_busy.value,
                                    sum(load.media_cost for load in loads),
                                    sum(load.settled_cost for load in loads))

    # ------------------------------------------------------------------ calibration
    def is_calibration_peer(self, request: web.Request) -> bool:
        return secrets.compare_digest(request.headers.get(TOKEN_HEADER, ""),
                                      self._calibration_token)

    async def _calibrate(self) -> None:
        """Measures what a session costs this host before taking clients' sessions
        (``server.client.calibration``); on any failure the prior stands, and the server serves."""
        prior = self.host_model.unit
        try:
            self.calibration = await asyncio.wait_for(self._measure_session_cost(),
                                                      CALIBRATION_TIMEOUT_S)
        except (CalibrationFailed, TimeoutError, OSError, ValueError) as exc:
            reason = str(exc) or f"not done within {CALIBRATION_TIMEOUT_S:g} s"
            self.calibration = {"error": reason}
            log.warning("start-up calibration failed (%s): a 256x256 session is taken to "
                        "cost %.3f cores (session.cores_per_session) until measured",
                        reason, prior)
        else:
            log.info("start-up calibration: %d sessions at %dx%d, %.3f cores a 256x256 "
                     "session (the prior was %.3f), %.2f cores idle, %.1f fps at least",
                     self.calibration["sessions"], self.settings.video.size,
                     self.settings.video.size, self.calibration["cores_per_session"], prior,
                     self.calibration["idle_cores"], self.calibration["fps_min"])
        finally:
            self.calibrating = False

    def session_capacity(self, loads: list[WorkerLoad]) -> int:
        """Sessions at the default frame side that the engines' measured capacity admits
        (``session.max_engine_load``), at most ``session.max_sessions``."""
        s, video = self.settings.session, self.settings.video
        return min(s.max_sessions, int(sum(c * s.max_engine_load // video.fps for c in
                                           gpu_capacity_fps(loads, video.size).values())))

    def _calibration_sessions(self, loads: list[WorkerLoad]) -> int:
        """As set, or a quarter of what the prior and the engine would admit: enough for
        a reading well above the idle server's noise, few enough for any host to carry;
        never more than ``session.max_sessions``."""
        s = self.settings.session
        prior = self.cores * s.max_host_load / (s.cores_per_session
                                                * session_cost(self.settings.video.size))
        admits = min(prior, self.session_capacity(loads))
        low, high = CALIBRATION_SESSIONS
        wanted = s.calibration_sessions or min(high, max(low, admits // 4))
        return int(min(wanted, s.max_sessions))

    def _peer_plan(self, sessions: int) -> tuple[PeerPlan, dict[str, str]]:
        """Where the calibration's peers reach this server, and what they must send."""
        http = self.settings.http
        host = "127.0.0.1" if http.host in ("", "0.0.0.0", "::") else http.host
        host = f"[{host}]" if ":" in host else host
        headers = {TOKEN_HEADER: self._calibration_token}
        if http.api_keys:
            headers["Authorization"] = f"Bearer {http.api_keys[0]}"
        if http.allowed_hosts:
            headers["Host"] = http.allowed_hosts[0]
        # Long enough for the last answered to settle and be measured with the first.
        seconds = 3 * SETTLED_S + MEASURE_S
        return PeerPlan(f"http://{host}:{http.port}", sessions, seconds,
                        list(self.settings.ice.host_addresses)), headers

    async def _measure_session_cost(self) -> dict[str, Any]:
        """Idle cores, then ``_calibration_sessions`` real sessions' cores once all have
        settled, from the CPU time of the server's processes (not their peers')."""
        size = self.settings.video.size
        sessions = self._calibration_sessions(await self.loads())
        idle = await cores_used(self.pids, IDLE_S)
        plan, headers = self._peer_plan(sessions)
        peers = await asyncio.create_subprocess_exec(
            *plan.command(), env={**os.environ, HEADERS_ENV: json.dumps(headers)},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            cost = sessions * session_cost(size)
            while True:
                loads = await self.loads()
                if sum(load.settled_cost for load in loads) >= cost - 1e-9:
                    break
                if peers.returncode is not None:
                    _, err = await peers.communicate()
                    raise CalibrationFailed(f"its peers ended before their {sessions} "
                                            f"sessions had settled: {err.decode()[-500:]}")
                await asyncio.sleep(0.25)
            busy = await cores_used(self.pids, MEASURE_S)
            if sum(load.settled_cost for load in await self.loads()) < cost - 1e-9:
                raise CalibrationFailed("sessions ended while they were measured")
            out, err = await peers.communicate()
        finally:
            if peers.returncode is None:
                peers.kill()
                await peers.wait()
        if peers.returncode != 0:
            raise CalibrationFailed(f"its peers failed: {err.decode()[-500:]}")
        fps = json.loads(out)["video_fps"]
        if min(fps) < 24:
            log.warning("start-up calibration: the host carried %d sessions at %.1f fps at "
                        "least, below 24: what they cost is a floor", sessions, min(fps))
        unit = max(0.001, (busy - idle) / cost)
        self.host_model.calibrate(idle, unit)
        while sum(load.count for load in await self.loads()):  # the peers have hung up
            await asyncio.sleep(0.1)
        return {"sessions": sessions, "size": size, "cores_per_session": round(unit, 4),
                "idle_cores": round(idle, 3), "busy_cores": round(busy, 3),
                "fps_min": round(min(fps), 2)}

    @contextlib.asynccontextmanager
    async def placed(self, size: int, motion_only: bool = False
                     ) -> AsyncIterator[WorkerProcess]:
        """A worker for a new session, its place reserved while the offer is answered
        there; raises ``Refused``."""
        async with self._placing:
            loads = await self.loads()
            host = HostLoad(self.cores, self.cores_busy.value, self.host_model.idle,
                            self.host_model.unit)
            index = place(loads, size, self.limits, motion_only=motion_only, host=host)
            self._reserved[index][size, motion_only] += 1
        try:
            yield self.workers[index]
        finally:
            self._reserved[index][size, motion_only] -= 1


front_door_key: web.AppKey[FrontDoor] = web.AppKey("front_door", FrontDoor)


def _door(request: web.Request) -> FrontDoor:
    return request.app[front_door_key]


def _worst(answers: list[tuple[WorkerProcess, int, bytes, dict[str, str]]]
           ) -> tuple[int, bytes, dict[str, str]]:
    """Of the same request to every worker, the answer with the highest status: each must
    have succeeded for the whole to have (an avatar is needed on every worker)."""
    if not answers:
        fail(502, "worker_unavailable", "no media worker answered")
    return max(answers, key=lambda a: a[1])[1:]


#: A worker's answer headers that the front door passes on.
RELAYED_HEADERS = frozenset({"content-type", "retry-after", "www-authenticate", "location",
                             "link", "allow", "accept-post", "x-session-id", "x-viewer-token"})


def _relay(status: int, body: bytes, headers: dict[str, str]) -> web.Response:
    kept = {k: v for k, v in headers.items() if k.lower() in RELAYED_HEADERS}
    return web.Response(status=status, body=body, headers=kept)


async def _outgoing(request: web.Request) -> dict[str, Any]:
    """The request's body, query and content type, to send on to a worker."""
    return {"data": await read_body(request, request.read()),
            "params": dict(request.rel_url.query),
            "headers": {"Content-Type": request.headers.get("Content-Type",
                                                            "application/octet-stream"),
                        **_credentials(request)}}


def _credentials(request: web.Request) -> dict[str, str]:
    """The caller's API key, for the worker to check and to know whose sessions to show."""
    key = request.headers.get("Authorization")
    return {"Authorization": key} if key else {}


async def _forward(worker: WorkerProcess, request: web.Request) -> web.Response:
    try:
        return _relay(*await worker.request(request.method, request.rel_url.path,
                                            **await _outgoing(request)))
    except OSError as exc:
        fail(502, "worker_unavailable", f"media worker {worker.index} did not answer: {exc}")


def _any_worker(request: web.Request) -> WorkerProcess:
    live = _door(request).live_workers()
    if not live:
        at_capacity("no media worker is running (one is being replaced)")
    return live[0]


@routes.get("/")
async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


@routes.get("/kiosk")
async def kiosk(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "kiosk.html")


@routes.get("/config")
async def config(request: web.Request) -> web.Response:
    return web.json_response(config_body(_door(request).settings))


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    door = _door(request)
    loads = await door.loads()
    settings = door.settings
    size = settings.video.size
    fps = settings.video.fps
    workers = {load.index: load for load in loads}
    gpu_loads = engine_loads(loads, fps)
    status = "calibrating" if door.calibrating else "ok" if loads else "starting"
    return web.json_response({
        "status": status,
        "sessions": sum(load.count for load in loads),
        "motion_sessions": sum(load.motion_count for load in loads),
        "model": door.manifest.name,
        "runtime": door.runtime,
        "runtime_verified": door.runtime in VERIFIED,
        "capacity_fps": round(sum(gpu_capacity_fps(loads, size).values()), 1),
        "motion_capacity_fps": round(sum(gpu_capacity_fps(loads, NO_PICTURE).values()), 1),
        "session_capacity": door.session_capacity(loads),
        # The busiest GPU's share of its engine's capacity (one GPU: as a single server).
        "engine_load": round(max(gpu_loads.values(), default=0.0), 3),
        "engine_load_by_gpu": {str(g): round(v, 3) for g, v in gpu_loads.items()},
        # The server's processes: cores busy (measured each second) of the cores it has.
        "cores": door.cores,
        "cores_busy": round(door.cores_busy.value, 2),
        "cores_per_session": round(door.host_model.unit, 4),  # per 256x256, as measured
        "calibration": door.calibration,  # at start-up (server.client.calibration)
        "frame_size": size,
        "workers": [{"index": w.index, "gpu": w.spec.gpu, "pid": w.pid, "ready": w.ready,
                     "sessions": workers[w.index].count if w.index in workers else None,
                     "motion_sessions": workers[w.index].motion_count
                     if w.index in workers else None,
                     "loop_load": workers[w.index].loop_load if w.index in workers else None,
                     # per 256x256 session, as its loop has measured
                     "loop_unit": workers[w.index].loop_unit if w.index in workers else None}
                    for w in door.workers],
        "inference": [{"gpu": g, "pid": p.pid, "alive": p.alive, "max_batch": p.max_batch}
                      for g, p in enumerate(door.inference)],
    }, status=503 if door.calibrating else 200,
        headers={"Retry-After": str(RETRY_AFTER_S)} if door.calibrating else None)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """The front door's own metrics (engine batches, placement, restarts) and every
    worker's (sessions, frames, delays), each sample labelled with its ``process``."""
    door = _door(request)
    request.app[access_key].caller(request)
    sources = [("front-door", door.metrics.render().decode())]
    sources += [(f"worker-{worker.index}", body.decode())
                for worker, status, body, _ in await door.ask_all(
                    "GET", "/metrics", headers=_credentials(request))
                if status == 200]
    return web.Response(body=merge_expositions(sources), headers={"Content-Type": CONTENT_TYPE})


def _holder(request: web.Request, session_id: object) -> WorkerProcess:
    """The worker whose session ids start as ``session_id`` does, or 404."""
    for worker in _door(request).live_workers():
        if isinstance(session_id, str) and session_id.startswith(worker_prefix(worker.index)):
            return worker
    fail(404, "unknown_session", f"no live session {session_id!r}")


@routes.post("/offer")
async def offer(request: web.Request) -> web.Response:
    require_json(request)
    body = parse_json_object(await read_body(request, request.read()))
    if body.get("session_id") is not None:  # a viewer of a session that exists
        return await _forward(_holder(request, body["session_id"]), request)
    return await _place(request, body)


@routes.post("/sessions")
async def create_session(request: web.Request) -> web.Response:
    require_json(request)
    body = parse_json_object(await read_body(request, request.read()))
    name = body.get("name")
    if isinstance(name, str) and name and "/" not in name:  # the worker checks its form
        statuses = [status for _, status, _, _ in
                    await _door(request).ask_all("GET", f"/names/{quote(name)}")]
        if any(status != 404 for status in statuses):
            fail(409, "name_taken", f"a live session is already called {name!r}")
    return await _place(request, body)


@routes.get("/names/{name}")
async def find_name(request: web.Request) -> web.Response:
    """Whichever worker holds the named session answers; a wrong token is 403."""
    answers = await _door(request).ask_all("GET", request.rel_url.path_qs)
    for status in (200, 403):
        for _, answer_status, answer, headers in answers:
            if answer_status == status:
                return _relay(answer_status, answer, headers)
    fail(404, "unknown_name", f"no live session is called {request.match_info['name']!r}")


@routes.post("/sessions/{session_id}/speech")
async def push_speech(request: web.Request) -> web.Response:
    """Streamed on to the worker as it arrives, so backpressure reaches the producer."""
    worker = _holder(request, request.match_info["session_id"])
    try:
        return _relay(*await worker.request(
            "POST", request.rel_url.path, data=request.content,
            headers={"Content-Type": request.headers.get("Content-Type", ""),
                     **_credentials(request)},
            timeout=aiohttp.ClientTimeout(total=None)))
    except OSError as exc:
        fail(502, "worker_unavailable", f"media worker {worker.index} did not answer: {exc}")


@routes.get("/sessions/{session_id}/events")
async def session_events(request: web.Request) -> web.StreamResponse:
    """The holding worker's event stream, relayed as it comes."""
    worker = _holder(request, request.match_info["session_id"])
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    try:
        async with worker.stream(request.rel_url.path, _credentials(request)) as upstream:
            if upstream.status != 200:
                return _relay(upstream.status, await upstream.read(), dict(upstream.headers))
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
    except (OSError, aiohttp.ClientError) as exc:
        if not response.prepared:
            fail(502, "worker_unavailable", f"media worker {worker.index} did not answer: "
                 f"{exc}")
    return response  # the worker's stream ended (its session did) or the worker went


@routes.get("/sessions/{session_id}/ws")
async def session_socket(request: web.Request) -> web.StreamResponse:
    """The client's WebSocket joined to one with the holding worker, message for message."""
    worker = _holder(request, request.match_info["session_id"])
    async with contextlib.AsyncExitStack() as stack:
        try:
            upstream = await stack.enter_async_context(
                worker.websocket(request.rel_url.path, _credentials(request)))
        except aiohttp.WSServerHandshakeError as exc:
            fail(exc.status, "websocket_refused", f"the session's worker refused: "
                 f"{exc.message}")
        except (OSError, aiohttp.ClientError) as exc:
            fail(502, "worker_unavailable", f"media worker {worker.index} did not answer: "
                 f"{exc}")
        ws = web.WebSocketResponse(max_msg_size=1 << 20)
        await ws.prepare(request)

        async def pump(source: Any, sink: Any) -> None:
            async for message in source:
                if message.type == aiohttp.WSMsgType.TEXT:
                    await sink.send_str(message.data)
                elif message.type == aiohttp.WSMsgType.BINARY:
                    await sink.send_bytes(message.data)
            await sink.close()

        tasks = [asyncio.create_task(pump(ws, upstream)), asyncio.create_task(pump(upstream, ws))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return ws


@routes.post("/sessions/{session_id}/interrupt")
async def interrupt(request: web.Request) -> web.Response:
    return await _forward(_holder(request, request.match_info["session_id"]), request)


routes.options("/whip")(sdp_endpoint_options)  # the same answer as a worker's


@routes.post("/whip")
async def whip_publish(request: web.Request) -> web.Response:
    """A WHIP publisher: placed like any new session (its size is a query parameter)."""
    return await _place(request, {"size": request.rel_url.query.get("size")})


@routes.route("*", "/whip/{session_id}")
@routes.route("*", "/sessions/{session_id}/whep")
@routes.route("*", "/sessions/{session_id}/whep/{viewer_id}")
async def held_resource(request: web.Request) -> web.Response:
    """A WHIP session's resource, a session's WHEP endpoint and its viewers: the worker
    holding the session answers."""
    return await _forward(_holder(request, request.match_info["session_id"]), request)


async def _place(request: web.Request, body: dict[str, Any]) -> web.Response:
    """A new session, on the worker placement picks (``POST /offer``, ``POST /sessions``,
    ``POST /whip``)."""
    door = _door(request)
    request.app[access_key].caller(request)  # no place is held for a caller without a key
    if door.calibrating and not door.is_calibration_peer(request):
        at_capacity("the server is measuring what a session costs on this host before it "
                    "takes sessions; retry in a few seconds", error="calibrating")
    options = body.get("options")
    options = options if isinstance(options, dict) else {}  # the worker names the problem
    size = options.get("size", body.get("size", door.settings.video.size))
    if isinstance(size, str) and size.isdigit():
        size = int(size)
    if size not in door.settings.video.allowed_sizes:
        size = door.settings.video.size  # the worker names the problem
    try:
        async with door.placed(int(size), options.get("motion_only") is True) as worker:
            response = await _forward(worker, request)
    except Refused as exc:
        door.metrics.admissions.labels(decision="refused").inc()
        at_capacity(str(exc))
    door.metrics.admissions.labels(decision="placed" if response.status in (200, 201)
                                   else f"worker_{response.status}").inc()
    return response


@routes.get("/sessions")
async def list_sessions(request: web.Request) -> web.Response:
    request.app[access_key].caller(request)
    sessions = []
    for worker, status, body, _ in await _door(request).ask_all(
            "GET", "/sessions", headers=_credentials(request)):
        if status == 200:
            sessions += [{**s, "worker": worker.index} for s in json.loads(body)["sessions"]]
    return web.json_response({"sessions": sessions})


@routes.route("*", "/sessions/{session_id}")
async def one_session(request: web.Request) -> web.Response:
    """Whichever worker holds it answers; the others say 404."""
    answers = await _door(request).ask_all(request.method, request.rel_url.path,
                                           **await _outgoing(request))
    for _, status, answer, answer_headers in answers:
        if status != 404:
            return _relay(status, answer, answer_headers)
    if answers:
        return _relay(*answers[0][1:])
    fail(404, "unknown_session", f"no live session {request.match_info['session_id']!r}")


@routes.get("/avatars")
async def list_avatars(request: web.Request) -> web.Response:
    return await _forward(_any_worker(request), request)


@routes.get("/avatars/{avatar_id}")
async def get_avatar(request: web.Request) -> web.Response:
    return await _forward(_any_worker(request), request)


@routes.get("/avatars/{avatar_id}/image")
async def avatar_image(request: web.Request) -> web.Response:
    return await _forward(_any_worker(request), request)


@routes.post("/avatars")
async def upload_avatar(request: web.Request) -> web.Response:
    """Every worker prepares the portrait (its sessions need it in the engine); the id is
    the content's hash, so it is the same on each."""
    door = _door(request)
    if not door.live_workers():
        at_capacity("no media worker is running (one is being replaced)")
    upload = await _outgoing(request)
    status, answer, headers = _worst(await door.ask_all("POST", "/avatars", **upload))
    if status == 201:
        door.remember_upload(json.loads(answer)["avatar_id"], upload)
    return _relay(status, answer, headers)


@routes.delete("/avatars/{avatar_id}")
async def delete_avatar(request: web.Request) -> web.Response:
    """Every worker forgets it, and a replaced worker is not taught it again."""
    door = _door(request)
    status, answer, headers = _worst(await door.ask_all("DELETE", request.rel_url.path,
                                                       **await _outgoing(request)))
    if status == 204:
        door.forget_upload(request.match_info["avatar_id"])
    return _relay(status, answer, headers)


def create_front_door(settings: Settings) -> web.Application:
    app = web.Application(client_max_size=settings.http.max_body_bytes,
                          middlewares=[cors(settings.http.cors_origins), json_errors,
                                       host_check(allowed_hosts(settings.http))])
    app.add_routes(routes)
    app.router.add_static("/static/", STATIC_DIR)
    door = FrontDoor(settings)
    app[front_door_key] = door
    app[settings_key] = settings
    app[metrics_key] = door.metrics
    app[access_key] = Access(settings.http)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        try:
            await door.start()
            log.info("ready: %d media worker(s), model %s on %s", len(door.workers),
                     door.manifest.name, door.runtime)
            yield
        finally:
            await door.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
