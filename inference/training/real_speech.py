r"""Recordings of real people with phone timings (issue 11), for training and evaluation.

The audio head is otherwise trained on synthetic speech only (:mod:`.corpus`). This
module turns recordings of real people (large, so they live outside the repository,
under a data root such as ``data/real_speech``) into :class:`RealUtterance` objects
shaped like the
synthesizers' :class:`inference.tts.Utterance`: 16 kHz float32 mono audio and phones as
``(start_s, end_s, name)`` with flite's lower-case CMU phone names (``ax`` for schwa,
``ah`` for the stressed vowel, ``pau`` for silence), which
:mod:`inference.training.visemes` maps.

Sources, laid out under ``ROOT/src/``, each a checkout of a public repository (no
registry package carries recordings of people)::

    git clone https://github.com/rhasspy/dataset-voice-cathy ROOT/src/dataset-voice-kathleen
    git -C ROOT/src/dataset-voice-kathleen checkout c51cb971036a127359b43c621f26ca5081eab13e
    git clone --no-checkout https://github.com/resemble-ai/Resemblyzer ROOT/src/Resemblyzer
    git -C ROOT/src/Resemblyzer restore \
        --source=15d828edebe06bc72b9cabc8ef8ca5ab2cb457ce -- audio_data LICENSE README.md


Speakers whose true text is known, all held out (never trained on), so that the
evaluation's phone labels are not the recogniser's; each a checkout restoring only
these paths::

    git clone --no-checkout https://github.com/Iselix/kwiiyatta ROOT/src/kwiiyatta
    git -C ROOT/src/kwiiyatta restore --source=5771c88fffbcfdadb1fb5084be8af220164a01ff -- \
        tests/data/cmu_us_clb_arctic/wav tests/data/cmu_us_clb_arctic/COPYING \
        tests/data/cmu_us_slt_arctic/wav tests/data/cmu_us_slt_arctic/COPYING
    git clone --no-checkout https://github.com/LCAV/pyroomacoustics ROOT/src/pyroomacoustics
    git -C ROOT/src/pyroomacoustics restore --source=6fe43fecb7c358ac9aaa054e7e73641189f1afff -- \
        examples/input_samples pyroomacoustics/datasets/cmu_arctic.py LICENSE
    git clone --no-checkout https://github.com/r9y9/pysptk ROOT/src/pysptk
    git -C ROOT/src/pysptk restore --source=65c26f5cac3caf8af031ef100c53369c3c83c5ef -- \
        pysptk/example_audio_data pysptk/util.py
    git clone --no-checkout https://github.com/auspicious3000/autovc ROOT/src/autovc
    git -C ROOT/src/autovc restore --source=c1827a60e83e6d26030b8953843b2f7cf2bd36db -- \
        wavs LICENSE
    git clone --no-checkout https://github.com/jaywalnut310/vits ROOT/src/vits
    git -C ROOT/src/vits restore --source=2e561ba58618d021b5b8323d3765880f7e0ecfdb -- \
        filelists LICENSE
    git clone --no-checkout https://github.com/coqui-ai/TTS ROOT/src/TTS
    git -C ROOT/src/TTS restore --source=25c07e3d8523ae73f4f5b6053c6691672e6aeb18 -- \
        tests/data/ljspeech

* CMU ARCTIC recordings of five real speakers (CMU's COPYING: "free for use for any
  purpose (commercial or otherwise)", kept with the notice), reading the ARCTIC prompts
  (their text is taken from Kathleen's copies): clb and slt (US women, 9 each) from
  kwiiyatta's test data, which ships COPYING; aew (US man) and axb (Indian English woman,
  3 each) from pyroomacoustics' examples; awb (Scottish man, 1) from pysptk's example.
* VCTK (CC BY 4.0): p225, p226, p227 and p228 (English, 2 F and 2 M; 10 each) from
  autovc's sample wavs; their text is VCTK's, from vits's file lists.
* LJSpeech (public domain): one US woman, 32 recordings from coqui TTS's test data; the
  text is LJSpeech's, from vits's file lists.

Speakers whose true text is known, trained on (their text found as above)::

    git clone --no-checkout https://github.com/andabi/deep-voice-conversion \
        ROOT/src/deep-voice-conversion
    git -C ROOT/src/deep-voice-conversion restore \
        --source=983c275d669e8f6c935b08582063f8aaaecff48e -- datasets/arctic/bdl LICENSE
    git clone --no-checkout https://github.com/yl4579/StarGANv2-VC ROOT/src/StarGANv2-VC
    git -C ROOT/src/StarGANv2-VC restore --source=985df557acad47131587955bfe13ea9b99168f71 -- \
        Demo/VCTK-corpus LICENSE

* CMU ARCTIC bdl (US man; CMU's licence as above): all 1,132 prompts, 51 minutes, in
  deep-voice-conversion's datasets (MIT; its README names CMU ARCTIC as their source).
* VCTK (CC BY 4.0) p230, p233, p236, p243, p244, p254, p258, p259 and p273 (British
  English, 4 F and 5 M), one recording each (sentence 023) from StarGANv2-VC's demo
  clips (MIT; VCTK's wav48). p228 is there too; it stays held out.

* ``dataset-voice-kathleen``: one native US English woman reading the CMU ARCTIC prompts
  (CC0; 1,620 recordings, 82 minutes; 48 kHz stereo, silence trimmed). The text is the
  prompt that was read.
* ``Resemblyzer/audio_data``: LibriSpeech excerpts (CC BY 4.0) shipped in the Resemblyzer
  repository (Apache-2.0): 10 test-other speakers with 10 utterances each, and one
  train-clean-100 utterance from each of 251 speakers, with LibriSpeech's SPEAKERS.TXT
  (sex). No transcripts come with them: the text is pocketsphinx's own recognition
  (``text_source == "asr"``), so these phone labels are rougher than Kathleen's (21.5%
  word errors where the true text is known; 94% of video frames keep their viseme). Only
  the LibriSpeech folders are used: the repository's other audio is of unclear licence.

Phone timings come from forced alignment with pocketsphinx 5 (the ``real-speech``
extra: its wheel carries the en-us acoustic model and dictionary). Words are
pronounced as flite says them (so schwas are ``ax``, as in the synthetic corpus), falling
back on pocketsphinx's dictionary when flite is not installed.

``python -m inference.training.real_speech --root ROOT --prepare`` aligns everything once
and caches it as ``ROOT/real_speech-v2.pkl``; :func:`load_real_speech` reads that cache.
:func:`split` separates training speakers from held-out ones (never trained on).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inference.tts import SAMPLE_RATE, Utterance, resample

#: 2: flite's ``aa`` split into ``aa`` and ``ah`` (/V/ as in "but"; :func:`build_lexicon`).
CACHE_VERSION = 2
#: Where the recordings are looked for unless told (``data/`` is kept out of git).
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "data" / "real_speech"
CACHE_NAME = f"real_speech-v{CACHE_VERSION}.pkl"
#: Silence added around every recording before alignment (Kathleen's are trimmed to the
#: first and last sample of speech, which leaves the aligner no room for a pause).
PAD_S = 0.2
#: pocketsphinx works on 10 ms frames.
FRAME_S = 0.01

KATHLEEN_DIR = Path("src/dataset-voice-kathleen/data")
LIBRI_DIR = Path("src/Resemblyzer/audio_data")
LIBRI_TEST_OTHER = "librispeech_test-other"
LIBRI_TRAIN_CLEAN = "librispeech_train-clean-100"

#: Held out from training: all ten LibriSpeech test-other speakers (5 F, 5 M) and sixteen
#: train-clean-100 speakers (8 F, 8 M; the first eight of each sex by speaker number).
HELDOUT_TEST_OTHER: tuple[str, ...] = (
    "libri-1688", "libri-1998", "libri-2033", "libri-2414", "libri-2609",
    "libri-3005", "libri-3080", "libri-3331", "libri-367", "libri-533",
)
N_HELDOUT_CLEAN_PER_SEX = 8

#: Real speakers whose true text is known, every one held out:
#: (corpus, speaker, sex, accent, glob under ROOT/src).
TRUE_TEXT_SPEAKERS: tuple[tuple[str, str, str, str, str], ...] = (
    ("arctic", "arctic-clb", "F", "US", "kwiiyatta/tests/data/cmu_us_clb_arctic/wav/*.wav"),
    ("arctic", "arctic-slt", "F", "US", "kwiiyatta/tests/data/cmu_us_slt_arctic/wav/*.wav"),
    ("arctic", "arctic-aew", "M", "US",
     "pyroomacoustics/examples/input_samples/cmu_arctic_us_aew_*.wav"),
    ("arctic", "arctic-axb", "F", "Indian",
     "pyroomacoustics/examples/input_samples/cmu_arctic_us_axb_*.wav"),
    ("arctic", "arctic-awb", "M", "Scottish", "pysptk/pysptk/example_audio_data/arctic_*.wav"),
    ("vctk", "vctk-p225", "F", "English", "autovc/wavs/p225/*.wav"),
    ("vctk", "vctk-p226", "M", "English", "autovc/wavs/p226/*.wav"),
    ("vctk", "vctk-p227", "M", "English", "autovc/wavs/p227/*.wav"),
    ("vctk", "vctk-p228", "F", "English", "autovc/wavs/p228/*.wav"),
    ("ljspeech", "ljspeech", "F", "US", "TTS/tests/data/ljspeech/wavs/*.wav"),
)
TRUE_TEXT_CORPORA = frozenset(corpus for corpus, *_ in TRUE_TEXT_SPEAKERS)
#: Real speakers whose true text is known, trained on (same fields): ARCTIC's bdl reading
#: the ARCTIC prompts, and nine VCTK speakers reading VCTK's sentence 023.
TRAINING_TRUE_TEXT_SPEAKERS: tuple[tuple[str, str, str, str, str], ...] = (
    ("arctic", "arctic-bdl", "M", "US", "deep-voice-conversion/datasets/arctic/bdl/*.wav"),
    *(("vctk", f"vctk-{spk}", sex, "British", f"StarGANv2-VC/Demo/VCTK-corpus/{spk}/*.wav")
      for spk, sex in (("p230", "F"), ("p233", "F"), ("p236", "F"), ("p243", "M"),
                       ("p244", "F"), ("p254", "M"), ("p258", "M"), ("p259", "M"),
                       ("p273", "M"))),
)
VITS_FILELISTS = Path("src/vits/filelists")


@dataclass
class RealUtterance(Utterance):
    """A recording of a real person: :class:`Utterance` plus who spoke it.

    ``synth`` is ``"real"``; ``voice`` is ``"<corpus>:<speaker>"``.
    """

    speaker: str = ""
    sex: str = ""  # "F", "M" or "" when unknown
    corpus: str = ""
    utt_id: str = ""
    text_source: str = "prompt"  # "prompt" (what was read) or "asr" (recognised)
    accent: str = ""
    align_score: float = 0.0  # pocketsphinx's mean acoustic score per 10 ms frame


# ------------------------------------------------------------------------ phone names
#: pocketsphinx (CMU, upper case, no stress) phones; flite's names are these lower-cased,
#: plus ax (schwa, AH here), axr and the syllabic el, em, en.
_SPHINX = set("AA AE AH AO AW AY B CH D DH EH ER EY F G HH IH IY JH K L M N NG OW OY P R "
              "S SH T TH UH UW V W Y Z ZH".split())
_SPHINX_LOWER = {p.lower() for p in _SPHINX}
_FLITE_TO_SPHINX: dict[str, list[tuple[str, str]]] = {
    "ax": [("AH", "ax")], "axr": [("ER", "er")],
    "el": [("AH", "ax"), ("L", "l")], "em": [("AH", "ax"), ("M", "m")],
    "en": [("AH", "ax"), ("N", "n")],
}


def normalise_words(text: str) -> list[str]:
    """Lower-case words of ``text``: letters and inner apostrophes only."""
    text = text.lower().replace("-", " ")
    return [w.strip("'") for w in re.sub(r"[^a-z' ]+", " ", text).split() if w.strip("'")]


def _flite_phones(word: str) -> list[str] | None:
    try:
        out = subprocess.run(["flite", "-t", word, "-ps", "-o", "/dev/null"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    phones = [p for p in out.split() if p != "pau"]
    return phones or None


@functools.cache
def _sphinx_dict() -> dict[str, list[str]]:
    import pocketsphinx

    path = Path(pocketsphinx.get_model_path()) / "en-us" / "cmudict-en-us.dict"
    out: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split()
        if len(parts) > 1 and "(" not in parts[0]:
            out[parts[0]] = parts[1:]
    return out


def build_lexicon(words: set[str], cache: Path | None = None
                  ) -> dict[str, list[tuple[str, str]]]:
    """word -> [(sphinx phone, output phone name)], from flite (or pocketsphinx's dict).

    flite's lexicon says ``aa`` for both /A:/ ("father") and /V/ ("but", "up", "just"),
    whose jaws differ (0.9 and 0.7 in the evaluation's table); pocketsphinx's dictionary
    tells them apart (AA, and AH, which it shares with the schwa flite calls ``ax``), so
    where it says AH the phone is ``ah``, aligned with the AH model. Words neither can
    pronounce are left out (utterances with them are skipped).
    """
    known: dict[str, list[list[str]]] = {}
    if cache is not None and cache.exists():
        known = json.loads(cache.read_text())
    use_flite = shutil.which("flite") is not None
    lex: dict[str, list[tuple[str, str]]] = {}
    for w in sorted(words):
        if w in known:
            lex[w] = [tuple(p) for p in known[w]]  # type: ignore[misc]
            continue
        pron: list[tuple[str, str]] = []
        if use_flite:
            for p in _flite_phones(w) or []:
                if p in _FLITE_TO_SPHINX:
                    pron += _FLITE_TO_SPHINX[p]
                elif p.upper() in _SPHINX:
                    pron.append((p.upper(), p))
                else:
                    pron = []
                    break
            pron = split_open_vowels(pron, _sphinx_dict().get(w))
        else:
            pron = [(p, p.lower()) for p in _sphinx_dict().get(w, []) if p in _SPHINX]
        if pron:
            lex[w] = pron
    if cache is not None:
        known.update({w: [list(p) for p in pron] for w, pron in lex.items()})
        cache.write_text(json.dumps(known, indent=0, sort_keys=True))
    return lex


def split_open_vowels(pron: list[tuple[str, str]], cmu: list[str] | None
                      ) -> list[tuple[str, str]]:
    """flite's pronunciation with each ``aa`` that pocketsphinx's dictionary (``cmu``, of
    the same length) says is AH made ``ah``."""
    if cmu is None or len(cmu) != len(pron):
        return pron
    return [("AH", "ah") if name == "aa" and theirs == "AH" else (sphinx, name)
            for (sphinx, name), theirs in zip(pron, cmu, strict=True)]


# ------------------------------------------------------------------------ sources
@dataclass
class _Item:
    corpus: str
    speaker: str
    sex: str
    accent: str
    utt_id: str
    path: str
    text: str | None  # None: recognise it


def _read_speakers(path: Path) -> dict[str, str]:
    sexes: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith(";") or "|" not in line:
            continue
        parts = [p.strip() for p in line.split("|")]
        sexes[parts[0]] = parts[1]
    return sexes


def find_items(root: Path) -> list[_Item]:
    """Every recording under ``root/src`` that a source knows (missing sources skipped)."""
    items: list[_Item] = []
    kd = root / KATHLEEN_DIR
    if kd.is_dir():
        for wav in sorted(kd.glob("*.wav")):
            txt = wav.with_suffix(".txt")
            if txt.exists():
                items.append(_Item("kathleen", "kathleen", "F", "US", wav.stem, str(wav),
                                   txt.read_text(encoding="utf-8").strip()))
    items += _true_text_items(root)
    ld = root / LIBRI_DIR
    for sub in (LIBRI_TEST_OTHER, LIBRI_TRAIN_CLEAN):
        d = ld / sub
        if not d.is_dir():
            continue
        sexes = _read_speakers(d / "SPEAKERS.TXT")
        for flac in sorted(d.rglob("*.flac")):
            spk = flac.stem.split("-")[0]
            items.append(_Item("librispeech", f"libri-{spk}", sexes.get(spk, ""), "",
                               flac.stem, str(flac), None))
    return items


def _true_text_items(root: Path) -> list[_Item]:
    """The speakers with true text: ARCTIC prompts as Kathleen's files give them,
    VCTK and LJSpeech text from vits's file lists (a recording without text is skipped)."""
    texts: dict[str, str] = {}
    for txt in sorted((root / KATHLEEN_DIR).glob("arctic_*.txt")):
        prompt = re.match(r"arctic_[ab]\d{4}", txt.stem)
        if prompt:
            texts.setdefault(prompt.group(0), txt.read_text(encoding="utf-8").strip())
    for filelist in sorted((root / VITS_FILELISTS).glob("*_filelist.txt")):
        for line in filelist.read_text(encoding="utf-8").splitlines():
            parts = line.split("|")
            if len(parts) >= 2:
                texts.setdefault(Path(parts[0]).stem, parts[-1].strip())
    items: list[_Item] = []
    for corpus, speaker, sex, accent, pattern in TRUE_TEXT_SPEAKERS + TRAINING_TRUE_TEXT_SPEAKERS:
        for wav in sorted((root / "src").glob(pattern)):
            prompt = re.search(r"[ab]\d{4}$", wav.stem)  # arctic_a0001, cmu_arctic_us_aew_a0001
            key = f"arctic_{prompt.group(0)}" if corpus == "arctic" and prompt else wav.stem
            if key in texts:
                items.append(_Item(corpus, speaker, sex, accent, f"{speaker}-{wav.stem}",
                                   str(wav), texts[key]))
    return items


def load_audio(path: str) -> np.ndarray:
    """First channel, 16 kHz float32 within [-1, 1] (resampling a recording that peaks at
    full scale rings a little past it)."""
    import soundfile as sf

    audio, rate = sf.read(path, dtype="float32", always_2d=True)
    return np.clip(resample(audio[:, 0], rate, SAMPLE_RATE), -1.0, 1.0)


def _pad(audio: np.ndarray) -> np.ndarray:
    n = int(PAD_S * SAMPLE_RATE)
    rng = np.random.default_rng(len(audio))
    noise = lambda: (rng.standard_normal(n) * 3e-5).astype(np.float32)  # noqa: E731
    return np.concatenate([noise(), audio, noise()])


def _pcm(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


# ------------------------------------------------------------------------ workers
_DECODERS: dict[str, object] = {}


def _decoder(kind: str, dict_path: str | None = None):
    from pocketsphinx import Decoder

    key = f"{kind}:{dict_path}"
    if key not in _DECODERS:
        kw = {"samprate": SAMPLE_RATE, "loglevel": "FATAL"}
        if kind == "align":
            kw.update(dict=dict_path, bestpath=False)
        _DECODERS[key] = Decoder(**kw)
    return _DECODERS[key]


def _recognise(path: str) -> str:
    d = _decoder("asr")
    audio = _pad(load_audio(path))
    d.start_utt()
    d.process_raw(_pcm(audio), full_utt=True)
    d.end_utt()
    hyp = d.hyp()
    words = [] if hyp is None else [re.sub(r"\(\d+\)$", "", w) for w in hyp.hypstr.split()]
    return " ".join(w for w in words if not w.startswith(("<", "[", "+")))


def align(audio: np.ndarray, words: list[str], lex: dict[str, list[tuple[str, str]]],
          dict_path: str) -> tuple[list[tuple[float, float, str]], float] | None:
    """Forced alignment of ``words`` to 16 kHz ``audio``: contiguous phones covering the
    whole audio (``pau`` where silent) and the mean acoustic score per frame; None when
    pocketsphinx finds no path."""
    d = _decoder("align", dict_path)
    pcm = _pcm(audio)
    d.set_align_text(" ".join(words))
    d.start_utt()
    d.process_raw(pcm, full_utt=True)
    d.end_utt()
    if d.hyp() is None:
        return None
    d.set_alignment()
    d.start_utt()
    d.process_raw(pcm, full_utt=True)
    d.end_utt()
    seconds = audio.size / SAMPLE_RATE
    phones: list[tuple[float, float, str]] = []
    score, frames = 0.0, 0
    # Walk pocketsphinx's iterators once, in place: keeping them past a step crashes it.
    for word in d.get_alignment():
        wname = re.sub(r"\(\d+\)$", "", word.name)
        segs = [(ph.name, ph.start, ph.duration, ph.score) for ph in word]
        names = [out for _, out in lex.get(wname, [])]
        for i, (pname, start, dur, sc) in enumerate(segs):
            if wname in lex and len(names) == len(segs):
                name = names[i]
            elif pname.upper() in _SPHINX:
                name = pname.lower()
            else:
                name = "pau"  # SIL and noise models
            phones.append((start * FRAME_S, (start + dur) * FRAME_S, name))
            score += sc
            frames += dur
    return _tidy(phones, seconds), score / max(frames, 1)


def _tidy(phones: list[tuple[float, float, str]], seconds: float
          ) -> list[tuple[float, float, str]]:
    """Contiguous, ordered, within [0, seconds]; neighbouring pauses merged."""
    out: list[tuple[float, float, str]] = []
    t = 0.0
    for s, e, name in sorted(phones):
        s, e = max(s, t), min(e, seconds)
        if s > t + 1e-6:
            out.append((t, s, "pau"))
        if e <= s:
            continue
        if out and name == "pau" and out[-1][2] == "pau":
            out[-1] = (out[-1][0], e, "pau")
        else:
            out.append((s, e, name))
        t = e
    if t < seconds - 1e-6:
        if out and out[-1][2] == "pau":
            out[-1] = (out[-1][0], seconds, "pau")
        else:
            out.append((t, seconds, "pau"))
    merged: list[tuple[float, float, str]] = []
    for s, e, name in out:
        if merged and name == "pau" and merged[-1][2] == "pau":
            merged[-1] = (merged[-1][0], e, "pau")
        else:
            merged.append((s, e, name))
    return merged


def _align_item(args: tuple[_Item, str, str]) -> RealUtterance | str:
    item, text, dict_path = args
    lex = _WORKER_LEX
    words = normalise_words(text)
    missing = [w for w in words if w not in lex]
    if not words or missing:
        return f"{item.utt_id}: no pronunciation for {missing or 'empty text'}"
    audio = _pad(load_audio(item.path))
    res = align(audio, words, lex, dict_path)
    if res is None:
        return f"{item.utt_id}: pocketsphinx found no alignment"
    phones, score = res
    utt = RealUtterance(
        audio=audio, phones=phones, synth="real", voice=f"{item.corpus}:{item.speaker}",
        text=" ".join(words), speaker=item.speaker, sex=item.sex, corpus=item.corpus,
        utt_id=item.utt_id, text_source="prompt" if item.text is not None else "asr",
        accent=item.accent, align_score=score)
    return utt


_WORKER_LEX: dict[str, list[tuple[str, str]]] = {}


def _init_worker(lex: dict[str, list[tuple[str, str]]]) -> None:
    global _WORKER_LEX
    _WORKER_LEX = lex


def write_align_dict(lex: dict[str, list[tuple[str, str]]], path: Path) -> Path:
    """pocketsphinx's pronouncing dictionary of ``lex``, written to ``path``."""
    path.write_text("".join(f"{w} {' '.join(s for s, _ in pron)}\n"
                            for w, pron in sorted(lex.items())))
    return path


def align_texts(clips: list[tuple[np.ndarray, str]], workdir: Path
                ) -> list[list[tuple[float, float, str]] | None]:
    """Phones of each (16 kHz audio, its text) by the forced alignment that labels the real
    recordings (None where it finds no path): speech whose true timings are known (a
    synthesizer's), labelled this way, says what the aligner's own errors cost a score."""
    texts = [normalise_words(text) for _, text in clips]
    lex = build_lexicon({w for words in texts for w in words})
    dict_path = str(write_align_dict(lex, Path(workdir) / "align.dict"))
    out: list[list[tuple[float, float, str]] | None] = []
    for (audio, _), words in zip(clips, texts, strict=True):
        res = align(audio, words, lex, dict_path) if all(w in lex for w in words) else None
        out.append(None if res is None else res[0])
    return out


# ------------------------------------------------------------------------ prepare/load
def prepare(root: Path, workers: int = 2, limit: int | None = None,
            log=print) -> list[RealUtterance]:
    """Recognise (LibriSpeech), align and cache everything under ``root``."""
    root = Path(root)
    items = find_items(root)
    if limit:
        # A few of every speaker group, for a quick look.
        by: dict[str, list[_Item]] = {}
        for it in items:
            by.setdefault(it.corpus + it.path.split("/")[-2], []).append(it)
        items = [it for group in by.values() for it in group[:limit]]
    if not items:
        raise FileNotFoundError(f"no recordings under {root / 'src'} (this module's "
                                "docstring says how to get them)")
    log(f"{len(items)} recordings")
    asr_cache = root / "asr_text.json"
    asr = json.loads(asr_cache.read_text()) if asr_cache.exists() else {}
    todo = [it for it in items if it.text is None and it.utt_id not in asr]
    t0 = time.time()
    if todo:
        log(f"recognising {len(todo)} LibriSpeech recordings (no transcripts ship with them)")
        with ProcessPoolExecutor(workers) as ex:
            for it, text in zip(todo, ex.map(_recognise, [it.path for it in todo],
                                             chunksize=4), strict=True):
                asr[it.utt_id] = text
        asr_cache.write_text(json.dumps(asr, indent=0, sort_keys=True))
        log(f"  {time.time() - t0:.0f} s")
    texts = {it.utt_id: it.text if it.text is not None else asr.get(it.utt_id, "")
             for it in items}
    words = {w for t in texts.values() for w in normalise_words(t)}
    lex = build_lexicon(words, root / f"lexicon-v{CACHE_VERSION}.json")
    dict_path = write_align_dict(lex, root / "align.dict")
    log(f"lexicon: {len(lex)} of {len(words)} words pronounced")
    t0 = time.time()
    done = _cached_alignments(root / CACHE_NAME) if not limit else {}
    utts: list[RealUtterance] = []
    failed: list[str] = []
    jobs = []
    for it in items:
        cached = done.get(it.utt_id)
        words = " ".join(normalise_words(texts[it.utt_id]))
        if cached is not None and cached.text == words and cached.speaker == it.speaker:
            utts.append(cached)
        else:
            jobs.append((it, texts[it.utt_id], str(dict_path)))
    log(f"{len(utts)} alignments reused from {CACHE_NAME}; aligning {len(jobs)}")
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(lex,)) as ex:
        for res in ex.map(_align_item, jobs, chunksize=8):
            (failed if isinstance(res, str) else utts).append(res)  # type: ignore[arg-type]
    order = {it.utt_id: k for k, it in enumerate(items)}
    utts.sort(key=lambda u: order[u.utt_id])
    log(f"aligned {len(jobs) - len(failed)} ({len(failed)} skipped) in "
        f"{time.time() - t0:.0f} s")
    for msg in failed[:20]:
        log("  skipped " + msg)
    if not limit:
        with (root / CACHE_NAME).open("wb") as f:
            pickle.dump({"version": CACHE_VERSION, "utterances": utts, "skipped": failed},
                        f, protocol=pickle.HIGHEST_PROTOCOL)
    return utts


def _cached_alignments(path: Path) -> dict[str, RealUtterance]:
    """The utterances a previous ``prepare`` aligned, by id (none if it never ran): a new
    source is then aligned alone, the rest reused when their text has not changed."""
    if not path.exists():
        return {}
    with path.open("rb") as f:
        data = pickle.load(f)
    if data.get("version") != CACHE_VERSION:
        return {}
    return {u.utt_id: u for u in data["utterances"]}


def load_real_speech(root: str | Path) -> list[RealUtterance]:
    """The prepared utterances (``--prepare`` makes them); FileNotFoundError if absent."""
    path = Path(root) / CACHE_NAME
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: run python -m inference.training.real_speech "
            f"--root {root} --prepare (sources: inference/training/real_speech.py)")
    with path.open("rb") as f:
        data = pickle.load(f)
    return data["utterances"]


def heldout_speakers(utts: list[RealUtterance]) -> set[str]:
    """Speakers never trained on: LibriSpeech test-other (10), 8 F + 8 M of the
    train-clean-100 speakers (lowest speaker numbers of each sex), and every speaker whose
    true text is known and listed for evaluation (:data:`TRUE_TEXT_SPEAKERS`)."""
    present = {u.speaker for u in utts}
    held = {s for s in HELDOUT_TEST_OTHER if s in present}
    held.update({speaker for _, speaker, *_ in TRUE_TEXT_SPEAKERS} & present)
    clean = sorted({(int(u.speaker.split("-")[1]), u.speaker, u.sex) for u in utts
                    if u.corpus == "librispeech" and u.speaker not in HELDOUT_TEST_OTHER})
    for sex in ("F", "M"):
        held.update([spk for _, spk, sx in clean if sx == sex][:N_HELDOUT_CLEAN_PER_SEX])
    return held


def train_speakers(utts: list[RealUtterance]) -> set[str]:
    return {u.speaker for u in utts} - heldout_speakers(utts)


def split(utts: list[RealUtterance]) -> tuple[list[RealUtterance], list[RealUtterance]]:
    """(training utterances, held-out utterances): disjoint in speakers."""
    held = heldout_speakers(utts)
    return [u for u in utts if u.speaker not in held], [u for u in utts if u.speaker in held]


def describe(utts: list[RealUtterance]) -> dict[str, object]:
    def info(us: list[RealUtterance]) -> dict[str, object]:
        spk = {u.speaker: u.sex for u in us}
        return {"utterances": len(us), "minutes": round(sum(u.seconds for u in us) / 60, 1),
                "speakers": len(spk), "female": sum(s == "F" for s in spk.values()),
                "male": sum(s == "M" for s in spk.values()),
                "asr_text": sum(u.text_source == "asr" for u in us)}
    train, held = split(utts)
    return {"all": info(utts), "train": info(train), "heldout": info(held)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.environ.get("REAL_SPEECH_ROOT", str(DEFAULT_ROOT)))
    ap.add_argument("--prepare", action="store_true", help="align and cache the recordings")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--limit", type=int, help="only this many per speaker group, not cached")
    args = ap.parse_args(argv)
    root = Path(args.root)
    if args.prepare:
        utts = prepare(root, args.workers, args.limit)
    else:
        utts = load_real_speech(root)
    print(json.dumps(describe(utts), indent=1))


if __name__ == "__main__":
    # Run the module's own copy, so that pickles name inference.training.real_speech's
    # classes rather than __main__'s.
    from inference.training import real_speech as _module

    sys.exit(_module.main())
