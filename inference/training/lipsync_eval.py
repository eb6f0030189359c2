"""Lip-sync evaluation anyone can rerun (issue 11, item 5):
``python -m inference.training.lipsync_eval [--set flite|real --root DIR] [--out FILE.json]``.

Two systems side by side on speech with phone timings:

* ``model``: what the server sends. The audio goes through the server's own feature path
  (:class:`inference.features.FrameWindows`, fed in 20 ms chunks) into the shipped engine
  (``engines/sonic-lite.json`` on onnxruntime, the default runtime, default knobs); the
  first 11 output coefficients are scored. ``--engine torch`` runs the ``.pt`` head
  (:class:`~inference.model.audio_head.AudioHead`, as ``evaluate.py`` does) on the same
  windows instead, to score a newly trained head before it is exported; with the ONNX
  engine the JSON also records how far the ``.pt`` head is from it (``meta.onnx_vs_pt``).
* ``loudness``: jawOpen = the frame's RMS level (80 ms Hann window on the frame centre)
  in dB, mapped linearly from 30 dB below the clip's 95th-percentile level (0) to it (1),
  and 0 below -60 dBFS; every other shape 0. It knows nothing of speech.

Video frame ``i`` covers ``[i, i+1) / 25`` s of input and is scored at its centre. The
model is trained to lead the sound (``visemes.Leads``: the jaw by one lead, the lips by
another, within its 40 ms feature look-ahead); its ``designed leads``, read from the
head's JSON beside its weights. Each articulator is read at its own designed lead: frame
``i`` stands for the sound at ``centre + lead`` (the jaw's lead for jaw r, vowels and
pauses; the lips' for closure, rounding and every AUC; loudness: 0).

Targets are phone-based and our own (not the training targets): per phone a jaw openness,
a lip closure (p b m) and a lip rounding value (:data:`PHONE_TABLE`; diphthongs in two
halves, ``hh`` takes the next phone's shape), piecewise constant, smoothed by a Gaussian
(sigma 20 ms). Lags: ``r(lag)`` pairs the prediction at time t with the target at
``t - lag``, so a positive lag means the prediction is late and a designed lead of 40 ms
is the lag -40 ms; scanned over [-200, +200] ms in 10 ms steps, per articulator.

Metrics, per condition (clean; ``degraded`` = pink noise 20 dB below the speech, then an
Opus round trip at 32 kbit/s) and system:

* r (Pearson, over all frames of all clips) at lag 0, at the designed lead, and the
  best lag with its r, for jaw (jawOpen), closure (mouthClose + mean press) and rounding
  (pucker + funnel), each against its own target;
* ROC AUCs per phone segment (the mean score over the frames whose sound time falls in
  the segment, or the one nearest its middle), by the Mann-Whitney statistic:
  closure p/b/m vs t/d/k/g/n/ng with score mouthClose + mean press - jawOpen (so the
  loudness baseline, whose closure is 0, is scored on -jawOpen: "are lip closures
  quieter?"); rounding uw uh ow ao oy w vs iy ih ey eh ae with pucker + funnel;
  spreading, the reverse, with mean stretch + mean smile; labiodental f v vs s z sh zh
  th dh hh with mouthRollLower. The baseline's constant 0 scores give 0.5 exactly.
* jaw in pauses: mean jawOpen over frames whose sound time is over 100 ms from every
  speech phone, as a % of the mean jawOpen over vowel segments.

Then bad inputs (each with silence before and after): pure silence, whispered speech
(espeak-ng's whisper variant), shouting (gain + hard clipping), laughter-like bursts,
music under speech, two talkers at once, very low and very high pitch (flite pitch
shifted by 8 semitones): jawOpen mean and max, jaw r where phones are known, and whether
the mouth stays closed where no one speaks (95th percentile of jawOpen there below 0.1).

``--set real --root DIR`` scores recordings of real people prepared there
(:mod:`inference.training.real_speech`) whose phones come from recognised text (the
LibriSpeech excerpts); ``--set real-text`` those whose true text is known (ARCTIC, VCTK,
LJSpeech), so that their labels carry no recognition errors. Either: only held-out
speakers, never trained on, unless ``--all-speakers``. Jaw r is also
given per speaker (flite: per voice), and phone names outside the table are listed in
``meta.unknown_phones``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.ndimage import gaussian_filter1d
from scipy.signal import lfilter
from scipy.stats import rankdata

from inference.model.blendshapes import SPEECH
from inference.model.timing import TIMING
from inference.training.visemes import LEADS, PROTOTYPES, Leads, V, phoneme_visemes
from inference.tts import SAMPLE_RATE

FPS = TIMING.fps
#: Which lead each scored articulator is read at.
ARTICULATOR_LEAD = {"jaw": "jaw", "closure": "lips", "rounding": "lips"}
NO_LEAD = Leads(0.0, 0.0)
LAGS_MS = np.arange(-200, 201, 10)
TARGET_SIGMA_S = 0.02
PAUSE_MARGIN_S = 0.1
CLOSED_JAW = 0.1  # 95th percentile of jawOpen below this where no one speaks: "closed"
SNR_DB = 20.0
OPUS_BITRATE = 32000

_I = {name: i for i, name in enumerate(SPEECH)}

# ---------------------------------------------------------------------------- phones
#: Per CMU phone: (jaw, closure, rounding) in [0, 1]; diphthongs as two halves.
Shape = tuple[float, float, float]
PHONE_TABLE: dict[str, tuple[Shape, ...]] = {
    # vowels: open, mid, close
    "aa": ((0.9, 0, 0),), "ae": ((0.8, 0, 0),), "ah": ((0.7, 0, 0),), "ao": ((0.8, 0, 0.6),),
    "eh": ((0.6, 0, 0),), "ax": ((0.45, 0, 0),), "er": ((0.35, 0, 0.4),),
    "axr": ((0.35, 0, 0.4),), "ih": ((0.35, 0, 0),), "ix": ((0.3, 0, 0),),
    "iy": ((0.25, 0, 0),), "uh": ((0.35, 0, 0.8),), "uw": ((0.2, 0, 1.0),),
    "aw": ((0.85, 0, 0), (0.3, 0, 0.8)), "ay": ((0.85, 0, 0), (0.3, 0, 0)),
    "ey": ((0.55, 0, 0), (0.3, 0, 0)), "ow": ((0.6, 0, 0.6), (0.3, 0, 1.0)),
    "oy": ((0.75, 0, 0.7), (0.3, 0, 0)),
    # consonants
    "p": ((0.0, 1, 0),), "b": ((0.0, 1, 0),), "m": ((0.0, 1, 0),), "em": ((0.0, 1, 0),),
    "f": ((0.1, 0, 0),), "v": ((0.1, 0, 0),), "th": ((0.2, 0, 0),), "dh": ((0.2, 0, 0),),
    "t": ((0.25, 0, 0),), "d": ((0.25, 0, 0),), "n": ((0.25, 0, 0),), "l": ((0.25, 0, 0),),
    "dx": ((0.25, 0, 0),), "nx": ((0.25, 0, 0),), "el": ((0.3, 0, 0),),
    "en": ((0.25, 0, 0),), "s": ((0.1, 0, 0),), "z": ((0.1, 0, 0),),
    "sh": ((0.15, 0, 0.5),), "zh": ((0.15, 0, 0.5),), "ch": ((0.15, 0, 0.5),),
    "jh": ((0.15, 0, 0.5),), "k": ((0.3, 0, 0),), "g": ((0.3, 0, 0),), "ng": ((0.3, 0, 0),),
    "r": ((0.25, 0, 0.5),), "w": ((0.15, 0, 1.0),), "y": ((0.2, 0, 0),),
}
ARTICULATORS: tuple[str, ...] = ("jaw", "closure", "rounding")
PAUSES = frozenset({"pau", "sil", "sp", "spn", "h#", ""})
TRANSPARENT = frozenset({"hh", "h"})  # take the next phone's shape
VOWELS = frozenset({"aa", "ae", "ah", "ao", "aw", "ax", "axr", "ay", "eh", "er", "ey", "ih",
                    "ix", "iy", "ow", "oy", "uh", "uw"})

#: The AUC contrasts: (positive phones, negative phones, score name).
CONTRASTS: dict[str, tuple[frozenset[str], frozenset[str], str]] = {
    "closure_pbm_vs_tdkgnng": (frozenset({"p", "b", "m"}),
                               frozenset({"t", "d", "k", "g", "n", "ng"}), "closure_minus_jaw"),
    "rounding_rounded_vs_spread": (frozenset({"uw", "uh", "ow", "ao", "oy", "w"}),
                                   frozenset({"iy", "ih", "ey", "eh", "ae"}), "rounding"),
    "spreading_spread_vs_rounded": (frozenset({"iy", "ih", "ey", "eh", "ae"}),
                                    frozenset({"uw", "uh", "ow", "ao", "oy", "w"}), "spreading"),
    "labiodental_fv_vs_fricatives": (frozenset({"f", "v"}),
                                     frozenset({"s", "z", "sh", "zh", "th", "dh", "hh"}),
                                     "labiodental"),
}

Phones = list[tuple[float, float, str]]


def normalise(name: str) -> str:
    """Lower case without stress digits (``AH0`` -> ``ah``)."""
    return "".join(c for c in name.strip().lower() if not c.isdigit())


def phone_shape(name: str) -> tuple[Shape, ...] | None:
    """A phone's (jaw, closure, rounding) halves; None for transparent ones (hh). Names
    outside the CMU table (other aligners' or espeak's) fall back on the viseme table."""
    key = normalise(name)
    if key in PAUSES or name.startswith("_"):
        return ((0.0, 0.0, 0.0),)
    if key in TRANSPARENT:
        return None
    if key in PHONE_TABLE:
        return PHONE_TABLE[key]
    visemes = phoneme_visemes(name)
    if visemes is None:
        return None
    out = []
    for vis in visemes:
        p = PROTOTYPES[V[vis]]
        out.append((float(p[_I["jawOpen"]]), 1.0 if vis == "PP" else 0.0,
                    float(min(1.0, p[_I["mouthPucker"]] + p[_I["mouthFunnel"]]))))
    return tuple(out)


def phone_targets(phones: Phones, times: np.ndarray, sigma_s: float = TARGET_SIGMA_S,
                  step_s: float = 0.005) -> np.ndarray:
    """(len(times), 3) jaw / closure / rounding targets at ``times`` (s): each phone's
    values held over it, silence outside every phone, smoothed by a Gaussian."""
    times = np.asarray(times, np.float64)
    pad = 4 * sigma_s + step_s
    end = max([e for _, e, _ in phones] + [float(times.max(initial=0.0))])
    t0 = min(0.0, float(times.min(initial=0.0))) - pad
    grid = t0 + step_s * np.arange(int(np.ceil((end + pad - t0) / step_s)) + 1)
    values = np.zeros((grid.size, 3))
    pending: list[tuple[float, float]] = []
    for start, stop, name in phones:
        shape = phone_shape(name)
        if shape is None:
            pending.append((start, stop))
            continue
        spans = [(s, e, shape[0]) for s, e in pending]
        pending.clear()
        if len(shape) == 1:
            spans.append((start, stop, shape[0]))
        else:
            mid = 0.5 * (start + stop)
            spans += [(start, mid, shape[0]), (mid, stop, shape[1])]
        for s, e, v in spans:
            values[(grid >= s) & (grid < e)] = v
    if sigma_s > 0:
        values = gaussian_filter1d(values, sigma_s / step_s, axis=0, mode="constant")
    return np.stack([np.interp(times, grid, values[:, k]) for k in range(3)], axis=1)


def frame_centres(n_frames: int) -> np.ndarray:
    return (np.arange(n_frames) + 0.5) / FPS


# ---------------------------------------------------------------------------- metrics
def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson r; NaN where either side is constant."""
    a = np.asarray(a, np.float64) - np.mean(a)
    b = np.asarray(b, np.float64) - np.mean(b)
    den = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum() / den) if den > 1e-12 else math.nan


def lag_scan(preds: Sequence[np.ndarray], phones: Sequence[Phones], column: int,
             lags_ms: np.ndarray = LAGS_MS) -> np.ndarray:
    """r of each clip's per-frame ``preds`` (pooled over clips) with target ``column``
    taken at ``centre - lag``, for each lag: positive lag = the prediction is late."""
    r = np.empty(len(lags_ms))
    for k, lag in enumerate(lags_ms):
        tg = [phone_targets(ph, frame_centres(p.size) - lag / 1000.0)[:, column]
              for p, ph in zip(preds, phones, strict=True)]
        r[k] = pearson(np.concatenate(preds), np.concatenate(tg))
    return r


def best_lag(lags_ms: np.ndarray, r: np.ndarray) -> tuple[float, float]:
    """(lag ms, r) of the highest r; ties go to the smallest |lag|. NaN if r is all NaN."""
    if np.all(np.isnan(r)):
        return math.nan, math.nan
    filled = np.where(np.isnan(r), -np.inf, r)
    order = np.argsort(np.abs(lags_ms), kind="stable")
    k = order[int(np.argmax(filled[order]))]
    return float(lags_ms[k]), float(r[k])


def auc(pos: Iterable[float], neg: Iterable[float]) -> float:
    """ROC AUC by the Mann-Whitney U statistic (ties count half); NaN if a side is empty."""
    pos, neg = np.asarray(list(pos), np.float64), np.asarray(list(neg), np.float64)
    if pos.size == 0 or neg.size == 0:
        return math.nan
    ranks = rankdata(np.concatenate([pos, neg]))
    u = ranks[: pos.size].sum() - pos.size * (pos.size + 1) / 2.0
    return float(u / (pos.size * neg.size))


def segment_means(score: np.ndarray, phones: Phones, names: frozenset[str],
                  lead_s: float) -> list[float]:
    """Mean ``score`` over each segment of a phone in ``names``: the frames whose sound
    time (centre + lead) falls in it, or the frame nearest its middle if none does."""
    sound = frame_centres(score.size) + lead_s
    out = []
    for start, end, name in phones:
        if normalise(name) not in names:
            continue
        inside = (sound >= start) & (sound < end)
        if inside.any():
            out.append(float(score[inside].mean()))
        else:
            k = int(np.argmin(np.abs(sound - 0.5 * (start + end))))
            out.append(float(score[k]))
    return out


def quiet_mask(n_frames: int, active: Sequence[tuple[float, float]], lead_s: float,
               margin_s: float = PAUSE_MARGIN_S) -> np.ndarray:
    """Frames whose sound time is more than ``margin_s`` from every active span."""
    sound = frame_centres(n_frames) + lead_s
    quiet = np.ones(n_frames, bool)
    for s, e in active:
        quiet &= (sound < s - margin_s) | (sound >= e + margin_s)
    return quiet


def speech_spans(phones: Phones) -> list[tuple[float, float]]:
    return [(s, e) for s, e, p in phones if normalise(p) not in PAUSES and not p.startswith("_")]


def articulator_scores(c: np.ndarray) -> dict[str, np.ndarray]:
    """The per-frame scores of (n, 11) SPEECH coefficients that the metrics use."""
    jaw = c[:, _I["jawOpen"]]
    closure = c[:, _I["mouthClose"]] + 0.5 * (c[:, _I["mouthPressLeft"]]
                                              + c[:, _I["mouthPressRight"]])
    return {
        "jaw": jaw,
        "closure": closure,
        "rounding": c[:, _I["mouthPucker"]] + c[:, _I["mouthFunnel"]],
        "closure_minus_jaw": closure - jaw,
        "spreading": 0.5 * (c[:, _I["mouthStretchLeft"]] + c[:, _I["mouthStretchRight"]]
                            + c[:, _I["mouthSmileLeft"]] + c[:, _I["mouthSmileRight"]]),
        "labiodental": c[:, _I["mouthRollLower"]],
    }


def score_set(coeffs: Sequence[np.ndarray], phones: Sequence[Phones], leads: Leads,
              speakers: Sequence[str] | None = None) -> dict[str, object]:
    """Every metric of one system on one condition: ``coeffs[k]`` (n_k, 11) per clip."""
    scores = [articulator_scores(c) for c in coeffs]
    out: dict[str, object] = {"frames": int(sum(c.shape[0] for c in coeffs))}
    for col, art in enumerate(ARTICULATORS):
        r = lag_scan([s[art] for s in scores], phones, col)
        lag, r_best = best_lag(LAGS_MS, r)
        lead_ms = 1000.0 * getattr(leads, ARTICULATOR_LEAD[art])
        out[art] = {"r_lag0": float(r[LAGS_MS == 0][0]), "designed_lead_ms": lead_ms,
                    "r_designed_lead": float(np.interp(-lead_ms, LAGS_MS, r)),
                    "best_lag_ms": lag, "r_best": r_best,
                    "r_by_lag": {int(lag_): float(v) for lag_, v in zip(LAGS_MS, r, strict=True)}}
    aucs = {}
    for name, (pos, neg, score) in CONTRASTS.items():
        p = [m for s, ph in zip(scores, phones, strict=True)
             for m in segment_means(s[score], ph, pos, leads.lips)]
        n = [m for s, ph in zip(scores, phones, strict=True)
             for m in segment_means(s[score], ph, neg, leads.lips)]
        aucs[name] = {"auc": auc(p, n), "n_pos": len(p), "n_neg": len(n), "score": score}
    out["auc"] = aucs
    vowel = [m for s, ph in zip(scores, phones, strict=True)
             for m in segment_means(s["jaw"], ph, VOWELS, leads.jaw)]
    quiet = np.concatenate([s["jaw"][quiet_mask(s["jaw"].size, speech_spans(ph), leads.jaw)]
                            for s, ph in zip(scores, phones, strict=True)])
    vowel_mean = float(np.mean(vowel)) if vowel else math.nan
    pause_mean = float(quiet.mean()) if quiet.size else math.nan
    out["pause_jaw"] = {"pause_mean": pause_mean, "vowel_mean": vowel_mean,
                        "pause_frames": int(quiet.size),
                        "pct_of_vowels": 100.0 * pause_mean / vowel_mean
                        if vowel_mean > 1e-9 else math.nan}
    if speakers is not None:
        by: dict[str, dict[str, float]] = {}
        for spk in sorted(set(speakers)):
            keep = [k for k, s in enumerate(speakers) if s == spk]
            r = lag_scan([scores[k]["jaw"] for k in keep], [phones[k] for k in keep], 0,
                         np.array([0.0, -1000.0 * leads.jaw]))
            by[spk] = {"jaw_r_lag0": float(r[0]), "jaw_r_designed_lead": float(r[1]),
                       "clips": len(keep)}
        out["by_speaker"] = by
    return out


# ---------------------------------------------------------------------------- systems
def loudness_baseline(audio: np.ndarray, n_frames: int, range_db: float = 30.0,
                      gate_dbfs: float = -60.0) -> np.ndarray:
    """(n_frames, 11): jawOpen from the frame's RMS level (80 ms Hann window on the frame
    centre), 0 at ``range_db`` below the clip's 95th-percentile level and 1 at it; 0
    below ``gate_dbfs``; every other shape 0."""
    half = int(0.04 * SAMPLE_RATE)
    win = np.hanning(2 * half + 1)
    win /= win.sum()
    x = np.pad(np.asarray(audio, np.float64), (half, half + SAMPLE_RATE // FPS))
    centres = (frame_centres(n_frames) * SAMPLE_RATE).astype(int) + half
    frames = np.stack([x[c - half : c + half + 1] for c in centres]) if n_frames else \
        np.zeros((0, 2 * half + 1))
    db = 10.0 * np.log10((frames * frames) @ win + 1e-20)
    out = np.zeros((n_frames, len(SPEECH)), np.float32)
    live = db > gate_dbfs
    if live.any():
        ref = float(np.percentile(db[live], 95))
        out[:, _I["jawOpen"]] = np.where(live, np.clip((db - ref + range_db) / range_db, 0, 1),
                                         0.0)
    return out


@dataclass
class ModelRunner:
    """The server's path from 16 kHz audio to the coefficients it sends: FrameWindows in
    20 ms chunks, then the shipped engine (or the ``.pt`` head with ``engine="torch"``)."""

    engine: str = "onnx"
    manifest: str = "engines/sonic-lite.json"
    weights: str | None = None  # the .pt head for engine="torch" (default: the shipped one)
    _run: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)

    def leads(self) -> Leads:
        """The designed leads of the head this runs: from the manifest's ``audio_head``, or
        the JSON that training wrote beside the ``.pt``."""
        if self.engine == "onnx":
            from inference.engine import Manifest

            return head_leads(Manifest.load(_repo_path(self.manifest)).extra.get("audio_head"))
        from inference.model.audio_head import HEAD_WEIGHTS

        described = Path(self.weights or HEAD_WEIGHTS).with_suffix(".json")
        return head_leads(json.loads(described.read_text()) if described.exists() else None)

    def windows(self, audio: np.ndarray) -> np.ndarray:
        from inference.features import FrameWindows

        fw = FrameWindows(TIMING)
        chunk = SAMPLE_RATE // 50
        wins = []
        for i in range(0, audio.size, chunk):
            fw.push(audio[i : i + chunk])
            wins += [w for _, w in fw.ready()]
        wins += [w for _, w in fw.finish()]
        if not wins:
            return np.zeros((0, TIMING.window_frames, TIMING.features.n_mels), np.float32)
        return np.stack(wins).astype(np.float32)

    def _runner(self) -> Callable[[np.ndarray], np.ndarray]:
        if self._run is not None:
            return self._run
        if self.engine == "onnx":
            self._run = _onnx_runner(self.manifest)
        elif self.engine == "torch":
            self._run = _torch_runner(self.weights)
        else:
            raise ValueError(f"engine must be onnx or torch, not {self.engine!r}")
        return self._run

    def coefficients(self, audio: np.ndarray) -> np.ndarray:
        """(n_frames, 11): one row per video frame the audio starts."""
        return self.run_windows(self.windows(np.asarray(audio, np.float32)))

    def run_windows(self, wins: np.ndarray, batch: int = 256) -> np.ndarray:
        run = self._runner()
        out = [run(wins[i : i + batch]) for i in range(0, wins.shape[0], batch)]
        return np.concatenate(out) if out else np.zeros((0, len(SPEECH)), np.float32)


def _onnx_runner(manifest_path: str) -> Callable[[np.ndarray], np.ndarray]:
    """The shipped engine on the server's default runtime; a small portrait, since the
    coefficients do not depend on it."""
    from inference.engine import FrameInput, PreparedPortrait
    from inference.face_detect import FaceBox
    from inference.face_geometry import geometry_from_face_box
    from inference.runtimes import create_engine

    engine = create_engine("onnxruntime", _repo_path(manifest_path), intra_op_threads=2)
    size = 64
    geometry = geometry_from_face_box(FaceBox(x=0.25 * size, y=0.2 * size, w=0.5 * size,
                                              h=0.5 * size), size)
    slot = engine.prepare(PreparedPortrait(np.full((size, size, 3), 128, np.uint8), geometry))
    knobs = engine.manifest.knob_vector({})
    names = engine.manifest.coefficient_names
    cols = [names.index(n) for n in SPEECH]

    def run(wins: np.ndarray) -> np.ndarray:
        batch = [FrameInput.for_frame(slot, i, FPS, w, knobs, 0.0) for i, w in enumerate(wins)]
        return engine.run(batch).coefficients[:, cols].astype(np.float32)

    return run


def _repo_path(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else Path(__file__).resolve().parents[2] / p


def head_leads(description: dict | None) -> Leads:
    """A trained head's leads from what training wrote of it (``targets.leads_s``; heads
    trained before leads were per articulator say ``anticipation_s``, one for all)."""
    targets = (description or {}).get("targets") or {}
    if "leads_s" in targets:
        return Leads(**targets["leads_s"])
    if "anticipation_s" in targets:
        return Leads(targets["anticipation_s"], targets["anticipation_s"])
    return LEADS


def _torch_runner(weights: str | None = None) -> Callable[[np.ndarray], np.ndarray]:
    import torch

    from inference.model.audio_head import HEAD_WEIGHTS, AudioHead

    head = AudioHead.from_weights(weights or HEAD_WEIGHTS)

    def run(wins: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return head(torch.from_numpy(wins)).numpy()

    return run


# ---------------------------------------------------------------------------- data
@dataclass
class Clip:
    audio: np.ndarray  # 16 kHz float32
    phones: Phones
    speaker: str
    text: str = ""


def pad_clip(audio: np.ndarray, phones: Phones, before: float, after: float
             ) -> tuple[np.ndarray, Phones]:
    """Digital silence around a clip, labelled ``pau`` (phone times shift with it)."""
    a, b = int(before * SAMPLE_RATE), int(after * SAMPLE_RATE)
    audio = np.concatenate([np.zeros(a, np.float32), np.asarray(audio, np.float32),
                            np.zeros(b, np.float32)])
    shift = a / SAMPLE_RATE
    end = audio.size / SAMPLE_RATE
    moved = [(s + shift, e + shift, p) for s, e, p in phones]
    first = moved[0][0] if moved else end
    last = moved[-1][1] if moved else shift
    return audio, [(0.0, first, "pau"), *moved, (last, end, "pau")]


def flite_set(n: int = 48, seed: int = 0, voices: Sequence[str] = ("slt", "awb", "rms")
              ) -> list[Clip]:
    """``n`` held-out sentences (never spoken in training) in flite's voices whose
    speakers training never heard, 0.3-0.7 s of silence either side."""
    from inference.training.corpus import sentences
    from inference.tts import flite

    texts = sentences(700, 0)[540:]  # the corpus's evaluation split (seed 0)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        voice = voices[i % len(voices)]
        u = flite(texts[i % len(texts)], voice)
        audio, phones = pad_clip(u.audio, u.phones, *rng.uniform(0.3, 0.7, 2))
        out.append(Clip(audio, phones, voice, u.text))
    return out


def real_set(root: str, heldout_only: bool = True, text_source: str = "asr"
             ) -> tuple[list[Clip], str]:
    """Recordings of real people (:mod:`inference.training.real_speech`) whose text came
    from ``text_source`` ("asr": recognised; "prompt": what was read), and which of them
    were kept: the held-out speakers, never trained on, unless ``heldout_only`` is off."""
    from inference.training.real_speech import load_real_speech, split

    try:
        utts = load_real_speech(root)
    except FileNotFoundError as exc:
        raise SystemExit(f"real speech: {exc}") from exc
    kept = "all speakers"
    if heldout_only:
        utts = split(utts)[1]
        kept = "held-out speakers (real_speech.split)"
    utts = [u for u in utts if u.text_source == text_source]
    kept += f", {'recognised' if text_source == 'asr' else 'true'} text"
    clips = [Clip(np.asarray(u.audio, np.float32), list(u.phones), u.speaker, u.text)
             for u in utts]
    if not clips:
        raise SystemExit(f"no recordings under {root} ({kept})")
    return clips, kept


def aligned_labels(clips: list[Clip]) -> list[Clip]:
    """The clips with their phones from pocketsphinx's forced alignment of their text (as
    the real recordings are labelled) instead of their own; clips it cannot align are
    left out."""
    import tempfile

    from inference.training.real_speech import align_texts

    with tempfile.TemporaryDirectory() as workdir:
        phones = align_texts([(c.audio, c.text) for c in clips], Path(workdir))
    return [Clip(c.audio, ph, c.speaker, c.text)
            for c, ph in zip(clips, phones, strict=True) if ph is not None]


def unknown_phones(clips: Sequence[Clip]) -> dict[str, int]:
    """Phone names outside the CMU table (scored through the viseme fallback)."""
    known = set(PHONE_TABLE) | PAUSES | TRANSPARENT
    out: dict[str, int] = {}
    for c in clips:
        for _, _, name in c.phones:
            if normalise(name) not in known and not name.startswith("_"):
                out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def speech_snr_noise(audio: np.ndarray, phones: Phones, snr_db: float,
                     rng: np.random.Generator, kind: str = "pink") -> np.ndarray:
    """augment.add_noise with the SNR taken against the speech (not the padded clip)."""
    from inference.training import augment

    mask = np.zeros(audio.size, bool)
    for s, e in speech_spans(phones):
        mask[int(s * SAMPLE_RATE) : int(e * SAMPLE_RATE)] = True
    x = audio.astype(np.float64)
    rms_all = math.sqrt(float(np.mean(x * x)) + 1e-20)
    rms_speech = math.sqrt(float(np.mean(x[mask] ** 2)) + 1e-20) if mask.any() else rms_all
    # add_noise sets the noise against the whole clip's RMS: move the SNR to match.
    return augment.add_noise(audio, snr_db - 20 * math.log10(rms_speech / rms_all), rng, kind)


def degrade(clip: Clip, rng: np.random.Generator, snr_db: float = SNR_DB,
            bitrate: int = OPUS_BITRATE) -> Clip:
    from inference.training import augment

    y = speech_snr_noise(clip.audio, clip.phones, snr_db, rng)
    y = augment.opus_round_trip(y, bitrate)
    return Clip(y, clip.phones, clip.speaker, clip.text)


# ---------------------------------------------------------------------------- bad inputs
@dataclass
class BadClip:
    audio: np.ndarray
    phones: Phones | None  # the talker whose phones score r (None: not speech)
    active: list[tuple[float, float]]  # where someone speaks or vocalises
    note: str = ""


def laughter(rng: np.random.Generator, bursts: int = 7) -> np.ndarray:
    """'ha-ha-ha': breathy voiced bursts (F0 falling from ~300 Hz, /a/ formants), decaying."""
    out = []
    for k in range(bursts):
        n = int(rng.uniform(0.1, 0.15) * SAMPLE_RATE)
        t = np.arange(n) / SAMPLE_RATE
        f0 = 300.0 - 60.0 * k / bursts + 30.0 * t / t[-1]
        phase = np.cumsum(f0 / SAMPLE_RATE)
        pulses = (np.diff(np.floor(phase), prepend=0.0) > 0).astype(np.float64)
        src = pulses + 0.3 * rng.standard_normal(n) * np.exp(-t / 0.03)  # aspirated onset
        y = src
        for f, bw in ((800, 90), (1250, 110), (2600, 160)):
            r = math.exp(-math.pi * bw / SAMPLE_RATE)
            y = lfilter([1 - r], [1, -2 * r * math.cos(2 * math.pi * f / SAMPLE_RATE), r * r], y)
        env = np.sin(np.pi * t / t[-1]) ** 0.5 * 0.85 ** k
        out += [y * env, np.zeros(int(rng.uniform(0.08, 0.12) * SAMPLE_RATE))]
    x = np.concatenate(out)
    return (0.5 * x / np.abs(x).max()).astype(np.float32)


def bad_input_clips(seed: int = 0) -> dict[str, BadClip]:
    """The inputs the issue asks about, each with 0.8 s of silence either side (music under
    speech: music throughout). Speech cases are skipped if their synthesizer is missing."""
    from inference.training import augment
    from inference.tts import Espeak, SpeechUnavailable, flite

    rng = np.random.default_rng(seed + 11)
    sec = SAMPLE_RATE
    clips: dict[str, BadClip] = {
        "silence": BadClip(np.zeros(3 * sec, np.float32), None, [], "3 s digital silence"),
    }

    def padded(audio: np.ndarray, phones: Phones) -> tuple[np.ndarray, Phones]:
        return pad_clip(audio, phones, 0.8, 0.8)

    lau = laughter(rng)
    a, _ = padded(lau, [])
    clips["laughter_bursts"] = BadClip(a, None, [(0.8, 0.8 + lau.size / sec)],
                                       "7 synthetic 'ha' bursts; an open mouth is fair here")
    try:
        es = Espeak.get()
        w = es.synth("I am whispering so nobody else can hear me.", "en-us+whisper")
        a, ph = padded(augment.set_peak(w.audio, -12), w.phones)
        clips["whisper"] = BadClip(a, ph, speech_spans(ph),
                                   "espeak-ng en-us+whisper (whisper is a training variant)")
    except SpeechUnavailable:
        pass
    try:
        u1 = flite("Please call Stella and ask her to bring these things with her.", "slt")
        u2 = flite("The birch canoe slid on the smooth planks near the river.", "awb")
        u3 = flite("Father parked the car far from the barn.", "rms")
    except SpeechUnavailable:
        return clips
    a, ph = padded(u1.audio, u1.phones)
    clips["shouting_clipped_+20dB"] = BadClip(
        augment.clip(augment.set_peak(a, -1.0), 20.0), ph, speech_spans(ph),
        "flite slt at -1 dBFS peak, +20 dB drive, hard-clipped")
    music = augment.music(np.arange(a.size) / sec, rng, chords=True)
    speech_rms = float(np.sqrt(np.mean(u1.audio.astype(np.float64) ** 2)))
    music *= speech_rms / max(float(np.sqrt(np.mean(music.astype(np.float64) ** 2))), 1e-9)
    clips["music_under_speech_-10dB"] = BadClip(
        (a + 10 ** (-10 / 20) * music).astype(np.float32), ph, speech_spans(ph),
        "chords 10 dB below the speech, for 0.8 s before and after it too")
    off = 0.6
    b_audio = np.concatenate([np.zeros(int(off * sec), np.float32), u2.audio])
    n = max(u1.audio.size, b_audio.size)
    mix = np.zeros(n, np.float32)
    mix[: u1.audio.size] += u1.audio
    mix[: b_audio.size] += b_audio * (speech_rms / max(float(np.sqrt(np.mean(
        u2.audio.astype(np.float64) ** 2))), 1e-9))
    a, ph = padded(mix, u1.phones)
    shift = 0.8
    ph2 = [(s + shift + off, e + shift + off, p) for s, e, p in u2.phones]
    clips["two_talkers"] = BadClip(a, ph, speech_spans(ph) + speech_spans(ph2),
                                   "slt and awb (0.6 s later) at equal level; r vs slt")
    import librosa

    for name, u, steps in (("low_pitch_-8st", u2, -8), ("high_pitch_+8st", u3, 8)):
        y = librosa.effects.pitch_shift(u.audio, sr=sec, n_steps=steps).astype(np.float32)
        a, ph = padded(y, u.phones)
        clips[name] = BadClip(a, ph, speech_spans(ph),
                              f"flite {u.voice} pitch-shifted {steps:+d} semitones")
    return clips


def score_bad(coeffs: np.ndarray, clip: BadClip, leads: Leads) -> dict[str, object]:
    jaw = coeffs[:, _I["jawOpen"]]
    lead_s = leads.jaw
    quiet = quiet_mask(jaw.size, clip.active, lead_s)
    out: dict[str, object] = {"jaw_mean": float(jaw.mean()), "jaw_max": float(jaw.max()),
                              "finite": bool(np.isfinite(coeffs).all())}
    if quiet.any():
        q = jaw[quiet]
        out.update(quiet_jaw_mean=float(q.mean()), quiet_jaw_p95=float(np.percentile(q, 95)),
                   quiet_jaw_max=float(q.max()),
                   closed_when_quiet=bool(np.percentile(q, 95) < CLOSED_JAW))
    speaking = ~quiet_mask(jaw.size, clip.active, lead_s, margin_s=0.0)
    if speaking.any():
        out["speaking_jaw_mean"] = float(jaw[speaking].mean())
    if clip.phones is not None:
        r = lag_scan([jaw], [clip.phones], 0, np.array([-1000.0 * lead_s]))
        out["jaw_r_designed_lead"] = float(r[0])
    return out


# ---------------------------------------------------------------------------- run
SYSTEMS = ("model", "loudness")


def system_coefficients(runner: ModelRunner, audio: np.ndarray) -> dict[str, np.ndarray]:
    model = runner.coefficients(audio)
    return {"model": model, "loudness": loudness_baseline(audio, model.shape[0])}


def evaluate(clips: list[Clip], runner: ModelRunner, *, degraded: bool = True,
             bad: bool = True, seed: int = 0, snr_db: float = SNR_DB,
             bitrate: int = OPUS_BITRATE, per_speaker: bool = False) -> dict[str, object]:
    """All metrics: ``results[condition][system]`` and ``bad_inputs[case][system]``."""
    rng = np.random.default_rng(seed + 1000)
    leads = {"model": runner.leads(), "loudness": NO_LEAD}
    conditions = {"clean": clips}
    if degraded:
        conditions["degraded"] = [degrade(c, rng, snr_db, bitrate) for c in clips]
    results: dict[str, dict[str, object]] = {}
    consistency = None
    for cond, cs in conditions.items():
        coeffs = [system_coefficients(runner, c.audio) for c in cs]
        phones = [c.phones for c in cs]
        speakers = [c.speaker for c in cs] if per_speaker else None
        results[cond] = {s: score_set([c[s] for c in coeffs], phones, leads[s], speakers)
                         for s in SYSTEMS}
        if cond == "clean" and runner.engine == "onnx":
            try:
                pt = ModelRunner("torch")
                diff = max(float(np.abs(pt.coefficients(c.audio) - k["model"]).max())
                           for c, k in zip(cs, coeffs, strict=True))
                consistency = {"max_abs_diff_onnx_vs_pt_head": diff}
            except ImportError:  # torch is the dev extra
                consistency = None
    out: dict[str, object] = {"results": results, "onnx_vs_pt": consistency}
    if bad:
        out["bad_inputs"] = {}
        for case, clip in bad_input_clips(seed).items():
            co = system_coefficients(runner, clip.audio)
            out["bad_inputs"][case] = {"note": clip.note, **{
                s: score_bad(co[s], clip, leads[s]) for s in SYSTEMS}}
    return out


def _f(x: object, fmt: str = ".3f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def table(report: dict[str, object]) -> str:
    leads = report["meta"]["designed_leads_ms"]
    lines = [
        f"jaw r at lag 0 / at the designed lead ({-leads['jaw']:+.0f} ms) / best lag (ms) "
        "and its r; best lags of closure and rounding; per-segment AUCs (lips read at "
        f"{-leads['lips']:+.0f} ms); pause jaw as % of vowel jaw",
        "| condition | system | jaw r0 | jaw r@lead | jaw best | closure best | "
        "rounding best | AUC close | AUC round | AUC spread | AUC f/v | pause jaw % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cond, by in report["results"].items():
        for system, s in by.items():
            def best(art: str, s: dict = s) -> str:
                return f"{_f(s[art]['best_lag_ms'], '+.0f')} ({_f(s[art]['r_best'], '.2f')})"

            a = s["auc"]
            lines.append(
                f"| {cond} | {system} | {_f(s['jaw']['r_lag0'])} | "
                f"{_f(s['jaw']['r_designed_lead'])} | {best('jaw')} | {best('closure')} | "
                f"{best('rounding')} | {_f(a['closure_pbm_vs_tdkgnng']['auc'])} | "
                f"{_f(a['rounding_rounded_vs_spread']['auc'])} | "
                f"{_f(a['spreading_spread_vs_rounded']['auc'])} | "
                f"{_f(a['labiodental_fv_vs_fricatives']['auc'])} | "
                f"{_f(s['pause_jaw']['pct_of_vowels'], '.1f')} |")
    if report.get("bad_inputs"):
        lines += ["", "| bad input | system | jaw mean / max | quiet jaw p95 | closed when quiet "
                  "| jaw r@lead |", "| --- | --- | --- | --- | --- | --- |"]
        for case, by in report["bad_inputs"].items():
            for system in SYSTEMS:
                b = by[system]
                lines.append(
                    f"| {case} | {system} | {_f(b['jaw_mean'])} / {_f(b['jaw_max'])} | "
                    f"{_f(b.get('quiet_jaw_p95'))} | {b.get('closed_when_quiet', '—')} | "
                    f"{_f(b.get('jaw_r_designed_lead'))} |")
    return "\n".join(lines)


def _clean_json(x: object) -> object:
    """NaN to null (strict JSON)."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {k: _clean_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean_json(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=("flite", "real", "real-text"), default="flite")
    ap.add_argument("--root", help="recordings for --set real and real-text")
    ap.add_argument("--n", type=int, help="flite: utterances (default 48, slt/awb/rms in "
                    "turn); real: keep only the first N")
    ap.add_argument("--all-speakers", action="store_true",
                    help="real: score training speakers too (default: held-out ones only)")
    ap.add_argument("--engine", choices=("onnx", "torch"), default="onnx")
    ap.add_argument("--manifest", default="engines/sonic-lite.json")
    ap.add_argument("--weights", help="with --engine torch: a trained head's .pt (default: "
                                      "the shipped one)")
    ap.add_argument("--snr-db", type=float, default=SNR_DB,
                    help="degraded: pink noise this far below the speech")
    ap.add_argument("--opus-bitrate", type=int, default=OPUS_BITRATE)
    ap.add_argument("--labels", choices=("own", "aligned"), default="own",
                    help="flite: 'aligned' scores against pocketsphinx's alignment of the "
                         "text (as the real recordings are labelled) instead of flite's own "
                         "timings, to see what the aligner's errors cost")
    ap.add_argument("--no-bad-inputs", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/lipsync-eval.json")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.labels == "aligned" and args.set != "flite":
        ap.error("--labels aligned is for --set flite (the real recordings are aligned "
                 "already)")
    if args.set in ("real", "real-text"):
        if not args.root:
            ap.error(f"--set {args.set} needs --root DIR")
        clips, kept = real_set(args.root, not args.all_speakers,
                               "asr" if args.set == "real" else "prompt")
        clips = clips[: args.n] if args.n else clips
    else:
        clips, kept = flite_set(args.n or 48, args.seed), "slt, awb, rms (unseen speakers)"
        if args.labels == "aligned":
            clips = aligned_labels(clips)
            kept += ", phones from pocketsphinx's alignment of the text"
    runner = ModelRunner(args.engine, args.manifest, args.weights)
    leads = runner.leads()
    report = evaluate(clips, runner, bad=not args.no_bad_inputs, seed=args.seed,
                      snr_db=args.snr_db, bitrate=args.opus_bitrate, per_speaker=True)
    report["meta"] = {
        "set": args.set, "root": args.root, "clips": len(clips), "kept": kept,
        "seconds": round(sum(c.audio.size for c in clips) / SAMPLE_RATE, 1),
        "speakers": sorted({c.speaker for c in clips}),
        "unknown_phones": unknown_phones(clips),
        "engine": args.engine if args.engine == "torch" else f"onnxruntime {args.manifest}",
        "designed_leads_ms": {"jaw": 1000 * leads.jaw, "lips": 1000 * leads.lips},
        "lookahead_ms": TIMING.lookahead_ms,
        "lag_convention": "r(lag) pairs the prediction at t with the target at t - lag: "
                          "positive = prediction late; a designed lead L is lag -L",
        "segment_timing": "frame i stands for the sound at its centre + the system's "
                          "designed lead (the model's jaw lead for the jaw, vowels and "
                          "pauses, its lips' lead for the AUCs; loudness 0)",
        "auc": "per phone segment (mean score over its frames), Mann-Whitney",
        "scores": {k: v[2] for k, v in CONTRASTS.items()},
        "degraded": f"pink noise {args.snr_db:g} dB below the speech RMS, then Opus "
                    f"{args.opus_bitrate // 1000} kbit/s",
        "closed_when_quiet": f"95th percentile of jawOpen < {CLOSED_JAW} more than "
                             f"{1000 * PAUSE_MARGIN_S:.0f} ms from any speech",
        "runtime_s": None,
    }
    report["meta"]["runtime_s"] = round(time.monotonic() - t0, 1)
    text = table(report)
    print(text)
    print(f"\n{len(clips)} clips, {report['meta']['seconds']} s; "
          f"{report['meta']['runtime_s']} s to run")
    if report.get("onnx_vs_pt"):
        print(f"ONNX engine vs .pt head: max |diff| "
              f"{report['onnx_vs_pt']['max_abs_diff_onnx_vs_pt_head']:.2e}")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    report["table"] = text
    path.write_text(json.dumps(_clean_json(report), indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
