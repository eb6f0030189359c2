"""The real-speech loader (issue 11) on the prepared data, when this machine has it.

The recordings are not in the repository (inference/training/real_speech.py says how
to get them): set REAL_SPEECH_ROOT (default data/real_speech) to a root prepared with
``python -m inference.training.real_speech --root ROOT --prepare``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from inference.training import real_speech as rs
from inference.training.visemes import _TABLE, _TRANSPARENT
from inference.tts import SAMPLE_RATE, flite

pytestmark = pytest.mark.unit

ROOT = Path(os.environ.get("REAL_SPEECH_ROOT", rs.DEFAULT_ROOT))


def test_normalise_words() -> None:
    assert rs.normalise_words("Author of the danger-trail, Philip's etc.") == [
        "author", "of", "the", "danger", "trail", "philip's", "etc"]


def test_tidy_makes_contiguous_phones() -> None:
    phones = rs._tidy([(0.1, 0.2, "ax"), (0.2, 0.25, "pau"), (0.25, 0.3, "pau"),
                       (0.3, 0.9, "t")], 0.5)
    assert phones[0] == (0.0, 0.1, "pau")
    assert [p for _, _, p in phones] == ["pau", "ax", "pau", "t"]
    assert phones[-1][1] == 0.5
    assert all(a[1] == b[0] for a, b in zip(phones, phones[1:], strict=False))


def test_the_vowel_of_but_is_told_from_the_vowel_of_father() -> None:
    """flite says ``aa`` for both; where pocketsphinx's dictionary says AH it is /V/,
    less open, and becomes ``ah``, aligned with the AH model. A pronunciation the
    dictionary lacks or gives at another length is kept as flite's."""
    but = [("B", "b"), ("AA", "aa"), ("T", "t")]
    assert rs.split_open_vowels(but, ["B", "AH", "T"]) == [("B", "b"), ("AH", "ah"),
                                                           ("T", "t")]
    father = [("F", "f"), ("AA", "aa"), ("DH", "dh"), ("ER", "er")]
    assert rs.split_open_vowels(father, ["F", "AA", "DH", "ER"]) == father
    assert rs.split_open_vowels(but, None) == but
    assert rs.split_open_vowels(but, ["B", "AH", "T", "S"]) == but
    assert _TABLE["ah"] == "AA"  # the same viseme; the jaw by vowel is lower


def test_true_text_speakers_take_their_prompts_and_file_list_text(tmp_path: Path) -> None:
    """ARCTIC recordings get the prompt Kathleen read (matched by prompt id, whatever the
    file's prefix); VCTK and LJSpeech get vits's file-list text; a recording with no text
    is left out."""
    def touch(rel: str, text: str = "") -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    touch("src/dataset-voice-kathleen/data/arctic_a0001_1592748574.txt", "Author of it.\n")
    touch("src/dataset-voice-kathleen/data/arctic_a0002_1592748585.txt", "Not this one.")
    touch("src/kwiiyatta/tests/data/cmu_us_slt_arctic/wav/arctic_a0001.wav")
    touch("src/pyroomacoustics/examples/input_samples/cmu_arctic_us_aew_a0001.wav")
    touch("src/pyroomacoustics/examples/input_samples/cmu_arctic_us_aew_a0009.wav")  # no text
    touch("src/vits/filelists/vctk_audio_sid_text_train_filelist.txt",
          "DUMMY2/p225/p225_003.wav|101|Six spoons of fresh snow peas.\n")
    touch("src/vits/filelists/ljs_audio_text_val_filelist.txt",
          "DUMMY1/LJ001-0002.wav|in being comparatively modern.\n")
    touch("src/autovc/wavs/p225/p225_003.wav")
    touch("src/TTS/tests/data/ljspeech/wavs/LJ001-0002.wav")
    touch("src/deep-voice-conversion/datasets/arctic/bdl/arctic_a0002.wav")

    items = {it.utt_id: it for it in rs._true_text_items(tmp_path)}
    assert {k: (v.speaker, v.text) for k, v in items.items()} == {
        "arctic-slt-arctic_a0001": ("arctic-slt", "Author of it."),
        "arctic-aew-cmu_arctic_us_aew_a0001": ("arctic-aew", "Author of it."),
        "vctk-p225-p225_003": ("vctk-p225", "Six spoons of fresh snow peas."),
        "ljspeech-LJ001-0002": ("ljspeech", "in being comparatively modern."),
        "arctic-bdl-arctic_a0002": ("arctic-bdl", "Not this one."),
    }
    assert {it.corpus for it in items.values()} <= rs.TRUE_TEXT_CORPORA


@pytest.mark.skipif(shutil.which("flite") is None, reason="flite is not installed (it "
                    "speaks the recordings and pronounces their words)")
def test_prepare_aligns_only_recordings_it_has_not_seen(tmp_path: Path) -> None:
    """A second ``prepare`` reuses the cached alignment of a recording whose text did not
    change and aligns the changed one (a new source costs only its own alignment)."""
    pytest.importorskip("pocketsphinx", reason="the real-speech extra's aligner")
    import soundfile as sf

    data = tmp_path / rs.KATHLEEN_DIR
    data.mkdir(parents=True)
    for stem, text in (("arctic_a0001_1", "Author of the danger trail."),
                       ("arctic_a0002_1", "Not at this particular case.")):
        sf.write(data / f"{stem}.wav", flite(text).audio, SAMPLE_RATE)
        (data / f"{stem}.txt").write_text(text)
    logs: list[str] = []
    first = {u.utt_id: u for u in rs.prepare(tmp_path, workers=1, log=logs.append)}
    assert len(first) == 2 and "0 alignments reused from" in " ".join(logs)
    (data / "arctic_a0002_1.txt").write_text("Not at this case.")
    logs.clear()
    second = {u.utt_id: u for u in rs.prepare(tmp_path, workers=1, log=logs.append)}
    assert "1 alignments reused from" in " ".join(logs) and "aligning 1" in " ".join(logs)
    assert second["arctic_a0001_1"].phones == first["arctic_a0001_1"].phones
    assert second["arctic_a0002_1"].text == "not at this case"
    assert len(second["arctic_a0002_1"].phones) < len(first["arctic_a0002_1"].phones)


@pytest.fixture(scope="module")
def utts() -> list[rs.RealUtterance]:
    if not (ROOT / rs.CACHE_NAME).exists():
        pytest.skip(f"no prepared real speech at {ROOT / rs.CACHE_NAME} (the recordings are "
                    "not in the repository: inference/training/real_speech.py says how to "
                    "get them)")
    return rs.load_real_speech(ROOT)


def test_utterances_are_sane(utts: list[rs.RealUtterance]) -> None:
    assert len(utts) > 100
    for u in utts:
        assert u.audio.dtype == np.float32 and u.audio.ndim == 1
        assert np.abs(u.audio).max() <= 1.0
        seconds = u.audio.size / SAMPLE_RATE
        assert u.phones[0][0] == 0.0 and abs(u.phones[-1][1] - seconds) < 1e-6
        for (s0, e0, _), (s1, _, _) in zip(u.phones, u.phones[1:], strict=False):
            assert s0 < e0 <= s1 + 1e-9
        names = {p for _, _, p in u.phones}
        assert all(p == p.lower() and not any(c.isdigit() for c in p) for p in names)
        assert "pau" in names and len(names) > 3
        # Every phone name is one the viseme table knows (not its fallback).
        for p in names:
            assert p in rs._SPHINX_LOWER | {"pau", "ax"}, p
            assert p in _TABLE or p in _TRANSPARENT, p
        assert u.speaker and u.synth == "real"


def test_silences_are_quieter_than_speech(utts: list[rs.RealUtterance]) -> None:
    """The aligner puts 'pau' on the quiet parts: a rough check of its timings."""
    quieter = 0
    for u in utts:
        sil, speech = [], []
        for s, e, p in u.phones:
            seg = u.audio[int(s * SAMPLE_RATE):int(e * SAMPLE_RATE)]
            (sil if p == "pau" else speech).append(seg)
        rms = [10 * np.log10(np.mean(np.concatenate(x).astype(np.float64) ** 2) + 1e-12)
               for x in (sil, speech)]
        quieter += rms[0] < rms[1] - 10
    assert quieter >= 0.95 * len(utts)


def test_split_is_disjoint_and_covers_both_sexes(utts: list[rs.RealUtterance]) -> None:
    train, held = rs.split(utts)
    tr, he = rs.train_speakers(utts), rs.heldout_speakers(utts)
    assert tr.isdisjoint(he)
    assert {u.speaker for u in train} == tr and {u.speaker for u in held} == he
    assert len(train) + len(held) == len(utts)
    assert len(he) >= 8
    assert {u.sex for u in held} >= {"F", "M"}
    assert sum(u.seconds for u in train) > 3600
    # The true-text speakers listed for evaluation are held out; those listed for
    # training (and Kathleen) are trained on.
    present = {u.speaker for u in utts}
    assert {speaker for _, speaker, *_ in rs.TRUE_TEXT_SPEAKERS} & present <= he
    assert {speaker for _, speaker, *_ in rs.TRAINING_TRUE_TEXT_SPEAKERS} & present <= tr
    assert "kathleen" in tr
