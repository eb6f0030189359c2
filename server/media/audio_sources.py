"""Where a session's driving speech comes from: a WebRTC peer's audio (the offering peer, a
WHIP publisher, a participant in a meeting room) or speech an application pushes.

Each is an ``AudioSource``: the session's timeline takes one chunk from it each tick
(with when its sound arrived), asks it whether the session should still live, and shows
its figures. The session knows nothing else of where its speech comes from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import numpy as np
from aiortc.mediastreams import MediaStreamTrack

from server.config import SessionSettings
from server.media.audio_ingest import AudioIngest, pump_track
from server.media.clock import AUDIO_RATE, MediaClock
from server.media.events import EventStream
from server.media.speech import SpeechQueue, Utterances
from server.session_spec import SessionKind

Spawn = Callable[[Coroutine[Any, Any, None]], None]


class AudioSource(Protocol):
    #: What ``GET /sessions`` shows as the session's state while it lives: its peer's
    #: connection state, or ``ready`` for pushed speech.
    state: str

    def next_chunk(self, k: int, now: float) -> tuple[np.ndarray, float | None]:
        """Timeline chunk ``k``: one chunk of 48 kHz mono samples (silence where there is
        none), and when its first sample arrived (None: nothing arrived for it)."""
        ...

    def gone(self, now: float, watched: bool) -> str | None:
        """Why the session should end now, if it should; ``watched``: a viewer has it."""
        ...

    def peer_state(self, state: str, now: float) -> None:
        """The driving peer's connection changed state."""
        ...

    def heard(self, now: float) -> None:
        """The driving peer sent something other than media (an RTCP report)."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class PeerAudio:
    """A peer's audio over WebRTC, behind the adaptive buffer (``AudioIngest``): tracks are
    added as they come (a room's participant may leave and publish again). The session
    lives as long as its peer, not its microphone: it goes if the peer never connects
    within ``connect_timeout_s``, or sends nothing at all (no media, no RTCP report) for
    ``peer_timeout_s``; silence alone never ends it."""

    def __init__(self, clock: MediaClock, settings: SessionSettings, spawn: Spawn) -> None:
        self.state = "new"
        self.ingest = AudioIngest(clock.chunk_samples, settings.jitter_ms,
                                  settings.max_buffer_ms)
        self._settings = settings
        self._spawn = spawn
        self._created = clock.origin
        self._connected_at: float | None = None
        self._last_heard: float | None = None

    def add_track(self, track: MediaStreamTrack) -> None:
        loop = asyncio.get_running_loop()
        self._spawn(pump_track(track, self.ingest, loop.time))

    def next_chunk(self, k: int, now: float) -> tuple[np.ndarray, float | None]:
        return self.ingest.read()

    def gone(self, now: float, watched: bool) -> str | None:
        if self._connected_at is None:
            if now - self._created > self._settings.connect_timeout_s:
                return "never connected"
            return None
        heard = max(t for t in (self.ingest.last_push, self._last_heard, self._connected_at)
                    if t is not None)
        if now - heard > self._settings.peer_timeout_s:
            return "peer timeout: nothing received"
        return None

    def peer_state(self, state: str, now: float) -> None:
        self.state = state
        if state == "connected" and self._connected_at is None:
            self._connected_at = now

    def heard(self, now: float) -> None:
        self._last_heard = now

    def stats(self) -> dict[str, Any]:
        stats = self.ingest.stats
        return {"buffer_ms": round(1000 * self.ingest.level / AUDIO_RATE, 1),
                "underruns": stats.underruns,
                "dropped_ms": round(1000 * stats.dropped_samples / AUDIO_RATE, 1),
                # Played faster (spliced out) or slower (spliced in) to keep the buffer at
                # its target: server/media/audio_ingest.py.
                "removed_ms": round(1000 * stats.removed_samples / AUDIO_RATE, 1),
                "repeated_ms": round(1000 * stats.repeated_samples / AUDIO_RATE, 1),
                "received_s": round(stats.received_samples / AUDIO_RATE, 2)}

    def close(self) -> None:
        pass


class PushedSpeech:
    """Speech an application pushes (``POST /sessions``), played in order at real time as
    it is queued: no network clock to follow, so each chunk arrives as it is taken. The
    session has no peer of its own: it goes after ``unattended_timeout_s`` with no speech
    queued and no viewer."""

    state = "ready"  # whoever watches comes and goes

    def __init__(self, session_id: str, clock: MediaClock, settings: SessionSettings,
                 events: EventStream, keep_chunks: int) -> None:
        self.utterances = Utterances(session_id, clock, SpeechQueue(
            clock.chunk_samples, round(settings.speech_buffer_s * AUDIO_RATE)), events,
            keep_chunks)
        self._chunk = clock.chunk_samples
        self._timeout = settings.unattended_timeout_s
        self._last_active = clock.origin
        self._received = 0

    def next_chunk(self, k: int, now: float) -> tuple[np.ndarray, float | None]:
        pushed = self.utterances.take(k)
        if pushed is None:
            return np.zeros(self._chunk, np.int16), now
        self._received += pushed.size
        return pushed, now

    def gone(self, now: float, watched: bool) -> str | None:
        if self.utterances.queue.queued or watched:
            self._last_active = now
        elif now - self._last_active > self._timeout:
            return "idle: no speech and no viewer"
        return None

    def peer_state(self, state: str, now: float) -> None:
        pass  # its viewers' connections are theirs

    def heard(self, now: float) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"buffer_ms": round(1000 * self.utterances.queue.queued / AUDIO_RATE, 1),
                "received_s": round(self._received / AUDIO_RATE, 2)}

    def close(self) -> None:
        self.utterances.close()


def audio_source(kind: SessionKind, session_id: str, clock: MediaClock,
                 settings: SessionSettings, events: EventStream, spawn: Spawn,
                 keep_chunks: int) -> PeerAudio | PushedSpeech:
    """The source a session of ``kind`` takes its speech from."""
    if kind is SessionKind.HOSTED:
        return PushedSpeech(session_id, clock, settings, events, keep_chunks)
    return PeerAudio(clock, settings, spawn)
