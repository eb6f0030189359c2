"""Offline speech with phoneme timings: espeak-ng, flite and festival, all made on this machine.

One home for every synthesizer the project uses: tests and benchmarks speak through
:func:`espeak`, the training corpus through :class:`Espeak`, :func:`flite` and
:func:`festival_batch`. Each reports where its phonemes fall in the audio:

* espeak-ng through its C API (``libespeak-ng.so.1``, ctypes) with phoneme events, so
  every phoneme arrives with its position in the audio;
* flite prints phoneme end times with ``-psdur``;
* festival (``kal_diphone``, a natural-recording diphone voice) prints its ``Segment``
  relation's end times from a Scheme script.

A missing tool or voice raises :class:`SpeechUnavailable` (tests skip on it); a tool that
fails raises :class:`SpeechFailed` carrying the tool's own error output.
"""

from __future__ import annotations

import ctypes
import io
import re
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from inference.engine import FeatureSpec

#: The rate every utterance is kept at: the model's feature rate.
SAMPLE_RATE = FeatureSpec().sample_rate


class SpeechUnavailable(RuntimeError):
    """A synthesizer or one of its voices is not installed here."""


class SpeechFailed(RuntimeError):
    """A synthesizer ran and failed; the message carries its own error output."""


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


def resample(audio: np.ndarray, rate: int, to: int = SAMPLE_RATE) -> np.ndarray:
    """Polyphase resampling of mono float audio from ``rate`` to ``to``."""
    if rate == to:
        return audio.astype(np.float32)
    try:
        from scipy.signal import resample_poly  # only where speech is made, not to serve
    except ImportError:
        raise SpeechUnavailable("making speech here needs scipy: pip install -e "
                                "'.[examples]'") from None
    g = np.gcd(rate, to)
    return resample_poly(audio, to // g, rate // g).astype(np.float32)


def run_tool(args: list[str]) -> str:
    """Run a synthesizer; its stdout, or :class:`SpeechFailed` with what it printed."""
    if shutil.which(args[0]) is None:
        raise SpeechUnavailable(f"{args[0]} is not installed (apt-get install {args[0]})")
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        said = " ".join((result.stderr + "\n" + result.stdout).split())
        raise SpeechFailed(f"{args[0]} exited with {result.returncode}: {said[-600:]}")
    return result.stdout


def _read_wav(path: Path) -> tuple[np.ndarray, int]:
    """A 16-bit PCM WAV as mono float32 (first channel) and its rate."""
    with wave.open(str(path)) as w:
        rate, channels = w.getframerate(), w.getnchannels()
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").reshape(-1, channels)
    return pcm[:, 0].astype(np.float32) / 32768.0, rate


def _phones_from_ends(ends: list[tuple[str, float]], seconds: float
                      ) -> list[tuple[float, float, str]]:
    """(name, end) pairs to (start, end, name) spans within the audio; the last one ends
    with it (flite reports its final pause a little past the samples it writes)."""
    phones: list[tuple[float, float, str]] = []
    start = 0.0
    for name, end in ends:
        end = min(max(end, start), seconds)
        phones.append((start, end, name))
        start = end
    if phones:
        s0, _, name = phones[-1]
        phones[-1] = (s0, seconds, name)
    return phones


# ---------------------------------------------------------------------------- espeak-ng
class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p),
                ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint),
                ("text_position", ctypes.c_int), ("length", ctypes.c_int),
                ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", _EventId)]


class _Voice(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("languages", ctypes.c_char_p),
                ("identifier", ctypes.c_char_p), ("gender", ctypes.c_ubyte),
                ("age", ctypes.c_ubyte), ("variant", ctypes.c_ubyte), ("xx1", ctypes.c_ubyte),
                ("score", ctypes.c_int), ("spare", ctypes.c_void_p)]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                             ctypes.POINTER(_Event))
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_PHONEME_EVENTS = 0x0001
_EVENT_LIST_TERMINATED, _EVENT_PHONEME, _EVENT_SAMPLERATE = 0, 7, 8
_RATE, _PITCH = 1, 3
_CHARS_UTF8 = 1


class Espeak:
    """espeak-ng through its C API: audio plus timed phoneme events (one per process)."""

    _instance: Espeak | None = None

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libespeak-ng.so.1")
        except OSError as exc:
            raise SpeechUnavailable(
                f"espeak-ng's library is not installed (apt-get install espeak-ng): {exc}"
            ) from exc
        self.sample_rate = int(self.lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 200, None, _INITIALIZE_PHONEME_EVENTS))
        if self.sample_rate <= 0:
            raise SpeechUnavailable("espeak_Initialize failed: is espeak-ng-data installed?")
        self._chunks: list[np.ndarray] = []
        self._events: list[tuple[int, str]] = []
        self._callback = _CALLBACK(self._on_synth)  # keep a reference: C holds it
        self.lib.espeak_SetSynthCallback(self._callback)
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.lib.espeak_SetVoiceByProperties.argtypes = [ctypes.POINTER(_Voice)]
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
        """Select ``voice``: a voice file's name ("en-us", "en+f3") or, as the espeak-ng
        command line also accepts, a language ("en-gb")."""
        if self.lib.espeak_SetVoiceByName(voice.encode()) == 0:
            return True
        spec = _Voice(languages=voice.encode())
        return "+" not in voice and self.lib.espeak_SetVoiceByProperties(ctypes.byref(spec)) == 0

    def synth(self, text: str, voice: str = "en-us", rate: int = 175,
              pitch: int = 50) -> Utterance:
        """Speak ``text`` at ``rate`` words per minute; phoneme i spans [its event, the next
        event or the audio end)."""
        if not self.has_voice(voice):
            raise SpeechUnavailable(f"espeak-ng has no voice {voice!r}")
        self.lib.espeak_SetParameter(_RATE, rate, 0)
        self.lib.espeak_SetParameter(_PITCH, pitch, 0)
        self._chunks, self._events = [], []
        data = text.encode("utf-8")
        self.lib.espeak_Synth(data, len(data) + 1, 0, 1, 0, _CHARS_UTF8, None, None)
        self.lib.espeak_Synchronize()
        pcm = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
        audio = resample(pcm.astype(np.float32) / 32768.0, self.sample_rate)
        end = audio.size / SAMPLE_RATE
        times = [ms / 1000.0 for ms, _ in self._events] + [end]
        phones = [(times[i], max(times[i + 1], times[i]), name)
                  for i, (_, name) in enumerate(self._events)]
        return Utterance(audio, phones, "espeak-ng", voice, text)


def espeak(text: str, *, voice: str = "en-us", words_per_minute: int = 150,
           rate: int = SAMPLE_RATE) -> np.ndarray:
    """``text`` spoken by espeak-ng, as int16 mono at ``rate`` Hz."""
    audio = resample(Espeak.get().synth(text, voice, words_per_minute).audio, SAMPLE_RATE, rate)
    return np.clip(np.round(audio * 32768.0), -32768, 32767).astype(np.int16)


# ---------------------------------------------------------------------------- flite
@cache
def flite_voices() -> frozenset[str]:
    """The voices compiled into this machine's flite (empty without flite)."""
    try:
        listing = run_tool(["flite", "-lv"])
    except SpeechUnavailable:
        return frozenset()
    return frozenset(listing.split(":", 1)[-1].split())


def flite(text: str, voice: str = "slt") -> Utterance:
    """Speak ``text`` with flite; ``-psdur`` prints ``phone:end_s`` pairs."""
    if voice not in flite_voices():
        raise SpeechUnavailable(f"flite has no voice {voice!r} (apt-get install flite)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.wav"
        printed = run_tool(["flite", "-voice", voice, "-psdur", "-t", text, "-o", str(path)])
        audio, rate = _read_wav(path)
    audio = resample(audio, rate)
    ends = []
    for item in printed.split():
        name, _, end = item.rpartition(":")
        ends.append((name, float(end)))
    return Utterance(audio, _phones_from_ends(ends, audio.size / SAMPLE_RATE), "flite", voice,
                     text)


# ---------------------------------------------------------------------------- festival
@cache
def festival_voices() -> frozenset[str]:
    """The voices festival can load here (empty without festival or without a voice: the
    Debian package installs none by itself; festvox-kallpc16k brings ``kal_diphone``)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "voices.scm"
        script.write_text('(format t "@@ %l\\n" (voice.list))\n')
        try:
            printed = run_tool(["festival", "-b", str(script)])
        except SpeechUnavailable:
            return frozenset()
    found = re.search(r"^@@ \(?([^)\n]*)\)?$", printed, re.MULTILINE)
    return frozenset(found.group(1).split()) - {"nil"} if found else frozenset()


def _scheme_string(text: str) -> str:
    return '"' + text.replace("\\", " ").replace('"', " ") + '"'


def festival_batch(items: list[tuple[str, float, float, float]],
                   voice: str = "kal_diphone") -> list[Utterance]:
    """Speak each (text, duration_stretch, f0_mean_hz, f0_std_hz) with festival in one
    process; phoneme i spans [the previous Segment's end, its own end)."""
    if voice not in festival_voices():
        raise SpeechUnavailable(
            f"festival has no voice {voice!r} (apt-get install festival festvox-kallpc16k)")
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
        printed = run_tool(["festival", "-b", str(script)])
        segs: dict[int, list[tuple[str, float]]] = {}
        cur = -1
        for line in printed.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "@@":
                cur = int(parts[1])
                segs[cur] = []
            elif len(parts) == 2 and cur >= 0:
                segs[cur].append((parts[0], float(parts[1])))
        out = []
        for i, (text, stretch, f0_mean, _) in enumerate(items):
            audio, rate = _read_wav(Path(tmp) / f"{i}.wav")
            audio = resample(audio, rate)
            phones = _phones_from_ends(segs.get(i, []), audio.size / SAMPLE_RATE)
            out.append(Utterance(audio, phones, "festival",
                                 f"{voice}|x{stretch:.2f}|f0={f0_mean:.0f}", text))
    return out


# ---------------------------------------------------------------------------- helpers
def silence(seconds: float, rate: int = SAMPLE_RATE) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.int16)


def _write_wav(target: str | io.BytesIO, pcm: np.ndarray, rate: int) -> None:
    with wave.open(target, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype(np.int16).tobytes())


def write_wav(path: str | Path, pcm: np.ndarray, rate: int = SAMPLE_RATE) -> Path:
    _write_wav(str(path), pcm, rate)
    return Path(path)


def wav_bytes(pcm: np.ndarray, rate: int = SAMPLE_RATE) -> bytes:
    """Mono 16-bit ``pcm`` as the bytes of a WAV file (to send over HTTP)."""
    buffer = io.BytesIO()
    _write_wav(buffer, pcm, rate)
    return buffer.getvalue()


def conversation(rate: int = SAMPLE_RATE) -> np.ndarray:
    """About 12 s: silence, a sentence, a long pause, another sentence, silence."""
    first = espeak("Hello there. I am a talking portrait, and my lips follow your voice.",
                   rate=rate)
    second = espeak("Speech in, video out, in real time.", voice="en-gb", rate=rate)
    return np.concatenate([silence(1.5, rate), first, silence(2.0, rate), second,
                           silence(3.0, rate)])
