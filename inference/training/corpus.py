"""The training and held-out speech: which synthesizer speaks what, in which voice.

The synthesizers and their phoneme timings live in :mod:`inference.tts`. Many espeak
voices, variants, rates and pitches plus festival's ``kal_diphone`` at many rates and
pitches make the training set; some espeak voices and the whole of flite are kept out of
it, so the evaluation measures voices (and a synthesizer) the head never heard. flite's
``kal16`` is the same speaker (KAL) as festival's ``kal_diphone``, so it is reported
apart from slt, awb and rms.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inference.tts import (
    SAMPLE_RATE,
    Espeak,
    Utterance,
    festival_batch,
    flite,
)

#: espeak voices (language + variant) used for training.
TRAIN_LANGS: tuple[str, ...] = ("en-us", "en", "en-gb-x-rp", "en-029", "en-gb-x-gbclan")
TRAIN_VARIANTS: tuple[str, ...] = (
    "", "m1", "m2", "m3", "m4", "f1", "f2", "f3", "klatt", "klatt2", "croak", "Andy",
    "annie", "max", "whisper",
)
#: A little of other languages, for phonotactics the English set lacks.
OTHER_LANGS: tuple[str, ...] = ("de", "es", "fr", "it")
#: espeak voices never used for training (unseen accents and unseen variants).
HELDOUT_VOICES: tuple[str, ...] = (
    "en-gb-scotland+f4", "en-us-nyc+m7", "en-gb-x-gbcwmd+klatt4", "en-us+f5",
)
#: flite voices (the held-out synthesizer).
FLITE_VOICES: tuple[str, ...] = ("slt", "awb", "rms", "kal16")

#: flite voices of speakers never heard in training (festival's kal_diphone is KAL, as
#: flite's kal16): the headline held-out-synthesizer figure.
FLITE_UNSEEN_SPEAKERS: tuple[str, ...] = ("slt", "awb", "rms")

CORPUS_VERSION = 3  # 3: utterances pickled from inference.tts


# ---------------------------------------------------------------------------- text
_SUBJECTS = (
    "the old fisherman", "my brother", "a quiet child", "the judge", "our neighbour",
    "that yellow dog", "the chef", "every voter", "the shy violinist", "a thousand birds",
    "the teacher", "she", "he", "we", "they", "you", "the museum guard", "Professor Booth",
    "the zoo keeper", "a giant whale", "the mayor of Boston", "George", "Ruth", "Vivian",
)
_VERBS = (
    "bought", "watched", "measured", "pushed", "forgot", "chose", "borrowed", "painted",
    "fixed", "thought about", "loved", "threw", "caught", "shared", "visited", "moved",
    "judged", "washed", "ordered", "reached", "opened", "carried", "juggled", "examined",
)
_OBJECTS = (
    "a bowl of soup", "the big blue boat", "seven shiny shoes", "a thick book",
    "the azure vase", "fresh cheese", "a pair of gloves", "the broken window",
    "his own voice", "the beautiful garden", "a huge pizza", "the measure of the truth",
    "the church bells", "a cup of warm milk", "the rough map", "some oranges",
    "the vague usual answer", "five purple plums", "the wooden chair", "a red umbrella",
)
_PLACES = (
    "at the market", "near the river", "in the morning", "on Thursday", "after lunch",
    "by the zoo", "under the bridge", "in a hurry", "with great joy", "all through June",
    "before the show", "at the edge of the woods", "outside the theatre", "in the rain",
)
_EXTRA = (
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs.",
    "How vexingly quick daft zebras jump!",
    "Sphinx of black quartz, judge my vow.",
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.",
    "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.",
    "Four hours of steady work faced us.",
    "A large size in stockings is hard to sell.",
    "The boy was there when the sun rose.",
    "A rod is used to catch pink salmon.",
    "The source of the huge river is the clear spring.",
    "Kick the ball straight and follow through.",
    "Help the woman get back to her feet.",
    "A pot of tea helps to pass the evening.",
    "Smoky fires lack flame and heat.",
    "The soft cushion broke the man's fall.",
    "The salt breeze came across from the sea.",
    "The girl at the booth sold fifty bonds.",
    "Oh, really? Who would have thought so!",
    "Mmm, maybe. Well, I'm not sure about that.",
    "Yes. No. Perhaps. Absolutely!",
    "Wow, look at the moon over the ocean.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "Zoe measured the azure pleasure boat with a ruler.",
    "Who knew you would move to Peru in June?",
    "Father parked the car far from the barn.",
    "I see three green trees by the sea.",
    "The thin thief thought through thirty thorny thickets.",
    "She sells sea shells by the sea shore.",
    "Peter Piper picked a peck of pickled peppers.",
    "Bob bought a big bag of blueberries.",
    "Five vivid violets wave over the valley.",
    "Choose cheap cheese and juicy oranges.",
    "Around the world in eighty days.",
    "Our hour of power is now.",
)
_NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
            "twenty", "forty two", "a hundred", "ninety nine")
_OTHER_TEXT: dict[str, tuple[str, ...]] = {
    "de": ("Guten Morgen, wie geht es dir heute?", "Die Katze schläft auf dem warmen Sofa.",
           "Ich möchte bitte ein Stück Kuchen.", "Wir fahren morgen früh nach München."),
    "es": ("Buenos días, ¿cómo estás?", "El perro come una manzana roja.",
           "Mañana vamos a la playa con mis amigos.", "Me gusta mucho la música."),
    "fr": ("Bonjour, comment allez-vous?", "Le chat dort sur le canapé bleu.",
           "Nous partons demain matin pour Paris.", "Je voudrais un café, s'il vous plaît."),
    "it": ("Buongiorno, come stai oggi?", "La pizza è molto buona qui.",
           "Andiamo al mare domani mattina.", "Il gatto dorme sulla sedia."),
}


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct, varied English sentences (templates over word lists, plus classics)."""
    rng = random.Random(seed)
    out: list[str] = list(_EXTRA)
    seen = set(out)
    while len(out) < n:
        kind = rng.random()
        s, v, o, p = (rng.choice(x) for x in (_SUBJECTS, _VERBS, _OBJECTS, _PLACES))
        if kind < 0.45:
            text = f"{s} {v} {o} {p}."
        elif kind < 0.6:
            text = f"Did {s} really say that {rng.choice(_SUBJECTS)} {v} {o}?"
        elif kind < 0.75:
            text = f"{s} {v} {o}. Then {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} it {p}."
        elif kind < 0.85:
            text = (f"{rng.choice(_NUMBERS).capitalize()} people {v} {o}, "
                    f"and {rng.choice(_NUMBERS)} of them left {p}.")
        else:
            text = f"Well, {s} {v} {o}, but {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {o}!"
        text = text[0].upper() + text[1:]
        if text not in seen:
            seen.add(text)
            out.append(text)
    rng.shuffle(out)
    return out[:n]


# ---------------------------------------------------------------------------- corpus
def pad_silence(utt: Utterance, before: float, after: float) -> Utterance:
    """Digital silence around the speech (phoneme times shift with it)."""
    a, b = int(before * SAMPLE_RATE), int(after * SAMPLE_RATE)
    audio = np.concatenate([np.zeros(a, np.float32), utt.audio, np.zeros(b, np.float32)])
    shift = a / SAMPLE_RATE
    phones = [(s + shift, e + shift, p) for s, e, p in utt.phones]
    return Utterance(audio, phones, utt.synth, utt.voice, utt.text)


def alignment_check(utt: Utterance) -> tuple[float, float]:
    """Mean RMS (dBFS) inside silence phonemes and inside the other phonemes.

    Aligned events put the silence phonemes on the quiet parts: the first number is far
    below the second.
    """
    def rms_db(parts: list[np.ndarray]) -> float:
        x = np.concatenate(parts) if parts else np.zeros(1, np.float32)
        return float(10 * np.log10(np.mean(x.astype(np.float64) ** 2) + 1e-12))

    sil, speech = [], []
    for s, e, p in utt.phones:
        seg = utt.audio[int(s * SAMPLE_RATE) : int(e * SAMPLE_RATE)]
        (sil if p.startswith("_") or p in ("pau", "sil") else speech).append(seg)
    return rms_db(sil), rms_db(speech)


@dataclass
class Corpus:
    train: list[Utterance]
    heldout_voices: list[Utterance]
    heldout_synth: list[Utterance]

    def describe(self) -> dict[str, object]:
        def info(us: list[Utterance]) -> dict[str, object]:
            return {"utterances": len(us), "hours": round(sum(u.seconds for u in us) / 3600, 3),
                    "voices": sorted({u.voice.split("|")[0] for u in us}),
                    "synthesizers": sorted({u.synth for u in us})}
        return {"train": info(self.train), "heldout_voices": info(self.heldout_voices),
                "heldout_synth": info(self.heldout_synth)}


def build_corpus(n_train: int = 2400, n_eval: int = 160, seed: int = 0,
                 cache_dir: str | Path = "data/audio-head", n_festival: int = 800) -> Corpus:
    """Make (or load from ``cache_dir``) the training and held-out utterances.

    ``n_train`` espeak utterances plus ``n_festival`` festival ones train; flite speaks the
    held-out synthesizer set. A missing synthesizer or voice raises ``SpeechUnavailable``
    rather than quietly train on less. Sentences are split too: evaluation sentences are
    never spoken in training.
    """
    key = hashlib.sha1(
        f"{CORPUS_VERSION}-{n_train}-{n_eval}-{seed}-{n_festival}".encode()).hexdigest()[:10]
    cache = Path(cache_dir) / f"corpus-{key}.pkl"
    if cache.exists():
        with cache.open("rb") as f:
            return pickle.load(f)
    rng = random.Random(seed)
    texts = sentences(700, seed)
    train_texts, eval_texts = texts[:540], texts[540:]
    es = Espeak.get()
    voices = [f"{lang}+{v}" if v else lang for lang in TRAIN_LANGS for v in TRAIN_VARIANTS]
    voices = [v for v in voices if es.has_voice(v)]
    others = [f"{lang}+{v}" if v else lang for lang in OTHER_LANGS for v in TRAIN_VARIANTS[:8]]
    others = [v for v in others if es.has_voice(v)]

    def padded(utt: Utterance) -> Utterance:
        return pad_silence(utt, rng.uniform(0.1, 0.6), rng.uniform(0.1, 0.6))

    train = []
    for i in range(n_train):
        rate, pitch = rng.randint(110, 260), rng.randint(15, 85)
        if others and i % 20 == 19:
            voice = rng.choice(others)
            text = rng.choice(_OTHER_TEXT[voice.split("+")[0]])
        else:
            voice, text = rng.choice(voices), rng.choice(train_texts)
        train.append(padded(es.synth(text, voice, rate, pitch)))
    if n_festival:
        frng = random.Random(seed + 1)
        items = [(frng.choice(train_texts), frng.uniform(0.75, 1.45), frng.uniform(75, 190),
                  frng.uniform(5, 30)) for _ in range(n_festival)]
        # Its own random stream, so the espeak and held-out utterances stay as before.
        train += [pad_silence(u, frng.uniform(0.1, 0.6), frng.uniform(0.1, 0.6))
                  for u in festival_batch(items)]
    held_v = [padded(es.synth(eval_texts[i % len(eval_texts)], HELDOUT_VOICES[i % 4],
                              rng.randint(130, 220), rng.randint(25, 75)))
              for i in range(n_eval)]
    held_s = [padded(flite(eval_texts[i % len(eval_texts)], FLITE_VOICES[i % 4]))
              for i in range(n_eval)]
    corpus = Corpus(train, held_v, held_s)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with cache.open("wb") as f:
        pickle.dump(corpus, f, protocol=pickle.HIGHEST_PROTOCOL)
    return corpus
