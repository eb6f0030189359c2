"""Phoneme-labelled speech made on this machine: espeak-ng (ctypes), festival and flite.

espeak-ng is driven through its C API so that every phoneme arrives as an event with
its position in the audio (``espeakINITIALIZE_PHONEME_EVENTS``); festival (the
``kal_diphone`` voice: a natural-recording diphone voice, unlike espeak's formant
synthesis) reports its ``Segment`` relation's end times from a Scheme script; flite
prints phoneme end times with ``-psdur``. Many espeak voices, variants, rates and
pitches plus festival at many rates and pitches make the training set; some espeak
voices and the whole of flite are kept out of it, so the evaluation measures voices (and
a synthesizer) the head never heard. flite's ``kal16`` is the same speaker (KAL) as
festival's ``kal_diphone``, so it is reported apart from slt, awb and rms.
"""

from __future__ import annotations

import ctypes
import hashlib
import pickle
import random
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.signal import resample_poly

SAMPLE_RATE = 16000

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

CORPUS_VERSION = 2


@dataclass
class Utterance:
    """16 kHz float32 audio and its phonemes as (start_s, end_s, name)."""

    audio: np.ndarray
    phones: list[tuple[float, float, str]]
    synth: str
    voice: str
    text: str

    @property
    def seconds(self) -> float:
        return self.audio.size / SAMPLE_RATE


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


# ---------------------------------------------------------------------------- espeak
class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p),
                ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint),
                ("text_position", ctypes.c_int), ("length", ctypes.c_int),
                ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", _EventId)]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                             ctypes.POINTER(_Event))
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_PHONEME_EVENTS = 0x0001
_EVENT_LIST_TERMINATED, _EVENT_PHONEME, _EVENT_SAMPLERATE = 0, 7, 8
_RATE, _PITCH = 1, 3
_CHARS_UTF8 = 1


class EspeakUnavailable(RuntimeError):
    """libespeak-ng.so.1 could not be loaded."""


class Espeak:
    """espeak-ng through its C API: audio plus timed phoneme events (one per process)."""

    _instance: Espeak | None = None

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libespeak-ng.so.1")
        except OSError as exc:
            raise EspeakUnavailable(str(exc)) from exc
        self.sample_rate = int(self.lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 200, None, _INITIALIZE_PHONEME_EVENTS))
        if self.sample_rate <= 0:
            raise EspeakUnavailable("espeak_Initialize failed")
        self._chunks: list[np.ndarray] = []
        self._events: list[tuple[int, str]] = []
        self._callback = _CALLBACK(self._on_synth)  # keep a reference: C holds it
        self.lib.espeak_SetSynthCallback(self._callback)
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint,
                                          ctypes.c_int, ctypes.c_uint, ctypes.c_uint,
                                          ctypes.c_void_p, ctypes.c_void_p]

    @classmethod
    def get(cls) -> Espeak:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _on_synth(self, wav: ctypes.Array, n: int, events: ctypes.Array) -> int:
        if n > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, (n,)).copy())
        i = 0
        while events[i].type != _EVENT_LIST_TERMINATED:
            ev = events[i]
            if ev.type == _EVENT_PHONEME:
                name = bytes(ev.id.string).split(b"\0")[0].decode("ascii", "replace")
                self._events.append((ev.audio_position, name))
            elif ev.type == _EVENT_SAMPLERATE:
                self.sample_rate = int(ev.id.number)
            i += 1
        return 0

    def has_voice(self, voice: str) -> bool:
        return self.lib.espeak_SetVoiceByName(voice.encode()) == 0

    def synth(self, text: str, voice: str = "en-us", rate: int = 175,
              pitch: int = 50) -> Utterance:
        """Speak ``text``; phoneme i spans [its event, the next event or the audio end)."""
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r}")
        self.lib.espeak_SetParameter(_RATE, rate, 0)
        self.lib.espeak_SetParameter(_PITCH, pitch, 0)
        self._chunks, self._events = [], []
        data = text.encode("utf-8")
        self.lib.espeak_Synth(data, len(data) + 1, 0, 1, 0, _CHARS_UTF8, None, None)
        self.lib.espeak_Synchronize()
        pcm = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
        audio = _to_16k(pcm.astype(np.float32) / 32768.0, self.sample_rate)
        end = audio.size / SAMPLE_RATE
        times = [ms / 1000.0 for ms, _ in self._events] + [end]
        phones = [(times[i], max(times[i + 1], times[i]), name)
                  for i, (_, name) in enumerate(self._events)]
        return Utterance(audio, phones, "espeak-ng", voice, text)


def _to_16k(audio: np.ndarray, rate: int) -> np.ndarray:
    if rate == SAMPLE_RATE:
        return audio.astype(np.float32)
    g = np.gcd(rate, SAMPLE_RATE)
    return resample_poly(audio, SAMPLE_RATE // g, rate // g).astype(np.float32)


# ---------------------------------------------------------------------------- flite
def flite_available() -> bool:
    return shutil.which("flite") is not None


def flite(text: str, voice: str = "slt") -> Utterance:
    """Speak ``text`` with flite; ``-psdur`` prints ``phone:end_s`` pairs."""
    import soundfile as sf

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.wav"
        res = subprocess.run(["flite", "-voice", voice, "-psdur", "-t", text, "-o", str(path)],
                             check=True, capture_output=True, text=True)
        audio, rate = sf.read(str(path), dtype="float32")
    audio = _to_16k(audio.reshape(-1), rate)
    phones: list[tuple[float, float, str]] = []
    start = 0.0
    for item in res.stdout.split():
        name, _, end_s = item.rpartition(":")
        end = float(end_s)
        phones.append((start, end, name))
        start = end
    return Utterance(audio, phones, "flite", voice, text)


# ---------------------------------------------------------------------------- festival
def festival_available() -> bool:
    return shutil.which("festival") is not None


def _scheme_string(text: str) -> str:
    return '"' + text.replace("\\", " ").replace('"', " ") + '"'


def festival_batch(items: list[tuple[str, float, float, float]],
                   voice: str = "kal_diphone") -> list[Utterance]:
    """Speak each (text, duration_stretch, f0_mean_hz, f0_std_hz) with festival in one
    process; phoneme i spans [the previous Segment's end, its own end)."""
    import soundfile as sf

    with tempfile.TemporaryDirectory() as tmp:
        lines = [f"(voice_{voice})", "(set! base_lr int_lr_params)"]
        for i, (text, stretch, f0_mean, f0_std) in enumerate(items):
            wav = Path(tmp) / f"{i}.wav"
            lines += [
                f"(Parameter.set 'Duration_Stretch {stretch:.3f})",
                f"(set! int_lr_params (list (list 'target_f0_mean {f0_mean:.1f}) "
                f"(list 'target_f0_std {f0_std:.1f}) (list 'model_f0_mean 170) "
                "(list 'model_f0_std 34)))",
                f"(set! utt (utt.synth (Utterance Text {_scheme_string(text)})))",
                f'(utt.save.wave utt "{wav}" \'riff)',
                f'(format t "@@ {i}\\n")',
                "(mapcar (lambda (s) (format t \"%s %f\\n\" (item.name s) "
                "(item.feat s \"end\"))) (utt.relation.items utt 'Segment))",
            ]
        script = Path(tmp) / "batch.scm"
        script.write_text("\n".join(lines) + "\n")
        res = subprocess.run(["festival", "-b", str(script)], check=True,
                             capture_output=True, text=True)
        segs: dict[int, list[tuple[str, float]]] = {}
        cur = -1
        for line in res.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "@@":
                cur = int(parts[1])
                segs[cur] = []
            elif len(parts) == 2 and cur >= 0:
                segs[cur].append((parts[0], float(parts[1])))
        out = []
        for i, (text, stretch, f0_mean, _) in enumerate(items):
            audio, rate = sf.read(str(Path(tmp) / f"{i}.wav"), dtype="float32")
            audio = _to_16k(audio.reshape(-1), rate)
            phones: list[tuple[float, float, str]] = []
            start = 0.0
            for name, end in segs.get(i, []):
                phones.append((start, max(end, start), name))
                start = max(end, start)
            if phones and phones[-1][1] < audio.size / SAMPLE_RATE:
                s0, _, name = phones[-1]
                phones[-1] = (s0, audio.size / SAMPLE_RATE, name)
            out.append(Utterance(audio, phones, "festival",
                                 f"{voice}|x{stretch:.2f}|f0={f0_mean:.0f}", text))
    return out


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

    ``n_train`` espeak utterances plus ``n_festival`` festival ones (if festival is
    installed) train. Sentences are split too: evaluation sentences are never spoken in
    training.
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
    if n_festival and festival_available():
        frng = random.Random(seed + 1)
        items = [(frng.choice(train_texts), frng.uniform(0.75, 1.45), frng.uniform(75, 190),
                  frng.uniform(5, 30)) for _ in range(n_festival)]
        # Its own random stream, so the espeak and held-out utterances stay as before.
        train += [pad_silence(u, frng.uniform(0.1, 0.6), frng.uniform(0.1, 0.6))
                  for u in festival_batch(items)]
    held_v = [padded(es.synth(eval_texts[i % len(eval_texts)], HELDOUT_VOICES[i % 4],
                              rng.randint(130, 220), rng.randint(25, 75)))
              for i in range(n_eval)]
    held_s = []
    if flite_available():
        held_s = [padded(flite(eval_texts[i % len(eval_texts)], FLITE_VOICES[i % 4]))
                  for i in range(n_eval)]
    corpus = Corpus(train, held_v, held_s)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with cache.open("wb") as f:
        pickle.dump(corpus, f, protocol=pickle.HIGHEST_PROTOCOL)
    return corpus
