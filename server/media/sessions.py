"""The live sessions of one server: creation, lookup, and clean-up that leaks nothing."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from aiortc import RTCPeerConnection

from inference.engine import NO_PICTURE, Manifest
from inference.service import Inference
from server.config import Settings
from server.costs import media_cost
from server.load import SETTLED_S
from server.media.avatars import DEFAULT_AVATAR, AvatarStore
from server.media.encoding import EncodeBatches, vp8_tuning
from server.media.session import Session, SessionContext
from server.metrics import Metrics
from server.session_spec import NewSession, SessionOptions

log = logging.getLogger(__name__)


class AtCapacity(RuntimeError):
    pass


class NameTaken(ValueError):
    pass


class TooManyViewers(RuntimeError):
    pass




def _grid_phases(setting: int, runtime: str) -> int:
    """``session.grid_phases`` resolved: 0 picks by the runtime (2 instants a frame with a
    GPU's, none with the CPU's), -1 is none."""
    if setting == 0:
        return 0 if runtime == "onnxruntime" else 2
    return max(setting, 0)


def _cost(sessions: Iterable[Session], loop: bool) -> float:
    video: collections.Counter[int] = collections.Counter()
    motion: collections.Counter[int] = collections.Counter()
    for session in sessions:
        (motion if session.motion_only else video)[session.avatar.size] += 1
    return media_cost(video, motion, loop=loop)


class SessionManager:
    def __init__(self, settings: Settings, manifest: Manifest, inference: Inference,
                 avatars: AvatarStore, metrics: Metrics, id_prefix: str = "",
                 runtime: str = "onnxruntime") -> None:
        self.settings = settings
        #: Instants of the media grid that session clocks start on (0: none).
        self.grid_phases = _grid_phases(settings.session.grid_phases, runtime)
        #: Starts every session id: a media worker's ``w<index>-``, so the front door can
        #: route a session's requests (a streamed speech body can be sent only once).
        self.id_prefix = id_prefix
        self.manifest = manifest
        self.inference = inference
        self.avatars = avatars
        self.metrics = metrics
        self._sessions: dict[str, Session] = {}
        #: Per session, its peer connections by an id of their own (a WHEP viewer's
        #: resource names one).
        self._peers: dict[str, dict[str, RTCPeerConnection]] = {}
        #: Per session, which of its peers are viewers, and viewers' offers being answered.
        self._viewers: dict[str, set[str]] = {}
        self._viewers_coming = collections.Counter[str]()
        self._reserved: list[tuple[int, bool]] = []  # (size, motion-only) being created
        self.encodes = EncodeBatches()  # every session's video encodes, a batch a hand-off
        self.context = SessionContext(settings.session, settings.video.fps, manifest,
                                      inference, metrics, self.encodes,
                                      vp8_tuning(settings.video))

    def __len__(self) -> int:
        return len(self._sessions)

    def _frame_cost(self, size: int, motion_only: bool = False) -> float:
        """Share of the engine one session of this frame size (or motion-only, the
        coefficients alone) takes, by measured capacity."""
        capacity = self.inference.capacity_fps(NO_PICTURE if motion_only else size)
        return self.settings.video.fps / capacity if capacity > 0 else 0.0

    def engine_load(self) -> float:
        """Share of the engine's measured capacity the live sessions need at full frame rate."""
        return sum(self._frame_cost(s.avatar.size, s.motion_only)
                   for s in self._sessions.values())

    def count_by_size(self, *, answering: bool = False, motion_only: bool = False
                      ) -> dict[str, int]:
        """Live video (or ``motion_only``) sessions by frame side; with ``answering``, only
        those whose offer is still being answered (no peer yet)."""
        return dict(collections.Counter(
            str(session.avatar.size) for session_id, session in self._sessions.items()
            if session.motion_only == motion_only
            and (not answering or not self._peers.get(session_id))))

    def media_cost(self, *, loop: bool = False) -> float:
        """Cost of every live session in cores, or in the event loop
        (``server.costs.session_cost``)."""
        return _cost(self._sessions.values(), loop)

    def settled_cost(self, after_s: float = SETTLED_S, *, loop: bool = False) -> float:
        """Cost of the sessions with a peer, made ``after_s`` or more ago: those whose
        load a second's measure already holds in full."""
        now = time.time()
        return _cost((s for session_id, s in self._sessions.items()
                      if self._peers.get(session_id) and now - s.created >= after_s), loop)

    def degraded(self, below_fps: float) -> int:
        """Sessions, sending for a while, whose fresh frames per second are under ``below_fps``:
        overload shows here while viewers still count a full rate of repeated frames."""
        return sum(s.fps()[1] < below_fps for s in self._sessions.values()
                   if s.frames_sent >= 50)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def names(self) -> dict[str, str]:
        return {s.name: s.id for s in self._sessions.values() if s.name is not None}

    def named(self, name: str) -> Session | None:
        return next((s for s in self._sessions.values() if s.name == name), None)

    def list(self, visible: Callable[[Session], bool] = lambda s: True
             ) -> list[dict[str, Any]]:
        return [s.describe() for s in self._sessions.values() if visible(s)]

    async def create(self, spec: NewSession, owner: str | None = None, *,
                     calibration: bool = False) -> Session:
        """The session ``spec`` asks for, made for ``owner`` (raises ``UnknownAvatar``,
        ``AtCapacity``, ``NameTaken``); ``calibration``: one the front door runs against
        itself at start-up."""
        avatar_id, size, motion_only, name = (spec.avatar or DEFAULT_AVATAR, spec.size,
                                              spec.motion_only, spec.name)
        self.avatars.get(avatar_id, owner)  # another key's private portrait is not there
        if name is not None and self.named(name) is not None:
            raise NameTaken(f"a live session is already called {name!r}")
        limits = self.settings.session
        most, kind = (limits.max_motion_sessions, "motion-only ") if motion_only \
            else (limits.max_sessions, "")
        alike = sum(s.motion_only == motion_only for s in self._sessions.values()) + \
            sum(m == motion_only for _, m in self._reserved)
        if alike >= most:
            raise AtCapacity(f"server holds its maximum of {most} {kind}sessions")
        load = self.engine_load() + sum(self._frame_cost(s, m) for s, m in self._reserved)
        if load + self._frame_cost(size, motion_only) > limits.max_engine_load:
            raise AtCapacity(f"the engine is at {load:.0%} of its measured capacity; another "
                             f"{size}x{size} session would pass session.max_engine_load="
                             f"{limits.max_engine_load}")
        self._reserved.append((size, motion_only))
        try:
            handle = await self.avatars.acquire(avatar_id, size)
        finally:
            self._reserved.remove((size, motion_only))
        if name is not None and self.named(name) is not None:  # made while we waited
            self.avatars.release(handle)
            raise NameTaken(f"a live session is already called {name!r}")
        options = SessionOptions(self.settings.session.knob_defaults())
        options.values.update(spec.options)
        session = Session(self.id_prefix + uuid.uuid4().hex, spec.kind, handle, options,
                          self.context, motion_only=motion_only, owner=owner, name=name,
                          token=spec.token, max_bitrate=self.settings.video.max_bitrate(size),
                          grid_phase=self._quietest_phase(size, motion_only),
                          calibration=calibration)
        self._sessions[session.id] = session
        self._peers[session.id] = {}
        if spec.record:
            folder = Path(self.settings.session.recording_dir)
            folder.mkdir(parents=True, exist_ok=True)
            session.record(folder / f"{session.id}.mp4")
        session.on_close(self._forget)
        self.metrics.sessions_total.inc()
        self.metrics.sessions_active.set(len(self._sessions))
        return session

    def _quietest_phase(self, size: int, motion_only: bool) -> tuple[int, int] | None:
        """The phase of the media grid with the fewest live sessions like this one (which
        the scheduler batches together), so each instant carries an even share."""
        phases = self.grid_phases
        if not phases:
            return None
        alike = collections.Counter(s.grid_phase for s in self._sessions.values()
                                    if s.avatar.size == size and s.motion_only == motion_only)
        return min(((p, phases) for p in range(phases)), key=lambda p: alike[p])

    def add_peer(self, session: Session, pc: RTCPeerConnection, *, viewer: bool = False) -> str:
        """Keep ``pc`` until it or its session goes; the id it is known by."""
        peer_id = uuid.uuid4().hex
        self._peers.setdefault(session.id, {})[peer_id] = pc
        if viewer:
            self._viewers.setdefault(session.id, set()).add(peer_id)
        return peer_id

    @contextlib.contextmanager
    def viewer_place(self, session_id: str, most: int) -> Iterator[None]:
        """A place for one more viewer of the session while its offer is answered (raises
        ``TooManyViewers`` past ``most``, those being answered counted in)."""
        held = len(self._viewers.get(session_id, ())) + self._viewers_coming[session_id]
        if held >= most:
            raise TooManyViewers(f"session {session_id} has its most viewers, {most} "
                                 "(session.max_viewers)")
        self._viewers_coming[session_id] += 1
        try:
            yield
        finally:
            self._viewers_coming[session_id] -= 1
            if not self._viewers_coming[session_id]:
                del self._viewers_coming[session_id]

    def peer(self, session_id: str, peer_id: str) -> RTCPeerConnection | None:
        return self._peers.get(session_id, {}).get(peer_id)

    def drop_peer(self, session_id: str, peer_id: str) -> None:
        self._peers.get(session_id, {}).pop(peer_id, None)
        self._viewers.get(session_id, set()).discard(peer_id)

    async def _forget(self, session: Session) -> None:
        self._sessions.pop(session.id, None)
        peers = self._peers.pop(session.id, {}).values()
        self._viewers.pop(session.id, None)
        self.avatars.release(session.avatar)
        reason = (session.close_reason or "closed").split(":")[0]
        self.metrics.sessions_closed.labels(reason=reason).inc()
        self.metrics.sessions_active.set(len(self._sessions))
        await asyncio.gather(*(pc.close() for pc in peers), return_exceptions=True)

    async def close(self, session_id: str, reason: str) -> bool:
        session = self._sessions.get(session_id)
        if session is None:
            return False
        await session.close(reason)
        return True

    async def close_all(self) -> None:
        await asyncio.gather(*(s.close("server shutdown") for s in list(self._sessions.values())),
                             return_exceptions=True)
        self.encodes.close()
