"""Builds the aiohttp application: engine, scheduler, avatars and sessions, in that order."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import cv2
import numpy as np
from aiohttp import web

from inference.engine import FrameInput, Manifest
from inference.features import log_mel
from inference.runtimes import VERIFIED, resolve_runtime
from inference.service import Inference, start_inline
from server.config import Settings
from server.costs import LOOP_SHARE
from server.engine_settings import check_model, inference_config
from server.http.access import Access
from server.http.app_keys import access_key, metrics_key, settings_key
from server.http.common import STATIC_DIR
from server.http.middleware import middlewares
from server.load import LoopLoad
from server.media.avatars import DEFAULT_AVATAR, AvatarStore
from server.media.encoding import use_realtime_vp8, vp8_tuning
from server.media.peer import pin_host_addresses
from server.media.ports import bind_udp_in_range
from server.media.sessions import SessionManager
from server.metrics import Metrics
from server.worker.api import add_routes
from server.worker.state import ServerState, state_key

log = logging.getLogger(__name__)


def _warm_features(manifest: Manifest) -> None:
    """Build the model's mel tables before the first session needs them."""
    log_mel(np.zeros(manifest.features.n_fft, np.float32), manifest.features)


async def _warm_up(state: ServerState) -> None:
    """Load the default avatar and run the engine once per allowed size, so the first
    session meets a warm engine and the scheduler starts with a runtime estimate."""
    log.info("preparing the default avatar")
    await state.avatars.load_default()
    manifest = state.manifest
    silence = np.full((manifest.window_frames, manifest.features.n_mels),
                      np.log10(manifest.features.floor), np.float32)
    batches = sorted({1, 2, state.inference.max_batch})
    for size in state.settings.video.allowed_sizes:
        log.info("warming the engine at %dx%d", size, size)
        handle = await state.avatars.acquire(DEFAULT_AVATAR, size)
        try:
            frame = FrameInput.for_frame(handle.slot, 0, manifest.fps, silence,
                                         manifest.knob_vector({}), 0.0)
            for batch in batches:
                await state.inference.warm_up([frame] * batch)
            if size == state.settings.video.size and state.settings.session.max_motion_sessions:
                log.info("warming the engine's motion-only path")
                for batch in batches:
                    await state.inference.warm_up([frame] * batch, picture=False)
        finally:
            state.avatars.release(handle)


def _freeze_startup_objects() -> None:
    """Keep what start-up made (aiortc, PyAV, the model's tables: some 100,000s of objects)
    out of every later garbage collection. A full collection over them stopped the
    event loop for 140-165 ms, so a session connecting then took in a burst of audio that
    stayed in its buffer as extra delay (measured: 130 -> 290 ms pipeline delay)."""
    gc.collect()
    gc.freeze()


Connect = Callable[[Settings, Metrics], Awaitable[Inference]]


async def connect_inline(settings: Settings, metrics: Metrics) -> Inference:
    """The shared scheduler and the engine on a thread of this process."""
    config = inference_config(settings, resolve_runtime(settings.engine.runtime))
    return await start_inline(config, on_batch=metrics.on_batch, on_drop=metrics.on_drop)


def create_app(settings: Settings, *, connect: Connect = connect_inline,
               runtime: str | None = None, id_prefix: str = "",
               behind_door: bool = False) -> web.Application:
    """One whole server, or one media worker of many (``behind_door``: it then also
    answers the front door's internal routes): ``connect`` gives it its inference (by
    default the engine on a thread of this process); ``runtime`` is the one the engine
    runs on, where the front door resolved it; ``id_prefix`` starts its session ids."""
    app = web.Application(client_max_size=settings.http.max_body_bytes,
                          middlewares=middlewares(settings.http, entry=not behind_door))
    add_routes(app, internal=behind_door)
    app.router.add_static("/static/", STATIC_DIR)
    metrics = Metrics()
    app[settings_key] = settings
    app[metrics_key] = metrics
    app[access_key] = Access(settings.http)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        pin_host_addresses(settings.ice.host_addresses)
        if settings.ice.udp_ports:
            bind_udp_in_range(asyncio.get_running_loop(), *settings.ice.udp_ports)
        use_realtime_vp8(vp8_tuning(settings.video))
        # One frame's colour conversion is too small to share out: OpenCV's thread pool
        # then spins a thread per core for each frame, in every worker at once.
        cv2.setNumThreads(1)
        resolved = runtime or resolve_runtime(settings.engine.runtime)
        log.info("loading %s on %s%s", settings.manifest_path.name, resolved,
                 "" if resolved in VERIFIED else " (UNVERIFIED runtime)")
        manifest = Manifest.load(settings.manifest_path)
        check_model(settings, manifest)
        inference = await connect(settings, metrics)
        avatars = AvatarStore(inference, settings.avatar, settings.video.allowed_sizes)
        sessions = SessionManager(settings, manifest, inference, avatars, metrics, id_prefix,
                                  runtime=resolved)
        loop_load = LoopLoad(settings.session.cores_per_session * LOOP_SHARE)
        state = ServerState(settings, resolved, manifest, inference, avatars, sessions, metrics,
                            loop_load)
        app[state_key] = state
        meter = asyncio.get_running_loop().create_task(state.loop_load.run(
            lambda: (sessions.media_cost(loop=True), sessions.settled_cost(loop=True))))
        try:
            log.info("warming the audio features")
            await asyncio.to_thread(_warm_features, manifest)
            await _warm_up(state)
            _freeze_startup_objects()
            log.info("ready: model %s on %s, capacity %.0f frames/s at %dx%d", manifest.name,
                     resolved, inference.capacity_fps(settings.video.size),
                     settings.video.size, settings.video.size)
            yield
            await sessions.close_all()
        finally:
            meter.cancel()
            await inference.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
