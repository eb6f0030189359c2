"""A media worker's process: the WebRTC peers, audio, features and video encoding of its
sessions.

The front door starts one per few cores (``server.worker.handle``). Each serves the same
HTTP API as a single server, and the front door's internal routes, on a Unix socket only
the front door talks to, and sends its frames to the inference process of its GPU
through a shared ring (``inference.process``): the sessions of every worker on that GPU
share one scheduler and so one batch.
"""

from __future__ import annotations

import logging
import os
from multiprocessing.connection import Connection

from aiohttp import web

from inference.child_process import Ready, until_stopped
from inference.engine import Manifest
from inference.process.client import RemoteInference
from inference.runtimes import GPU_RUNTIMES
from inference.service import Inference
from server.config import Settings
from server.http.serving import JsonErrorAppRunner
from server.metrics import Metrics
from server.worker.app import create_app
from server.worker.handle import WorkerSpec, worker_prefix

log = logging.getLogger(__name__)


async def serve(control: Connection, spec: WorkerSpec) -> None:
    """The worker process: its whole server on the Unix socket, until the front door says
    stop or is gone."""
    for noisy in ("aioice", "aiortc"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    async def connect(settings: Settings, metrics: Metrics) -> Inference:
        inference = RemoteInference(
            Manifest.load(settings.manifest_path), spec.inference_address, spec.authkey,
            pending=spec.ring_pending, max_side=max(settings.video.allowed_sizes),
            motion_pending=spec.ring_motion_pending,
            ring_name=spec.ring_name, on_drop=metrics.on_drop)
        await inference.start()
        return inference

    app = create_app(spec.settings, connect=connect, runtime=spec.runtime,
                     id_prefix=spec.host_prefix + worker_prefix(spec.index), behind_door=True)
    runner = JsonErrorAppRunner(app, access_log=None)  # its own errors in JSON too
    await runner.setup()  # loads, warms up and prepares the default avatar
    if os.path.exists(spec.socket_path):
        os.unlink(spec.socket_path)  # left by a predecessor that died
    await web.UnixSite(runner, spec.socket_path).start()
    control.send(Ready(os.getpid()))
    log.info("worker %d ready, its frames to the inference process %s", spec.index,
             f"of GPU {spec.gpu}" if spec.runtime in GPU_RUNTIMES else "on the CPU")
    await until_stopped(control)
    await runner.cleanup()  # closes its sessions and disconnects from the inference process
