"""Audio in: a peer's audio frames into one 48 kHz mono stream, behind an adaptive buffer.

The session clock reads fixed 20 ms chunks at its own pace. This buffer absorbs network
jitter (it refills to ``jitter_ms`` after running dry) and steers its level back to that
target whatever the sender does: audio held beyond it (a backlog after a stall, a sender
clock running fast) is played up to 10% faster, and a level below it (a slow sender
clock, growing jitter) a little slower, by removing or repeating whole pitch periods or
quiet stretches (``server.media.time_scale``). So the delay comes back after a stall instead of
staying, and clock skew never accumulates. Video follows the same output stream, so lips
and sound stay together. Past ``max_buffer_ms`` the oldest audio is still dropped, as a
last resort. Every chunk read remembers when its first sample arrived, so the pipeline
delay can be measured from the real arrival time.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiortc.rtcrtpreceiver
import av
import numpy as np
from aiortc import RTCPeerConnection
from aiortc.codecs import get_decoder
from aiortc.jitterbuffer import MAX_MISORDER, JitterFrame
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtcrtpparameters import RTCRtpCodecParameters
from aiortc.rtp import RtpPacket

from server.media.clock import AUDIO_RATE
from server.media.time_scale import FADE, MIN_LAG, best_lag, splice_in, splice_out

log = logging.getLogger(__name__)

#: Playout runs at most this much faster or slower than real time.
MAX_RATE = 0.10
#: The buffer's error is corrected over about this many chunks (1 s) until MAX_RATE binds.
RESPONSE_CHUNKS = 50
#: Reads over which the buffer's level is averaged (0.5 s): one late or missing packet
#: moves the average a little, a backlog or a skewed clock moves it for good.
LEVEL_WINDOW = 25
#: Below this RMS (about -40 dBFS) a stretch counts as quiet: any lag splices unheard.
QUIET_RMS = 300.0
#: A voiced splice needs the signal to repeat this well at the lag.
MIN_MATCH = 0.6


@dataclass
class IngestStats:
    received_samples: int = 0
    underruns: int = 0
    dropped_samples: int = 0
    removed_samples: int = 0  # played faster: samples spliced out
    repeated_samples: int = 0  # played slower: samples spliced in


class AudioIngest:
    """FIFO of mono int16 samples at 48 kHz, read in fixed chunks by the session clock."""

    def __init__(self, chunk_samples: int, jitter_ms: float, max_buffer_ms: float) -> None:
        self.chunk = chunk_samples
        self.target = int(AUDIO_RATE * jitter_ms / 1000)
        self.limit = int(AUDIO_RATE * max_buffer_ms / 1000)
        self.stats = IngestStats()
        self._segments: deque[tuple[np.ndarray, float]] = deque()
        self._level = 0
        self._buffering = True
        self._levels: deque[int] = deque(maxlen=LEVEL_WINDOW)
        self._debt = 0.0  # samples to remove (> 0) or repeat (< 0) as splices allow
        self.last_push: float | None = None

    @property
    def level(self) -> int:
        return self._level

    def push(self, samples: np.ndarray, arrival: float) -> None:
        if samples.size == 0:
            return
        self._segments.append((samples, arrival))
        self._level += samples.size
        self.stats.received_samples += samples.size
        self.last_push = arrival
        if self._level > self.limit:
            self._drop(self._level - self.target - self.chunk)

    def read(self) -> tuple[np.ndarray, float | None]:
        """One chunk and the arrival time of its first sample; silence (None) when dry.
        Before each read the buffer holds the chunk plus ``jitter_ms`` of audio (refilled
        to that after running dry, steered back to it otherwise): after it, ``jitter_ms``
        of audio is left to ride out a late packet."""
        target = self.target + self.chunk
        if self._buffering:
            if self._level < target:
                return np.zeros(self.chunk, np.int16), None
            self._buffering = False
            self._levels.clear()
            self._debt = 0.0
        if self._level < self.chunk:
            self.stats.underruns += 1
            self._buffering = True
            return np.zeros(self.chunk, np.int16), None
        self._levels.append(self._level)
        step = MAX_RATE * self.chunk
        error = (sum(self._levels) / len(self._levels) - target) / RESPONSE_CHUNKS
        debt = self._debt + min(max(error, -step), step)
        self._debt = min(max(debt, -2.0 * self.chunk), 2.0 * self.chunk)
        arrival = self._segments[0][1]
        return self._scaled_chunk(), arrival

    def _scaled_chunk(self) -> np.ndarray:
        """The next chunk of output: plain, or with one splice where the debt calls for one
        and the audio allows it unheard (a quiet stretch, or a repeating voiced one)."""
        n = self.chunk
        if self._debt >= MIN_LAG:
            hi = min(int(self._debt), n, self._level - n)
            lag = self._splice_lag(self._peek(n + hi), hi) if hi >= MIN_LAG else 0
            if lag:
                self._debt -= lag
                self.stats.removed_samples += lag
                return splice_out(self._take(n + lag), lag)
        elif self._debt <= -MIN_LAG:
            hi = min(int(-self._debt), (n - FADE) // 2)
            lag = self._splice_lag(self._peek(n), hi)
            if lag:
                self._debt += lag
                self.stats.repeated_samples += lag
                return splice_in(self._take(n - lag), lag)
        return self._take(n)

    @staticmethod
    def _splice_lag(x: np.ndarray, hi: int) -> int:
        """A lag up to ``hi`` at which ``x`` splices unheard, or 0 if none here."""
        signal = x[:hi + FADE].astype(np.float32)
        if float(np.sqrt(np.mean(signal * signal))) < QUIET_RMS:
            return hi
        lag, match = best_lag(x, MIN_LAG, hi)
        return lag if match >= MIN_MATCH else 0

    def _peek(self, count: int) -> np.ndarray:
        parts, have = [], 0
        for samples, _ in self._segments:
            parts.append(samples[:count - have])
            have += parts[-1].size
            if have >= count:
                break
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _take(self, count: int) -> np.ndarray:
        parts = []
        while count > 0:
            samples, arrival = self._segments[0]
            if samples.size <= count:
                self._segments.popleft()
                parts.append(samples)
                count -= samples.size
            else:
                parts.append(samples[:count])
                self._segments[0] = (samples[count:], arrival)
                count = 0
        out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self._level -= out.size
        return out

    def _drop(self, count: int) -> None:
        self._take(count)
        self.stats.dropped_samples += count


class Resampler:
    """Audio frames to mono int16 at ``rate``, through FFmpeg's resampler as PyAV's
    ``AudioResampler`` does, but in a filter graph of one thread. FFmpeg gives a graph a
    pool of one thread per core by default, idle for audio, so every session held that
    many threads (16 on a 16-core host) for as long as its resampler lived."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._graph: av.filter.Graph | None = None
        self._input: tuple[str, str, int] | None = None
        self._samples_in = 0  # since the graph was made

    def output_after(self, samples: int, rate: int) -> int:
        """Samples that ``samples`` more input at ``rate`` will bring out: the growth of the
        input's length at the output rate (what the filter holds back is constant once it
        runs, so it cancels)."""
        return ((self._samples_in + samples) * self.rate // rate
                - self._samples_in * self.rate // rate)

    def _configure(self, frame: av.AudioFrame) -> av.filter.Graph:
        graph = av.filter.Graph()
        graph.threads = 1
        source = graph.add_abuffer(format=frame.format.name, layout=frame.layout.name,
                                   sample_rate=frame.sample_rate,
                                   time_base=fractions.Fraction(1, frame.sample_rate))
        chain = [source, graph.add("aresample", str(self.rate)),
                 graph.add("aformat", "sample_fmts=s16:channel_layouts=mono"),
                 graph.add("abuffersink")]
        for a, b in zip(chain, chain[1:], strict=False):
            a.link_to(b)
        graph.configure()
        return graph

    def resample(self, frame: av.AudioFrame) -> np.ndarray:
        shape = (frame.format.name, frame.layout.name, frame.sample_rate)
        if self._graph is None or shape != self._input:
            self._graph, self._input = self._configure(frame), shape
            self._samples_in = 0
        frame.pts = None  # the graph keeps its own time
        self._graph.push(frame)
        self._samples_in += frame.samples
        out = []
        while True:
            try:
                out.append(self._graph.pull().to_ndarray().reshape(-1))
            except (av.BlockingIOError, av.EOFError):
                break
        return np.concatenate(out) if len(out) > 1 else out[0] if out else np.zeros(0, np.int16)


def to_mono_48k(frame: av.AudioFrame, resampler: Resampler) -> np.ndarray:
    """Mono int16 at 48 kHz. Takes one channel of packed s16 stereo (down-mixing identical
    channels would add 3 dB); anything else goes through ``resampler``."""
    if frame.sample_rate == AUDIO_RATE and frame.format.name == "s16":
        data = frame.to_ndarray().reshape(-1)
        channels = len(frame.layout.channels)
        return (data[::channels] if channels > 1 else data).copy()
    return resampler.resample(frame)


async def pump_track(track: MediaStreamTrack, ingest: AudioIngest,
                     clock: Callable[[], float]) -> None:
    """Feed an inbound audio track into ``ingest`` until the track ends."""
    resampler = Resampler(AUDIO_RATE)
    try:
        while True:
            frame = await track.recv()
            assert isinstance(frame, av.AudioFrame)
            ingest.push(to_mono_48k(frame, resampler), clock())
    except MediaStreamError:
        log.debug("inbound audio track ended")


class InlineAudioDecoder:
    """Decodes a receiver's audio on the event loop, as each packet leaves its jitter
    buffer. aiortc gives every receiver a decoder thread fed by a queue, which hands each
    decoded 20 ms back to the loop with a task and a wake-up through its self-pipe: two
    thread switches and a GIL hand-over per packet, against 0.03 ms to decode one. This
    stands in for that queue (``put``, as the receiver calls it). Opus is decoded to mono,
    which is what the session keeps (a stereo stream is down-mixed by libopus)."""

    def __init__(self, output: asyncio.Queue[Any], error: threading.Event) -> None:
        self._output = output
        self._error = error
        self._codec: str | None = None
        self._decoder: Any = None

    def put(self, task: tuple[RTCRtpCodecParameters, Any] | None) -> None:
        if task is None:  # the receiver stops: so does its track
            self._output.put_nowait(None)
            return
        codec, encoded = task
        if codec.name != self._codec:
            self._decoder, self._codec = _audio_decoder(codec), codec.name
        try:
            frames = self._decoder.decode(encoded)
        except av.FFmpegError as exc:  # as aiortc does: keep the decoder's state
            log.warning("failed to decode a %s packet: %s", codec.name, exc)
            self._error.set()
            return
        for frame in frames:
            self._output.put_nowait(frame)


class _MonoOpusDecoder:
    def __init__(self) -> None:
        self.codec = av.CodecContext.create("libopus", "r")
        self.codec.format = "s16"
        self.codec.layout = "mono"
        self.codec.sample_rate = AUDIO_RATE

    def decode(self, encoded: Any) -> list[av.AudioFrame]:
        packet = av.Packet(encoded.data)
        packet.pts, packet.time_base = encoded.timestamp, fractions.Fraction(1, AUDIO_RATE)
        return list(self.codec.decode(packet))


def _audio_decoder(codec: RTCRtpCodecParameters) -> Any:
    return _MonoOpusDecoder() if codec.name.lower() == "opus" else get_decoder(codec)


class PacketsOnArrival:
    """Stands in for aiortc's audio jitter buffer, which lets a packet go only once four
    more have come (80 ms of 20 ms packets, 160 ms of 40 ms ones) and holds everything
    behind a lost packet until 16 have piled up: delay that no one measured, before the
    session's own buffer (``AudioIngest``) even sees the audio. That buffer rides out
    jitter itself, so here a packet passes as it arrives; one older than a packet already
    passed comes too late to be heard and is dropped, unless it is so far behind that the
    sender must have started its numbering again (as aiortc's buffer judges it)."""

    def __init__(self) -> None:
        self._last: int | None = None

    def add(self, packet: RtpPacket) -> tuple[bool, JitterFrame | None]:
        """(no picture lost, the packet's frame or None), as aiortc's buffer answers."""
        if self._last is not None:
            ahead = (packet.sequence_number - self._last) % 65536
            if ahead == 0 or 65536 - ahead <= MAX_MISORDER:
                return False, None
        self._last = packet.sequence_number
        data = packet._data  # type: ignore[attr-defined]  # the receiver's depayloaded payload
        return False, JitterFrame(data=data, timestamp=packet.timestamp)


def decode_on_loop(pc: RTCPeerConnection, track: MediaStreamTrack) -> None:
    """``track``'s receiver decodes on the event loop (``InlineAudioDecoder``) rather than on
    a thread of its own, each packet as it arrives (``PacketsOnArrival``); call as the track
    arrives, before the connection is up. Audio only: decoding a picture is long enough to
    hold the loop up."""
    receiver = next((t.receiver for t in pc.getTransceivers() if t.receiver.track is track),
                    None)
    if receiver is None or track.kind != "audio" or \
            receiver._RTCRtpReceiver__started:  # type: ignore[attr-defined]
        return
    receiver._RTCRtpReceiver__decoder_queue = InlineAudioDecoder(  # type: ignore[attr-defined]
        track._queue, receiver._RTCRtpReceiver__decoder_error)  # type: ignore[attr-defined]
    receiver._RTCRtpReceiver__jitter_buffer = PacketsOnArrival()  # type: ignore[attr-defined]
    aiortc.rtcrtpreceiver.decoder_worker = _decoder_thread


_aiortc_decoder_thread = aiortc.rtcrtpreceiver.decoder_worker


def _decoder_thread(loop: asyncio.AbstractEventLoop, input_q: Any, output_q: Any,
                    decode_error: threading.Event) -> None:
    """What aiortc's decoder thread runs: nothing for a receiver that decodes on the loop
    (the thread ends at once), aiortc's own loop for any other."""
    if not isinstance(input_q, InlineAudioDecoder):
        _aiortc_decoder_thread(loop, input_q, output_q, decode_error)
