"""Train sonic-lite's audio head: ``python -m inference.training.train``.

Builds (or loads) the synthetic corpus (espeak-ng and festival; flite held out), adds a
degraded copy of every utterance plus a few non-speech clips (noise, music) labelled
closed, computes features with the server's
own :func:`inference.features.log_mel`, trains :class:`AudioHead` on CPU and writes
``engines/sonic-lite-audio-head.pt`` (state_dict) and ``.json`` (what it was trained on
and how well it does on held-out voices and the held-out synthesizer).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from inference.model.audio_head import HEAD_WEIGHTS, AudioHead
from inference.model.timing import TIMING
from inference.training import augment
from inference.training.corpus import build_corpus
from inference.training.visemes import LEADS, PROTOTYPES, VISEMES, JawTarget, Leads
from inference.training.windows import Windows, make_windows
from inference.tts import SAMPLE_RATE, Utterance


def training_clips(train: list[Utterance], seed: int, n_noise: int, eq_db: float = 12.0,
                   speed: tuple[float, float] = (0.8, 1.25)
                   ) -> tuple[list[tuple[np.ndarray, list | None]], dict[str, int]]:
    """Clean (random gain) and degraded copies of each utterance, plus non-speech."""
    rng = np.random.default_rng(seed)
    babble = [u.audio for u in train[: 200]]
    clips: list[tuple[np.ndarray, list | None]] = []
    counts: dict[str, int] = {}
    for u in train:
        x = augment.random_eq(u.audio, rng, eq_db) if rng.random() < 0.5 else u.audio
        clips.append((augment.set_peak(x, float(rng.uniform(-30, -1))), u.phones))
        phones = u.phones
        x = u.audio
        if rng.random() < 0.6:
            factor = float(rng.uniform(*speed))
            x = augment.speed_perturb(x, factor)
            phones = [(s / factor, e / factor, p) for s, e, p in u.phones]
            counts["speed"] = counts.get("speed", 0) + 1
        y, done = augment.random_chain(x, rng, babble, eq_db)
        for d in done:
            key = "".join(c for c in d if c.isalpha())
            counts[key] = counts.get(key, 0) + 1
        clips.append((y, phones))
    for x in augment.non_speech(n_noise, rng):
        clips.append((x, None))
    return clips, counts


def _named_values(text: str, cast: type) -> dict[str, Any]:
    """``name=value,...`` as a dict (ValueError if a value does not cast)."""
    pairs = (item.partition("=") for item in text.split(",") if item.strip())
    return {name.strip(): cast(value) for name, _, value in pairs}


def viseme_weights(text: str) -> dict[str, float]:
    """``--viseme-weight``: ``VISEME=W,...`` (names from ``visemes.VISEMES``)."""
    try:
        weights = _named_values(text, float)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give VISEME=W,...") from None
    unknown = sorted(set(weights) - set(VISEMES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown visemes {unknown}; known: {VISEMES}")
    return weights


@dataclass(frozen=True)
class Copies:
    """How many times each real recording enters training: ``N`` for every corpus, or
    ``corpus=N,...`` (corpora not named: once)."""

    text: str
    default: int = 1
    by_corpus: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Copies:
        try:
            if "=" not in text:
                return cls(text, int(text))
            return cls(text, 1, _named_values(text, int))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give N or corpus=N,...") from None

    def __call__(self, corpus: str) -> int:
        return self.by_corpus.get(corpus, self.default)


def train_head(windows: Windows, *, epochs: int, batch: int, lr: float, seed: int,
               log_every: int = 200, tilt_norm: bool = AudioHead.tilt_norm,
               shape_weight: float = 1.0, ce_weight: float = 0.02,
               hidden: int = 96, viseme_weight: dict[str, float] | None = None,
               warp: float = 0.0, ccc_weight: float = 0.0, band_mask: int = 0,
               teacher: AudioHead | None = None, distill: float = 0.5,
               device: str | torch.device = "cpu") -> AudioHead:
    """``shape_weight``: the lip shapes' share of the loss against jawOpen's 3;
    ``ce_weight``: the viseme-classification term's (it sharpens which shape is meant);
    ``viseme_weight``: how much more the frames labelled with a viseme count (short,
    strong gestures such as ``PP`` are few among the vowels); ``warp``: each window's
    bands warped by a random factor within 1 +- warp (``augment.vtlp_table``);
    ``ccc_weight``: a term for each coefficient's concordance with its target over the
    batch (1 - CCC), which, unlike the squared error, costs a head that hedges towards
    the middle where it is unsure (open vowels under-opened, lips left ajar through
    p/b/m); ``band_mask``: up to that many adjacent mel bands of each window hidden
    (``mask_bands``); ``teacher``, ``distill``: each window's target moves that share of
    the way to what ``teacher`` (a trained head, e.g. several members) makes of the same
    window, so one member can learn the ensemble's answers. Returned on the CPU."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    device = torch.device(device)
    model = AudioHead(hidden=hidden).to(device)
    model.tilt_norm = tilt_norm
    batch_of = windows.batcher(device)
    if teacher is not None:
        teacher = teacher.to(device).eval()
    targets = torch.from_numpy(windows.targets).to(device)
    labels = torch.from_numpy(windows.labels).to(device)
    warps = torch.from_numpy(augment.vtlp_table(TIMING.features, warp)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    n = windows.starts.size
    steps_per_epoch = n // batch
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total,
                                                pct_start=0.05)
    protos = torch.from_numpy(PROTOTYPES).to(device)
    weight = torch.full((PROTOTYPES.shape[1],), shape_weight)
    weight[0] = 3.0  # jawOpen is what viewers notice most
    frame_weight = torch.ones(len(VISEMES))
    for name, w in (viseme_weight or {}).items():
        frame_weight[VISEMES.index(name)] = w
    weight, frame_weight = weight.to(device), frame_weight.to(device)
    step = 0
    t0 = time.time()
    for epoch in range(epochs):
        order = rng.permutation(n)
        for b in range(steps_per_epoch):
            idx = order[b * batch : (b + 1) * batch]
            rows = torch.from_numpy(idx).to(device)
            target, label = targets[rows], labels[rows]
            mel = batch_of(idx)
            if warp > 0:
                mel = warp_bands(mel, warps[torch.randint(len(warps), (len(idx),),
                                                          device=device)])
            if band_mask > 0:
                mel = mask_bands(model._clean(mel), band_mask)
            if teacher is not None:
                with torch.no_grad():
                    target = torch.lerp(target, teacher(mel), distill)
            pred = model(mel)
            per_frame = frame_weight[label][:, None]
            mse = (((pred - target) ** 2) * weight * per_frame).sum() / (
                per_frame.sum() * weight.numel())
            # Nearest-prototype classification is how accuracy is scored: a soft version.
            dist = ((pred[:, None, :] - protos[None]) ** 2).sum(-1)
            ce = F.cross_entropy(-dist / 0.05, label)
            loss = mse + ce_weight * ce
            if ccc_weight > 0:
                loss = loss + ccc_weight * ((1.0 - concordance(pred, target)) * weight).sum() / (
                    weight.sum())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % log_every == 0:
                print(f"epoch {epoch} step {step}/{total} mse {mse.item():.4f} "
                      f"ce {ce.item():.3f} {time.time() - t0:.0f}s", flush=True)
    return model.cpu().eval()


def concordance(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Lin's concordance correlation of each column over the batch (B, C) -> (C,): 1 only
    where the prediction equals the target in mean, spread and correlation."""
    pm, tm = pred.mean(0), target.mean(0)
    cov = ((pred - pm) * (target - tm)).mean(0)
    return 2.0 * cov / (pred.var(0, unbiased=False) + target.var(0, unbiased=False)
                        + (pm - tm) ** 2 + 1e-6)


def mask_bands(mel: torch.Tensor, max_width: int) -> torch.Tensor:
    """(B, T, n_mels) with a random run of 0..``max_width`` adjacent bands of each window
    set to each frame's mean over all bands (SpecAugment's frequency mask): a head that
    cannot lean on any one formant region reads vowels from the spectrum's overall
    shape, which carries over better to voices it never heard."""
    b, _, m = mel.shape
    width = torch.randint(0, max_width + 1, (b,), device=mel.device)
    first = (torch.rand(b, device=mel.device) * (m - width + 1)).long()
    bands = torch.arange(m, device=mel.device)[None]
    hidden = (bands >= first[:, None]) & (bands < (first + width)[:, None])
    return torch.where(hidden[:, None, :], mel.mean(dim=2, keepdim=True), mel)


def warp_bands(mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """(B, T, n_mels) with each window's bands read at ``source`` (B, n_mels), a
    fractional band index, between its two neighbours."""
    lo = source.floor().long()
    hi = (lo + 1).clamp(max=mel.shape[2] - 1)
    frac = (source - lo)[:, None, :]
    span = (-1, mel.shape[1], -1)
    below = mel.gather(2, lo[:, None, :].expand(*span))
    above = mel.gather(2, hi[:, None, :].expand(*span))
    return below + frac * (above - below)


def training_data(args: argparse.Namespace) -> tuple[Windows, dict[str, Any]]:
    """The training windows, and what they were made of (for the weights' JSON)."""
    t_start = time.time()
    corpus = build_corpus(args.n_train, args.n_eval, args.seed, args.cache, args.n_festival)
    print(f"corpus: {corpus.describe()} ({time.time() - t_start:.0f}s)", flush=True)
    train = list(corpus.train)
    real: dict[str, object] = {}
    if args.real_speech:
        from inference.training.real_speech import describe, load_real_speech, split

        recordings = load_real_speech(Path(args.real_speech))
        train += [u for u in split(recordings)[0] for _ in range(args.real_copies(u.corpus))]
        real = describe(recordings)
        print(f"real speech: {real}", flush=True)
    clips, aug_counts = training_clips(train, args.seed, n_noise=len(train) // 25,
                                       eq_db=args.eq_db, speed=(args.speed_min, args.speed_max))
    leads = Leads(jaw=args.jaw_lead_ms / 1000.0, lips=args.lips_lead_ms / 1000.0)
    jaw = jaw_target(args)
    command = "python -m inference.training.train" + (
        f" --real-speech {args.real_speech} --real-copies {args.real_copies.text}"
        if args.real_speech else "") + (
        f" --jaw-lead-ms {args.jaw_lead_ms:g}" if leads.jaw != LEADS.jaw else "") + (
        f" --lips-lead-ms {args.lips_lead_ms:g}" if leads.lips != LEADS.lips else "") + (
        " --jaw-by-vowel" if args.jaw_by_vowel else "") + (
        " --jaw-without-dominance" if not jaw.dominance else "")
    description = {
        "training_hours": round(sum(a.size for a, _ in clips) / SAMPLE_RATE / 3600, 3),
        "corpus": corpus.describe(),
        "real_speech": real or None,
        "augmentation": {
            "copies": f"each utterance once clean (random EQ up to {args.eq_db:g} dB p=0.5, "
                      "peak -30..-1 dBFS) and once speed-perturbed "
                      f"x{args.speed_min:g}-{args.speed_max:g} (p=0.6) then "
                      f"augment.random_chain (EQ up to {args.eq_db:g} dB)",
            "applied_counts": aug_counts,
            "non_speech_clips": len(clips) - 2 * len(train),
        },
        "targets": {"visemes": list(VISEMES), "leads_s": {"jaw": leads.jaw, "lips": leads.lips},
                    "blend_sigma_s": 0.03,
                    "jaw": jaw.describe()},
    }
    return make_windows(clips, leads, jaw), {"command": command, "description": description}


def jaw_target(args: argparse.Namespace) -> JawTarget:
    return JawTarget(by_vowel=args.jaw_by_vowel, dominance=not args.jaw_without_dominance)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n-train", type=int, default=1600)
    ap.add_argument("--n-eval", type=int, default=160)
    ap.add_argument("--n-festival", type=int, default=800)
    ap.add_argument("--epochs", type=int, default=8,
                    help="0: only build the training windows (with --windows, to save them)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eq-db", type=float, default=12.0)
    ap.add_argument("--speed-min", type=float, default=0.8)
    ap.add_argument("--speed-max", type=float, default=1.25)
    ap.add_argument("--tilt-norm", type=int, default=int(AudioHead.tilt_norm))
    ap.add_argument("--shape-weight", type=float, default=1.0)
    ap.add_argument("--ce-weight", type=float, default=0.02)
    ap.add_argument("--hidden", type=int, default=96, help="channels of the convolutions")
    ap.add_argument("--members", type=int, default=1,
                    help="heads trained alone on the same windows, from seeds seed, "
                         "seed+1, ..., and shipped as one whose output is their mean "
                         "(AudioHead.ensemble)")
    ap.add_argument("--viseme-weight", type=viseme_weights, default={},
                    help="frames of these visemes count more in the loss, e.g. PP=3,FF=2")
    ap.add_argument("--warp", type=float, default=0.0,
                    help="vocal tract length perturbation: each window's bands warped by "
                         "a random factor within 1 +- this (0: none)")
    ap.add_argument("--band-mask", type=int, default=0,
                    help="hide a random run of up to this many adjacent mel bands in each "
                         "training window (frequency masking)")
    ap.add_argument("--jaw-lead-ms", type=float, default=1000 * LEADS.jaw,
                    help="jawOpen's targets show the sound this much later")
    ap.add_argument("--lips-lead-ms", type=float, default=1000 * LEADS.lips,
                    help="the lip shapes' targets show the sound this much later")
    ap.add_argument("--jaw-by-vowel", action="store_true",
                    help="jawOpen's target for a vowel is its own height (visemes.VOWEL_JAW), "
                         "not its viseme's (which lumps, e.g., /i:/ with /I/)")
    ap.add_argument("--jaw-without-dominance", action="store_true",
                    help="jawOpen's target blends neighbouring phones alike, not by the "
                         "lips' dominance (visemes.JawTarget)")
    ap.add_argument("--ccc-weight", type=float, default=0.5,
                    help="weight of a concordance (1 - CCC) term per coefficient, beside "
                         "the squared error (0: none); 0.5 lifted every lip shape on "
                         "held-out real speakers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default="data/audio-head")
    ap.add_argument("--real-speech", metavar="ROOT", default=None,
                    help="also train on the recordings of real people prepared there "
                         "(inference.training.real_speech); its held-out speakers never")
    ap.add_argument("--real-copies", type=Copies.parse,
                    default="kathleen=1,librispeech=4,vctk=4",
                    help="times each recording enters training (each with its own "
                         "augmentation draws): N, or per corpus, e.g. "
                         "kathleen=1,librispeech=4 (one reader's 93 minutes would "
                         "otherwise outweigh 235 speakers' 51)")
    ap.add_argument("--teacher", metavar="HEAD.pt", default=None,
                    help="a trained head whose answers the targets move towards (--distill)")
    ap.add_argument("--distill", type=float, default=0.5,
                    help="with --teacher: the share of each target taken from the teacher")
    ap.add_argument("--out", default=str(HEAD_WEIGHTS))
    ap.add_argument("--windows", metavar="FILE.npz", default=None,
                    help="train from the windows saved here, or build them and save them "
                         "here: build on a machine with the synthesizers, train on one "
                         "with a GPU")
    ap.add_argument("--device", default="cpu", help="torch device to train on, e.g. cuda")
    ap.add_argument("--no-eval", action="store_true",
                    help="skip the held-out synthetic evaluation (it needs the corpus)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    saved = Path(args.windows) if args.windows else None
    if saved is not None and saved.exists():
        windows, data = Windows.load(saved)
        targets = data["description"].get("targets", {})
        built = (targets.get("leads_s"), targets.get("jaw", "its viseme's"))
        asked = ({"jaw": args.jaw_lead_ms / 1000.0, "lips": args.lips_lead_ms / 1000.0},
                 jaw_target(args).describe())
        if built != asked:
            ap.error(f"{saved} holds targets {built}, not the {asked} asked for: "
                     "build the windows anew (another --windows file)")
        print(f"{windows.starts.size} training windows from {saved}", flush=True)
    else:
        windows, data = training_data(args)
        if saved is not None:
            windows.save(saved, data)
    t_data = time.time() - t_start
    print(f"{windows.starts.size} training windows ({t_data:.0f}s)", flush=True)
    if args.epochs == 0:
        return
    teacher = AudioHead.from_weights(args.teacher) if args.teacher else None
    members = [train_head(windows, epochs=args.epochs, batch=args.batch, lr=args.lr,
                          seed=args.seed + i, tilt_norm=bool(args.tilt_norm),
                          shape_weight=args.shape_weight, ce_weight=args.ce_weight,
                          hidden=args.hidden, viseme_weight=args.viseme_weight,
                          warp=args.warp, ccc_weight=args.ccc_weight,
                          band_mask=args.band_mask, device=args.device,
                          teacher=teacher, distill=args.distill)
               for i in range(args.members)]
    model = members[0] if args.members == 1 else AudioHead.ensemble(members)
    t_train = time.time() - t_start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out)

    metrics = None
    if not args.no_eval:
        corpus = build_corpus(args.n_train, args.n_eval, args.seed, args.cache, args.n_festival)
        from inference.training.evaluate import evaluate_all

        metrics = evaluate_all(model, corpus, seed=args.seed)
    params = sum(p.numel() for p in model.parameters())
    desc = {
        "model": "AudioHead", "parameters": params, "weights": out.name,
        "command": data["command"]
            + (f" --n-train {args.n_train}" if args.n_train != 1600 else "")
            + (f" --n-festival {args.n_festival}" if args.n_festival != 800 else "")
            + (f" --hidden {args.hidden}" if args.hidden != 96 else "")
            + (f" --members {args.members}" if args.members != 1 else "")
            + (f" --teacher {Path(args.teacher).name} --distill {args.distill:g}"
               if args.teacher else "")
            + (f" --epochs {args.epochs}" if args.epochs != 8 else "")
            + (f" --lr {args.lr:g}" if args.lr != 4e-3 else "")
            + (f" --warp {args.warp:g}" if args.warp else "")
            + (f" --band-mask {args.band_mask}" if args.band_mask else "")
            + (f" --ccc-weight {args.ccc_weight:g}" if args.ccc_weight else "")
            + (" --viseme-weight " + ",".join(f"{k}={v:g}" for k, v in args.viseme_weight.items())
               if args.viseme_weight else ""),
        "device": args.device,
        "seed": args.seed, "members": args.members,
        "epochs": args.epochs, "batch": args.batch, "lr": args.lr,
        "shape_weight": args.shape_weight, "ce_weight": args.ce_weight, "hidden": args.hidden,
        "viseme_weight": args.viseme_weight or None, "warp": args.warp,
        "band_mask": args.band_mask,
        "ccc_weight": args.ccc_weight,
        "tilt_norm": bool(args.tilt_norm), "festival_utterances": args.n_festival,
        "training_windows": int(windows.starts.size),
        **data["description"],
        "seconds": {"data": round(t_data), "training": round(t_train - t_data),
                    "total": round(time.time() - t_start)},
        "headline_heldout_synth": {
            "set": "heldout_synth_slt_awb_rms",
            "why": "festival's kal_diphone (a training voice) and flite's kal16 are the same "
                   "speaker (KAL), so kal16 is not an unseen speaker: the headline "
                   "held-out-synthesizer figure is over flite slt, awb and rms only; "
                   "heldout_synth (all four) and heldout_synth_kal16 are reported too",
            "clean": metrics["trained"].get("heldout_synth_slt_awb_rms/clean")
            if metrics else None,
        },
        "metrics": metrics,
    }
    Path(str(out.with_suffix(".json"))).write_text(json.dumps(desc, indent=2) + "\n")
    print(json.dumps(desc["seconds"]))
    if metrics and not math.isfinite(float(metrics["trained"]["heldout_synth/clean"]["jaw_r"])):
        raise SystemExit("training produced non-finite metrics")


if __name__ == "__main__":
    main()
