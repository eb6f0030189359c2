"""Training and evaluation windows: every video frame's mel window with its mouth target.

Cut by the model's own :data:`~inference.model.timing.TIMING` and the server's own
:func:`~inference.features.log_mel`, so the head trains on exactly what it sees live.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference.features import log_mel
from inference.model.timing import TIMING
from inference.training.visemes import PROTOTYPES, frame_targets, segments_from_phonemes
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


def utterance_windows(audio: np.ndarray, phones: Phones | None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mel padded with the window's history, targets, labels) for one clip.

    Frame i's window starts at mel frame ``TIMING.window_start(i)``; the mel gets
    ``HISTORY`` silent frames in front and the audio 0.1 s of silence after, so the last
    frames have their look-ahead. ``phones`` None: non-speech, a closed mouth throughout.
    """
    n_frames = audio.size * TIMING.fps // SAMPLE_RATE
    mel = log_mel(np.concatenate([audio, np.zeros(SAMPLE_RATE // 10, np.float32)]),
                  TIMING.features)
    mel = np.concatenate([np.full((HISTORY, mel.shape[1]), SILENCE, np.float32), mel])
    if phones is None:
        return mel, np.zeros((n_frames, len(PROTOTYPES[0])), np.float32), np.zeros(
            n_frames, np.int64)
    targets, labels = frame_targets(segments_from_phonemes(phones), n_frames, TIMING.fps)
    return mel, targets, labels


def make_windows(clips: list[tuple[np.ndarray, Phones | None]]) -> Windows:
    mels, starts, targets, labels, utt = [], [], [], [], []
    offset = 0
    for k, (audio, phones) in enumerate(clips):
        mel, tg, lab = utterance_windows(audio, phones)
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
