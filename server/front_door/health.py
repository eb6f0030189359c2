"""The whole server's health and metrics, as the front door sees them: every worker's
load and every process's metrics, gathered into one answer."""

from __future__ import annotations

from aiohttp import web

from inference.engine import NO_PICTURE
from inference.runtimes import VERIFIED
from server.front_door.door import front_door_key
from server.front_door.placement import engine_loads, gpu_capacity_fps
from server.front_door.relay import ask_every, credentials
from server.http.app_keys import access_key
from server.http.errors import RETRY_AFTER_S
from server.metrics import CONTENT_TYPE, merge_expositions


async def healthz(request: web.Request) -> web.Response:
    """200 while it takes sessions; 503 with ``Retry-After`` while it calibrates. Answered
    from what the front door last read (each second), never by waiting for a worker."""
    door = request.app[front_door_key]
    loads = door.admission.recent  # as read within the last second: no worker is asked
    settings = door.settings
    size = settings.video.size
    workers = {load.index: load for load in loads}
    gpu_loads = engine_loads(loads, settings.video.fps)
    calibrating = door.calibration.running
    status = "calibrating" if calibrating else "ok" if loads else "starting"
    member = door.member
    return web.json_response({
        "status": status,
        # In a cluster: this host's id and state, and whether Redis answers ("degraded":
        # no, so new sessions are placed on this host alone).
        **({"node": member.node, "state": member.state,
            "cluster": "degraded" if member.degraded else "ok"} if member else {}),
        "sessions": sum(load.count for load in loads),
        "motion_sessions": sum(load.motion_count for load in loads),
        "model": door.manifest.name,
        "runtime": door.runtime,
        # Whether this runtime's frames were ever checked against the reference on real
        # hardware (TensorRT has not been: see inference/runtimes/__init__.py).
        "runtime_verified": door.runtime in VERIFIED,
        "capacity_fps": round(sum(gpu_capacity_fps(loads, size).values()), 1),
        "motion_capacity_fps": round(sum(gpu_capacity_fps(loads, NO_PICTURE).values()), 1),
        # Sessions of the default size the engines hold at full frame rate, within the
        # admission limit: what a load balancer needs.
        "session_capacity": door.admission.session_capacity(loads),
        # The busiest GPU's share of its engine's capacity (one GPU: as a single server).
        "engine_load": round(max(gpu_loads.values(), default=0.0), 3),
        "engine_load_by_gpu": {str(g): round(v, 3) for g, v in gpu_loads.items()},
        # The server's processes: cores busy (measured each second) of the cores it has.
        "cores": door.cores,
        "cores_busy": round(door.cores_busy.value, 2),
        "cores_per_session": round(door.admission.host_model.unit, 4),  # per 256x256
        "calibration": door.calibration.result,  # measured at start-up
        "frame_size": size,
        "workers": [{"index": w.index, "gpu": w.spec.gpu, "pid": w.pid, "ready": w.ready,
                     "sessions": workers[w.index].count if w.index in workers else None,
                     "motion_sessions": workers[w.index].motion_count
                     if w.index in workers else None,
                     "loop_load": workers[w.index].loop_load if w.index in workers else None,
                     # per 256x256 session, as its loop has measured
                     "loop_unit": workers[w.index].loop_unit if w.index in workers else None}
                    for w in door.processes.workers],
        "inference": [{"gpu": g, "pid": p.pid, "alive": p.alive, "max_batch": p.max_batch}
                      for g, p in enumerate(door.processes.inference)],
    }, status=503 if calibrating else 200,
        headers={"Retry-After": str(RETRY_AFTER_S)} if calibrating else None)


async def metrics(request: web.Request) -> web.Response:
    """The front door's own metrics (engine batches, placement, restarts) and every
    worker's (sessions, frames, delays), each sample labelled with its ``process``."""
    door = request.app[front_door_key]
    request.app[access_key].caller(request)
    sources = [("front-door", door.metrics.render().decode())]
    sources += [(f"worker-{worker.index}", body.decode())
                for worker, status, body, _ in await ask_every(
                    door.processes.live_workers(), "GET", "/metrics",
                    headers=credentials(request))
                if status == 200]
    return web.Response(body=merge_expositions(sources), headers={"Content-Type": CONTENT_TYPE})


HANDLERS = {"healthz": healthz, "metrics": metrics}
