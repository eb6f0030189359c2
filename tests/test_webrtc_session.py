"""End to end over real WebRTC on loopback: an aiortc peer sends speech, gets the avatar back."""

from __future__ import annotations

import json
import math
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.mouth import mouth_box, mouth_openness
from server.client.peer import Received, run_session

pytestmark = pytest.mark.e2e

HISTOGRAMS = ("sonic_pipeline_delay_seconds", "sonic_av_offset_seconds")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _mouth_box(server, size: int) -> tuple[slice, slice]:
    return mouth_box(_get(f"{server.url}/avatars/astronaut")["geometry"][str(size)], size)


def _mouth_signal(received: Received, box: tuple[slice, slice]) -> np.ndarray:
    """How open each frame's mouth looks (``benchmarks.mouth``)."""
    return mouth_openness(received.video.data, box)


def _frame_centres(received: Received) -> np.ndarray:
    """When each frame is on screen, mid-way: it shows the 40 ms of speech starting at its
    timestamp."""
    return received.video.sender_times() + 0.02


def _audio_envelope_at(received: Received, times: np.ndarray) -> np.ndarray:
    audio = received.audio
    starts = audio.sender_times()
    rms = np.array([np.sqrt(np.mean(d.astype(np.float32) ** 2)) for d in audio.data])
    centres = starts + np.array([len(d) for d in audio.data]) / 48000 / 2
    return np.interp(times, centres, rms)


def assert_mouth_follows_speech(received: Received, box: tuple[slice, slice], *,
                                min_speaking: int = 25, min_quiet: int = 10
                                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The viewer heard speech and silence, and the mouth was open (cavity in the mouth
    box) more than three times as much in the speech as in the silence. Per frame: the
    openness, and whether it was speech or silence."""
    mouth = _mouth_signal(received, box)
    envelope = _audio_envelope_at(received, _frame_centres(received))
    speaking = envelope > 0.2 * envelope.max()
    quiet = envelope < 0.02 * envelope.max()
    assert envelope.max() > 1000, "the viewer heard no speech"
    assert speaking.sum() > min_speaking and quiet.sum() > min_quiet, \
        (speaking.sum(), quiet.sum())
    assert mouth[speaking].mean() > 3 * mouth[quiet].mean(), \
        (mouth[speaking].mean(), mouth[quiet].mean())
    return mouth, speaking, quiet


def _best_lag_frames(video: np.ndarray, audio: np.ndarray, max_lag: int = 6) -> float:
    """Lag (in frames, positive = video late) maximising correlation, refined to sub-frame."""
    v = (video - video.mean()) / (video.std() + 1e-9)
    a = (audio - audio.mean()) / (audio.std() + 1e-9)
    lags = np.arange(-max_lag, max_lag + 1)
    n = len(v)
    scores = np.array([np.mean(v[max(0, k):n + min(0, k)] * a[max(0, -k):n - max(0, k)])
                       for k in lags])
    best = int(np.argmax(scores))
    if 0 < best < len(lags) - 1:
        y0, y1, y2 = scores[best - 1:best + 2]
        denom = y0 - 2 * y1 + y2
        return float(lags[best] + (0.5 * (y0 - y2) / denom if denom else 0.0))
    return float(lags[best])


def _buckets(server, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound, read from /metrics."""
    text = urllib.request.urlopen(f"{server.url}/metrics", timeout=5).read().decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    buckets: dict[float, float] = {}
    for s in family.samples:  # summed over the processes that report it
        if s.name == f"{name}_bucket":
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
    return buckets


@pytest.fixture(scope="module")
def metrics_before(server) -> dict[str, dict[float, float]]:
    return {name: _buckets(server, name) for name in HISTOGRAMS}


@pytest.fixture(scope="module")
def received(server, speech_wav, metrics_before) -> Received:
    import asyncio

    return asyncio.run(run_session(server.url, str(speech_wav), seconds=11.0, coefficients=True))


@pytest.fixture(scope="module")
def observed(server, received, metrics_before) -> dict[str, dict[float, float]]:
    """What this module's session added to each histogram (cumulative counts by bound)."""
    return {name: {le: count - metrics_before[name][le]
                   for le, count in _buckets(server, name).items()} for name in HISTOGRAMS}


def test_video_arrives_at_25_fps(received):
    assert received.video_fps() >= 24.0, received.video_fps()
    assert len(received.video.data) >= 24 * 10


def test_returned_audio_is_the_driving_speech(received):
    rms = np.array([np.sqrt(np.mean(d.astype(np.float32) ** 2)) for d in received.audio.data])
    assert rms.max() > 500  # speech came back ...
    assert np.percentile(rms, 10) < 30  # ... and so did the pauses


def test_mouth_moves_with_speech_and_rests_in_silence(server, received):
    mouth, speaking, quiet = assert_mouth_follows_speech(
        received, _mouth_box(server, received.video.data[0].shape[0]),
        min_speaking=50, min_quiet=50)
    assert np.percentile(mouth[speaking], 90) > 0.05  # the mouth visibly opens ...
    assert np.percentile(mouth[quiet], 90) < 0.02  # ... and stays closed in the pauses


def test_lips_and_sound_are_within_one_frame(server, received):
    box = _mouth_box(server, received.video.data[0].shape[0])
    mouth = _mouth_signal(received, box)
    envelope = _audio_envelope_at(received, _frame_centres(received))
    lag = _best_lag_frames(mouth, envelope)
    assert abs(lag) <= 1.0, f"video is {lag * 40:.0f} ms off the audio"


def test_session_reports_pipeline_delay_and_av_offset(observed):
    # The session is gone after hang-up; its figures went to the metrics: a delay for
    # nearly every fresh frame, under 200 ms, and video within one frame of its audio.
    delay = observed["sonic_pipeline_delay_seconds"]
    assert delay[math.inf] > 200, delay
    assert delay[0.2] >= 0.95 * delay[math.inf], delay
    assert delay[0.1] == 0, delay  # it cannot be shorter than session.pipeline_delay_ms
    offset = observed["sonic_av_offset_seconds"]
    assert offset[math.inf] > 200, offset
    # Both tracks leave on one clock: most frames with their audio, nearly all within a
    # frame of it. A frame repeated while the engine was late counts as far off as its
    # picture is old; on a busy shared 2-core machine a few are (7% seen with two other
    # processes spinning on its cores), which a benchmark measures
    # (benchmarks/results/2026-12-02-soak-busy-neighbours.md), not this test.
    assert offset[0.005] - offset[-0.005] >= 0.5 * offset[math.inf], offset
    assert offset[0.04] - offset[-0.04] >= 0.9 * offset[math.inf], offset


def test_motion_coefficients_arrive_on_the_data_channel_with_the_frames(received):
    messages = received.coefficients
    assert len(messages) > 200
    frames = [m["frame"] for m in messages]
    assert frames == sorted(frames) and len(set(frames)) == len(frames)
    names = set(messages[0]["coefficients"])
    assert {"jawOpen", "mouthClose", "eyeBlinkLeft", "headYaw"} <= names
    jaw = np.array([m["coefficients"]["jawOpen"] for m in messages])
    assert np.isfinite(jaw).all() and jaw.max() > 0.3 and np.percentile(jaw, 10) < 0.05


def test_a_counting_peer_sends_encoded_speech_and_counts_what_a_decoding_one_sees(
        server, speech_wav):
    """The load generator's peer (``benchmarks.sessions``): speech encoded once, replayed;
    frames counted from their RTP headers, not decoded. It counts the 25 video frames and
    25 audio packets (40 ms each, ``session.audio_packet_ms``) a second a decoding peer
    gets, stamped as that one's are, the server hears its speech, and its bandwidth
    estimate reaches the encoder as a real one's."""
    import asyncio

    from server.client.speech import EncodedSpeech

    async def run() -> tuple[Received, list[dict]]:
        peer = asyncio.create_task(run_session(
            server.url, "", seconds=6.0, audio=EncodedSpeech(EncodedSpeech.encode_wav(
                str(speech_wav))), count_only=True, keep=False))
        await asyncio.sleep(5.5)
        listed = await asyncio.to_thread(_get, f"{server.url}/sessions")
        return await peer, listed["sessions"]

    received, listed = asyncio.run(run())
    (stats,) = [s["stats"] for s in listed if s["session_id"] == received.session_id]
    # Frames that queued while the connection came up arrive in a burst: the rate is
    # read after the first second, and each frame is counted once (one per 3600 ticks).
    arrivals = np.array(received.video.arrivals)
    steady = arrivals[arrivals >= arrivals[0] + 1.0]
    assert 24.0 <= (len(steady) - 1) / (steady[-1] - steady[0]) <= 26.0
    pts = received.video.pts
    assert 120 <= len(pts) <= (pts[-1] - pts[0]) / 3600 + 1
    assert 24.0 <= 1 / np.median(np.diff(received.audio.arrivals)) <= 26.0
    assert np.median(np.diff(received.audio.pts)) == 1920
    # RTP time from the stream's first frame, as a decoded frame's pts: 3600 ticks a frame.
    steps = np.diff(received.video.pts)
    assert np.median(steps) == 3600 and (steps > 0).all()
    assert stats["audio"]["received_s"] > 4.0
    delay = stats["pipeline_delay_ms"]  # what the load generator reports per session
    assert 0 < delay["p50"] <= delay["p95"] <= delay["p99"]
    # Its bandwidth estimate went back, and bounds the encoding (within the 10% an
    # estimate may wander before the encoder follows it down).
    estimate = stats["video_estimate"]
    assert estimate is not None and estimate > 0
    assert stats["video_bitrate"] < estimate / 0.9
