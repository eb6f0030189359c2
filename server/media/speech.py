"""Speech an application pushes into a session (its TTS, as it synthesises): the body
decoded as it streams in (WAV, or raw ``audio/L16``), converted to the server's 48 kHz
mono, and queued for the session's timeline, which plays it at real time. A producer
that runs ahead waits once the queue holds ``limit`` samples: backpressure, not memory."""

from __future__ import annotations

import asyncio
import struct
import time
from collections import deque
from typing import Any

import av
import numpy as np

from server.media.audio_ingest import Resampler
from server.media.clock import AUDIO_RATE, MediaClock
from server.media.events import EventStream

WAV_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"})
RATES = range(8000, 96001)


class SpeechError(ValueError):
    """Speech that cannot be played; ``code`` names why for the JSON answer."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _parameters(content_type: str) -> tuple[str, dict[str, str]]:
    kind, *parts = (p.strip() for p in content_type.split(";"))
    params = {}
    for part in parts:
        name, _, value = part.partition("=")
        params[name.strip().lower()] = value.strip().strip('"')
    return kind.lower(), params


class SpeechDecoder:
    """A speech body, fed as it arrives, out as 48 kHz mono int16. WAV (16-bit PCM, the
    header read from the stream, a data size of 0 or 0xFFFFFFFF meaning "until the end",
    as streaming TTS writes it) or ``audio/L16;rate=R;channels=C`` (16-bit big-endian, as
    RFC 2586 defines it)."""

    def __init__(self, content_type: str) -> None:
        kind, params = _parameters(content_type)
        self._header: bytearray | None = None
        self.rate = self.channels = 0
        self._big_endian = False
        if kind in WAV_TYPES:
            self._header = bytearray()
        elif kind == "audio/l16":
            try:
                self.rate = int(params.get("rate", ""))
                self.channels = int(params.get("channels", "1"))
            except ValueError:
                raise SpeechError(400, "bad_audio_format", "audio/L16 needs rate=<Hz> and "
                                  "channels=<1 or 2>, e.g. audio/L16;rate=16000") from None
            self._big_endian = True
            self._check_format()
        else:
            raise SpeechError(415, "unsupported_media_type",
                              f"speech must be audio/wav or audio/L16;rate=...;channels=..., "
                              f"not {content_type or 'nothing'}")
        self._pending = b""
        self._resampler = Resampler(AUDIO_RATE)
        self.samples_in = 0  # frames of the source, at its own rate

    def _check_format(self) -> None:
        if self.rate not in RATES or self.channels not in (1, 2):
            raise SpeechError(400, "bad_audio_format",
                              f"{self.rate} Hz, {self.channels} channel(s): speech must be "
                              f"8-96 kHz, mono or stereo")

    def _read_header(self) -> bytes | None:
        """Once the WAV header is whole: the bytes after it; until then None."""
        head = self._header
        assert head is not None
        if len(head) >= 4 and head[:4] != b"RIFF" or len(head) >= 12 and head[8:12] != b"WAVE":
            raise SpeechError(400, "bad_wav", "not a WAV file (no RIFF/WAVE header)")
        at, fmt = 12, None
        while len(head) >= at + 8:
            kind, size = head[at:at + 4], struct.unpack("<I", head[at + 4:at + 8])[0]
            if kind == b"data":
                if fmt is None:
                    raise SpeechError(400, "bad_wav", "the WAV data comes before its format")
                self._header = None
                return bytes(head[at + 8:])
            if len(head) < at + 8 + size:
                break
            if kind == b"fmt ":
                fmt = head[at + 8:at + 8 + size]
                if size < 16:
                    raise SpeechError(400, "bad_wav", "the WAV format chunk is too short")
                code, self.channels, self.rate = struct.unpack("<HHI", fmt[:8])
                bits = struct.unpack("<H", fmt[14:16])[0]
                if code not in (1, 0xFFFE) or bits != 16:
                    raise SpeechError(400, "bad_audio_format", "WAV speech must be 16-bit PCM")
                self._check_format()
            at += 8 + size + (size & 1)
            if at > 1 << 16:
                raise SpeechError(400, "bad_wav", "no WAV data in the first 64 kB")
        return None

    def feed(self, data: bytes) -> np.ndarray:
        """The samples these bytes complete (maybe none yet)."""
        if self._header is not None:
            self._header += data
            rest = self._read_header()
            if rest is None:
                return np.zeros(0, np.int16)
            data = rest
        data = self._pending + data
        frame_bytes = 2 * self.channels
        usable = len(data) - len(data) % frame_bytes
        self._pending = data[usable:]
        if not usable:
            return np.zeros(0, np.int16)
        pcm = np.frombuffer(data[:usable], ">i2" if self._big_endian else "<i2")
        self.samples_in += pcm.size // self.channels
        if self.rate == AUDIO_RATE and self.channels == 1:
            return pcm.astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm.astype(np.int16).reshape(1, -1), format="s16",
                                           layout="mono" if self.channels == 1 else "stereo")
        frame.sample_rate = self.rate
        return self._resampler.resample(frame)

    def finish(self) -> None:
        """The body ended: it must have been whole."""
        if self._header is not None:
            raise SpeechError(400, "bad_wav", "the body ended inside the WAV header")
        if self._pending:
            raise SpeechError(400, "odd_byte_count", f"the speech ended {len(self._pending)} "
                              f"byte(s) into a sample frame of {2 * self.channels} bytes")


class SpeechQueue:
    """Pushed speech waiting to play, each part tagged with its utterance: the timeline
    takes ``chunk`` samples a tick. ``clear`` (barge-in, the session's end) empties it
    and starts a new ``generation``: what producers of the old one still send is
    refused."""

    def __init__(self, chunk: int, limit: int) -> None:
        self.chunk = chunk
        self.limit = limit
        self._parts: deque[tuple[str, np.ndarray]] = deque()
        self.queued = 0
        self.generation = 0
        self._room = asyncio.Event()
        self._room.set()

    async def put(self, samples: np.ndarray, utterance: str, generation: int) -> bool:
        """Queue ``samples``, waiting while the queue is full (the producer is ahead).
        False, and nothing queued, once the queue is cleared after ``generation``."""
        for start in range(0, samples.size, self.chunk):
            part = samples[start:start + self.chunk]
            while self.queued + part.size > self.limit and self.generation == generation:
                self._room.clear()
                await self._room.wait()
            if self.generation != generation:
                return False
            self._parts.append((utterance, part))
            self.queued += part.size
        return self.generation == generation

    def read(self) -> tuple[np.ndarray, list[tuple[str, int]]] | None:
        """The next chunk (padded with silence where the queue ran out) and how many of its
        samples each utterance gave, or None when nothing is queued."""
        if not self.queued:
            return None
        out, have, sources = [], 0, []
        while have < self.chunk and self._parts:
            utterance, part = self._parts.popleft()
            take = part[:self.chunk - have]
            if take.size < part.size:
                self._parts.appendleft((utterance, part[take.size:]))
            out.append(take)
            have += take.size
            self.queued -= take.size
            if sources and sources[-1][0] == utterance:
                sources[-1] = (utterance, sources[-1][1] + take.size)
            else:
                sources.append((utterance, take.size))
        self._room.set()
        if have < self.chunk:
            out.append(np.zeros(self.chunk - have, np.int16))
        return np.concatenate(out), sources

    def clear(self) -> list[str]:
        """Empty it; the utterances that had speech still queued."""
        cut = list(dict.fromkeys(utterance for utterance, _ in self._parts))
        self._parts.clear()
        self.queued = 0
        self.generation += 1
        self._room.set()
        return cut


class Utterances:
    """Pushed speech on a session's timeline: which utterances each chunk holds, their
    start and end announced (``events``) when the chunk's sound is due to leave on the
    session ``clock``, and, at a barge-in, how much of each cut one was heard."""

    def __init__(self, session_id: str, clock: MediaClock, queue: SpeechQueue,
                 events: EventStream, keep_chunks: int) -> None:
        self._session_id = session_id
        self._clock = clock
        self.queue = queue
        self._events = events
        self._keep = keep_chunks
        self._count = 0
        self._chunk_sources: dict[int, list[tuple[str, int]]] = {}  # chunk -> its samples
        self._played: dict[str, int] = {}  # utterance -> samples the timeline took
        self._last_chunk: dict[str, int] = {}  # utterance -> the last chunk it is in
        self._totals: dict[str, int] = {}  # utterance -> samples in all, once all arrived
        self._rates: dict[str, int] = {}  # utterance -> the rate it was sent at
        self._timers: dict[str, list[asyncio.TimerHandle]] = {}  # its events still to come

    def sent_at(self, utterance: str, rate: int) -> None:
        """``utterance`` arrives at ``rate`` Hz: what is said of it counts its samples so."""
        self._rates[utterance] = rate

    def next_id(self) -> str:
        """A name for the next utterance, in the order they play."""
        self._count += 1
        return f"{self._session_id}-u{self._count}"

    def take(self, k: int) -> np.ndarray | None:
        """Chunk ``k`` of pushed speech for the timeline (None: nothing queued)."""
        self._chunk_sources.pop(k - self._keep, None)
        pushed = self.queue.read()
        if pushed is None:
            return None
        samples, sources = pushed
        self._chunk_sources[k] = sources
        for utterance, n in sources:
            if utterance not in self._played:
                self._played[utterance] = 0
                self._announce("utterance_started", utterance, k)
            self._played[utterance] += n
            self._last_chunk[utterance] = k
            self._end_when_played(utterance)
        return samples

    def complete(self, utterance: str, samples: int) -> None:
        """All of ``utterance`` has arrived: ``samples`` at 48 kHz. Its end is announced
        when the last of them leaves."""
        if samples:
            self._totals[utterance] = samples
            self._end_when_played(utterance)

    def cut(self, first: int, end: int) -> list[dict[str, Any]]:
        """Barge-in from chunk ``first`` (chunks up to ``end`` are on the timeline, unsent):
        the queue emptied, and for each utterance cut, how much of it was heard, in seconds
        and in its own samples (at the rate it was sent, as its upload was counted). Cut
        ones are never "ended"; "started" only if their sound left before the cut."""
        queued = self.queue.clear()
        unsent: dict[str, int] = {}
        for k in range(first, end):
            for utterance, n in self._chunk_sources.pop(k, ()):
                unsent[utterance] = unsent.get(utterance, 0) + n
        heard = []
        for utterance in dict.fromkeys([*unsent, *queued]):
            played = self._played.get(utterance, 0) - unsent.get(utterance, 0)
            rate = self._rates.get(utterance, AUDIO_RATE)
            heard.append({"utterance_id": utterance,
                          "heard_samples": played * rate // AUDIO_RATE, "rate": rate,
                          "heard_s": round(played / AUDIO_RATE, 3)})
            for timer in self._timers.pop(utterance, ()):
                timer.cancel()
            self._forget(utterance)
        return heard

    def close(self) -> None:
        self.queue.clear()  # a producer waiting for room is let go
        for timers in self._timers.values():
            for timer in timers:
                timer.cancel()
        self._timers.clear()

    def _end_when_played(self, utterance: str) -> None:
        total = self._totals.get(utterance)
        if total is not None and self._played.get(utterance, -1) >= total:
            del self._totals[utterance]  # announced once; what was played stays until then
            self._announce("utterance_ended", utterance, self._last_chunk[utterance] + 1)

    def _forget(self, utterance: str) -> None:
        for table in (self._totals, self._played, self._last_chunk, self._rates):
            table.pop(utterance, None)

    def _announce(self, kind: str, utterance: str, k: int) -> None:
        """``kind`` of ``utterance`` when chunk ``k``'s sound is sent (its media time and
        frame, and the wall clock then: what RTCP sender reports map viewers' audio to),
        whether or not anyone is watching."""
        loop = asyncio.get_running_loop()
        at = self._clock.audio_send_time(k)

        def publish() -> None:
            if kind == "utterance_ended":
                self._timers.pop(utterance, None)
                self._forget(utterance)
            self._events.publish({
                "type": kind, "session_id": self._session_id, "utterance_id": utterance,
                "media_time_s": round(k * self._clock.chunk_seconds, 3),
                "frame": k // self._clock.chunks_per_frame,
                "wall_time": round(time.time() - (loop.time() - at), 4)})

        self._timers.setdefault(utterance, []).append(loop.call_at(at, publish))
