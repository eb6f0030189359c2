"""Contact sheets of the mouth, up close: how the renderer opens, closes and shapes it.

Each row is one portrait; each column one mouth pose (at rest, half open, fully open, lips
pressed shut, rounded), cropped around the mouth of a 512x512 frame and enlarged 2x, so
teeth, lip edges and the inside of the mouth can be judged by eye.

    python -m inference.training.mouth_sheet --out docs/mouth.jpg [--image PORTRAIT ...]

Without ``--image`` the default avatar alone is drawn. The poses go through the renderer
the engine exports (``inference.model.renderer``), with the coefficients set directly.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2
import numpy as np
import torch

from inference.images import decode_image, load_default_avatar
from inference.model.blendshapes import ALL
from inference.model.renderer import Renderer
from inference.portrait import PreparedPortrait, prepare_portrait
from inference.training.visemes import PROTOTYPES, V

SIZE = 512
ZOOM = 2

#: Column title -> the pose's speech coefficients (the rest, head and blinks, stay 0).
POSES: dict[str, dict[str, float]] = {
    "rest": {},
    "half open": {"jawOpen": 0.5},
    "fully open": {"jawOpen": 1.0},
    "p b m": {},  # from the viseme prototype below
    "oo": {},
}
_FROM_VISEME = {"p b m": "PP", "oo": "OU"}


def pose_vector(name: str) -> np.ndarray:
    vector = np.zeros(len(ALL), np.float32)
    if name in _FROM_VISEME:
        prototype = PROTOTYPES[V[_FROM_VISEME[name]]]
        vector[: prototype.size] = prototype
    for key, value in POSES[name].items():
        vector[ALL.index(key)] = value
    return vector


def render_poses(portrait: PreparedPortrait, renderer: Renderer) -> list[np.ndarray]:
    """The portrait in every pose, as RGB frames."""
    names = list(POSES)
    image = torch.from_numpy(portrait.image).permute(2, 0, 1).float().div(255.0)
    batch = len(names)
    with torch.no_grad():
        frames = renderer(image[None].expand(batch, -1, -1, -1).contiguous(),
                          torch.from_numpy(portrait.geometry)[None].expand(batch, -1),
                          torch.from_numpy(np.stack([pose_vector(n) for n in names])))
    return list(frames.numpy())


def mouth_crop(frame: np.ndarray, portrait: PreparedPortrait) -> np.ndarray:
    """The mouth region (to below the chin's travel), enlarged ``ZOOM`` times."""
    from inference.engine import GEOMETRY_NAMES

    g = dict(zip(GEOMETRY_NAMES, portrait.geometry.tolist(), strict=True))
    side = frame.shape[0]

    def px(v: float) -> float:
        return (v + 1.0) * 0.5 * side

    cx, cy = px(g["mouth_x"]), px(g["mouth_y"])
    half_w = 1.7 * g["mouth_half_width"] * 0.5 * side
    top, bottom = cy - 0.8 * half_w, cy + 1.0 * half_w
    x0, x1 = int(max(0, cx - half_w)), int(min(side, cx + half_w))
    y0, y1 = int(max(0, top)), int(min(side, bottom))
    crop = frame[y0:y1, x0:x1]
    return cv2.resize(crop, (crop.shape[1] * ZOOM, crop.shape[0] * ZOOM),
                      interpolation=cv2.INTER_CUBIC)


def contact_sheet(portraits: list[PreparedPortrait]) -> np.ndarray:
    renderer = Renderer().eval()
    rows = []
    for portrait in portraits:
        cells = [mouth_crop(f, portrait) for f in render_poses(portrait, renderer)]
        height = max(c.shape[0] for c in cells)
        width = max(c.shape[1] for c in cells)
        cells = [cv2.copyMakeBorder(c, 0, height - c.shape[0], 0, width - c.shape[1],
                                    cv2.BORDER_CONSTANT, value=(0, 0, 0)) for c in cells]
        rows.append(np.concatenate([np.pad(c, ((4, 4), (4, 4), (0, 0))) for c in cells], 1))
    width = max(r.shape[1] for r in rows)
    rows = [np.pad(r, ((0, 0), (0, width - r.shape[1]), (0, 0))) for r in rows]
    cell_w = rows[0].shape[1] // len(POSES)
    header = np.zeros((34, width, 3), np.uint8)
    for i, name in enumerate(POSES):
        cv2.putText(header, name, (i * cell_w + 10, 24), cv2.FONT_HERSHEY_SIMPLEX, 0.7,
                    (230, 230, 230), 2, cv2.LINE_AA)
    return np.concatenate([header, *rows], 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/mouth.png"))
    parser.add_argument("--image", type=Path, action="append", default=[],
                        help="a portrait (repeatable); the default avatar comes first")
    args = parser.parse_args()
    images = [load_default_avatar()] + [decode_image(p.read_bytes()) for p in args.image]
    sheet = contact_sheet([prepare_portrait(image, size=SIZE) for image in images])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(args.out), cv2.cvtColor(sheet, cv2.COLOR_RGB2BGR))
    print(f"{args.out}: {sheet.shape[1]}x{sheet.shape[0]}")


if __name__ == "__main__":
    main()
