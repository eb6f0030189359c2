"""Phonemes to visemes to per-video-frame mouth targets (the audio head's labels).

Both synthesizers' inventories map onto one small viseme set: espeak-ng's mnemonics
(``h@l'oU``, ``_:`` ...) and flite's CMU phones (``hh ax l ow``, ``pau`` ...). Each
viseme has a target vector over :data:`inference.model.blendshapes.SPEECH`. Frame
targets follow a simple dominance model of coarticulation (Cohen and Massaro): every
segment pulls the mouth towards its target with a strength (its dominance) spread over
time by a Gaussian, so short consonants with strong lip gestures (p b m, f v) still
reach their shape while weak ones (t, k, h) take the colour of their vowels. The shape
track leads the sound (:data:`LEADS`), because the mouth moves before the sound it makes
is heard; the jaw and the lips each by their own lead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from inference.model.blendshapes import SPEECH
from inference.model.timing import TIMING

#: Viseme classes, in label order (index = class id).
VISEMES: tuple[str, ...] = (
    "sil", "PP", "FF", "TH", "DD", "KK", "CH", "SS", "RR", "AA", "AE", "E", "IH", "OH", "OU",
)
V = {name: i for i, name in enumerate(VISEMES)}


def _vec(**kw: float) -> list[float]:
    """A SPEECH vector from short names; left/right pairs are set together."""
    out = dict.fromkeys(SPEECH, 0.0)
    alias = {"jaw": ["jawOpen"], "close": ["mouthClose"], "funnel": ["mouthFunnel"],
             "pucker": ["mouthPucker"], "stretch": ["mouthStretchLeft", "mouthStretchRight"],
             "smile": ["mouthSmileLeft", "mouthSmileRight"], "roll": ["mouthRollLower"],
             "press": ["mouthPressLeft", "mouthPressRight"]}
    for key, value in kw.items():
        for name in alias[key]:
            out[name] = value
    return [out[name] for name in SPEECH]


#: Target blendshapes of each viseme (rows in VISEMES order, columns in SPEECH order).
PROTOTYPES: np.ndarray = np.array([
    _vec(),                                                  # sil: relaxed, closed
    _vec(jaw=0.04, close=0.7, roll=0.25, press=0.55),        # PP: p b m
    _vec(jaw=0.10, close=0.15, roll=0.75, stretch=0.1),      # FF: f v
    _vec(jaw=0.22, stretch=0.2, smile=0.05),                 # TH: th dh
    _vec(jaw=0.28, stretch=0.25, smile=0.15),                # DD: t d n l
    _vec(jaw=0.36, stretch=0.1),                             # KK: k g ng
    _vec(jaw=0.18, funnel=0.55, pucker=0.3),                 # CH: ch jh sh zh
    _vec(jaw=0.10, stretch=0.45, smile=0.35),                # SS: s z
    _vec(jaw=0.20, funnel=0.3, pucker=0.45),                 # RR: r er
    _vec(jaw=0.78, stretch=0.1),                             # AA: open back vowels
    _vec(jaw=0.68, stretch=0.4, smile=0.2),                  # AE: open front (trap)
    _vec(jaw=0.48, stretch=0.45, smile=0.2),                 # E: mid front, schwa
    _vec(jaw=0.22, stretch=0.65, smile=0.5),                 # IH: close front, y
    _vec(jaw=0.55, funnel=0.65, pucker=0.2),                 # OH: rounded open-mid
    _vec(jaw=0.16, funnel=0.4, pucker=0.85),                 # OU: close rounded, w
], dtype=np.float32)

#: How strongly each viseme holds its shape against its neighbours.
DOMINANCE: np.ndarray = np.array(
    [1.0, 4.0, 3.0, 1.0, 0.6, 0.5, 1.5, 1.2, 1.0, 1.2, 1.2, 1.0, 1.0, 1.2, 1.5],
    dtype=np.float32
)
UNIFORM: np.ndarray = np.ones_like(DOMINANCE)


@dataclass(frozen=True)
class Leads:
    """How long each articulator's shape leads the sound it makes (s): ``jaw`` for
    jawOpen, ``lips`` for every lip shape (closure, rounding, spreading, f/v)."""

    jaw: float = 0.04
    lips: float = 0.04

    def __post_init__(self) -> None:
        for name in ("jaw", "lips"):
            if not 0.0 <= getattr(self, name) <= 0.2:
                raise ValueError(f"{name} lead {getattr(self, name)} s: give 0 to 0.2 s")


#: The shipped head's leads (its training targets; the evaluation reads each articulator
#: at its own).
LEADS = Leads()


@dataclass(frozen=True)
class JawTarget:
    """How jawOpen's training target is made. ``by_vowel``: a vowel's own height
    (:data:`VOWEL_JAW`), not its viseme's (which lumps, e.g., /i:/ with /I/).
    ``dominance``: neighbouring phones blend by the lips' dominance, so that a bilabial
    pulls a short vowel's jaw down as hard as its lips; without it every phone weighs
    alike, as the jaw (a slow articulator the lips ride on) moves through a /p/ towards
    the vowel's height."""

    by_vowel: bool = False
    dominance: bool = True

    def describe(self) -> str:
        """What the weights' JSON says (and a saved windows file is checked against)."""
        height = "each vowel's height" if self.by_vowel else "its viseme's"
        return height if self.dominance else f"{height}, blended without dominance"


#: The shipped head's jaw target.
JAW_TARGET = JawTarget()

JAW = SPEECH.index("jawOpen")
#: Spread of each segment's influence (Gaussian sigma).
BLEND_SIGMA_S = 0.03

# Marks to strip from espeak mnemonics before lookup (stress, length, variant markers).
_STRIP = re.compile(r"[':;,#/!\-\d]")

# espeak-ng mnemonics (normalised) and flite CMU phones; diphthongs as (first, second).
_TABLE: dict[str, str | tuple[str, str]] = {
    # silence
    "_": "sil", "pau": "sil", "sil": "sil", "h#": "sil", "": "sil",
    # bilabials, labiodentals, dentals
    "p": "PP", "b": "PP", "m": "PP", "em": "PP",
    "f": "FF", "v": "FF",
    "T": "TH", "D": "TH", "th": "TH", "dh": "TH",
    # alveolars, velars
    "t": "DD", "d": "DD", "n": "DD", "l": "DD", "L": "DD", "dx": "DD", "nx": "DD", "el": "DD",
    "en": "DD", "?": "DD", "tl": "DD",
    "k": "KK", "g": "KK", "N": "KK", "ng": "KK", "x": "KK", "c": "KK", "q": "KK", "G": "KK",
    # postalveolars, sibilants
    "S": "CH", "Z": "CH", "tS": "CH", "dZ": "CH", "sh": "CH", "zh": "CH", "ch": "CH",
    "jh": "CH", "C": "CH",
    "s": "SS", "z": "SS", "ts": "SS", "dz": "SS",
    # approximants
    "r": "RR", "R": "RR", "er": "RR", "axr": "RR", "3": "RR", "3r": "RR", "@r": "RR",
    "w": "OU", "W": "OU",
    "j": "IH", "y": "IH", "J": "IH",
    # vowels (espeak)
    "a": "AE", "A": "AA", "aa": "AA", "A@": "AA", "V": "AA", "0": "OH", "Q": "OH",
    "@": "E", "E": "E", "e": "E", "e@": ("E", "E"), "a@": "AA", "&": "AE", "@L": "DD",
    "i": "IH", "I": "IH", "i@": ("IH", "E"), "y:": "OU", "Y": "OU",
    "o": "OH", "O": "OH", "O@": "OH", "o@": "OH", "u": "OU", "U": "OU", "U@": ("OU", "E"),
    "aI": ("AA", "IH"), "aI@": ("AA", "E"), "aU": ("AA", "OU"), "aU@": ("AA", "OU"),
    "eI": ("E", "IH"), "oU": ("OH", "OU"), "OI": ("OH", "IH"), "@U": ("E", "OU"),
    "ai": ("AA", "IH"), "au": ("AA", "OU"), "ei": ("E", "IH"), "oi": ("OH", "IH"),
    # vowels (flite / CMU)
    "ae": "AE", "ah": "AA", "ao": "OH", "aw": ("AA", "OU"), "ax": "E", "ay": ("AA", "IH"),
    "eh": "E", "ey": ("E", "IH"), "ih": "IH", "ix": "IH", "iy": "IH", "ow": ("OH", "OU"),
    "oy": ("OH", "IH"), "uh": "OU", "uw": "OU",
}
#: Phonemes with no lip shape of their own: they take the following phoneme's viseme.
_TRANSPARENT = {"h", "hh", "H", "h#h"}

#: Jaw openness of each vowel by its height (open 0.9 ... close 0.2), for jaw targets per
#: phone (``segments_from_phonemes(jaw_by_vowel=True)``): a viseme lumps vowels whose
#: jaws differ (IH holds the close /i:/ and the near-close /I/, OH the open-mid /O:/ and
#: the close-mid /o/, E the mid /E/ and the schwa). Diphthongs as (first, second). CMU
#: phones (flite, the aligner's labels) and espeak-ng's English mnemonics.
VOWEL_JAW: dict[str, tuple[float, ...]] = {
    # CMU
    "aa": (0.9,), "ae": (0.8,), "ah": (0.7,), "ao": (0.8,), "eh": (0.6,), "ax": (0.45,),
    "er": (0.35,), "axr": (0.35,), "ih": (0.35,), "ix": (0.3,), "iy": (0.25,),
    "uh": (0.35,), "uw": (0.2,), "aw": (0.85, 0.3), "ay": (0.85, 0.3), "ey": (0.55, 0.3),
    "ow": (0.6, 0.3), "oy": (0.75, 0.3),
    # espeak-ng (after stripping stress and length marks)
    "a": (0.8,), "A": (0.9,), "V": (0.7,), "0": (0.8,), "Q": (0.8,), "O": (0.8,),
    "O@": (0.8,), "o@": (0.8,), "o": (0.6,), "@": (0.45,), "3": (0.35,), "E": (0.6,),
    "e": (0.55,), "e@": (0.6, 0.45), "a@": (0.9,), "A@": (0.9,), "&": (0.8,), "I": (0.35,),
    "i": (0.25,), "i@": (0.3, 0.45), "U": (0.35,), "u": (0.2,), "U@": (0.35, 0.45),
    "aI": (0.85, 0.3), "aI@": (0.85, 0.45), "aU": (0.85, 0.3), "aU@": (0.85, 0.3),
    "eI": (0.55, 0.3), "oU": (0.6, 0.3), "@U": (0.45, 0.3), "OI": (0.75, 0.3),
    "ai": (0.85, 0.3), "au": (0.85, 0.3), "ei": (0.55, 0.3), "oi": (0.75, 0.3),
}


def phoneme_visemes(phoneme: str) -> tuple[str, ...] | None:
    """Viseme(s) of one phoneme (two for diphthongs); None for transparent ones (h)."""
    raw = phoneme.strip()
    if raw.startswith("_") or raw in ("pau", "sil", "h#", ""):
        return ("sil",)
    if raw in _TRANSPARENT:
        return None
    for key in (raw, raw.replace(":", ""), _STRIP.sub("", raw) if raw != "0" else "0"):
        if key in _TABLE:
            hit = _TABLE[key]
            return hit if isinstance(hit, tuple) else (hit,)
        if key.lower() in _TRANSPARENT:
            return None
    # Unknown (other languages' mnemonics): fall back on the first letter.
    key = _STRIP.sub("", raw)
    for n in range(len(key), 0, -1):
        if key[:n] in _TABLE:
            hit = _TABLE[key[:n]]
            return hit if isinstance(hit, tuple) else (hit,)
    return ("E",)


def vowel_jaw(phoneme: str) -> tuple[float, ...] | None:
    """A vowel's jaw openness (two for diphthongs), None for anything else; looked up as
    ``phoneme_visemes`` looks up a viseme."""
    raw = phoneme.strip()
    for key in (raw, raw.replace(":", ""), _STRIP.sub("", raw) if raw != "0" else "0"):
        if key in VOWEL_JAW:
            return VOWEL_JAW[key]
    return None


@dataclass(frozen=True)
class Segment:
    """One viseme held over [start, end) seconds of the audio; ``jaw``, where set, is its
    jaw openness in place of the viseme's."""

    start: float
    end: float
    viseme: int
    jaw: float | None = None


def segments_from_phonemes(phones: list[tuple[float, float, str]],
                           jaw_by_vowel: bool = False) -> list[Segment]:
    """(start_s, end_s, phoneme) -> viseme segments (diphthongs split in half); with
    ``jaw_by_vowel`` each vowel's segments carry its own jaw openness (``VOWEL_JAW``)."""
    out: list[Segment] = []
    pending: list[tuple[float, float]] = []  # transparent phonemes awaiting a viseme
    for start, end, ph in phones:
        vis = phoneme_visemes(ph)
        if vis is None:
            pending.append((start, end))
            continue
        jaws = vowel_jaw(ph) if jaw_by_vowel else None
        if jaws is not None and len(jaws) != len(vis):
            jaws = (jaws[0],) * len(vis) if len(vis) > len(jaws) else jaws[:len(vis)]
        jaw = [None] * len(vis) if jaws is None else list(jaws)
        for s, e in pending:
            out.append(Segment(s, e, V[vis[0]], jaw[0]))
        pending.clear()
        if len(vis) == 1:
            out.append(Segment(start, end, V[vis[0]], jaw[0]))
        else:
            mid = 0.5 * (start + end)
            out.append(Segment(start, mid, V[vis[0]], jaw[0]))
            out.append(Segment(mid, end, V[vis[1]], jaw[1]))
    for s, e in pending:
        out.append(Segment(s, e, V["sil"]))
    return out


def frame_targets(
    segments: list[Segment], n_frames: int, fps: int = TIMING.fps, *, step_s: float = 0.005,
    leads: Leads = LEADS, jaw_dominance: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-video-frame targets (n_frames, len(SPEECH)) and viseme labels (n_frames,).

    Frame ``i`` covers ``[i/fps, (i+1)/fps)`` of the audio and is sampled at its centre;
    jawOpen shows the sound ``leads.jaw`` later, every other shape the sound
    ``leads.lips`` later. Time outside every segment is silence. The label is the viseme
    with the largest dominance-weighted share in the lips' timing, i.e. the shape the
    target is showing. ``jaw_dominance`` off: jawOpen blends its neighbours without the
    visemes' dominance (:class:`JawTarget`).
    """
    lips = _influence(segments, n_frames, fps, step_s, leads.lips)
    targets = (lips @ PROTOTYPES) / np.maximum(lips.sum(1, keepdims=True), 1e-6)
    if leads.jaw != leads.lips or not jaw_dominance or \
            any(seg.jaw is not None for seg in segments):
        jaw, opening = _influence(segments, n_frames, fps, step_s, leads.jaw, jaw=True,
                                  dominance=DOMINANCE if jaw_dominance else UNIFORM)
        targets[:, JAW] = opening / np.maximum(jaw.sum(1), 1e-6)
    return targets.astype(np.float32), lips.argmax(1)


def _influence(segments: list[Segment], n_frames: int, fps: int, step_s: float,
               lead_s: float, jaw: bool = False, dominance: np.ndarray = DOMINANCE) -> Any:
    """(n_frames, n_visemes): each viseme's dominance-weighted influence on each frame,
    whose shape is that of the sound ``lead_s`` after the frame's centre. With ``jaw``,
    also (n_frames,): the same blend of the jaw's openness, each segment's own where it
    has one (the influences' sum divides it)."""
    duration = n_frames / fps
    n = int(np.ceil(duration / step_s)) + 1
    cls = np.zeros(n, np.int64)  # silence by default
    opening = np.zeros(n, np.float32)
    for seg in segments:
        lo = int(np.ceil((seg.start - lead_s) / step_s))
        hi = int(np.ceil((seg.end - lead_s) / step_s))
        span = slice(max(lo, 0), max(min(hi, n), 0))
        cls[span] = seg.viseme
        opening[span] = PROTOTYPES[seg.viseme, JAW] if seg.jaw is None else seg.jaw
    onehot = np.zeros((n, len(VISEMES)), np.float32)
    onehot[np.arange(n), cls] = dominance[cls]
    half = int(np.ceil(4 * BLEND_SIGMA_S / step_s))
    tk = np.arange(-half, half + 1) * step_s
    kernel = np.exp(-0.5 * (tk / BLEND_SIGMA_S) ** 2).astype(np.float32)
    padded = np.concatenate([np.zeros((half, len(VISEMES)), np.float32), onehot,
                             np.zeros((half, len(VISEMES)), np.float32)])
    padded[:half, V["sil"]] = dominance[V["sil"]]
    padded[-half:, V["sil"]] = dominance[V["sil"]]
    centres = np.minimum(((np.arange(n_frames) + 0.5) / fps / step_s).round().astype(int),
                         n - 1)
    influence = np.stack([kernel @ padded[c : c + 2 * half + 1] for c in centres])
    if not jaw:
        return influence
    # Silence's jaw is 0, so the padding adds weight and no opening.
    weighted = np.concatenate([np.zeros(half, np.float32), onehot.sum(1) * opening,
                               np.zeros(half, np.float32)])
    return influence, np.array([kernel @ weighted[c : c + 2 * half + 1] for c in centres])


def nearest_viseme(coeffs: np.ndarray) -> np.ndarray:
    """Class of each coefficient vector (..., len(SPEECH)): its nearest prototype."""
    d = ((coeffs[..., None, :] - PROTOTYPES) ** 2).sum(-1)
    return d.argmin(-1)
