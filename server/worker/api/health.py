"""How the worker is doing: its load for the front door (``GET /internal/load``), and,
when it serves alone, the public health and metrics of the whole server."""

from __future__ import annotations

from aiohttp import web

from inference.engine import NO_PICTURE
from inference.runtimes import VERIFIED
from server.http.errors import fail
from server.metrics import CONTENT_TYPE
from server.worker.api.context import caller, state
from server.worker.report import WorkerReport
from server.worker.state import ServerState

#: A session sending fewer fresh frames than this share of video.fps counts as degraded.
DEGRADED_BELOW = 0.96


def report(s: ServerState) -> WorkerReport:
    sessions = s.sessions
    sizes = [*s.settings.video.allowed_sizes, NO_PICTURE]
    return WorkerReport(
        sessions=sessions.count_by_size(), answering=sessions.count_by_size(answering=True),
        motion=sessions.count_by_size(motion_only=True),
        motion_answering=sessions.count_by_size(answering=True, motion_only=True),
        capacity_fps={size: round(s.inference.capacity_fps(size), 1) for size in sizes},
        loop_load=round(s.loop_load.value, 3), settled_cost=round(sessions.settled_cost(), 3),
        loop_idle=round(s.loop_load.model.idle, 4), loop_unit=round(s.loop_load.model.unit, 4),
        names=sessions.names())


async def load(request: web.Request) -> web.Response:
    """The front door's reading of this worker (internal)."""
    return web.Response(text=report(state(request)).to_json(), content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    """The whole server's health, when this process is the whole server."""
    s = state(request)
    size, fps = s.settings.video.size, s.settings.video.fps
    load = report(s)
    return web.json_response({
        "status": "ok",
        "sessions": sum(load.sessions.values()),
        "motion_sessions": sum(load.motion.values()),
        "model": s.manifest.name,
        "runtime": s.runtime,
        # Whether this runtime's frames were ever checked against the reference on real
        # hardware (TensorRT has not been: see inference/runtimes/__init__.py).
        "runtime_verified": s.runtime in VERIFIED,
        "capacity_fps": load.capacity_fps[size],
        "motion_capacity_fps": load.capacity_fps[NO_PICTURE],
        # Sessions of the default size this engine holds at full frame rate, within the
        # admission limit: what a load balancer needs.
        "session_capacity": int(load.capacity_fps[size] * s.settings.session.max_engine_load
                                // fps),
        "engine_load": round(s.sessions.engine_load(), 3),
        "frame_size": size,
        "loop_load": load.loop_load,
    })


async def metrics(request: web.Request) -> web.Response:
    caller(request)
    s = state(request)

    def refresh() -> None:
        s.metrics.engine_load.set(s.sessions.engine_load())
        s.metrics.sessions_degraded.set(
            s.sessions.degraded(DEGRADED_BELOW * s.settings.video.fps))
        for size in s.settings.video.allowed_sizes:
            s.metrics.capacity_fps.labels(size=str(size)).set(s.inference.capacity_fps(size))

    return web.Response(body=s.metrics.render(refresh), headers={"Content-Type": CONTENT_TYPE})


async def cluster(request: web.Request) -> web.Response:
    """A server that runs alone is no cluster (``cluster.redis_url`` needs the front door)."""
    caller(request)
    return web.json_response({"node": None, "cluster": False, "nodes": []})


async def drain(request: web.Request) -> web.Response:
    caller(request)
    fail(409, "not_clustered", "this server is not in a cluster (cluster.redis_url)")


HANDLERS = {"healthz": healthz, "metrics": metrics, "cluster": cluster, "drain": drain}
INTERNAL = [("GET", "/internal/load", load)]
