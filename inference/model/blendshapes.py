"""The motion coefficients of sonic-lite, named after ARKit's blendshapes.

The audio head predicts the speech shapes; the idle model adds blinks and head pose;
the renderer makes each one do what its name says on any frontal portrait.
"""

from __future__ import annotations

#: Predicted from audio, each in [0, 1].
SPEECH: tuple[str, ...] = (
    "jawOpen",
    "mouthClose",
    "mouthFunnel",
    "mouthPucker",
    "mouthStretchLeft",
    "mouthStretchRight",
    "mouthSmileLeft",
    "mouthSmileRight",
    "mouthRollLower",
    "mouthPressLeft",
    "mouthPressRight",
)

#: From the session clock (and a little from speech): blinks in [0, 1], head angles in radians.
IDLE: tuple[str, ...] = ("eyeBlinkLeft", "eyeBlinkRight", "headPitch", "headYaw", "headRoll")

ALL: tuple[str, ...] = SPEECH + IDLE
