"""Degrade clean synthetic speech toward what real microphones and WebRTC deliver, and make
the non-speech clips (noise, music) the mouth must stay closed on.

Every transform takes and returns 16 kHz mono float32 of the same length and keeps
time alignment (reverb keeps the direct path at lag 0, the Opus round trip removes the
codec's pre-skip), so the phoneme labels stay valid.
"""

from __future__ import annotations

import fractions

import numpy as np
from scipy.signal import butter, fftconvolve, firwin2, lfilter, resample_poly, sosfilt

from inference.engine import FeatureSpec
from inference.tts import SAMPLE_RATE

#: libopus's encoder look-ahead at 48 kHz (the Ogg pre-skip), removed after decoding.
OPUS_PRESKIP_48K = 312


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-20))


def pink_noise(n: int, rng: np.random.Generator) -> np.ndarray:
    """1/f noise (Paul Kellet's filter on white noise), unit RMS."""
    b = [0.049922035, -0.095993537, 0.050612699, -0.004408786]
    a = [1.0, -2.494956002, 2.017265875, -0.522189400]
    y = lfilter(b, a, rng.standard_normal(n + 2000))[2000:]
    return (y / _rms(y)).astype(np.float32)


def add_noise(x: np.ndarray, snr_db: float, rng: np.random.Generator, kind: str = "white",
              babble: list[np.ndarray] | None = None) -> np.ndarray:
    """Noise at ``snr_db`` below the speech's RMS: white, pink, or babble (other speech)."""
    n = x.size
    if kind == "babble" and babble:
        noise = np.zeros(n, np.float32)
        for _ in range(3):
            src = babble[int(rng.integers(len(babble)))]
            src = np.resize(src, n) if src.size < n else src
            off = int(rng.integers(0, max(src.size - n, 0) + 1))
            noise += src[off : off + n] / max(_rms(src), 1e-6)
    elif kind == "pink":
        noise = pink_noise(n, rng)
    else:
        noise = rng.standard_normal(n).astype(np.float32)
    scale = _rms(x) / max(_rms(noise), 1e-9) * 10 ** (-snr_db / 20)
    return (x + scale * noise).astype(np.float32)


def reverb(x: np.ndarray, rt60: float, rng: np.random.Generator,
           direct_db: float = 0.0) -> np.ndarray:
    """Convolve with a synthetic room: a direct path at lag 0 plus a noise tail decaying
    60 dB in ``rt60`` seconds (starting after a few ms, like the first reflections)."""
    n = int(min(rt60, 1.0) * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    tail = rng.standard_normal(n) * np.exp(-6.9 * t / rt60)
    tail[: int(0.003 * SAMPLE_RATE)] = 0.0
    tail *= 10 ** (-direct_db / 20) / max(np.sqrt(np.sum(tail**2)), 1e-9)
    ir = tail
    ir[0] = 1.0
    y = fftconvolve(x, ir)[: x.size]
    return (y * (_rms(x) / max(_rms(y), 1e-9))).astype(np.float32)


def set_peak(x: np.ndarray, dbfs: float) -> np.ndarray:
    """Scale so the peak sits at ``dbfs`` (digital silence stays silent)."""
    peak = float(np.max(np.abs(x))) if x.size else 0.0
    if peak <= 0.0:
        return x.astype(np.float32)
    return (x * (10 ** (dbfs / 20) / peak)).astype(np.float32)


def band_limit(x: np.ndarray, low: float, high: float) -> np.ndarray:
    """Band-pass (e.g. 300-3400 Hz telephone); ``high`` >= Nyquist means high-pass only."""
    if high >= SAMPLE_RATE / 2 - 1:
        sos = butter(4, low, "highpass", fs=SAMPLE_RATE, output="sos")
    else:
        sos = butter(4, [low, high], "bandpass", fs=SAMPLE_RATE, output="sos")
    return sosfilt(sos, x).astype(np.float32)


def clip(x: np.ndarray, drive_db: float) -> np.ndarray:
    """Overdrive by ``drive_db`` and hard-clip at full scale (a hot microphone)."""
    return np.clip(x * 10 ** (drive_db / 20), -1.0, 1.0).astype(np.float32)


def random_eq(x: np.ndarray, rng: np.random.Generator, max_db: float = 8.0) -> np.ndarray:
    """A random smooth spectral tilt and bumps (microphones, rooms, other vocal tracts),
    as a zero-delay linear-phase FIR so the timing is unchanged."""
    freqs = np.array([0.0, 150, 400, 900, 1800, 3000, 4500, 6500, 8000]) / (SAMPLE_RATE / 2)
    tilt = rng.uniform(-1.0, 1.0) * np.linspace(-1.0, 1.0, freqs.size)
    gains_db = max_db * np.clip(0.6 * tilt + 0.5 * rng.uniform(-1, 1, freqs.size), -1, 1)
    taps = firwin2(129, freqs, 10 ** (gains_db / 20))
    return np.convolve(x, taps, mode="same").astype(np.float32)


def speed_perturb(x: np.ndarray, factor: float) -> np.ndarray:
    """Play ``factor`` times faster: tempo, pitch and formants all scale (a cheap vocal
    tract length change). Phoneme times must be divided by ``factor``."""
    up = 200
    down = int(round(up * factor))
    return resample_poly(x, up, down).astype(np.float32)


def opus_round_trip(x: np.ndarray, bitrate: int = 24000) -> np.ndarray:
    """Encode with libopus at 48 kHz (20 ms frames, as WebRTC) and decode, back at 16 kHz."""
    import av  # here, so training imports without PyAV (a bare GPU host)

    pcm48 = np.clip(resample_poly(x, 3, 1), -1.0, 1.0)
    pcm = (pcm48 * 32767.0).astype(np.int16)
    n = 960
    pcm = np.concatenate([pcm, np.zeros((-pcm.size) % n + 2 * n, np.int16)])
    enc = av.CodecContext.create("libopus", "w")
    enc.sample_rate, enc.layout, enc.format, enc.bit_rate = 48000, "mono", "s16", bitrate
    enc.time_base = fractions.Fraction(1, 48000)
    enc.open()
    dec = av.CodecContext.create("opus", "r")
    dec.sample_rate, dec.layout = 48000, "mono"
    out: list[np.ndarray] = []

    def drain(packets: list[av.Packet]) -> None:
        for p in packets:
            out.extend(f.to_ndarray().reshape(-1).astype(np.float32) for f in dec.decode(p))

    for i in range(0, pcm.size, n):
        frame = av.AudioFrame.from_ndarray(pcm[None, i : i + n], format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48000, i
        frame.time_base = fractions.Fraction(1, 48000)
        drain(enc.encode(frame))
    drain(enc.encode(None))
    y = np.concatenate(out) if out else np.zeros(0, np.float32)
    if y.size and np.abs(y).max() > 2.0:  # integer output format
        y = y / 32768.0
    y = y[OPUS_PRESKIP_48K : OPUS_PRESKIP_48K + pcm48.size]
    y = np.pad(y, (0, pcm48.size - y.size))
    return resample_poly(y, 1, 3)[: x.size].astype(np.float32)


def server_resample(x: np.ndarray, rate: int) -> np.ndarray:
    """Audio at ``rate`` to 16 kHz the way the server does: PyAV to 48 kHz s16 on ingest,
    then PyAV to 16 kHz s16 for the features."""
    import av  # here, so training imports without PyAV (a bare GPU host)

    def resample(pcm: np.ndarray, src: int, dst: int) -> np.ndarray:
        r = av.AudioResampler(format="s16", layout="mono", rate=dst)
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
        frame.sample_rate = src
        parts = [f.to_ndarray().reshape(-1) for f in r.resample(frame)]
        parts += [f.to_ndarray().reshape(-1) for f in r.resample(None)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)

    pcm = (np.clip(x, -1.0, 1.0) * 32767.0).astype(np.int16)
    return resample(resample(pcm, rate, 48000), 48000, SAMPLE_RATE).astype(np.float32) / 32768.0


def random_chain(x: np.ndarray, rng: np.random.Generator,
                 babble: list[np.ndarray] | None = None, eq_db: float = 8.0
                 ) -> tuple[np.ndarray, list[str]]:
    """A random mix of the degradations above, and what was applied (for the record)."""
    done: list[str] = []
    y = x.astype(np.float32)
    if rng.random() < 0.5:
        y = random_eq(y, rng, eq_db)
        done.append("eq")
    if rng.random() < 0.4:
        rt60 = float(rng.uniform(0.15, 0.7))
        y = reverb(y, rt60, rng, direct_db=float(rng.uniform(-3, 6)))
        done.append(f"reverb{rt60:.2f}")
    if rng.random() < 0.6:
        kind = str(rng.choice(["white", "pink", "babble"]))
        snr = float(rng.uniform(0, 30))
        y = add_noise(y, snr, rng, kind, babble)
        done.append(f"{kind}{snr:.0f}dB")
    if rng.random() < 0.3:
        low, high = [(300, 3400), (200, 4000), (100, 8000), (80, 6000)][int(rng.integers(4))]
        y = band_limit(y, low, high)
        done.append(f"band{low}-{high}")
    y = set_peak(y, float(rng.uniform(-30, -1)))
    done.append("gain")
    if rng.random() < 0.15:
        drive = float(rng.uniform(3, 12))
        y = clip(set_peak(y, -1.0), drive)
        done.append(f"clip{drive:.0f}")
    if rng.random() < 0.1:
        y = (y + rng.uniform(-0.1, 0.1)).astype(np.float32)
        done.append("dc")
    if rng.random() < 0.5:
        rate = int(rng.choice([16000, 24000, 32000]))
        y = opus_round_trip(y, rate)
        done.append(f"opus{rate // 1000}k")
    return y, done


# ---------------------------------------------------------------------------- non-speech
def non_speech(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Noise floors, hum and synthetic music (notes and chords): the mouth stays closed."""
    out = []
    for i in range(n):
        secs = float(rng.uniform(1.5, 4.0))
        t = np.arange(int(secs * SAMPLE_RATE)) / SAMPLE_RATE
        kind = i % 4
        if kind == 0:
            x = pink_noise(t.size, rng)
        elif kind == 1:
            x = rng.standard_normal(t.size).astype(np.float32)
        else:
            x = music(t, rng, chords=kind == 3)
        x = set_peak(x, float(rng.uniform(-60 if kind < 2 else -30, -3)))
        out.append(x.astype(np.float32))
    return out


def music(t: np.ndarray, rng: np.random.Generator, chords: bool = True) -> np.ndarray:
    """Plucked harmonic notes (or triads) on a random melody, with a slow decay."""
    x = np.zeros(t.size)
    note_len = float(rng.uniform(0.2, 0.6))
    for start in np.arange(0.0, t[-1], note_len):
        root = 220.0 * 2 ** (int(rng.integers(-12, 13)) / 12)
        freqs = [root * r for r in ((1.0, 1.26, 1.5) if chords else (1.0,))]
        seg = (t >= start) & (t < start + note_len)
        tt = t[seg] - start
        env = np.exp(-tt * rng.uniform(2, 8))
        for f in freqs:
            for h in range(1, 6):
                x[seg] += env * np.sin(2 * np.pi * f * h * tt) / h
    return x.astype(np.float32)


def _slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Hz to Slaney mels (librosa's default scale: linear to 1 kHz, logarithmic above)."""
    hz = np.asarray(hz, np.float64)
    log = 15.0 + np.log(np.maximum(hz, 1e-9) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log, hz / (200.0 / 3.0))


def _slaney_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0)),
                    mel * (200.0 / 3.0))


def mel_centres_hz(spec: FeatureSpec) -> np.ndarray:
    """Centre frequency of each mel band of ``log_mel`` (as ``librosa.mel_frequencies``)."""
    edges = np.linspace(_slaney_mel(spec.fmin), _slaney_mel(spec.fmax), spec.n_mels + 2)
    return _slaney_hz(edges)[1:-1]


def vtlp_table(spec: FeatureSpec, max_warp: float, steps: int = 21) -> np.ndarray:
    """Vocal tract length perturbation in the mel domain: for each warp factor ``a`` in
    ``[1 - max_warp, 1 + max_warp]``, the (fractional) source band of each output band,
    so that what the speech had at ``f`` shows at ``a * f`` (formants of a shorter or
    longer vocal tract); (steps, n_mels). Speakers differ most in where their formants
    lie, which the mouth's shape does not depend on."""
    centres = mel_centres_hz(spec)
    bands = np.arange(spec.n_mels, dtype=np.float64)
    factors = np.linspace(1.0 - max_warp, 1.0 + max_warp, steps)
    return np.stack([np.interp(centres / a, centres, bands) for a in factors]).astype(
        np.float32)
