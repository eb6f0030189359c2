"""The landmark-anchored renderer: 16 ARKit-named coefficients -> one warped portrait frame.

Why this shape: ONNX Runtime's GridSample is what a frame costs on CPU, so the whole face
motion is ONE backward flow field and ONE ``grid_sample``. The flow is a low-rank sum of
separable 1-D profiles, ``grid = sum_k a_k(y) b_k(x)`` per axis (one small batched MatMul,
sharper and cheaper than upsampling a coarse grid). Every profile is anchored on the face
mesh (``GEOMETRY_NAMES``), so shapes land on the real lips, lids and jaw. A mouth
interior is then composited where the lips part; it is the only other full-resolution work.

The mouth starts from the portrait's own: the inner lip contour says whether its lips are
closed or parted (a smile showing teeth, say). Parted, the upper teeth stay with the skull
and the lower teeth ride down with the jaw, and the cavity opens between them; closed, the
lips part and a hint of teeth shows under them. The cavity is coloured from the portrait
itself (its lips for throat and tongue, its skin's lighting for teeth), shaded, and its
edges are feathered over at least a pixel and a half, so it sits on any face and a mouth
that is almost shut shows no line.

Conventions. Geometry is normalised [-1, 1] in the crop (grid-sample, align_corners=False,
y down); the portrait is assumed square (as the server prepares it). Coefficients follow
``blendshapes.ALL``; speech shapes and blinks are clamped to [0, 1], head angles (radians)
to +-0.35. "Left"/"Right" in coefficient names are the SUBJECT's, as in ARKit: the
subject's left appears on the IMAGE's right, so ``mouthSmileLeft`` and ``eyeBlinkLeft``
move the image-right corner / eye (``eye_right_*`` in the geometry, whose names are image
sides). Head signs match sonic-lite: positive headPitch nods the chin down, positive
headYaw moves the face to the image's right, positive headRoll turns it clockwise.

All speech coefficients at 0 leave the mouth exactly as in the portrait (every speech
term is multiplied by its coefficient), so a neutral frame is the portrait up to the idle
head motion.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from inference.engine import GEOMETRY_NAMES
from inference.model.blendshapes import ALL, SPEECH

__all__ = ["Renderer"]

_G = {name: i for i, name in enumerate(GEOMETRY_NAMES)}
_C = {name: i for i, name in enumerate(ALL)}


def _smoothstep(edge0: Tensor | float, edge1: Tensor | float, x: Tensor) -> Tensor:
    """Hermite ramp from 0 at edge0 to 1 at edge1 (edges may be in either order)."""
    t = ((x - edge0) / (edge1 - edge0)).clamp(0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def _soft_clamp01(u: Tensor, eps: float) -> Tensor:
    """clamp(u, 0, 1) with rounded corners of size ``eps`` (keeps the warp smooth)."""
    return 0.5 * (torch.sqrt(u * u + eps * eps) - torch.sqrt((u - 1.0) ** 2 + eps * eps) + 1.0)


def _lens(u: Tensor, power: float) -> Tensor:
    """(1 - u^2)^power on |u| < 1, else 0: a lip opening's profile across the mouth."""
    return (1.0 - u * u).clamp(min=0.0) ** power


class Renderer(nn.Module):
    """portrait (B,3,H,W in [0,1]), geometry (B, len(GEOMETRY_NAMES)), coefficients
    (B, 16 in ``blendshapes.ALL`` order) -> frame (B,H,W,3) uint8."""

    # Amplitudes, relative to the face's own distances (mw: mouth half-width, mc:
    # mouth-to-chin distance).
    jaw_drop: float = 0.45  # chin travel at jawOpen=1, x mc
    upper_lip_share: float = 0.22  # part of the lip gap taken by the upper lip lifting
    funnel_gap: float = 0.42  # round opening height at mouthFunnel=1, x mw
    funnel_width: float = 0.45  # its half-width, x mw
    smile_up: float = 0.4  # corner lift, x mw
    smile_out: float = 0.14
    stretch_out: float = 0.26
    stretch_down: float = 0.10
    pucker_in: float = 0.5  # corners in, x mw
    funnel_in: float = 0.24
    pucker_grow: float = 0.2  # vertical lip magnification
    funnel_grow: float = 0.18
    press_thin: float = 0.55  # lip thinning (fraction removed-ish)
    roll_thin: float = 0.85
    jaw_corner_down: float = 0.30  # corners follow the jaw, x its drop
    jaw_in: float = 0.07
    teeth_upper: float = 0.2  # visible upper teeth under a closed portrait's lip, x mw
    teeth_lower: float = 0.12  # lower teeth when wide open, x mw

    def __init__(self) -> None:
        super().__init__()
        if len(ALL) != 16 or ALL[: len(SPEECH)] != SPEECH:
            raise RuntimeError("blendshapes.ALL changed; update the renderer's indices")
        # Teeth: a warm off-white as bright as the skin is lit. Throat and tongue: the lips'
        # colour, redder.
        self.register_buffer("teeth_tint", torch.tensor([0.97, 0.93, 0.86]), persistent=False)
        self.register_buffer("cavity_tint", torch.tensor([1.0, 0.6, 0.6]), persistent=False)
        # Where the lip and skin colours are sampled, either side of the mouth's centre (a
        # buffer: a tensor made on each call would be a host copy, which CUDA graphs forbid).
        self.register_buffer("colour_offsets", torch.tensor([[-0.04, 0.0, 0.04]]),
                             persistent=False)

    def forward(self, portrait: Tensor, geometry: Tensor, coefficients: Tensor) -> Tensor:
        image = self.render(portrait, geometry, coefficients)
        return (image * 255.0 + 0.5).clamp(0.0, 255.0).to(torch.uint8).permute(0, 2, 3, 1)

    # ------------------------------------------------------------------ render
    def render(self, portrait: Tensor, geometry: Tensor, coefficients: Tensor) -> Tensor:
        """Float RGB (B, 3, H, W): the warped portrait with the mouth interior drawn in."""
        height, width = portrait.shape[2], portrait.shape[3]
        device = portrait.device
        ys = (torch.arange(height, dtype=torch.float32, device=device) + 0.5) * (2.0 / height) - 1.0
        xs = (torch.arange(width, dtype=torch.float32, device=device) + 0.5) * (2.0 / width) - 1.0
        ys = ys[None, :]  # (1, H)
        xs = xs[None, :]  # (1, W)

        def g(name: str) -> Tensor:
            i = _G[name]
            return geometry[:, i : i + 1]  # (B, 1)

        def c(name: str) -> Tensor:
            i = _C[name]
            return coefficients[:, i : i + 1]

        speech = coefficients[:, : len(SPEECH)].clamp(0.0, 1.0)

        def s(name: str) -> Tensor:
            i = _C[name]
            return speech[:, i : i + 1]

        jaw, close, funnel, pucker = s("jawOpen"), s("mouthClose"), s("mouthFunnel"), s(
            "mouthPucker"
        )
        # Subject's left = image right: "_r" below means the image's right side.
        stretch_r, stretch_l = s("mouthStretchLeft"), s("mouthStretchRight")
        smile_r, smile_l = s("mouthSmileLeft"), s("mouthSmileRight")
        roll_lower = s("mouthRollLower")
        press_r, press_l = s("mouthPressLeft"), s("mouthPressRight")
        blink_r = c("eyeBlinkLeft").clamp(0.0, 1.0)
        blink_l = c("eyeBlinkRight").clamp(0.0, 1.0)
        pitch = c("headPitch").clamp(-0.35, 0.35)
        yaw = c("headYaw").clamp(-0.35, 0.35)
        roll = c("headRoll").clamp(-0.35, 0.35)

        mx, my, mw, cy = g("mouth_x"), g("mouth_y"), g("mouth_half_width").clamp(min=0.01), g(
            "chin_y"
        )
        elx, ely, erx, ery = g("eye_left_x"), g("eye_left_y"), g("eye_right_x"), g("eye_right_y")
        eye_dist = (erx - elx).abs().clamp(min=0.02)
        eye_y = 0.5 * (ely + ery)
        eye_chin = (cy - eye_y).clamp(min=0.05)
        mc = (cy - my).clamp(min=0.02)

        # ---------------------------------------------------------------- head
        # Translation from yaw/pitch about a pivot behind the face, roll about the neck;
        # a plateau over the head that fades out around it and before the image border,
        # so background, shoulders and border pixels never move.
        face_x = 0.5 * (elx + erx)
        tx = yaw * eye_chin
        ty = pitch * eye_chin
        pivot_x, pivot_y = mx, cy + 0.3 * eye_chin
        face_half = (0.5 * (g("face_right_x") - g("face_left_x"))).clamp(min=0.6 * eye_dist)
        border_x = 1.0 - _smoothstep(0.82, 0.98, xs.abs())
        border_y = 1.0 - _smoothstep(0.82, 0.98, ys.abs())
        head_x = (1.0 - _smoothstep(1.25 * face_half, 2.2 * face_half, (xs - face_x).abs()))
        head_x = head_x * border_x
        top = g("forehead_y")
        head_y = _smoothstep(top - 1.2 * eye_chin, top - 0.4 * eye_chin, ys) * (
            1.0 - _smoothstep(cy + 0.1 * eye_chin, cy + 0.6 * eye_chin, ys)
        )
        head_y = head_y * border_y

        def moved(px: Tensor, py: Tensor) -> tuple[Tensor, Tensor]:
            """Where a face point ends up after the head motion (inside the plateau)."""
            return px + tx - roll * (py - pivot_y), py + ty + roll * (px - pivot_x)

        # Every later term is added to the same grid, so anchor it where the head put it.
        hmx, hmy = moved(mx, my)
        dmx, dmy = hmx - mx, hmy - my  # the mouth region's shift
        mx, my = hmx, hmy
        cy = cy + moved(g("chin_x"), g("chin_y"))[1] - g("chin_y")
        clx, cly = g("mouth_corner_left_x") + dmx, g("mouth_corner_left_y") + dmy
        crx, cry = g("mouth_corner_right_x") + dmx, g("mouth_corner_right_y") + dmy
        uo, ui = g("upper_lip_outer_y") + dmy, g("upper_lip_inner_y") + dmy
        li, lo = g("lower_lip_inner_y") + dmy, g("lower_lip_outer_y") + dmy
        nose_y = g("nose_y") + dmy
        iw = g("mouth_inner_half_width").clamp(min=0.5 * mw, max=mw)
        jaw_half = (0.5 * (g("jaw_right_x") - g("jaw_left_x"))).clamp(min=1.2 * mw)
        upper_t = (ui - uo).clamp(min=0.004)
        lower_t = (lo - li).clamp(min=0.004)
        elx2, ely2 = moved(elx, ely)
        erx2, ery2 = moved(erx, ery)

        # ---------------------------------------------------------------- lips, sideways
        # Per side, the lips scale about the mouth centre: smile and stretch pull a corner
        # out, pucker and funnel draw both in; fades out past the corner into the cheek.
        # Outward pulls reach into the cheeks; the inward draw stays on the lips, or the
        # face outline would follow it.
        inward = self.pucker_in * pucker + self.funnel_in * funnel + self.jaw_in * jaw
        out_l = self.stretch_out * stretch_l + self.smile_out * smile_l  # (B, 1)
        out_r = self.stretch_out * stretch_r + self.smile_out * smile_r
        dx = xs - mx  # (B, W)
        fade_cheek = 1.0 - _smoothstep(0.9 * mw, 1.9 * mw, dx.abs())
        lips_x = dx * fade_cheek * torch.where(dx < 0.0, out_l, out_r)
        band_y = 1.0 - _smoothstep(0.55 * mc, 1.25 * mc, (ys - my).abs())  # (B, H)
        purse_x = -inward * dx * (1.0 - _smoothstep(0.5 * mw, 1.6 * mw, dx.abs()))
        purse_y = 1.0 - _smoothstep(0.3 * mc, 0.8 * mc, (ys - my).abs())
        out_l = out_l - inward
        out_r = out_r - inward

        # Inner-lip half-widths per side once the corners moved: the lip opening's extent.
        wl = iw * (1.0 + out_l)
        wr = iw * (1.0 + out_r)
        u_mouth = dx / torch.where(dx < 0.0, wl, wr)  # (B, W)

        # ---------------------------------------------------------------- lip gap
        # The lips part about the lip line: the upper lip lifts by ``share`` of the gap, the
        # lower lip drops by the rest. jawOpen parts them in a lens between the inner
        # corners; mouthFunnel in a round opening; mouthClose keeps them together while
        # the jaw (and chin) still drop.
        # A portrait whose lips are already parted (teeth showing) opens at its bite line:
        # the upper lip and teeth stay, everything from the lower teeth down drops.
        g0 = (li - ui).clamp(min=0.0)
        parted = _smoothstep(0.04, 0.15, g0 / mw)  # (B, 1)
        share = self.upper_lip_share * (1.0 - parted)
        # The gap the jaw opens; the chin travels (1 - share) of it, the same on any face.
        drop = jaw * self.jaw_drop * mc * (1.0 - self.upper_lip_share * parted)
        gap_jaw = drop * (1.0 - close)
        gap_round = funnel * self.funnel_gap * mw
        gap = gap_jaw + gap_round  # at the centre column
        lens_jaw = _lens(u_mouth, 0.9)
        lens_round = _lens(dx / (self.funnel_width * mw * (1.0 + 0.3 * jaw)), 0.5)
        gap_x = (gap_jaw * lens_jaw + gap_round * lens_round) / gap.clamp(min=1e-4)  # (B, W)
        gap_x = gap_x.clamp(max=1.0)

        # The lips part at the bite line: in a smile the upper teeth fill most of the parted
        # lips, meeting the lower ones about 70% of the way down. The mouth interior follows
        # that line up toward the corners as the portrait's mouth bends (``split``); the
        # warp parts the lips along it straight, which the interior covers, because a bent
        # parting is not separable and cost the GPU 18% more per frame.
        bite = ui + (0.5 + 0.2 * parted) * g0
        bend = (0.5 * (cly + cry) - my) * ((xs - mx) / mw).square().clamp(max=1.0)  # (B, W)
        split = bite + bend
        ramp = _soft_clamp01((ys - bite) / gap.clamp(min=1e-4) + share, 0.12)
        lip_bottom = lo + (1.0 - share) * gap
        # The chin's travel ramps in below the lower lip over a band wide enough that its
        # slope stays under 0.6 where nothing else compensates it (beside the lips' lens,
        # or with the lips held shut): steeper, the skin there folds over into streaks.
        jaw_band = torch.maximum(0.4 * mc, 2.5 * (1.0 - share) * drop)
        to_jaw = _smoothstep(lip_bottom + 0.05 * mc, lip_bottom + 0.05 * mc + jaw_band, ys)
        lift = share * _smoothstep(my - 0.55 * mc, my, ys)  # (B, H)
        gap_y = gap * (1.0 - to_jaw) * (ramp - lift)

        # The jaw: from below the lower lip to the chin everything drops by the chin travel,
        # across the jaw's width; under the chin the neck compresses instead of tearing.
        below_chin = 1.0 - _smoothstep(cy, cy + 0.6 * mc + 2.0 * drop, ys)
        chin_y = (1.0 - share) * drop * to_jaw * below_chin
        chin_x = 1.0 - _smoothstep(0.25 * jaw_half, 1.5 * jaw_half, dx.abs())

        # mouthClose (and a pucker) also shuts a portrait that is already open: the lips
        # meet on the lip line.
        shut = (close + 0.7 * pucker).clamp(max=1.0) * g0 * 0.5
        shut_y = shut * torch.tanh((ys - my) / (0.25 * g0 + 0.004)) * (
            _smoothstep(nose_y, uo, ys) * (1.0 - _smoothstep(lo, cy, ys))
        )
        shut_x = _lens(dx / (1.1 * iw), 0.5)

        # ---------------------------------------------------------------- corners, vertical
        # Smile lifts a corner (and its cheek a little); stretch pulls it slightly down;
        # the jaw drags both corners down with it.
        corner_y = 0.5 * (cly + cry)
        bump_l = 1.0 - _smoothstep(0.0, 0.85 * mw, (xs - clx).abs())
        bump_r = 1.0 - _smoothstep(0.0, 0.85 * mw, (xs - crx).abs())
        down_l = (self.stretch_down * stretch_l - self.smile_up * smile_l) * mw
        down_r = (self.stretch_down * stretch_r - self.smile_up * smile_r) * mw
        jaw_down = self.jaw_corner_down * (1.0 - share) * drop * (1.0 - close)
        corner_x = bump_l * (down_l + jaw_down) + bump_r * (down_r + jaw_down)
        corner_band = 1.0 - _smoothstep(0.15 * mc, 0.75 * mc, (ys - corner_y).abs())

        # ---------------------------------------------------------------- lip volume
        # Pucker and funnel push the lips forward: seen from the front they grow taller
        # about the lip line. Press (per side) and rollLower thin them: the skin next to
        # the lip slides over it (sampling further out), fading out toward nose and chin.
        grow = self.pucker_grow * pucker + self.funnel_grow * funnel
        lip_half = 0.5 * (lo - uo).clamp(min=0.01)
        grow_y = (ys - my) * (1.0 - _smoothstep(lip_half, 2.2 * lip_half, (ys - my).abs()))
        grow_x = grow * _lens(dx / (1.15 * mw), 0.7)

        ui_now = ui - share * gap
        li_now = li + (1.0 - share) * gap
        thin_up_y = upper_t * ((ui_now - ys) / upper_t).clamp(0.0, 1.0) * _smoothstep(
            nose_y, uo - share * gap, ys
        )
        thin_lo_y = lower_t * ((ys - li_now) / lower_t).clamp(0.0, 1.0) * (
            1.0 - _smoothstep(lo + (1.0 - share) * gap, cy, ys)
        )
        side_r = _smoothstep(-0.35 * mw, 0.35 * mw, dx)
        press = press_l * (1.0 - side_r) + press_r * side_r  # (B, W)
        lip_extent = _lens(dx / (1.1 * mw), 0.5)
        thin_up_x = self.press_thin * press * lip_extent
        thin_lo_x = (self.press_thin * press + self.roll_thin * roll_lower) * lip_extent

        # ---------------------------------------------------------------- eyelids
        # A piecewise-linear vertical map per eye: when closed, the lid skin between the
        # crease and the lash line is stretched down to just above the lower lid, and the
        # eye itself is squeezed into a thin lash line under it; the brow stays put.
        def lid(ex: Tensor, ey: Tensor, side: str, amount: Tensor) -> tuple[Tensor, Tensor]:
            up = g(f"eye_{side}_upper_y") + (ey - g(f"eye_{side}_y"))
            low = g(f"eye_{side}_lower_y") + (ey - g(f"eye_{side}_y"))
            eh = (low - up).clamp(min=0.06 * eye_dist)
            half_w = g(f"eye_{side}_half_width").clamp(min=0.15 * eye_dist)
            crease, close_y, bottom = up - 1.6 * eh, low - 0.1 * eh, low + 0.45 * eh
            peak = close_y - (up - 0.2 * eh)
            prof_y = peak * (
                ((ys - crease) / (close_y - crease)).clamp(0.0, 1.0)
                - ((ys - close_y) / (bottom - close_y)).clamp(0.0, 1.0)
            )
            prof_x = amount * (1.0 - _smoothstep(1.15 * half_w, 1.6 * half_w, (xs - ex).abs()))
            return prof_x, prof_y

        lid_lx, lid_ly = lid(elx2, ely2, "left", blink_l)
        lid_rx, lid_ry = lid(erx2, ery2, "right", blink_r)

        # ---------------------------------------------------------------- the grid
        # grid = identity - sum_k a_k(y) b_k(x): one small MatMul per axis. Signs: a
        # positive term moves the content down/right (samples from above/left).
        batch = geometry.shape[0]
        ones_y = torch.ones_like(ys).expand(batch, -1)
        ones_x = torch.ones_like(xs).expand(batch, -1)
        a_x = torch.stack(
            [ones_y, head_y * (tx - roll * (ys - pivot_y)), band_y, purse_y], dim=2
        )
        b_x = torch.stack([xs.expand(batch, -1), -head_x, -lips_x, -purse_x], dim=1)
        a_y = torch.stack(
            [
                ys.expand(batch, -1),
                head_y,
                gap_y,
                chin_y,
                shut_y,
                corner_band,
                grow_y,
                thin_up_y,
                thin_lo_y,
                lid_ly,
                lid_ry,
            ],
            dim=2,
        )
        b_y = torch.stack(
            [
                ones_x,
                -head_x * (ty + roll * (xs - pivot_x)),
                -gap_x,
                -chin_x,
                shut_x,
                -corner_x,
                -grow_x,
                -thin_up_x,
                thin_lo_x,
                -lid_lx,
                -lid_rx,
            ],
            dim=1,
        )
        grid = torch.stack([a_x @ b_x, a_y @ b_y], dim=3)  # (B, H, W, 2)
        warped = F.grid_sample(
            portrait, grid, mode="bilinear", padding_mode="border", align_corners=False
        )

        # ---------------------------------------------------------------- mouth interior
        # Fills the new gap, its edges feathered over 3 px and faded in over the first 3 px
        # of opening (no dark line on a mouth that is almost shut). Throat and tongue take
        # the portrait's lip colour, darkened; a closed portrait shows its upper teeth under
        # the upper lip, and lower teeth above the lower lip when wide open, lit like its
        # skin; a parted one keeps its own teeth, which the warp moved.
        pixel = 2.0 / height
        gap_col = gap * gap_x  # (B, W)
        gap_half = (0.5 * gap_col).clamp(min=1e-4)
        centre_y = split + (0.5 - share) * gap_col
        v = (ys[:, :, None] - centre_y[:, None, :]) * (1.0 / gap_half)[:, None, :]  # (B, H, W)
        # Everything below is a linear ramp in v with per-column ends (cheaper than
        # smoothsteps at full resolution, and as smooth as a colour ramp needs).
        feather = (3.0 * pixel / gap_half).clamp(0.15, 1.0)  # (B, W)
        visible = _smoothstep(0.5 * pixel, 3.0 * pixel, gap_col) * _smoothstep(0.0, 0.25, gap_x)
        alpha = ((1.0 - v.abs()) * (1.0 / feather)[:, None, :]).clamp(0.0, 1.0) * (
            visible[:, None, :])

        lips, skin = self._colours(portrait, mx, uo, ui, li, lo, nose_y)  # (B, 3) each
        edge = 1.0 - _smoothstep(0.35, 0.95, u_mouth.abs())  # (B, W): the corners in shadow
        # Teeth: an upper band under the upper lip (fading over its last 45%), a dimmer
        # lower one above the lower lip once wide open; distances into the opening are
        # (1 + v) and (1 - v) times gap_half.
        upper_band = self.teeth_upper * mw  # (B, 1)
        lower_band = self.teeth_lower * mw
        up_scale = gap_half / (0.45 * upper_band)  # (B, W)
        upper = ((upper_band - gap_half) / (0.45 * upper_band))[:, None, :] - v * up_scale[
            :, None, :]
        low_scale = gap_half / (0.6 * lower_band)
        lower = ((lower_band - gap_half) / (0.6 * lower_band))[:, None, :] + v * low_scale[
            :, None, :]
        teeth_amt = ((1.0 - parted) * (1.0 - funnel) * (1.0 - 0.6 * pucker)
                     * _smoothstep(0.1, 0.35, jaw))  # (B, 1)
        teeth_x = (1.0 - _smoothstep(0.35, 0.75, u_mouth.abs())) * teeth_amt  # (B, W)
        wide = 0.6 * _smoothstep(0.45, 0.9, jaw)  # (B, 1)
        teeth = torch.maximum(upper.clamp(0.0, 1.0), lower.clamp(0.0, 1.0) * wide[:, :, None]
                              ) * teeth_x[:, None, :]  # (B, H, W)
        # Tongue low in the mouth; shadow under the upper lip and teeth, and in the corners.
        tongue = ((v + 0.1) * (1.0 / 0.95)).clamp(0.0, 1.0) * (
            0.75 * (1.0 - 0.7 * funnel) * edge)[:, None, :]
        shade = ((v + 1.0) * (0.3 / 1.3)).clamp(0.0, 0.3) + 0.7
        shade = shade * (0.5 + 0.5 * edge)[:, None, :]

        def per_channel(col: Tensor) -> Tensor:
            return col[:, :, None, None]  # (B, 3, 1, 1)

        deep = per_channel(0.3 * lips * self.cavity_tint)
        tongue_col = per_channel(0.6 * lips * self.cavity_tint)
        bright = (0.3 * skin.max(dim=1, keepdim=True).values + 0.66) * self.teeth_tint
        teeth_col = per_channel(0.75 * bright + 0.25 * (1.1 * skin).clamp(max=1.0))
        teeth_lit = (0.82 + 0.18 * edge)[:, None, None, :]  # (B, 1, 1, W)
        fill = (deep + (tongue_col - deep) * tongue[:, None]) * shade[:, None]
        fill = fill + (teeth_col * teeth_lit - fill) * teeth[:, None]
        return warped + (fill - warped) * alpha[:, None]

    def _colours(self, portrait: Tensor, mx: Tensor, uo: Tensor, ui: Tensor, li: Tensor,
                 lo: Tensor, nose_y: Tensor) -> tuple[Tensor, Tensor]:
        """The portrait's lip colour (mid upper and lower lip, a little either side of the
        centre) and skin colour (above the upper lip), (B, 3) each."""
        xs = mx + self.colour_offsets  # (B, 3)
        lip_pts = torch.cat([torch.stack([xs, (0.5 * (uo + ui)).expand_as(xs)], dim=2),
                             torch.stack([xs, (0.5 * (li + lo)).expand_as(xs)], dim=2)], dim=1)
        skin_y = (0.6 * nose_y + 0.4 * uo).expand_as(xs)
        skin_pts = torch.stack([xs, skin_y], dim=2)
        points = torch.cat([lip_pts, skin_pts], dim=1)[:, None]  # (B, 1, 9, 2)
        samples = F.grid_sample(portrait, points, mode="bilinear", padding_mode="border",
                                align_corners=False)[:, :, 0]  # (B, 3, 9)
        return samples[:, :, :6].mean(dim=2), samples[:, :, 6:].mean(dim=2)
