"""The returned speech's Opus encode: CPU per 20 ms chunk and what it does to the sound,
at libopus complexities (``compression_level``), through the server's own
``server.media.encoding.SpeechOpusEncoder`` (mono, CELT-only, 64 kbit/s).

Each configuration encodes the same speech (alternated, best of ``--repeats``) and
decodes it again; the sound is compared with the input by SNR and by log-spectral
distance (dB, 1024-point frames), after the codec's own delay.

    python -m benchmarks.speech_encoding
    python -m benchmarks.speech_encoding --wav a.wav b.wav --levels 10 5 3
"""

from __future__ import annotations

import argparse
import time

import av
import numpy as np

from server.media.clock import AUDIO_RATE
from server.media.encoding import SpeechOpusEncoder

CHUNK = AUDIO_RATE // 50


def _speech(paths: list[str]) -> list[np.ndarray]:
    """Each recording as int16 at 48 kHz, peaks at -4 dBFS; espeak-ng's conversation
    when none is given."""
    if not paths:
        from inference.tts import conversation

        return [conversation(AUDIO_RATE).astype(np.int16)]
    import librosa

    out = []
    for path in paths:
        y, _ = librosa.load(path, sr=AUDIO_RATE)
        out.append((y / np.abs(y).max() * 20000).astype(np.int16))
    return out


def _round_trip(speech: np.ndarray, level: int) -> tuple[float, np.ndarray]:
    """CPU seconds the encode took, and the decoded sound."""
    encoder = SpeechOpusEncoder(complexity=level)
    decoder = av.CodecContext.create("libopus", "r")
    decoder.format, decoder.layout, decoder.sample_rate = "s16", "mono", AUDIO_RATE
    packets, cpu = [], 0.0
    for k in range(speech.size // CHUNK):
        start = time.process_time()
        packets.append(encoder.encode(speech[k * CHUNK:(k + 1) * CHUNK], k * CHUNK))
        cpu += time.process_time() - start
    decoded = [f.to_ndarray().reshape(-1) for p in packets for f in decoder.decode(p)]
    return cpu, np.concatenate(decoded)


def _errors(sent: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """SNR and log-spectral distance (dB) of ``got`` against ``sent``, aligned."""
    import librosa

    n = min(sent.size, got.size) - 1000
    a = sent[:n].astype(np.float32)
    lag = max(range(1000), key=lambda d: float(np.dot(a, got[d:d + n].astype(np.float32))))
    b = got[lag:lag + n].astype(np.float32)
    snr = 10 * np.log10(np.sum(a * a) / np.sum((a - b) ** 2))
    spectra = [20 * np.log10(np.abs(librosa.stft(x / 32768, n_fft=1024)) + 1e-4)
               for x in (a, b)]
    lsd = float(np.mean(np.sqrt(np.mean((spectra[0] - spectra[1]) ** 2, axis=0))))
    return float(snr), lsd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wav", nargs="*", default=[], help="speech recordings to encode")
    parser.add_argument("--levels", type=int, nargs="+", default=[10, 5, 3])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    recordings = _speech(args.wav)
    chunks = sum(r.size // CHUNK for r in recordings)
    best = {level: float("inf") for level in args.levels}
    decoded: dict[int, list[np.ndarray]] = {}
    for _ in range(args.repeats):
        for level in args.levels:  # alternated, so a noisy neighbour hits each alike
            results = [_round_trip(r, level) for r in recordings]
            best[level] = min(best[level], sum(cpu for cpu, _ in results))
            decoded[level] = [got for _, got in results]
    print(f"{'level':>5} {'CPU ms/chunk':>13} {'SNR dB':>7} {'LSD dB':>7}")
    for level in args.levels:
        errors = [_errors(sent, got) for sent, got in zip(recordings, decoded[level],
                                                           strict=True)]
        snr, lsd = np.mean(errors, axis=0)
        print(f"{level:>5} {1000 * best[level] / chunks:>13.4f} {snr:>7.2f} {lsd:>7.2f}")


if __name__ == "__main__":
    main()
