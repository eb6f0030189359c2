"""sonic-lite's trained audio head: a log-mel window to the SPEECH mouth coefficients.

Trained by ``python -m inference.training.train`` on phoneme-labelled speech, synthetic
and real (see ``inference/training``); the weights ship as ``engines/sonic-lite-audio-head.pt``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from inference.engine import FrameTiming
from inference.model.blendshapes import SPEECH
from inference.model.timing import TIMING

LN10 = math.log(10.0)
#: The shipped head's trained weights (``python -m inference.training.train`` writes them
#: and a JSON of what they were trained on beside them; export bakes them into the ONNX).
HEAD_WEIGHTS = Path(__file__).resolve().parents[2] / "engines" / "sonic-lite-audio-head.pt"


class AudioHead(nn.Module):
    """mel window (B, 32, 80) of log10 mel power -> SPEECH coefficients (B, 11) in [0, 1].

    Three dilated convolutions (receptive field 31 mel frames) see the whole window.

    Level robustness: the spectrum enters relative to the window's loudest frame
    (floored 60 dB below it), so a gain change shifts nothing the convolutions see;
    absolute level enters only through a per-frame presence channel that saturates for
    anything louder than very quiet speech. A window whose loudest frame is below
    ``gate_bels`` (digital silence, a faint noise floor) is gated to a closed mouth.

    Members: ``members`` copies of the convolutions, each trained alone from its own seed
    (``train.py --members``), whose coefficients are averaged. They run as one set of
    grouped convolutions (member ``i`` owns the ``i``-th group of channels), so an ensemble
    is still one small graph; on unheard speakers two members reduce what any one seed
    gets wrong by chance (benchmarks/results/2026-12-05-lipsync-two-members.md).

    Smoothing is inside the window, because frames are computed independently (batched
    across sessions) and carry no state: the convolutions predict coefficients for every
    mel frame, and a fixed Gaussian (a zero-phase FIR) centred on the video frame's own
    audio pools them. It uses the window's look-ahead instead of lagging like a one-pole
    filter would.
    """

    gate_bels: float = -3.5  # window peak (log10 summed mel power) that opens the gate
    gate_width: float = 0.3
    presence_bels: float = -3.0  # per-frame level where the presence channel is half on
    floor_bels: float = 6.0  # relative spectrum floor below the window peak
    #: Remove the window's average spectral tilt (a straight line over the mel bins,
    #: fitted to the energy-weighted mean spectrum) before the convolutions: microphones,
    #: rooms and synthesizers differ most in tilt, which says little about the mouth.
    #: Off in the shipped head: with festival in the corpus and 12 dB EQ augmentation it
    #: gave no held-out gain (held-out synth jaw r 0.761 vs 0.766) and cost held-out espeak
    #: voices a little (0.858 vs 0.867).
    tilt_norm: bool = False
    #: Pooling weights below this (of a kernel summing to 1) are left out, and with them
    #: every convolution output that only they would read: the pooled coefficients move
    #: by under 1e-5, and the convolutions compute two thirds of what the whole window
    #: costs (the pooling reads frames 19-31 of 32).
    pool_floor: float = 1e-6
    #: log10 mel power the head reads: the features' floor (digital silence) to far
    #: above full scale; NaN reads as silence.
    mel_range: tuple[float, float] = (-10.0, 6.0)

    def __init__(self, timing: FrameTiming = TIMING, hidden: int = 96,
                 sigma_frames: float = 1.5, members: int = 1) -> None:
        super().__init__()
        n_mels, window_frames = timing.features.n_mels, timing.window_frames
        self.n_mels = n_mels
        self.window_frames = window_frames
        self.members = members
        c_in, width = n_mels + 2, hidden * members
        self.inp = nn.Conv1d(c_in, width, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Conv1d(width, width, 3, padding=d, dilation=d, groups=members)
            for d in (2, 4, 8)
        )
        self.out = nn.Conv1d(width, len(SPEECH) * members, 1, groups=members)
        # The video frame's own mel frames end where the look-ahead begins.
        centre = (window_frames - timing.lookahead_frames
                  - timing.mel_frames_per_video_frame / 2.0 - 0.5)
        t = torch.arange(window_frames, dtype=torch.float32)
        kernel = torch.exp(-0.5 * ((t - centre) / sigma_frames) ** 2)
        self.register_buffer("kernel", kernel / kernel.sum())
        #: The first frame the pooling reads.
        self.pool_from = int(torch.nonzero(self.kernel >= self.pool_floor)[0])
        axis = torch.linspace(-1.0, 1.0, n_mels)
        self.register_buffer("tilt_axis", axis, persistent=False)

    @classmethod
    def from_weights(cls, path: str | Path = HEAD_WEIGHTS,
                     timing: FrameTiming = TIMING) -> AudioHead:
        """A trained head, as wide and with as many members as its weights say."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        hidden = int(state["blocks.0.weight"].shape[1])  # a member's width
        head = cls(timing, hidden=hidden, members=int(state["inp.weight"].shape[0]) // hidden)
        head.load_state_dict(state)
        return head.eval()

    @classmethod
    def ensemble(cls, heads: list[AudioHead], timing: FrameTiming = TIMING) -> AudioHead:
        """One head whose coefficients are the mean of ``heads``' (alike in width; each
        one member): their weights side by side, as the groups of one head's convolutions."""
        hidden = heads[0].inp.out_channels
        joined = cls(timing, hidden=hidden, members=len(heads))
        joined.tilt_norm = heads[0].tilt_norm
        states = [h.state_dict() for h in heads]
        joined.load_state_dict({
            key: value if key == "kernel" else torch.cat([s[key] for s in states])
            for key, value in joined.state_dict().items()})
        return joined.eval()

    def _clean(self, mel: Tensor) -> Tensor:
        low, high = self.mel_range
        return torch.where(torch.isnan(mel), torch.full_like(mel, low), mel).clamp(low, high)

    def features(self, mel: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, n_mels) log-mel -> (B, n_mels + 2, T) level-normalised channels, and the
        window's peak (B,) of log10 summed mel power."""
        mel = self._clean(mel)
        # The clamp keeps 10 ** mel summed over the bands well inside float32.
        energy = torch.log10(torch.exp(mel * LN10).sum(dim=2))  # (B, T)
        peak = energy.max(dim=1, keepdim=True).values  # (B, 1)
        rel = (mel - peak[:, :, None]).clamp(min=-self.floor_bels)
        if self.tilt_norm:
            w = (energy - peak + self.floor_bels).clamp(min=0.0)  # (B, T) louder: more
            mean_spec = (rel * w[:, :, None]).sum(1) / (w.sum(1, keepdim=True) + 1e-6)
            x = self.tilt_axis
            slope = (mean_spec * x).sum(1, keepdim=True) / (x * x).sum()  # (B, 1)
            rel = (rel - slope[:, None, :] * x).clamp(min=-self.floor_bels)
        rel = rel / 3.0 + 1.0
        rel_energy = (energy - peak).clamp(min=-self.floor_bels) / 3.0 + 1.0
        presence = torch.sigmoid((energy - self.presence_bels) / 0.5)
        x = torch.cat([rel, rel_energy[:, :, None], presence[:, :, None]], dim=2)
        return x.transpose(1, 2), peak[:, 0]

    def per_frame(self, mel: Tensor, first: int = 0) -> tuple[Tensor, Tensor]:
        """Coefficients (B, T - first, 11) of the mel frames from ``first`` on, and the
        window's silence gate (B,). Each convolution computes only the frames that the next
        layer reads, exactly as over the whole window (its zero padding included)."""
        layers = [self.inp, *self.blocks]
        starts = [first] * len(layers)  # the first frame each layer must output
        for i in range(len(layers) - 1, 0, -1):
            starts[i - 1] = max(starts[i] - layers[i].padding[0], 0)
        x, peak = self.features(mel)
        h = F.gelu(_conv_from(self.inp, x, 0, starts[0]))
        for block, held_from, start in zip(self.blocks, starts[:-1], starts[1:], strict=True):
            h = h[:, :, start - held_from:] + F.gelu(_conv_from(block, h, held_from, start))
        coeffs = torch.sigmoid(self.out(h[:, :, first - starts[-1]:]))
        if self.members > 1:
            n = len(SPEECH)  # slices by a constant, so the ONNX keeps a static channel count
            coeffs = sum(coeffs[:, i * n:(i + 1) * n] for i in range(self.members)) / self.members
        coeffs = coeffs.transpose(1, 2)
        gate = torch.sigmoid((peak - self.gate_bels) / self.gate_width)
        return coeffs, gate

    def forward(self, mel: Tensor) -> Tensor:
        coeffs, gate = self.per_frame(mel, self.pool_from)
        pooled = (coeffs * self.kernel[None, self.pool_from:, None]).sum(dim=1)
        return pooled * gate[:, None]


def _conv_from(conv: nn.Conv1d, h: Tensor, held_from: int, start: int) -> Tensor:
    """``conv``'s outputs for the window's frames from ``start`` on, where ``h`` holds its
    input from frame ``held_from`` on (the window's start, or far enough in that ``conv``
    never reads before it): the zeros beyond the window are its own padding."""
    pad = conv.padding[0]
    skip = start - pad - held_from
    h = F.pad(h[:, :, max(skip, 0):], (max(-skip, 0), pad))
    return F.conv1d(h, conv.weight, conv.bias, dilation=conv.dilation, groups=conv.groups)
