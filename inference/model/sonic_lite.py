"""sonic-lite: a hand-set DSP talking-head model, defined once in PyTorch.

The module is exported to ONNX (``inference.model.export``) for the CPU server, and the
same module can run under CUDA later; it has no trained weights, only fixed DSP tensors.

Three stages, all per video frame and all pure functions of the inputs (so frames of
different sessions batch freely):

1. Audio to motion. Band energies of the log-mel window (dB) give, per mel frame, a
   level-compressed loudness gated against silence and noise, and its dip below the
   window's peak (syllable contrast). A Gaussian kernel centred slightly after the
   video frame (the face leads the sound) pools them into ``jawOpen``; spectral shape
   ratios of the pooled bands (F1 vs. low band: open vowels; 2-3.6 kHz and >3.6 kHz vs.
   voiced band: front vowels and fricatives; low-band dominance without front energy:
   rounded vowels) give openness, lip spread and funnel. ``motion_scale`` scales them.
2. Idle motion from the clock: a blink every 2-6 s (irregular, shifted per session by
   the phase; blinks are not scaled by a knob), and slow head sway (sums of
   incommensurate sines, ~1-2 degrees) plus a small speech-driven nod, both scaled by
   ``dynamic_scale``. Signs: positive headPitch nods the chin down, positive headYaw
   moves the face to the image's right, positive headRoll turns it clockwise on screen.
3. Rendering (``inference.model.renderer``): one backward flow field anchored on the
   portrait's face landmarks and one ``grid_sample``, then the mouth interior where the
   lips part; each coefficient does what its ARKit name says.

Geometry follows the grid-sample convention (normalised [-1, 1], align_corners=False,
y down). The portrait is assumed square (as prepared by the server); the flow is
computed per axis in normalised units.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

from inference.engine import FrameTiming
from inference.features import mel_frequencies
from inference.model.audio_head import AudioHead
from inference.model.blendshapes import ALL
from inference.model.renderer import Renderer
from inference.model.timing import TIMING

COEFFICIENT_NAMES: tuple[str, ...] = ALL

#: Frequency bands (Hz) whose energies drive the motion, in column order.
BANDS: tuple[tuple[str, float, float], ...] = (
    ("voiced", 100.0, 4000.0),  # loudness of voiced speech
    ("all", 100.0, 8000.0),  # loudness including fricatives
    ("low", 150.0, 500.0),  # F1 of close vowels, nasals
    ("f1", 500.0, 1100.0),  # F1 of open vowels
    ("f3", 2000.0, 3600.0),  # F2/F3 of front vowels
    ("high", 3600.0, 8000.0),  # fricatives
)
_VOICED, _ALL, _LOW, _F1, _F3, _HIGH = range(len(BANDS))


def _smoothstep(edge0: Tensor | float, edge1: Tensor | float, x: Tensor) -> Tensor:
    """Hermite ramp from 0 at edge0 to 1 at edge1 (edges may be in either order)."""
    t = ((x - edge0) / (edge1 - edge0)).clamp(0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def _soft_clamp01(u: Tensor, eps: float) -> Tensor:
    """clamp(u, 0, 1) with rounded corners of size ``eps`` (keeps the warp smooth)."""
    return 0.5 * (torch.sqrt(u * u + eps * eps) - torch.sqrt((u - 1.0) ** 2 + eps * eps) + 1.0)


def _cycle(freq: float, u: Tensor, offset: float) -> Tensor:
    """sin(2*pi*(freq*u + offset)), reducing the phase first so large u stays precise."""
    x = freq * u + offset
    return torch.sin(2.0 * math.pi * (x - torch.floor(x)))


class SonicLite(nn.Module):
    """mel, portrait, geometry, knobs, clock -> frame (uint8 BHWC), coefficients."""

    # Audio-to-motion constants (dB values are 10*log10 of summed mel power; a
    # full-scale sine reads about +28 dB in the voiced band, speech at -20 dBFS RMS
    # peaks near +18 dB, white noise at -60 dBFS sits near -30 dB).
    gate_db: float = -14.0  # below this a frame counts as silence/noise
    gate_width_db: float = 2.5
    loud_db: float = 0.0  # loudness compression knee
    loud_width_db: float = 5.0
    dip_db: float = 9.0  # dip below the window peak that halves the opening
    dip_width_db: float = 3.0
    lead_frames: float = 2.0  # motion leads sound by 20 ms
    sigma_frames: float = 3.0
    nod_sigma_frames: float = 5.0

    def __init__(self, timing: FrameTiming = TIMING, head: AudioHead | None = None) -> None:
        super().__init__()
        spec = timing.features
        self.timing = timing

        centres = mel_frequencies(spec.n_mels + 2, spec.fmin, spec.fmax)[1:-1]
        bands = np.stack([(centres >= lo) & (centres < hi) for _, lo, hi in BANDS], axis=1)
        self.register_buffer("band_weights", torch.from_numpy(bands.astype(np.float32)))

        # Window index of the video frame's centre: the frame's own mel frames sit just
        # before the look-ahead.
        centre = (timing.window_frames - timing.lookahead_frames
                  - timing.mel_frames_per_video_frame / 2.0 - 0.5)
        t = np.arange(timing.window_frames, dtype=np.float64)
        self.register_buffer("kernel", self._gauss(t, centre + self.lead_frames, self.sigma_frames))
        self.register_buffer("nod_kernel", self._gauss(t, centre, self.nod_sigma_frames))
        self.head = head if head is not None else AudioHead(timing)
        self.renderer = Renderer()

    @staticmethod
    def _gauss(t: np.ndarray, centre: float, sigma: float) -> Tensor:
        k = np.exp(-0.5 * ((t - centre) / sigma) ** 2)
        return torch.from_numpy((k / k.sum()).astype(np.float32))

    # ------------------------------------------------------------------ audio
    def audio_motion(self, mel: Tensor, motion_scale: Tensor) -> tuple[Tensor, ...]:
        """The hand-set DSP mapping of the first version, kept as the evaluation baseline
        (``inference.training.evaluate``): (jaw, spread, funnel, speech presence), each (B,)."""
        mel = torch.where(torch.isnan(mel), -10.0, mel).clamp(-10.0, 6.0)  # NaN: silence
        power = torch.exp(mel * math.log(10.0))  # (B, T, n_mels)
        bands = power @ self.band_weights  # (B, T, n_bands)
        db = 10.0 * torch.log10(bands + 1e-9)

        def presence(level: Tensor) -> Tensor:
            gate = torch.sigmoid((level - self.gate_db) / self.gate_width_db)
            return gate * torch.sigmoid((level - self.loud_db) / self.loud_width_db)

        voiced = db[..., _VOICED]
        dip = voiced - voiced.max(dim=1, keepdim=True).values
        contrast = torch.sigmoid((dip + self.dip_db) / self.dip_width_db)
        jaw_env = (presence(voiced) * (0.35 + 0.65 * contrast)) @ self.kernel  # (B,)
        speech_t = presence(db[..., _ALL])
        speech = speech_t @ self.kernel
        nod = presence(voiced) @ self.nod_kernel

        pooled = 10.0 * torch.log10((bands * self.kernel[None, :, None]).sum(dim=1) + 1e-9)
        v = pooled[:, _VOICED]
        openness = torch.sigmoid((pooled[:, _F1] - pooled[:, _LOW] + 6.0) / 5.0)
        front = torch.sigmoid((pooled[:, _F3] - v + 12.0) / 2.5)
        fricative = torch.sigmoid((pooled[:, _HIGH] - v + 3.0) / 4.0)
        rounded = torch.sigmoid((pooled[:, _LOW] - pooled[:, _F1] - 12.0) / 4.0) * (1.0 - front)

        jaw = (motion_scale * 0.95 * jaw_env * (0.3 + 0.7 * openness)).clamp(0.0, 1.0)
        spread = (motion_scale * speech * (0.6 * front + 0.4 * fricative)).clamp(0.0, 1.0)
        funnel = (motion_scale * 1.1 * jaw_env * rounded).clamp(0.0, 1.0)
        return jaw, spread, funnel, nod

    # ------------------------------------------------------------------ idle
    @staticmethod
    def idle_motion(clock: Tensor, nod: Tensor, dynamic_scale: Tensor) -> tuple[Tensor, ...]:
        """(blink, pitch, yaw, roll), each (B,); angles in radians."""
        phase = clock[:, 1]
        u = clock[:, 0] + phase  # the phase doubles as a per-session time offset
        # One blink per 4 s cell at a pseudo-random offset in [0.9, 3.1) s, so blinks are
        # 1.9-6.1 s apart. The hash uses small exact integers (cell mod 7, 11, 13), so
        # float32 runtimes agree on it and it never degrades for long sessions.
        cell = torch.floor(u / 4.0)
        a, b, c = (cell - m * torch.floor(cell / m) for m in (7.0, 11.0, 13.0))
        salt = 0.7548776 * phase
        mix = 0.1379 * a * a + 0.0571 * b * b + 0.0311 * c * c + 0.171 * a * c + salt
        at = 0.9 + 2.2 * (mix - torch.floor(mix))
        d = u - 4.0 * cell - at
        d = torch.where(d < 0.0, d / 0.06, d / 0.11)  # closes fast, opens slower
        blink = (0.75 * (1.0 + torch.cos(math.pi * d.clamp(-1.0, 1.0)))).clamp(0.0, 1.0)

        deg = math.pi / 180.0
        yaw = 1.6 * deg * (0.6 * _cycle(0.071, u, 0.1) + 0.4 * _cycle(0.173, u, 0.6))
        pitch = 1.0 * deg * (0.6 * _cycle(0.057, u, 0.3) + 0.4 * _cycle(0.131, u, 0.8))
        roll = 1.2 * deg * (0.6 * _cycle(0.043, u, 0.5) + 0.4 * _cycle(0.109, u, 0.2))
        pitch = pitch + 1.2 * deg * nod  # chin dips a little while talking
        return blink, dynamic_scale * pitch, dynamic_scale * yaw, dynamic_scale * roll

    def motion(self, mel: Tensor, knobs: Tensor, clock: Tensor) -> Tensor:
        """The coefficients alone: all a motion-only session needs (the motion graph)."""
        knobs = knobs.clamp(0.0, 2.0)
        motion_scale, dynamic_scale = knobs[:, 0], knobs[:, 1]
        speech = (self.head(mel) * motion_scale[:, None]).clamp(0.0, 1.0)
        blink, pitch, yaw, roll = self.idle_motion(clock, speech[:, 0], dynamic_scale)
        return torch.cat([speech, torch.stack([blink, blink, pitch, yaw, roll], 1)], 1)

    def forward(
        self, mel: Tensor, portrait: Tensor, geometry: Tensor, knobs: Tensor, clock: Tensor
    ) -> tuple[Tensor, Tensor]:
        coeffs = self.motion(mel, knobs, clock)
        return self.renderer(portrait, geometry, coeffs), coeffs


class MotionGraph(nn.Module):
    """``SonicLite.motion`` as a module of its own, so it exports as a graph of its own."""

    def __init__(self, model: SonicLite) -> None:
        super().__init__()
        self.model = model

    def forward(self, mel: Tensor, knobs: Tensor, clock: Tensor) -> Tensor:
        return self.model.motion(mel, knobs, clock)
