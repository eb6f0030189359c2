"""Adaptive playout on simulated clocks, with real speech: after a stall and its backlog
the buffer's delay comes back within 20 ms of where it was in under 5 s; a sender clock
0.1% or 1% fast or slow never moves it for an hour; no splice cuts more than 20 ms; and
what is spliced joins without a click."""

from __future__ import annotations

import numpy as np
import pytest

from inference.tts import SpeechUnavailable, conversation
from server.media.audio_ingest import AudioIngest
from server.media.time_scale import best_lag, splice_in, splice_out

pytestmark = pytest.mark.unit

CHUNK = 960  # 20 ms at 48 kHz


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    try:
        return conversation(48000).astype(np.int16)
    except SpeechUnavailable as exc:
        pytest.skip(str(exc))


def simulate(speech: np.ndarray, seconds: float, *, skew: float = 0.0,
             stall: tuple[float, float] | None = None, burst: int = 1, keep: bool = False
             ) -> tuple[AudioIngest, np.ndarray, list[np.ndarray]]:
    """A sender pushing 20 ms of ``speech`` (looped) per 20 ms of its own clock, which runs
    ``skew`` fast; the session reading 20 ms every 20 ms. Packets arrive ``burst`` at a
    time; during ``stall`` (start, length) nothing arrives, then all of it at once.
    Returns the buffer level (ms) after each read, and the chunks read if ``keep``."""
    ingest = AudioIngest(CHUNK, jitter_ms=30.0, max_buffer_ms=300.0)
    period = 0.02 / (1.0 + skew)
    levels = np.empty(int(seconds * 50))
    out: list[np.ndarray] = []
    pushed = 0
    for k in range(levels.size):
        now = 0.02 * k
        while True:
            sent = (pushed // burst * burst + burst - 1) * period + 0.005
            due = stall[0] + stall[1] if stall and stall[0] <= sent < sum(stall) else sent
            if due > now:
                break
            start = (pushed * CHUNK) % (speech.size - CHUNK)
            ingest.push(speech[start:start + CHUNK], due)
            pushed += 1
        chunk, _ = ingest.read()
        if keep:
            out.append(chunk)
        levels[k] = 1000 * ingest.level / 48000
    return ingest, levels, out


def _delay(levels: np.ndarray) -> np.ndarray:
    """The buffer's delay, averaged over each 1 s: a single read's level also moves by a
    whole 20 ms packet whenever the sender's and the reader's phases slip."""
    return np.convolve(levels, np.full(50, 1 / 50), mode="valid")


def test_after_a_stall_and_its_backlog_the_delay_returns_within_5_s(speech):
    ingest, levels, out = simulate(speech, 20.0, stall=(6.0, 0.25), keep=True)
    delay = _delay(levels)
    before = delay[250]  # the second before the stall
    assert levels[320:330].max() > before + 150  # the backlog sat in the buffer ...
    back = delay[int(6.25 * 50) + 250:]  # ... and from 5 s after it ended
    assert np.abs(back - before).max() <= 20, (before, back.max())
    assert ingest.stats.dropped_samples == 0 and ingest.stats.removed_samples > 9000
    assert max(c.size for c in out) == CHUNK


def test_bursty_arrival_within_the_jitter_target_plays_on_unchanged(speech):
    ingest, levels, _ = simulate(speech, 120.0, burst=2)  # a packet 20 ms late in two
    delay = _delay(levels)
    assert np.abs(delay[100:] - delay[100]).max() <= 5
    assert ingest.stats.underruns == 0 and ingest.stats.dropped_samples == 0
    # It settles once (0.1 s over two minutes) and does not keep churning.
    assert ingest.stats.removed_samples + ingest.stats.repeated_samples < 48000 * 0.2


@pytest.mark.parametrize("skew", [0.001, -0.001, 0.01, -0.01])
def test_a_skewed_sender_clock_never_moves_the_delay_in_an_hour(speech, skew):
    ingest, levels, _ = simulate(speech, 3600.0, skew=skew)
    delay = _delay(levels)
    settled = delay[500:]  # after the first 10 s
    assert np.abs(settled - delay[100]).max() <= 20, (delay[100], settled.min(), settled.max())
    assert ingest.stats.dropped_samples == 0
    assert ingest.stats.underruns == 0
    moved = ingest.stats.removed_samples - ingest.stats.repeated_samples
    assert moved == pytest.approx(skew * 3600 * 48000, rel=0.05, abs=1000)


def test_splices_join_without_a_click_and_cut_at_most_a_period(speech):
    voiced = speech[np.argmax(np.abs(speech)) - 2000:][:CHUNK + 960]
    lag, match = best_lag(voiced, 120, 960)
    assert match > 0.8  # speech repeats at its pitch period
    steepest = np.abs(np.diff(voiced.astype(float))).max()
    for spliced in (splice_out(voiced, lag), splice_in(voiced[:CHUNK], lag)):
        assert np.abs(np.diff(spliced.astype(float))).max() <= 1.2 * steepest
    tone = (8000 * np.sin(2 * np.pi * 200 * np.arange(3000) / 48000)).astype(np.int16)
    lag, match = best_lag(tone, 120, 960)
    assert lag % 240 in (0, 1, 239) and match > 0.99  # 200 Hz: a 240-sample period
