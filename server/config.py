"""Typed settings, loaded once from a TOML file and overridden from the command line.

Every field has a default, so the server runs with no file at all; the shipped
``configs/default.toml`` spells the defaults out. Validation names the offending value.
"""

from __future__ import annotations

import argparse
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.runtimes import RUNTIMES

REPO_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """A setting is missing, unknown, or out of range."""


@dataclass
class HttpSettings:
    host: str = "127.0.0.1"
    """Address to listen on; loopback by default."""
    port: int = 8080
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body accepted (uploads included); larger ones get 413."""


@dataclass
class IceSettings:
    servers: list[str] = field(default_factory=list)
    """STUN/TURN URLs offered to aiortc. Empty by default: no public STUN is contacted."""
    host_addresses: list[str] = field(default_factory=list)
    """If set, the only host candidates gathered (e.g. ["127.0.0.1"] for loopback tests)."""


@dataclass
class VideoSettings:
    size: int = 256
    """Output frame side in pixels (square); sessions may ask for another allowed size."""
    allowed_sizes: list[int] = field(default_factory=lambda: [256, 512])
    fps: int = 25
    codec: str = "VP8"
    """Preferred video codec for the answer (VP8 or H264) when the offer allows it."""


@dataclass
class AvatarSettings:
    expand_ratio: float = 0.5
    """Margin around the detected face, as a fraction of the face box on each side."""
    max_side: int = 4096
    max_pixels: int = 16_000_000
    max_avatars: int = 64
    """Uploaded portraits kept in memory; the oldest unused one is evicted past this."""


@dataclass
class EngineSettings:
    runtime: str = "auto"
    """Which runtime runs the model: "onnxruntime" (CPU), "torch-cuda", "tensorrt", or
    "auto" (TensorRT where it imports and a GPU is present, else torch-cuda where torch
    sees a GPU, else onnxruntime)."""
    manifest: str = "engines/sonic-lite.json"
    """Model manifest, relative to the repository root unless absolute."""
    intra_op_threads: int = 1


@dataclass
class SchedulerSettings:
    max_batch: int = 0
    """Most frames run in one engine call; 0 picks the engine's largest batch profile
    (CUDA graphs, TensorRT profiles), or 8 for an engine without profiles (the CPU)."""
    max_wait_ms: float = 5.0
    """Longest a ready frame waits for others to join its batch."""


@dataclass
class SessionSettings:
    pipeline_delay_ms: float = 130.0
    """Audio in to frame out: the outbound audio is the input delayed by exactly this."""
    jitter_ms: float = 30.0
    """Inbound audio held back to absorb network jitter before it enters the clock."""
    max_buffer_ms: float = 300.0
    """Inbound audio beyond this is dropped (sender clock faster than ours)."""
    peer_timeout_s: float = 10.0
    """A session whose peer sends no media for this long (or never connects) is closed."""
    max_sessions: int = 16
    max_engine_load: float = 0.9
    """Admit a session only while all sessions need at most this share of the engine's
    measured capacity (frames/s at their frame size); the rest is headroom for jitter."""
    motion_scale: float = 1.0
    dynamic_scale: float = 1.0


@dataclass
class Settings:
    http: HttpSettings = field(default_factory=HttpSettings)
    ice: IceSettings = field(default_factory=IceSettings)
    video: VideoSettings = field(default_factory=VideoSettings)
    avatar: AvatarSettings = field(default_factory=AvatarSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    session: SessionSettings = field(default_factory=SessionSettings)

    def validate(self) -> Settings:
        checks = [
            (1 <= self.http.port <= 65535, f"http.port={self.http.port} is not a port"),
            (self.video.fps > 0, f"video.fps={self.video.fps} must be positive"),
            (self.video.size in self.video.allowed_sizes,
             f"video.size={self.video.size} not in video.allowed_sizes"),
            (all(s % 16 == 0 and 64 <= s <= 1024 for s in self.video.allowed_sizes),
             f"video.allowed_sizes={self.video.allowed_sizes}: each must be a multiple of 16"
             " in [64, 1024]"),
            (self.video.codec.upper() in ("VP8", "H264"),
             f"video.codec={self.video.codec!r} must be VP8 or H264"),
            (self.scheduler.max_batch >= 0,
             f"scheduler.max_batch={self.scheduler.max_batch} must be >= 0 (0: automatic)"),
            (self.scheduler.max_wait_ms >= 0,
             f"scheduler.max_wait_ms={self.scheduler.max_wait_ms} must be >= 0"),
            (self.session.pipeline_delay_ms >= 60,
             f"session.pipeline_delay_ms={self.session.pipeline_delay_ms} must be >= 60"),
            (0 <= self.session.jitter_ms < self.session.max_buffer_ms,
             f"session.jitter_ms={self.session.jitter_ms} must be in "
             f"[0, max_buffer_ms={self.session.max_buffer_ms})"),
            (self.session.peer_timeout_s > 0,
             f"session.peer_timeout_s={self.session.peer_timeout_s} must be positive"),
            (self.session.max_sessions >= 1,
             f"session.max_sessions={self.session.max_sessions} must be >= 1"),
            (self.session.max_engine_load > 0,
             f"session.max_engine_load={self.session.max_engine_load} must be positive"),
            (self.avatar.expand_ratio >= 0,
             f"avatar.expand_ratio={self.avatar.expand_ratio} must be >= 0"),
            (self.engine.runtime in RUNTIMES,
             f"engine.runtime={self.engine.runtime!r} must be one of {', '.join(RUNTIMES)}"),
            (self.engine.intra_op_threads >= 1,
             f"engine.intra_op_threads={self.engine.intra_op_threads} must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        return self

    @property
    def manifest_path(self) -> Path:
        path = Path(self.engine.manifest)
        return path if path.is_absolute() else REPO_ROOT / path


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check/convert one value against a field's annotation (str, int, float, list[...])."""
    origin = typing.get_origin(annotation)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(annotation)
        return [_coerce(v, item, where) for v in value]
    try:
        if annotation is bool:
            if isinstance(value, str):
                return value.lower() in ("1", "true", "yes", "on")
            return bool(value)
        if annotation in (int, float, str):
            if annotation is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return annotation(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {value!r} is not a valid {annotation.__name__}") from None
    raise ConfigError(f"{where}: unsupported type {annotation}")


def _apply(settings: Settings, section: str, key: str, value: Any) -> None:
    hints = typing.get_type_hints(Settings)
    if section not in hints:
        raise ConfigError(f"unknown settings section [{section}]")
    group = getattr(settings, section)
    group_hints = typing.get_type_hints(type(group))
    if key not in group_hints:
        raise ConfigError(f"unknown setting {section}.{key}")
    setattr(group, key, _coerce(value, group_hints[key], f"{section}.{key}"))


def load_settings(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                  ) -> Settings:
    """Defaults, then the TOML file, then ``section.key`` overrides; validated."""
    settings = Settings()
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{section} must be a [section] of settings")
            for key, value in values.items():
                _apply(settings, section, key, value)
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        _apply(settings, section, key, value)
    return settings.validate()


def parse_args(argv: list[str] | None = None) -> Settings:
    """``python -m server [--config F] [--host H] [--port P] [--set section.key=value ...]``."""
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__)
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "default.toml"),
                        help="TOML settings file (default: configs/default.toml)")
    parser.add_argument("--host", help="override http.host")
    parser.add_argument("--port", type=int, help="override http.port")
    parser.add_argument("--runtime", help="override engine.runtime")
    parser.add_argument("--ice-host", action="append", dest="ice_hosts", metavar="ADDR",
                        help="pin ICE host candidates to ADDR (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any setting, e.g. --set scheduler.max_batch=4")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            parser.error(f"--set expects SECTION.KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value.strip()
    if args.host is not None:
        overrides["http.host"] = args.host
    if args.port is not None:
        overrides["http.port"] = args.port
    if args.runtime is not None:
        overrides["engine.runtime"] = args.runtime
    if args.ice_hosts:
        overrides["ice.host_addresses"] = args.ice_hosts
    try:
        return load_settings(args.config, overrides)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


__all__ = ["REPO_ROOT", "ConfigError", "Settings", "load_settings", "parse_args"]
