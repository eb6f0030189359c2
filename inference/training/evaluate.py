"""Score the trained audio head against the hand-set DSP baseline:
``python -m inference.training.evaluate``.

On held-out espeak voices and on the held-out synthesizer (flite), clean and degraded
(noise, reverb, low gain, Opus): frame viseme accuracy (each predicted vector classified
to its nearest viseme prototype), Pearson r of predicted vs. true jawOpen, and the lag
that maximises r (positive: the prediction lags the truth). Then bad inputs: silence,
clipping, DC, extreme levels, music, other sample rates.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from inference.model.audio_head import HEAD_WEIGHTS, AudioHead
from inference.model.blendshapes import SPEECH
from inference.training import augment
from inference.training.corpus import FLITE_UNSEEN_SPEAKERS, Corpus, build_corpus
from inference.training.visemes import nearest_viseme
from inference.training.windows import Windows, make_windows
from inference.tts import SAMPLE_RATE, Espeak, SpeechUnavailable, Utterance

Predictor = Callable[[torch.Tensor], torch.Tensor]
MAX_LAG = 5


def baseline_predictor() -> Predictor:
    """The DSP ``SonicLite.audio_motion`` in the 11-dim SPEECH space (others 0)."""
    from inference.model.export import build_model

    dsp = build_model()
    jaw_i, funnel_i = SPEECH.index("jawOpen"), SPEECH.index("mouthFunnel")
    stretch = [SPEECH.index("mouthStretchLeft"), SPEECH.index("mouthStretchRight")]

    def run(mel: torch.Tensor) -> torch.Tensor:
        jaw, spread, funnel, _ = dsp.audio_motion(mel, torch.ones(mel.shape[0]))
        out = torch.zeros(mel.shape[0], len(SPEECH))
        out[:, jaw_i], out[:, funnel_i] = jaw, funnel
        out[:, stretch[0]], out[:, stretch[1]] = spread, spread
        return out

    return run


@torch.no_grad()
def predict(fn: Predictor, windows: Windows, batch: int = 2048) -> np.ndarray:
    out = [fn(windows.batch(np.arange(i, min(i + batch, windows.starts.size)))).numpy()
           for i in range(0, windows.starts.size, batch)]
    return np.concatenate(out)


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / max(np.sqrt((a * a).sum() * (b * b).sum()), 1e-12))


def scores(pred: np.ndarray, windows: Windows) -> dict[str, float]:
    """Viseme accuracy (and the targets' own, the ceiling), jaw r, and the best lag."""
    jaw = SPEECH.index("jawOpen")
    acc = float((nearest_viseme(pred) == windows.labels).mean())
    ceiling = float((nearest_viseme(windows.targets) == windows.labels).mean())
    r_by_lag = {}
    for lag in range(-MAX_LAG, MAX_LAG + 1):
        ps, ts = [], []
        for k in np.unique(windows.utt):
            sel = np.flatnonzero(windows.utt == k)
            p, t = pred[sel, jaw], windows.targets[sel, jaw]
            if lag >= 0:
                ps.append(p[lag:])
                ts.append(t[: t.size - lag])
            else:
                ps.append(p[: p.size + lag])
                ts.append(t[-lag:])
        r_by_lag[lag] = _pearson(np.concatenate(ps), np.concatenate(ts))
    best = max(r_by_lag, key=lambda k: r_by_lag[k])
    return {"viseme_acc": acc, "target_ceiling_acc": ceiling, "jaw_r": r_by_lag[0],
            "best_lag_frames": best, "best_lag_ms": 1000 * best / 25, "jaw_r_best": r_by_lag[best],
            "frames": int(windows.starts.size)}


def degrade(utts: list[Utterance], seed: int) -> list[tuple[np.ndarray, list]]:
    """The evaluation's fixed degradation: room, noise at 5-20 dB SNR, low gain, Opus."""
    rng = np.random.default_rng(seed + 1000)
    babble = [u.audio for u in utts]
    out = []
    for u in utts:
        y = augment.reverb(u.audio, float(rng.uniform(0.2, 0.5)), rng, direct_db=3.0)
        kind = ("white", "pink", "babble")[int(rng.integers(3))]
        y = augment.add_noise(y, float(rng.uniform(5, 20)), rng, kind, babble)
        y = augment.set_peak(y, float(rng.uniform(-30, -6)))
        y = augment.opus_round_trip(y, int(rng.choice([16000, 24000])))
        out.append((y, u.phones))
    return out


def subset(windows: Windows, keep_utts: np.ndarray) -> tuple[np.ndarray, Windows]:
    """The windows of the utterances in ``keep_utts`` (and their row indices)."""
    rows = np.flatnonzero(np.isin(windows.utt, keep_utts))
    return rows, Windows(windows.mel, windows.starts[rows], windows.targets[rows],
                         windows.labels[rows], windows.utt[rows])


#: Held-out-synthesizer subsets. festival's kal_diphone (a training voice) and flite's
#: kal16 are both the speaker KAL, so the headline figure is over slt, awb and rms only.
SYNTH_SUBSETS: dict[str, tuple[str, ...]] = {
    "heldout_synth_slt_awb_rms": FLITE_UNSEEN_SPEAKERS,
    "heldout_synth_kal16": ("kal16",),
    "heldout_synth_slt": ("slt",), "heldout_synth_awb": ("awb",),
    "heldout_synth_rms": ("rms",),
}


def evaluate_all(model: AudioHead, corpus: Corpus, seed: int = 0) -> dict[str, dict]:
    """Scores per set and condition. ``heldout_synth`` is all four flite voices;
    ``heldout_synth_slt_awb_rms`` (the headline) leaves out kal16, whose speaker festival's
    kal_diphone shares; the single voices follow."""
    sets = {"heldout_voices": corpus.heldout_voices, "heldout_synth": corpus.heldout_synth}
    predictors = {"trained": model.eval(), "baseline": baseline_predictor()}
    results: dict[str, dict] = {name: {} for name in predictors}
    for set_name, utts in sets.items():
        if not utts:
            continue
        conditions = {"clean": [(u.audio, u.phones) for u in utts],
                      "noisy+opus": degrade(utts, seed)}
        for cond, clips in conditions.items():
            windows = make_windows(clips)
            for name, fn in predictors.items():
                pred = predict(fn, windows)
                results[name][f"{set_name}/{cond}"] = scores(pred, windows)
                if set_name != "heldout_synth":
                    continue
                for sub, voices in SYNTH_SUBSETS.items():
                    keep = np.array([k for k, u in enumerate(utts) if u.voice in voices])
                    rows, sw = subset(windows, keep)
                    results[name][f"{sub}/{cond}"] = scores(pred[rows], sw)
    results["bad_inputs"] = bad_inputs(predictors)
    return results


def bad_input_clips() -> dict[str, np.ndarray]:
    """Inputs a server meets in the wild, all as 16 kHz float32 (other rates resampled
    the way the server does)."""
    rng = np.random.default_rng(7)
    t = np.arange(3 * SAMPLE_RATE) / SAMPLE_RATE
    try:
        speech = Espeak.get().synth("Hello there, my lips follow your voice.", "en-us").audio
    except SpeechUnavailable:  # the speech-based cases need espeak-ng
        speech = None
    clips = {
        "silence": np.zeros(3 * SAMPLE_RATE, np.float32),
        "dc_only": np.full(3 * SAMPLE_RATE, 0.3, np.float32),
        "noise_-60dBFS": (rng.standard_normal(t.size) * 1e-3).astype(np.float32),
        "music_notes": augment.set_peak(augment.music(t, rng, chords=False), -6),
        "music_chords": augment.set_peak(augment.music(t, rng, chords=True), -3),
        "full_scale_square": np.sign(np.sin(2 * np.pi * 220 * t)).astype(np.float32),
    }
    if speech is not None:
        x48 = augment.resample_poly(speech, 3, 1).astype(np.float32)
        clips.update({
            "speech": augment.set_peak(speech, -6),
            "speech_very_loud_0dBFS": augment.set_peak(speech, 0),
            "speech_very_quiet_-45dBFS": augment.set_peak(speech, -45),
            "speech_clipped_+20dB": augment.clip(augment.set_peak(speech, -1), 20),
            "speech_dc_offset_0.3": augment.set_peak(speech, -12) + np.float32(0.3),
            "speech_48k": augment.server_resample(x48, 48000),
            "speech_44k1": augment.server_resample(
                augment.resample_poly(x48, 147, 160).astype(np.float32), 44100),
            "speech_8k": augment.server_resample(speech[::2].copy(), 8000),
        })
    return clips


def bad_inputs(predictors: dict[str, Predictor]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    jaw = SPEECH.index("jawOpen")
    for case, audio in bad_input_clips().items():
        windows = make_windows([(audio, None)])
        out[case] = {}
        for name, fn in predictors.items():
            pred = predict(fn, windows)
            out[case][name] = {"finite": bool(np.isfinite(pred).all()),
                               "jaw_mean": float(pred[:, jaw].mean()),
                               "jaw_max": float(pred[:, jaw].max()),
                               "any_max": float(pred.max())}
    return out


def markdown(results: dict[str, dict]) -> str:
    lines = ["| set | condition | model | viseme acc | (ceiling) | jaw r | best lag | r at lag |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({k for name in ("trained", "baseline") for k in results.get(name, {})})
    lines.insert(0, "heldout_synth = all four flite voices; the headline held-out-synthesizer "
                    "figure is heldout_synth_slt_awb_rms (kal16 shares its speaker, KAL, with "
                    "the festival kal_diphone training voice).\n")
    for key in keys:
        set_name, cond = key.split("/")
        for name in ("trained", "baseline"):
            s = results[name][key]
            lines.append(
                f"| {set_name} | {cond} | {name} | {s['viseme_acc']:.3f} | "
                f"{s['target_ceiling_acc']:.3f} | {s['jaw_r']:.3f} | "
                f"{s['best_lag_frames']:+d} ({s['best_lag_ms']:+.0f} ms) | {s['jaw_r_best']:.3f} |")
    lines += ["", "| bad input | trained jaw mean / max | baseline jaw mean / max | finite |",
              "| --- | --- | --- | --- |"]
    for case, by in results.get("bad_inputs", {}).items():
        tr, bl = by["trained"], by["baseline"]
        lines.append(f"| {case} | {tr['jaw_mean']:.3f} / {tr['jaw_max']:.3f} | "
                     f"{bl['jaw_mean']:.3f} / {bl['jaw_max']:.3f} | "
                     f"{tr['finite'] and bl['finite']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--weights", default=str(HEAD_WEIGHTS))
    ap.add_argument("--n-train", type=int, default=1600)
    ap.add_argument("--n-eval", type=int, default=160)
    ap.add_argument("--n-festival", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default="data/audio-head")
    ap.add_argument("--json", default="out/audio-head-eval.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    model = AudioHead.from_weights(args.weights)
    corpus = build_corpus(args.n_train, args.n_eval, args.seed, args.cache, args.n_festival)
    results = evaluate_all(model, corpus, args.seed)
    table = markdown(results)
    print(table)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": results, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
