"""Log-mel features: streaming equals offline, the framing rule, librosa agreement, speed."""

from __future__ import annotations

import subprocess
import sys
import time

import librosa
import numpy as np
import pytest

from inference.engine import FeatureSpec
from inference.features import (
    FrameWindows,
    StreamingLogMel,
    log_mel,
    mel_filterbank,
    mel_frequencies,
)
from inference.model.timing import TIMING
from inference.tts import SpeechUnavailable, espeak

pytestmark = pytest.mark.unit

SPEC = FeatureSpec()


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    """espeak-ng speech, mono float32 at 16 kHz."""
    try:
        pcm = espeak("Seven silly swans swam south, singing softly.", words_per_minute=175)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))
    return pcm.astype(np.float32) / 32768.0


def stream(samples: np.ndarray, chunk_sizes: np.ndarray) -> StreamingLogMel:
    features = StreamingLogMel(SPEC)
    pos = 0
    for size in chunk_sizes:
        features.push(samples[pos : pos + size])
        pos += int(size)
        if pos >= samples.size:
            break
    assert pos >= samples.size
    return features


def expected_frames(n_samples: int) -> int:
    """Frames whose whole n_fft span lies within the audio (plus the zeros before it)."""
    pad = SPEC.n_fft // 2 - SPEC.hop_length // 2
    return max(0, (n_samples + pad - SPEC.n_fft) // SPEC.hop_length + 1)


@pytest.mark.parametrize(
    "chunking", ["1", "159", "160", "161", "320", "512", "4000", "random", "whole"]
)
def test_streaming_equals_offline(speech: np.ndarray, chunking: str) -> None:
    n = speech.size
    if chunking == "random":
        sizes = np.random.default_rng(7).integers(0, 700, size=n)  # includes empty pushes
    elif chunking == "whole":
        sizes = np.array([n])
    else:
        sizes = np.full(n // int(chunking) + 1, int(chunking))
    features = stream(speech, sizes)
    offline = log_mel(speech, SPEC)
    assert offline.shape == (expected_frames(n), SPEC.n_mels)
    assert features.frames_available == offline.shape[0]
    streamed = features.window(0, features.frames_available)
    assert streamed.dtype == np.float32
    np.testing.assert_allclose(streamed, offline, rtol=0, atol=1e-5)


def test_matches_librosa_reference(speech: np.ndarray) -> None:
    """Same numbers as librosa's STFT + mel on the documented framing."""
    pad = SPEC.n_fft // 2 - SPEC.hop_length // 2
    padded = np.concatenate([np.zeros(pad, np.float32), speech])
    power = (
        np.abs(
            librosa.stft(
                padded, n_fft=SPEC.n_fft, hop_length=SPEC.hop_length, window="hann", center=False
            )
        )
        ** 2
    )
    mel = (
        librosa.filters.mel(
            sr=SPEC.sample_rate,
            n_fft=SPEC.n_fft,
            n_mels=SPEC.n_mels,
            fmin=SPEC.fmin,
            fmax=SPEC.fmax,
        )
        @ power
    )
    reference = np.log10(np.maximum(mel, SPEC.floor)).T
    ours = log_mel(speech, SPEC)
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-3)


def test_frame_j_is_centred_on_its_hop() -> None:
    """A click at the centre of hop j peaks in frame j, not a neighbour."""
    for j in (0, 3, 10):
        samples = np.zeros(6000, np.float32)
        samples[j * SPEC.hop_length + SPEC.hop_length // 2] = 1.0
        energy = log_mel(samples, SPEC).max(axis=1)
        assert int(np.argmax(energy)) == j


def test_window_pads_before_zero_and_refuses_the_future(speech: np.ndarray) -> None:
    features = StreamingLogMel(SPEC)
    features.push(speech[:8000])
    offline = log_mel(speech[:8000], SPEC)
    available = features.frames_available
    assert available == offline.shape[0] > 16

    window = features.window(-5, 16)
    assert window.shape == (16, SPEC.n_mels)
    np.testing.assert_array_equal(window[:5], np.log10(np.float32(SPEC.floor)))
    np.testing.assert_array_equal(window[5:], offline[:11])
    np.testing.assert_array_equal(features.window(-20, 16), np.log10(np.float32(SPEC.floor)))
    np.testing.assert_array_equal(features.window(available - 16, 16), offline[-16:])
    with pytest.raises(ValueError):
        features.window(available - 15, 16)

    # Digital silence reads exactly like the padding before frame 0.
    silent = StreamingLogMel(SPEC)
    silent.push(np.zeros(4000, np.float32))
    np.testing.assert_array_equal(silent.window(-4, 8)[:4], silent.window(-4, 8)[4:])


def test_discard_bounds_memory_and_keeps_later_frames(speech: np.ndarray) -> None:
    features = StreamingLogMel(SPEC)
    offline = log_mel(speech, SPEC)
    chunk = 320
    for pos in range(0, speech.size, chunk):
        features.push(speech[pos : pos + chunk])
        features.discard_before(features.frames_available - 20)
        start = features.frames_available - 16
        if start >= 0:
            np.testing.assert_allclose(
                features.window(start, 16), offline[start : start + 16], rtol=0, atol=1e-5
            )
    assert features.first_retained == features.frames_available - 20
    with pytest.raises(ValueError):
        features.window(features.first_retained - 1, 4)
    # Frames before 0 are padding, never "discarded", but a window spanning dropped
    # frames is refused.
    with pytest.raises(ValueError):
        features.window(-2, 16)
    assert features.frames_available - features.first_retained == 20


def test_streaming_is_cheap_per_20ms_chunk(speech: np.ndarray) -> None:
    """The server pushes every session's audio in 20 ms chunks on a 2-core box."""
    features = StreamingLogMel(SPEC)
    chunk = SPEC.sample_rate // 50
    audio = np.tile(speech, 3)
    n_chunks = audio.size // chunk
    start = time.perf_counter()
    for i in range(n_chunks):
        features.push(audio[i * chunk : (i + 1) * chunk])
        features.discard_before(features.frames_available - 32)
    per_chunk_ms = 1000.0 * (time.perf_counter() - start) / n_chunks
    assert per_chunk_ms < 1.0, f"{per_chunk_ms:.3f} ms per 20 ms chunk"


@pytest.mark.parametrize(
    "samples",
    [np.zeros(3000, np.float32), np.full(3000, 0.5, np.float32), np.ones(3000, np.float32)],
    ids=["silence", "dc", "full-scale-dc"],
)
def test_degenerate_inputs_are_finite(samples: np.ndarray) -> None:
    mel = log_mel(samples, SPEC)
    assert np.isfinite(mel).all()
    assert mel.min() >= np.log10(np.float32(SPEC.floor))


def test_short_input_has_no_frames() -> None:
    features = StreamingLogMel(SPEC)
    needed = SPEC.n_fft - (SPEC.n_fft // 2 - SPEC.hop_length // 2)
    features.push(np.zeros(needed - 1, np.float32))
    assert features.frames_available == 0
    assert log_mel(np.zeros(needed - 1, np.float32), SPEC).shape == (0, SPEC.n_mels)
    features.push(np.zeros(1, np.float32))
    assert features.frames_available == 1


def test_frame_windows_cut_each_frame_as_the_timing_says(speech: np.ndarray) -> None:
    """Live (20 ms chunks) and offline (one push, then finish) cut the same windows:
    frame i's window starts at window_start(i), silence before the audio, and finish
    completes the last frames with silence, one frame per 40 ms the audio begins."""
    timing = TIMING
    offline = log_mel(np.concatenate([speech, np.zeros(SPEC.sample_rate, np.float32)]), SPEC)
    silence = np.log10(np.float32(SPEC.floor))

    live = FrameWindows(timing)
    got: dict[int, np.ndarray] = {}
    for pos in range(0, speech.size, 320):
        live.push(speech[pos : pos + 320])
        got.update(live.ready())
    assert sorted(got) == list(range(len(got)))
    whole = FrameWindows(timing)
    whole.push(speech)
    every = dict([*whole.ready(), *whole.finish()])
    assert len(every) == -(-speech.size * timing.fps // SPEC.sample_rate)
    assert len(got) < len(every)  # the live stream still waits for the last look-aheads
    for i, window in every.items():
        start = timing.window_start(i)
        expected = np.full((timing.window_frames, SPEC.n_mels), silence, np.float32)
        lo = max(start, 0)
        expected[lo - start :] = offline[lo : start + timing.window_frames]
        np.testing.assert_allclose(window, expected, rtol=0, atol=1e-5)
        if i in got:
            np.testing.assert_allclose(got[i], window, rtol=0, atol=1e-5)


def test_audio_held_back_until_samples_wanted_completes_each_frame_when_it_is_pushed(
        speech: np.ndarray) -> None:
    """A caller pushing only once ``samples_wanted`` is reached (a frame period's audio in
    one call) gets every frame at the same point of the stream, with the same window, as
    one pushing each 20 ms chunk the moment it has it."""
    eager, held = FrameWindows(TIMING), FrameWindows(TIMING)
    eager_at: dict[int, tuple[int, np.ndarray]] = {}
    held_at: dict[int, tuple[int, np.ndarray]] = {}
    pending: list[np.ndarray] = []
    pushes = 0
    for pos in range(0, speech.size - 320, 320):
        chunk = speech[pos:pos + 320]
        eager.push(chunk)
        eager_at.update((i, (pos, w)) for i, w in eager.ready())
        pending.append(chunk)
        if held.samples_pushed + 320 * len(pending) >= held.samples_wanted():
            held.push(np.concatenate(pending))
            pending.clear()
            pushes += 1
            held_at.update((i, (pos, w)) for i, w in held.ready())
    assert sorted(held_at) == sorted(eager_at) and len(held_at) > 50
    assert pushes <= len(held_at) + 1  # one push a frame, not one a chunk
    for i, (pos, window) in eager_at.items():
        assert held_at[i][0] == pos
        np.testing.assert_array_equal(held_at[i][1], window)


@pytest.mark.parametrize(("n", "fmin", "fmax"), [(82, 0.0, 8000.0), (34, 80.0, 7600.0),
                                                 (10, 1200.0, 4000.0)])
def test_mel_frequencies_match_librosa_without_it(n: int, fmin: float, fmax: float) -> None:
    np.testing.assert_allclose(mel_frequencies(n, fmin, fmax),
                               librosa.mel_frequencies(n, fmin=fmin, fmax=fmax), rtol=1e-9)


@pytest.mark.parametrize("spec", [SPEC, FeatureSpec(n_mels=64, fmin=50.0, fmax=7600.0),
                                  FeatureSpec(sample_rate=22050, n_fft=1024, n_mels=128,
                                              fmax=11025.0)])
def test_the_mel_filterbank_is_librosas_bit_for_bit(spec: FeatureSpec) -> None:
    """The shipped model was trained on librosa's filterbank: ours must be the same floats."""
    ours = mel_filterbank(spec)
    theirs = librosa.filters.mel(sr=spec.sample_rate, n_fft=spec.n_fft, n_mels=spec.n_mels,
                                 fmin=spec.fmin, fmax=spec.fmax)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


def test_serving_never_imports_librosa() -> None:
    """The server, its features and its runtime start without librosa (and the numba,
    scipy and scikit-learn it brings): GPU hosts install what serving needs and no more."""
    script = ("import sys, numpy as np\n"
              "import server.worker.app, server.front_door.app, server.worker.main\n"
              "import inference.process.core, inference.process.standalone\n"
              "import inference.runtimes.onnxruntime\n"
              "from inference.features import log_mel\n"
              "log_mel(np.zeros(16000, np.float32))\n"
              "print(sorted(m for m in ('librosa', 'numba', 'sklearn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
