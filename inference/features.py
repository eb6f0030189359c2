"""Log-mel features, computed incrementally as audio arrives.

The host feeds every session's audio through :class:`StreamingLogMel` in small chunks
(20 ms) and slices per-video-frame windows out of it, so the work per chunk is only the
mel frames that chunk completed. :func:`log_mel` gives the same numbers offline (tests,
tools, training data), because both share one framing rule:

mel frame ``j`` is centred on sample ``j * hop + hop // 2`` and covers
``[j * hop + hop // 2 - n_fft // 2, j * hop + hop // 2 + n_fft // 2)``; samples before
0 are zeros. Frame ``j`` therefore describes the 10 ms hop ``[j * hop, (j + 1) * hop)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

import numpy as np

from inference.engine import FeatureSpec, FrameTiming


def mel_frequencies(n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """``n_mels`` frequencies (Hz) evenly spaced on Slaney's mel scale (librosa's default:
    linear below 1 kHz, logarithmic above), without importing librosa: the model's band
    weights need them on GPU hosts that do not have it."""
    f_sp, min_log_hz, logstep = 200.0 / 3.0, 1000.0, np.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp

    def to_mel(hz: float) -> float:
        return hz / f_sp if hz < min_log_hz else min_log_mel + np.log(hz / min_log_hz) / logstep

    mels = np.linspace(to_mel(fmin), to_mel(fmax), n_mels)
    return np.where(mels < min_log_mel, f_sp * mels,
                    min_log_hz * np.exp(logstep * (mels - min_log_mel)))


def mel_filterbank(spec: FeatureSpec) -> np.ndarray:
    """(n_mels, n_fft // 2 + 1) float32 triangles on Slaney's mel scale, each scaled to unit
    area ("slaney" norm): librosa's ``filters.mel`` defaults, the same floats, computed here
    so that serving needs neither librosa nor the numba, scipy and scikit-learn it pulls in."""
    fft_hz = np.fft.rfftfreq(spec.n_fft, 1.0 / spec.sample_rate)
    edges = mel_frequencies(spec.n_mels + 2, spec.fmin, spec.fmax)
    widths = np.diff(edges)
    ramps = np.subtract.outer(edges, fft_hz)
    weights = np.zeros((spec.n_mels, fft_hz.size), dtype=np.float32)
    for i in range(spec.n_mels):
        weights[i] = np.maximum(0, np.minimum(-ramps[i] / widths[i], ramps[i + 2] / widths[i + 1]))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, np.newaxis]
    return weights


@lru_cache(maxsize=8)
def _tables(spec: FeatureSpec) -> tuple[np.ndarray, np.ndarray]:
    """(periodic hann window, mel matrix transposed to (n_fft // 2 + 1, n_mels)), cached."""
    n = np.arange(spec.n_fft, dtype=np.float64)
    window = (0.5 - 0.5 * np.cos(2.0 * np.pi * n / spec.n_fft)).astype(np.float32)
    return window, np.ascontiguousarray(mel_filterbank(spec).T, dtype=np.float32)


def _left_pad(spec: FeatureSpec) -> int:
    """Zeros in front of sample 0 so that frame ``j`` starts at padded sample ``j * hop``."""
    return spec.n_fft // 2 - spec.hop_length // 2


def _frames_to_log_mel(padded: np.ndarray, n_frames: int, spec: FeatureSpec) -> np.ndarray:
    """Log-mel of the first ``n_frames`` frames of ``padded`` (frame j at j * hop)."""
    window, mel_t = _tables(spec)
    if n_frames <= 0:
        return np.empty((0, spec.n_mels), dtype=np.float32)
    span = (n_frames - 1) * spec.hop_length + spec.n_fft
    views = np.lib.stride_tricks.sliding_window_view(padded[:span], spec.n_fft)
    frames = views[:: spec.hop_length] * window
    spectrum = np.fft.rfft(frames, axis=-1)
    power = (spectrum.real * spectrum.real + spectrum.imag * spectrum.imag).astype(np.float32)
    # Per-row dot products keep results independent of how many frames are batched, so
    # streaming and offline agree bit for bit (a plain GEMM may block rows differently).
    mel_power = np.einsum("fk,km->fm", power, mel_t, optimize=False)
    return np.log10(np.maximum(mel_power, np.float32(spec.floor))).astype(np.float32)


def log_mel(samples: np.ndarray, spec: FeatureSpec | None = None) -> np.ndarray:
    """Offline log-mel, (frames, n_mels) float32: every frame that ``samples`` completes."""
    spec = spec or FeatureSpec()
    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    padded = np.concatenate([np.zeros(_left_pad(spec), np.float32), samples])
    n_frames = (padded.size - spec.n_fft) // spec.hop_length + 1
    return _frames_to_log_mel(padded, n_frames, spec)


class StreamingLogMel:
    """Incremental log-mel for one audio stream (16 kHz mono float32 in [-1, 1]).

    Not thread-safe; one instance per session, fed from one task.
    """

    def __init__(self, spec: FeatureSpec | None = None) -> None:
        self.spec = spec or FeatureSpec()
        _tables(self.spec)  # build the mel matrix now, not on the first audio chunk
        self.silence = np.log10(np.float32(self.spec.floor))
        # Samples not yet fully consumed; _pending[0] is padded sample _next_frame * hop.
        self._pending = np.zeros(_left_pad(self.spec), dtype=np.float32)
        self._next_frame = 0
        # Computed frames [_first, _first + _count) live in _store[:_count].
        self._store = np.empty((256, self.spec.n_mels), dtype=np.float32)
        self._first = 0
        self._count = 0

    @property
    def frames_available(self) -> int:
        """Frames ``0 .. frames_available - 1`` are complete (some may be discarded)."""
        return self._next_frame

    @property
    def first_retained(self) -> int:
        """Lowest frame index that :meth:`window` can still return."""
        return self._first

    def push(self, samples: np.ndarray) -> None:
        """Append audio and compute every mel frame that has become complete."""
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if samples.size == 0:
            return
        pending = np.concatenate([self._pending, samples])
        hop, n_fft = self.spec.hop_length, self.spec.n_fft
        n_new = (pending.size - n_fft) // hop + 1 if pending.size >= n_fft else 0
        if n_new > 0:
            self._append(_frames_to_log_mel(pending, n_new, self.spec))
            pending = pending[n_new * hop :]
            self._next_frame += n_new
        self._pending = pending.copy()

    def _append(self, rows: np.ndarray) -> None:
        needed = self._count + rows.shape[0]
        if needed > self._store.shape[0]:
            grown = np.empty((max(needed, 2 * self._store.shape[0]), self.spec.n_mels), np.float32)
            grown[: self._count] = self._store[: self._count]
            self._store = grown
        self._store[self._count : needed] = rows
        self._count = needed

    def window(self, start: int, length: int) -> np.ndarray:
        """Frames ``[start, start + length)`` as (length, n_mels) float32.

        Frames before 0 read as digital silence (``log10(floor)``).
        """
        end = start + length
        if length < 0 or end > self._next_frame:
            raise ValueError(
                f"frames [{start}, {end}) requested, only {self._next_frame} available"
            )
        lo = max(start, 0)
        if lo < end and lo < self._first:
            raise ValueError(f"frames before {self._first} were discarded (asked for {lo})")
        out = np.empty((length, self.spec.n_mels), dtype=np.float32)
        n_silent = min(lo - start, length)
        out[:n_silent] = self.silence
        if lo < end:
            out[n_silent:] = self._store[lo - self._first : end - self._first]
        return out

    def silence_from(self, sample: int) -> None:
        """The stream as if it had been silent from ``sample`` on (barge-in: speech cut off
        must not reach a frame still to be made): every mel frame that heard that audio
        reads as silence, and audio not yet framed is zeroed."""
        spec = self.spec
        padded = sample + _left_pad(spec)
        first = max(self._first, (padded - spec.n_fft) // spec.hop_length + 1)
        if first < self._first + self._count:
            self._store[first - self._first:self._count] = self.silence
        offset = padded - self._next_frame * spec.hop_length
        if offset < self._pending.size:
            self._pending[max(offset, 0):] = 0.0

    def discard_before(self, frame: int) -> None:
        """Forget frames below ``frame`` so a long session's memory stays bounded."""
        frame = min(frame, self._next_frame)
        drop = frame - self._first
        if drop <= 0:
            return
        keep = self._count - drop
        self._store[:keep] = self._store[drop : self._count]
        self._first = frame
        self._count = keep


class FrameWindows:
    """Each video frame's feature window, cut from a stream of 16 kHz audio as soon as the
    audio completes it (``FrameTiming.window_start``): the one path from audio to engine
    input, live (sessions) and offline (renders, tests, benchmarks).

    Memory stays bounded: mel frames no later window needs are dropped as windows leave.
    """

    def __init__(self, timing: FrameTiming) -> None:
        self.timing = timing
        self._mel = StreamingLogMel(timing.features)
        self.next_frame = 0
        self.samples_pushed = 0

    def push(self, samples: np.ndarray) -> None:
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        self.samples_pushed += samples.size
        self._mel.push(samples)

    def samples_wanted(self) -> int:
        """Samples that must have been pushed, in all, before ``ready`` yields the next frame:
        its window's last mel frame complete. A caller holding audio back (to push a frame
        period's worth at once: one call instead of two or more) pushes when it gets there."""
        timing, spec = self.timing, self.timing.features
        last = timing.window_start(self.next_frame) + timing.window_frames - 1
        return last * spec.hop_length + spec.n_fft - _left_pad(spec)

    def silence_from(self, sample: int) -> None:
        """Windows still to come hear nothing of the audio from ``sample`` on."""
        self._mel.silence_from(sample)

    def silent_window(self) -> np.ndarray:
        return np.full((self.timing.window_frames, self.timing.features.n_mels),
                       self._mel.silence, np.float32)

    def ready(self) -> Iterator[tuple[int, np.ndarray]]:
        """(video frame index, its (window_frames, n_mels) window) for every frame the audio
        pushed so far completes, in order, each once."""
        timing = self.timing
        while True:
            start = timing.window_start(self.next_frame)
            if start + timing.window_frames > self._mel.frames_available:
                return
            index = self.next_frame
            self.next_frame += 1
            window = self._mel.window(start, timing.window_frames)
            self._mel.discard_before(timing.window_start(self.next_frame))
            yield index, window

    def finish(self) -> Iterator[tuple[int, np.ndarray]]:
        """The end of a clip (offline): the windows of every frame its audio started,
        completed with silence so the last ones get their look-ahead. Push nothing after."""
        timing, spec = self.timing, self.timing.features
        started = -(-self.samples_pushed * timing.fps // spec.sample_rate)
        reach = timing.mel_frames_per_video_frame + timing.lookahead_frames
        self._mel.push(np.zeros(reach * spec.hop_length + spec.n_fft, np.float32))
        for index, window in self.ready():
            if index >= started:
                return
            yield index, window
