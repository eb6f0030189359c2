"""Time-scaling speech a pitch period at a time: how the ingest buffer catches up after a
stall, or keeps a sender's clock skew out of the delay, without an audible cut.

``splice_out`` removes ``lag`` samples and ``splice_in`` repeats ``lag`` samples, each by
cross-fading the signal into itself ``lag`` samples away. Where the sound repeats at that
lag (a voiced sound's pitch period, found by ``best_lag``) or is quiet, the seam cannot be
heard. This is how WebRTC's NetEq accelerates and stretches its playout.
"""

from __future__ import annotations

import numpy as np

#: Cross-fade length: 5 ms at 48 kHz.
FADE = 240
#: Shortest lag searched: a 400 Hz pitch period at 48 kHz.
MIN_LAG = 120
_DECIMATE = 4


def _normalised_correlation(ref: np.ndarray, x: np.ndarray, lags: np.ndarray) -> np.ndarray:
    windows = np.lib.stride_tricks.sliding_window_view(x, ref.size)[lags]
    dots = windows @ ref
    norms = np.sqrt((windows * windows).sum(axis=1) * float(ref @ ref)) + 1e-9
    return dots / norms


def best_lag(x: np.ndarray, lo: int, hi: int, fade: int = FADE) -> tuple[int, float]:
    """The lag in ``[lo, hi]`` where ``x[lag:lag + fade]`` best matches ``x[:fade]``, and
    their normalised correlation (1: identical shape). ``x`` needs ``hi + fade`` samples.
    Searched on a 12 kHz copy, then refined at full rate around the best coarse lag."""
    signal = x.astype(np.float32)
    coarse = signal[::_DECIMATE]
    ref = coarse[:fade // _DECIMATE]
    lags = np.arange(lo // _DECIMATE, hi // _DECIMATE + 1)
    found = int(lags[np.argmax(_normalised_correlation(ref, coarse, lags))]) * _DECIMATE
    fine = np.arange(max(lo, found - _DECIMATE), min(hi, found + _DECIMATE) + 1)
    scores = _normalised_correlation(signal[:fade], signal, fine)
    best = int(np.argmax(scores))
    return int(fine[best]), float(scores[best])


def _fade(length: int) -> np.ndarray:
    return np.linspace(1.0, 0.0, length, dtype=np.float32)


def splice_out(x: np.ndarray, lag: int, fade: int = FADE) -> np.ndarray:
    """``x`` less ``lag`` samples: its start fades into the signal ``lag`` later."""
    w = _fade(fade)
    seam = x[:fade] * w + x[lag:lag + fade] * (1.0 - w)
    return np.concatenate([np.round(seam).astype(np.int16), x[lag + fade:]])


def splice_in(x: np.ndarray, lag: int, fade: int = FADE) -> np.ndarray:
    """``x`` with ``lag`` more samples: after its first ``lag`` it fades back into its
    start, so that stretch plays twice. ``x`` needs ``lag + fade`` samples."""
    w = _fade(fade)
    seam = x[lag:lag + fade] * w + x[:fade] * (1.0 - w)
    return np.concatenate([x[:lag], np.round(seam).astype(np.int16), x[fade:]])
