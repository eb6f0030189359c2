"""How open the avatar's mouth looks in received frames: the measure the end-to-end tests
and the barge-in benchmark share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

#: Luminance under which a pixel counts as the inside of the mouth: the cavity is shaded
#: from the lips' colour, darker than lips, skin and teeth.
CAVITY_LUMINANCE = 80


def mouth_box(geometry: Mapping[str, float], size: int) -> tuple[slice, slice]:
    """The middle of the lips and the opening between them (not the corners, in shadow
    even at rest), from an avatar's geometry at ``size``."""
    half = geometry["mouth_half_width"] * size / 2
    x = round((geometry["mouth_x"] + 1) * size / 2)
    y = round((geometry["mouth_y"] + 1) * size / 2)
    return (slice(int(y - 0.4 * half), int(y + 0.9 * half)),
            slice(int(x - 0.7 * half), int(x + 0.7 * half)))


def mouth_openness(frames: Sequence[np.ndarray], box: tuple[slice, slice]) -> np.ndarray:
    """Per frame, the share of the box that is cavity: 0.5% at rest on the default avatar,
    7% half open, 17% fully open at 256x256. Head sway moves the face but hardly changes
    it."""
    return np.array([(f[box].astype(np.float32).mean(axis=2) < CAVITY_LUMINANCE).mean()
                     for f in frames])
