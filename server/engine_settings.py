"""The engine as the settings ask for it, for the front door (which starts the inference
processes) and a server running alone (which runs the engine itself): the checks only the
loaded model can make, and the shared scheduler's configuration."""

from __future__ import annotations

from inference.engine import Manifest
from inference.service import InferenceConfig
from server.config import ConfigError, Settings


def check_model(settings: Settings, manifest: Manifest) -> None:
    """Settings that only the loaded model can check: its frame rate, sizes and latency."""
    if settings.video.fps != manifest.fps:
        raise ConfigError(f"video.fps={settings.video.fps} but {manifest.name} renders at "
                          f"{manifest.fps} fps")
    unsupported = sorted(set(settings.video.allowed_sizes) - set(manifest.portrait_sizes))
    if unsupported:
        raise ConfigError(f"video.allowed_sizes has {unsupported}: {manifest.name} is made for "
                          f"{', '.join(map(str, manifest.portrait_sizes))}")
    needed_ms = 1000 * manifest.frame_latency_s + 20  # + one timeline chunk
    if settings.session.pipeline_delay_ms < needed_ms + 10:
        raise ConfigError(
            f"session.pipeline_delay_ms={settings.session.pipeline_delay_ms} leaves no time "
            f"to render: {manifest.name} needs its audio {needed_ms:.0f} ms after a frame "
            f"starts; give at least {needed_ms + 10:.0f} ms")


def inference_config(settings: Settings, runtime: str, device: int | None = None
                     ) -> InferenceConfig:
    """The shared scheduler and engine as the settings ask, on ``runtime``."""
    opts = {"intra_op_threads": settings.engine.intra_op_threads} \
        if runtime == "onnxruntime" else {}
    return InferenceConfig(runtime, str(settings.manifest_path), opts,
                           settings.scheduler.max_batch, settings.scheduler.max_wait_ms,
                           max_pending=4 * (settings.session.max_sessions
                                            + settings.session.max_motion_sessions) + 8,
                           device=device)
