"""Prometheus metrics of one server instance, on a registry of its own (no globals)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: N811
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

DELAY_BUCKETS = (0.04, 0.06, 0.08, 0.1, 0.12, 0.14, 0.16, 0.18, 0.2, 0.25, 0.3, 0.4, 0.6, 1.0)
OFFSET_BUCKETS = (-0.08, -0.04, -0.02, -0.01, -0.005, 0.0, 0.005, 0.01, 0.02, 0.04, 0.08)
ENGINE_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions_active = Gauge("sonic_sessions_active", "Live sessions", registry=r)
        self.sessions_total = Counter("sonic_sessions", "Sessions created", registry=r)
        self.sessions_closed = Counter("sonic_sessions_closed", "Sessions closed, by reason",
                                       ["reason"], registry=r)
        self.frames_sent = Counter("sonic_video_frames_sent", "Video frames sent", registry=r)
        self.frames_encoded = Counter(
            "sonic_video_frames_encoded",
            "Video frames encoded: once per frame of a session, however many watch it",
            registry=r)
        self.frames_repeated = Counter(
            "sonic_video_frames_repeated",
            "Video frames repeated because the next one was not ready on time", registry=r)
        self.frames_skipped = Counter(
            "sonic_video_frames_skipped",
            "Video frame times passed without a send (the worker's loop fell behind)",
            registry=r)
        self.frames_dropped = Counter("sonic_scheduler_frames_dropped",
                                      "Frame requests dropped by the scheduler, by reason",
                                      ["reason"], registry=r)
        self.batch_size = Histogram("sonic_engine_batch_size", "Frames per engine call",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.batch_seconds = Histogram("sonic_engine_batch_seconds", "Engine call duration",
                                       buckets=ENGINE_BUCKETS, registry=r)
        self.pipeline_delay = Histogram(
            "sonic_pipeline_delay_seconds", "Audio in (arrival) to video frame out",
            buckets=DELAY_BUCKETS, registry=r)
        self.av_offset = Histogram(
            "sonic_av_offset_seconds",
            "Video minus audio send-time offset for the same media time", buckets=OFFSET_BUCKETS,
            registry=r)
        self.http_errors = Counter("sonic_http_errors", "Requests answered with an error",
                                   ["status", "code"], registry=r)
        self.engine_load = Gauge("sonic_engine_load",
                                 "Share of the engine's measured capacity live sessions need",
                                 registry=r)
        self.sessions_degraded = Gauge(
            "sonic_sessions_degraded",
            "Live sessions whose fresh (not repeated) frames per second, over their last 50 "
            "frame times, are under 96% of video.fps", registry=r)
        self.capacity_fps = Gauge("sonic_engine_capacity_fps",
                                  "Frames/s the engine sustained at its best batch size",
                                  ["size"], registry=r)

    def on_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)

    def on_drop(self, reason: str) -> None:
        self.frames_dropped.labels(reason=reason).inc()

    def render(self, refresh: Callable[[], None] | None = None) -> bytes:
        if refresh is not None:
            refresh()
        return generate_latest(self.registry)


class FrontDoorMetrics(Metrics):
    """The front door's: engine batches and drops (reported by the inference processes),
    placement decisions and restarts. Per-session figures come from the workers."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.admissions = Counter("sonic_admissions", "New sessions placed on a worker or "
                                  "refused, by decision", ["decision"], registry=r)
        self.workers_alive = Gauge("sonic_workers_alive", "Media workers serving", registry=r)
        self.worker_restarts = Counter("sonic_worker_restarts",
                                       "Media workers replaced after dying", registry=r)
        self.inference_restarts = Counter("sonic_inference_restarts",
                                          "Inference processes restarted after dying",
                                          registry=r)


def merge_expositions(sources: list[tuple[str, str]]) -> bytes:
    """Several processes' metrics (``(process, exposition text)``) as one exposition:
    one family per name, each sample labelled with the ``process`` it came from."""
    families: dict[str, Metric] = {}
    for process, text in sources:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(
                family.name, family.documentation, family.type, family.unit))
            merged.samples += [sample._replace(labels={**sample.labels, "process": process})
                               for sample in family.samples]

    class Merged:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())  # type: ignore[arg-type]
    return generate_latest(registry)


__all__ = ["CONTENT_TYPE", "FrontDoorMetrics", "Metrics", "merge_expositions"]
