"""Typed settings, loaded once from a TOML file and overridden from the command line.

Every setting is declared once, with its default, its range and what it does: the same
declaration validates the file and the overrides, prints ``python -m server --help``,
and is shown (secrets withheld) by ``GET /config`` and in the start-up log. The server
runs with no file at all; the shipped ``configs/default.toml`` spells the defaults out.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
import socket
import textwrap
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.engine import KNOBS, KNOBS_BY_NAME
from inference.runtimes import RUNTIMES

REPO_ROOT = Path(__file__).resolve().parent.parent
_BOOLS = {"true": True, "yes": True, "on": True, "1": True,
          "false": False, "no": False, "off": False, "0": False}
WITHHELD = "(withheld)"
#: Video sessions per core that ``session.max_sessions = 0`` allows. A 256x256 session has
#: cost 0.061-0.077 cores on the hosts measured (benchmarks/README.md), so at ``max_host_load``
#: 0.75 measured load refuses the next session before this count does there.
SESSIONS_PER_CORE = 12
#: Motion-only sessions per core that ``session.max_motion_sessions = -1`` allows: one has
#: cost 0.044 cores on a GPU host (benchmarks/README.md), so measured load refuses first there too.
MOTION_SESSIONS_PER_CORE = 24


class ConfigError(ValueError):
    """A setting is missing, unknown, or out of range."""


def setting(default: Any, doc: str, *, low: float | None = None, high: float | None = None,
            choices: tuple[Any, ...] | None = None, secret: bool = False) -> Any:
    """A settings field: ``low``/``high``/``choices`` bound the value (each item of a
    list); a ``secret`` is never shown."""
    meta = {"doc": doc, "low": low, "high": high, "choices": choices, "secret": secret}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def knob_setting(name: str) -> Any:
    """A session default for one of the engine's knobs, with the knob's own range and doc."""
    knob = KNOBS_BY_NAME[name]
    return setting(knob.default, f"default {knob.doc}", low=knob.low, high=knob.high)


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


@dataclass
class HttpSettings:
    host: str = setting("127.0.0.1", "address to listen on; loopback by default")
    port: int = setting(8080, "TCP port to listen on", low=1, high=65535)
    max_body_bytes: int = setting(8 * 1024 * 1024, "largest request body accepted (uploads "
                                  "included); larger ones get 413", low=1024)
    body_timeout_s: float = setting(10.0, "a request body not received in full this long after "
                                    "its headers gets 408 (a client sending a byte every few "
                                    "seconds would otherwise hold its connection forever)",
                                    low=0.1)
    idle_timeout_s: float = setting(15.0, "a connection is closed after this long with no "
                                    "request in progress; it also bounds how long a "
                                    "request's headers may take to arrive", low=0.1)
    api_keys: list[str] = setting([], "keys a caller must present (Authorization: Bearer "
                                  "KEY) to create, drive, list or end sessions and to "
                                  "upload; each caller sees only its own sessions. Also "
                                  "read from SONIC_API_KEYS (comma-separated). Empty: open, "
                                  "as suits loopback", secret=True)
    cors_origins: list[str] = setting([], "web origins (https://app.example.com, or *) "
                                      "whose pages may call the API from the browser; "
                                      "empty: none, so other sites' pages cannot")
    allowed_hosts: list[str] = setting([], "Host names requests may carry (without port); "
                                       "empty: only 127.0.0.1, localhost and ::1 when "
                                       "listening on loopback (against DNS rebinding), any "
                                       "otherwise")
    max_request_bytes: int = setting(256 * 1024, "largest body of any request but a portrait "
                                     "upload (http.max_body_bytes) or streamed speech: JSON "
                                     "and SDP offers; a larger Content-Length is refused "
                                     "with 413 before the body is read", low=1024)
    max_body_memory_mb: int = setting(64, "request bodies one process reads at once, all "
                                      "requests together, in MB: past it a request is "
                                      "refused with 503 and Retry-After before its body is "
                                      "read, so no mix of large requests can exhaust memory",
                                      low=1)
    max_streams_per_caller: int = setting(16, "long-lived streams (event streams, WebSockets, "
                                          "speech uploads) one caller may hold open at once "
                                          "(a caller is an API key, or an address where "
                                          "keys are off); one more is refused with 429",
                                          low=1)
    max_offers_in_flight: int = setting(16, "WebRTC offers (new sessions, viewers, WHIP, "
                                        "WHEP) one address may have being answered at "
                                        "once; one more is refused with 429 and "
                                        "Retry-After: 1. Behind a reverse proxy every "
                                        "client shares its address: raise it there",
                                        low=1)


@dataclass
class IceSettings:
    servers: list[str] = setting([], "STUN/TURN URLs offered to aiortc; empty by default, so "
                                 "no public STUN is contacted")
    username: str = setting("", "TURN username, for the turn: URLs in ice.servers")
    credential: str = setting("", "TURN password, for the turn: URLs in ice.servers",
                              secret=True)
    host_addresses: list[str] = setting([], "if set, the only host candidates gathered "
                                        "(e.g. 127.0.0.1 for loopback tests)")
    blocked_ranges: list[str] = setting(
        ["169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128", "0.0.0.0/8", "224.0.0.0/4",
         "ff00::/8"],
        "address ranges an offer's candidates may not make the server send to: link-local "
        "(cloud metadata at 169.254.169.254), unspecified and multicast by default")
    mdns: bool = setting(False, "accept .local (mDNS) host names in an offer's candidates; "
                         "other names are never resolved")
    private_candidates: bool = setting(
        True, "let an offer's candidates make the server send connectivity checks to "
        "private addresses (10/8, 172.16/12, 192.168/16, 100.64/10 shared, fc00::/7): "
        "true for peers on the server's own network or behind the same NAT; false for a "
        "server on the internet, so that no offer can have it probe its own network")
    udp_ports: list[int] = setting([], "[low, high]: media (ICE host candidates) binds only "
                                   "UDP ports in this range, for firewalls and containers; "
                                   "empty: any port", low=1024, high=65535)


@dataclass
class JanusSettings:
    url: str = setting("", "REST URL of the Janus gateway (http://HOST:8088/janus) whose "
                       "VideoRooms avatars may join (POST /sessions with \"janus\"); empty: "
                       "off. Only this server is ever contacted, whatever a request says")
    api_secret: str = setting("", "Janus's api_secret, if it sets one", secret=True)
    timeout_s: float = setting(10.0, "longest wait for one Janus request (joining a room "
                               "included) before the session is refused with 502",
                               low=0.5, high=120.0)


@dataclass
class VideoSettings:
    size: int = setting(256, "default frame side in pixels (square); a session may ask for "
                        "another of video.allowed_sizes")
    allowed_sizes: list[int] = setting([256, 512], "frame sides sessions may ask for; each a "
                                       "size the model was made for", low=64, high=1024)
    fps: int = setting(25, "frames per second; must be the model's own", low=1, high=120)
    codec: str = setting("VP8", "preferred video codec of the answer when the offer allows it",
                         choices=("VP8", "H264"))
    encoder_speed: int = setting(12, "VP8 encoder speed (libvpx cpu-used): higher costs less "
                                 "CPU per frame and looks a little coarser", low=0, high=16)
    static_threshold: int = setting(
        500, "VP8 static threshold (libvpx static-thresh): a macroblock within this summed "
        "squared error of its prediction is not coded again, so a portrait's still "
        "background and skin cost nothing; 0 codes every one", low=0, high=5000)
    max_bitrate_kbps: int = setting(
        1000, "most kbit/s a 256x256 stream is sent at, whatever its viewers could take "
        "(other sizes scale with their pixel count, within aiortc's 1500): above it a "
        "rendered face looks no better, and each viewer's bits are egress paid for",
        low=100, high=20000)

    def max_bitrate(self, size: int) -> int:
        """The most bit/s a ``size`` x ``size`` stream is sent at."""
        return self.max_bitrate_kbps * 1000 * size * size // (256 * 256)


@dataclass
class AvatarSettings:
    expand_ratio: float = setting(0.5, "margin around the detected face, as a fraction of the "
                                  "face box on each side", low=0.0, high=4.0)
    max_side: int = setting(4096, "longest side of an uploaded image, in pixels", low=64)
    max_pixels: int = setting(16_000_000, "most pixels of an uploaded image", low=4096)
    max_decoded_mb: int = setting(64, "most memory decoding an upload may take, in MB (a "
                                  "16-bit RGBA pixel takes 8 bytes, an 8-bit RGB one 3)",
                                  low=1)
    max_avatars: int = setting(64, "uploaded portraits kept; the oldest unused one is "
                               "evicted past this", low=1)


@dataclass
class EngineSettings:
    runtime: str = setting("auto", "which runtime runs the model: onnxruntime (CPU), "
                           "torch-cuda, tensorrt (unverified: choose it explicitly), or auto "
                           "(torch-cuda where PyTorch sees a GPU, else onnxruntime)",
                           choices=RUNTIMES)
    manifest: str = setting("engines/sonic-lite.json", "model manifest, relative to the "
                            "repository root unless absolute")
    intra_op_threads: int = setting(1, "ONNX Runtime threads per engine call", low=1)


@dataclass
class WorkerSettings:
    count: int = setting(0, "media worker processes (WebRTC peers, audio, video encoding); "
                         "0: one per core with a GPU runtime, one per two cores on the CPU",
                         low=0)
    gpus: int = setting(0, "inference processes, one per GPU, each owning the shared "
                        "scheduler and an engine; 0: every visible GPU (one on the CPU)", low=0)
    embedded: bool = setting(False, "run everything in this one process, the engine on a "
                             "thread: no front door, workers or inference process")


@dataclass
class SchedulerSettings:
    max_batch: int = setting(0, "most frames in one engine call; 0 picks the engine's largest "
                             "batch profile on a GPU, 8 on the CPU", low=0)
    max_wait_ms: float = setting(5.0, "longest a ready frame waits for others to join its "
                                 "batch", low=0.0)


@dataclass
class SessionSettings:
    pipeline_delay_ms: float = setting(130.0, "audio in to frame out: the outbound audio is "
                                       "the input delayed by exactly this", low=60.0)
    frame_grace_ms: float = setting(15.0, "a frame not rendered by its send time is waited "
                                    "for this long before the last one is sent again: the "
                                    "lips then trail the sound by up to this much for that "
                                    "frame, instead of a frozen picture for a whole frame",
                                    low=0.0, high=40.0)
    audio_packet_ms: int = setting(40, "speech per RTP packet, both ways: the returned "
                                   "speech's (Opus frames of 20 ms joined), and what the "
                                   "answer asks peers to send (a=ptime; browsers honour "
                                   "it). 40 halves the packets of 20, and with them the "
                                   "audio's per-packet work; a packet lost takes that much "
                                   "sound with it", choices=(20, 40, 60))
    jitter_ms: float = setting(30.0, "inbound audio held beyond the 20 ms chunk being read, "
                               "to ride out a late packet; after a stall or with a skewed "
                               "sender clock the buffer is steered back to it by playing "
                               "up to 10% faster or slower", low=0.0)
    max_buffer_ms: float = setting(300.0, "inbound audio beyond this is dropped at once (a "
                                   "last resort behind the steering)", low=20.0)
    connect_timeout_s: float = setting(5.0, "an offer whose peer has not connected (ICE and "
                                       "DTLS) this long after its answer is closed, freeing "
                                       "its place", low=0.1)
    unattended_timeout_s: float = setting(300.0, "a session made by POST /sessions ends "
                                          "after this long with no speech queued and no "
                                          "viewer", low=1.0)
    speech_buffer_s: float = setting(30.0, "speech pushed to a session may run this far "
                                     "ahead of real time; a producer further ahead waits",
                                     low=1.0, high=600.0)
    peer_timeout_s: float = setting(10.0, "a session whose peer sends nothing for this long "
                                    "(no media and no RTCP reports: gone, not just quiet) is "
                                    "closed", low=0.1)
    recording_dir: str = setting("", "where sessions asked to record (options.record) write "
                                 "SESSION_ID.mp4; empty: recording is off")
    grid_phases: int = setting(0, "instants in each frame period that session clocks start "
                               "on (server/media_clock.py): sessions on one share their "
                               "timers, sends and frames, so a worker wakes once for all of "
                               "them and the engine batches their frames; a new session "
                               "takes the instant with the fewest. 0: 2 with a GPU runtime, "
                               "none on the CPU, whose engine gains little from batching "
                               "while frames bunched together queue for it; -1: none, each "
                               "clock starts when its session is made", low=-1, high=40)
    max_sessions: int = setting(0, f"most live sessions; 0: {SESSIONS_PER_CORE} per core the "
                                "server may run on, more than measured load has admitted at "
                                "the defaults on any host, so that measured load decides. It "
                                "also sizes the frame ring in /dev/shm", low=0)
    max_motion_sessions: int = setting(-1, "most live motion-only sessions (coefficients "
                                       "on a data channel, no video to encode); -1: "
                                       f"{MOTION_SESSIONS_PER_CORE} per core the server may "
                                       "run on, so that measured load decides; 0: none",
                                       low=-1)
    max_worker_load: float = setting(0.8, "admit a session on a media worker only while its "
                                     "event loop, measured each second, would stay busy at "
                                     "most this share of the time with it", low=0.01, high=1.0)
    max_viewers: int = setting(16, "viewers a session takes at once (receive-only offers "
                               "with its token, WHEP): one more is refused with 429. With "
                               "ice.udp_ports, at most a quarter of the range, whatever "
                               "this says: one session's token never takes every port",
                               low=1)
    max_host_load: float = setting(0.75, "admit a session only while the server's processes, "
                                   "measured each second, would keep at most this share of "
                                   "its cores busy with it", low=0.01, high=1.0)
    cores_per_session: float = setting(0.09, "cores a 256x256 video session is taken to need "
                                       "until the server has measured its own (one-GPU hosts "
                                       "measured 0.061-0.089 in a steady state, before the "
                                       "returned speech's encode was cut by a twelfth); a "
                                       "512x512 one 1.7 times that, a motion-only one 0.55 "
                                       "times", low=0.001)
    calibration_sessions: int = setting(0, "sessions the front door runs against itself at "
                                        "start-up, before it reports ready, to measure what a "
                                        "session costs this host's cores: admission's first "
                                        "figure in place of cores_per_session. 0: a quarter of "
                                        "what cores_per_session and the engine would admit, 2 "
                                        "to 24; -1: none", low=-1, high=256)
    max_engine_load: float = setting(0.9, "admit a session only while all sessions need at "
                                     "most this share of the engine's measured capacity",
                                     low=0.001)
    motion_scale: float = knob_setting("motion_scale")
    dynamic_scale: float = knob_setting("dynamic_scale")

    def knob_defaults(self) -> dict[str, float]:
        return {knob.name: getattr(self, knob.name) for knob in KNOBS}


def _host_label() -> str:
    """This host's name as a node id: its first label, lowercased, in [a-z0-9-]."""
    label = re.sub(r"[^a-z0-9-]", "-", socket.gethostname().split(".")[0].lower())
    return label.strip("-")[:NODE_ID_MAX] or "node"


NODE_ID_MAX = 40
NODE_ID = re.compile(rf"[a-z0-9][a-z0-9-]{{0,{NODE_ID_MAX - 1}}}")


@dataclass
class ClusterSettings:
    redis_url: str = setting("", "Redis that the cluster's hosts meet at "
                             "(redis://HOST:PORT/DB; --cluster); empty: this host alone",
                             secret=True)
    node_id: str = setting("", "this host's name in the cluster, [a-z0-9-] (--node-id); "
                           "empty: the host name's first label")
    advertise_url: str = setting("", "the URL other hosts reach this one's HTTP port at "
                                 "(--advertise-url); empty: http://HOST:PORT from http.host "
                                 "and http.port")
    lease_s: float = setting(5.0, "a host that has not renewed its place in Redis for this "
                             "long is gone: its sessions answer 410 and its names are free",
                             low=1.0, high=60.0)
    drain_timeout_s: float = setting(300.0, "on SIGTERM or POST /cluster/drain, how long "
                                     "the host's sessions may run on, none placed there, "
                                     "before it leaves", low=0.0)
    forward_timeout_s: float = setting(10.0, "how long a host waits for another to answer "
                                       "a request it forwards (504 past it)", low=0.5)

    def node(self) -> str:
        return self.node_id or _host_label()


@dataclass
class Settings:
    http: HttpSettings = field(default_factory=HttpSettings)
    ice: IceSettings = field(default_factory=IceSettings)
    janus: JanusSettings = field(default_factory=JanusSettings)
    video: VideoSettings = field(default_factory=VideoSettings)
    avatar: AvatarSettings = field(default_factory=AvatarSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    workers: WorkerSettings = field(default_factory=WorkerSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    session: SessionSettings = field(default_factory=SessionSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    def validate(self) -> Settings:
        for section, group, f in _fields(self):
            _check_range(f"{section}.{f.name}", getattr(group, f.name), f.metadata)
        checks = [
            (self.video.size in self.video.allowed_sizes,
             f"video.size={self.video.size} not in video.allowed_sizes="
             f"{self.video.allowed_sizes}"),
            (all(s % 16 == 0 for s in self.video.allowed_sizes),
             f"video.allowed_sizes={self.video.allowed_sizes}: each must be a multiple of 16"),
            (all(_is_network(r) for r in self.ice.blocked_ranges),
             f"ice.blocked_ranges={self.ice.blocked_ranges}: each must be an address range "
             "such as 169.254.0.0/16"),
            (not self.ice.udp_ports or (len(self.ice.udp_ports) == 2
                                        and self.ice.udp_ports[0] <= self.ice.udp_ports[1]),
             f"ice.udp_ports={self.ice.udp_ports}: give two ports, low then high"),
            (self.session.pipeline_delay_ms >= self.session.audio_packet_ms + 40,
             f"session.pipeline_delay_ms={self.session.pipeline_delay_ms} must be at least "
             f"session.audio_packet_ms={self.session.audio_packet_ms} + 40: a packet's last "
             "chunk is read from the input before the packet leaves"),
            (self.session.jitter_ms + 20 < self.session.max_buffer_ms,
             f"session.jitter_ms={self.session.jitter_ms} plus a 20 ms chunk must be below "
             f"session.max_buffer_ms={self.session.max_buffer_ms}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        return self

    def effective(self) -> dict[str, dict[str, Any]]:
        """Every setting as it is in force, by section; secrets show as withheld."""
        out: dict[str, dict[str, Any]] = {}
        for section, group, f in _fields(self):
            value = getattr(group, f.name)
            if f.metadata.get("secret") and value:
                value = WITHHELD
            out.setdefault(section, {})[f.name] = value
        return out

    @property
    def viewer_cap(self) -> int:
        """Viewers one session takes at once: ``session.max_viewers``, and with
        ``ice.udp_ports`` at most a quarter of that range (each viewer binds a port)."""
        if not self.ice.udp_ports:
            return self.session.max_viewers
        low, high = self.ice.udp_ports
        return max(1, min(self.session.max_viewers, (high - low + 1) // 4))

    @property
    def advertise_url(self) -> str:
        """Where other hosts reach this one: ``cluster.advertise_url``, or this host's own
        address and port."""
        if self.cluster.advertise_url:
            return self.cluster.advertise_url.rstrip("/")
        host = self.http.host if self.http.host not in ("", "0.0.0.0", "::") else \
            socket.gethostname()
        return f"http://{host}:{self.http.port}"

    @property
    def manifest_path(self) -> Path:
        path = Path(self.engine.manifest)
        return path if path.is_absolute() else REPO_ROOT / path


def _fields(settings: Settings) -> list[tuple[str, Any, dataclasses.Field[Any]]]:
    return [(section.name, getattr(settings, section.name), f)
            for section in dataclasses.fields(settings)
            for f in dataclasses.fields(getattr(settings, section.name))]


def _rule(meta: typing.Mapping[str, Any]) -> str:
    """The bound a setting's value must meet, in words ("" when it has none)."""
    low, high, choices = meta.get("low"), meta.get("high"), meta.get("choices")
    if choices is not None:
        return f"one of {', '.join(map(str, choices))}"
    if low is not None and high is not None:
        return f"in [{low:g}, {high:g}]"
    if low is not None:
        return f">= {low:g}"
    return f"<= {high:g}" if high is not None else ""


def _check_range(where: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    low, high, choices = meta.get("low"), meta.get("high"), meta.get("choices")
    for item in value if isinstance(value, list) else [value]:
        if (choices is not None and item not in choices) or \
                (low is not None and item < low) or (high is not None and item > high):
            raise ConfigError(f"{where}={value!r} must be {_rule(meta)}")


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check/convert one value against a field's annotation (str, int, float, list[...])."""
    origin = typing.get_origin(annotation)
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(annotation)
        return [_coerce(v, item, where) for v in value]
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _BOOLS:
                return _BOOLS[value.lower()]
            raise ValueError
        if annotation in (int, float, str):
            if isinstance(value, bool) and annotation is not str:
                raise ValueError
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
        raise ConfigError(f"unknown setting {section}.{key}; known: "
                          f"{', '.join(sorted(group_hints))}")
    setattr(group, key, _coerce(value, group_hints[key], f"{section}.{key}"))


#: The environment variable API keys may come from instead of a file on disk.
API_KEYS_ENV = "SONIC_API_KEYS"


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
    keys = os.environ.get(API_KEYS_ENV, "").strip()
    if keys:
        _apply(settings, "http", "api_keys", keys)
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        _apply(settings, section, key, value)
    cores = len(os.sched_getaffinity(0))
    if settings.session.max_sessions == 0:
        settings.session.max_sessions = SESSIONS_PER_CORE * cores
    if settings.session.max_motion_sessions == -1:
        settings.session.max_motion_sessions = MOTION_SESSIONS_PER_CORE * cores
    return settings.validate()


def settings_help() -> str:
    """Every setting with its default and what it does, for ``--help``."""
    lines = ["settings (override any with --set SECTION.KEY=VALUE; lists are comma-separated):"]
    for section, group, f in _fields(Settings()):
        default = getattr(group, f.name)
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        rule = _rule(f.metadata)
        lines.append(f"  {section}.{f.name} = {shown!s}" + (f"  ({rule})" if rule else ""))
        lines += textwrap.wrap(f.metadata["doc"], 88, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> Settings:
    """``python -m server [--config F] [--host H] [--port P] [--set section.key=value ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description="The Sonic media server: speech in over WebRTC, a talking portrait out.\n"
                    "Reads configs/default.toml (or --config), then the options below.",
        epilog=settings_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "default.toml"),
                        help="TOML settings file (default: configs/default.toml)")
    parser.add_argument("--host", help="override http.host")
    parser.add_argument("--port", type=int, help="override http.port")
    parser.add_argument("--runtime", help="override engine.runtime")
    parser.add_argument("--ice-host", action="append", dest="ice_hosts", metavar="ADDR",
                        help="pin ICE host candidates to ADDR (repeatable)")
    parser.add_argument("--cluster", metavar="REDIS_URL",
                        help="join the cluster meeting at this Redis (cluster.redis_url)")
    parser.add_argument("--node-id", help="this host's name in the cluster (cluster.node_id)")
    parser.add_argument("--advertise-url", metavar="URL",
                        help="where other hosts reach this one (cluster.advertise_url)")
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
    for option, key in ((args.cluster, "redis_url"), (args.node_id, "node_id"),
                        (args.advertise_url, "advertise_url")):
        if option is not None:
            overrides[f"cluster.{key}"] = option
    if args.ice_hosts:
        overrides["ice.host_addresses"] = args.ice_hosts
    try:
        return load_settings(args.config, overrides)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


__all__ = ["REPO_ROOT", "ConfigError", "Settings", "load_settings", "parse_args"]
