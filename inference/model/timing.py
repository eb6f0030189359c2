"""sonic-lite's frame timing, set once: export writes it into the manifest, training cuts
its windows by it, and the audio head centres its pooling kernel by it."""

from __future__ import annotations

from inference.engine import FeatureSpec, FrameTiming

#: 25 fps; a 16-mel-frame (160 ms) window per video frame, 4 frames (40 ms) of it ahead.
TIMING = FrameTiming(fps=25, features=FeatureSpec(), window_frames=16, lookahead_frames=4)
