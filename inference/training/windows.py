"""Training and evaluation windows: every video frame's mel window with its mouth target.

Cut by the model's own :data:`~inference.model.timing.TIMING` and the server's own
:func:`~inference.features.log_mel`, so the head trains on exactly what it sees live.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inference.features import log_mel
from inference.model.audio_head import AudioHead
from inference.model.timing import TIMING
from inference.training.visemes import (
    JAW_TARGET,
    LEADS,
    PROTOTYPES,
    JawTarget,
    Leads,
    frame_targets,
    segments_from_phonemes,
)
from inference.tts import SAMPLE_RATE

SILENCE = float(np.log10(TIMING.features.floor))
#: Silent mel frames in front of a clip: what the server reads before frame 0.
HISTORY = max(0, -TIMING.window_start(0))

Phones = list[tuple[float, float, str]]


@dataclass
class Windows:
    """Every video frame's mel window, stored once as concatenated padded mels."""

    mel: np.ndarray  # (total_mel_frames, n_mels) float16
    starts: np.ndarray  # (n_windows,) row of each window's first mel frame
    targets: np.ndarray  # (n_windows, 11)
    labels: np.ndarray  # (n_windows,)
    utt: np.ndarray  # (n_windows,) utterance index (for per-utterance metrics)

    def batch(self, idx: np.ndarray) -> torch.Tensor:
        rows = self.starts[idx, None] + np.arange(TIMING.window_frames)
        return torch.from_numpy(self.mel[rows].astype(np.float32))

    def batcher(self, device: torch.device) -> Callable[[np.ndarray], torch.Tensor]:
        """:meth:`batch` for a model on ``device``; a GPU holds the mel and cuts the
        windows itself, which a host-side gather per step would otherwise bound."""
        if device.type == "cpu":
            return self.batch
        mel = torch.from_numpy(self.mel).to(device)
        starts = torch.from_numpy(self.starts).to(device)
        span = torch.arange(TIMING.window_frames, device=device)

        def batch(idx: np.ndarray) -> torch.Tensor:
            rows = starts[torch.from_numpy(idx).to(device)][:, None] + span
            return mel[rows].float()

        return batch

    def save(self, path: str | Path, meta: dict[str, Any]) -> None:
        """To an ``.npz`` with ``meta`` (what the windows were made of), the mel as 8 bits
        over the range the head reads (steps of 0.06 bels, 0.6 dB; a quarter of the
        float32 bytes), so that training can run on another machine (a GPU host without
        the synthesizers) from one file."""
        low, high = AudioHead.mel_range
        q = np.round((np.clip(self.mel.astype(np.float32), low, high) - low)
                     * (255.0 / (high - low)))
        np.savez(path, mel_u8=q.astype(np.uint8), starts=self.starts, targets=self.targets,
                 labels=self.labels, utt=self.utt, meta=np.array(json.dumps(meta)))

    @classmethod
    def load(cls, path: str | Path) -> tuple[Windows, dict[str, Any]]:
        """Windows saved by :meth:`save`, and their ``meta``."""
        low, high = AudioHead.mel_range
        with np.load(path) as f:
            mel = f["mel_u8"].astype(np.float32) * ((high - low) / 255.0) + low
            windows = cls(mel.astype(np.float16), f["starts"], f["targets"], f["labels"],
                          f["utt"])
            return windows, json.loads(str(f["meta"]))


def utterance_windows(audio: np.ndarray, phones: Phones | None, leads: Leads = LEADS,
                      jaw: JawTarget = JAW_TARGET) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mel padded with the window's history, targets, labels) for one clip.

    Frame i's window starts at mel frame ``TIMING.window_start(i)``; the mel gets
    ``HISTORY`` silent frames in front and the audio 0.1 s of silence after, so the last
    frames have their look-ahead. ``phones`` None: non-speech, a closed mouth throughout.
    ``jaw``: how jawOpen's target is made.
    """
    n_frames = audio.size * TIMING.fps // SAMPLE_RATE
    mel = log_mel(np.concatenate([audio, np.zeros(SAMPLE_RATE // 10, np.float32)]),
                  TIMING.features)
    mel = np.concatenate([np.full((HISTORY, mel.shape[1]), SILENCE, np.float32), mel])
    if phones is None:
        return mel, np.zeros((n_frames, len(PROTOTYPES[0])), np.float32), np.zeros(
            n_frames, np.int64)
    targets, labels = frame_targets(segments_from_phonemes(phones, jaw.by_vowel), n_frames,
                                    TIMING.fps, leads=leads, jaw_dominance=jaw.dominance)
    return mel, targets, labels


def make_windows(clips: list[tuple[np.ndarray, Phones | None]], leads: Leads = LEADS,
                 jaw: JawTarget = JAW_TARGET) -> Windows:
    mels, starts, targets, labels, utt = [], [], [], [], []
    offset = 0
    for k, (audio, phones) in enumerate(clips):
        mel, tg, lab = utterance_windows(audio, phones, leads, jaw)
        n = tg.shape[0]
        mels.append(mel.astype(np.float16))
        # window_start is linear in the frame index: the first window plus a stride.
        starts.append(offset + HISTORY + TIMING.window_start(0)
                      + TIMING.mel_frames_per_video_frame * np.arange(n))
        targets.append(tg)
        labels.append(lab)
        utt.append(np.full(n, k))
        offset += mel.shape[0]
    return Windows(np.concatenate(mels), np.concatenate(starts), np.concatenate(targets),
                   np.concatenate(labels), np.concatenate(utt))
