"""What a session costs against a 256x256 video session, in the server's cores and in its
worker's event loop: the unit every load figure and admission rule counts in, shared by
the media workers (what their sessions cost) and the front door (what one more would)."""

from __future__ import annotations

#: What a session costs against a 256x256 video session, in two resources: the server's
#: cores (its whole CPU, the encoder threads included) and its worker's event-loop thread
#: (peers, audio, features, the data channel; the encoder runs off it). Measured on the
#: H200 host (2026-12-02,
#: benchmarks/results/2026-12-02-steady-state-admission-defaults.md), 512 against 256 and
#: motion-only against 256 within one call: cores 1.70 and 0.52 in one call, 1.92 and 0.59
#: in another, so video grows with the side to the power 0.75 and a motion-only session (no
#: encoder, no video packets) costs 0.55 of one; on the loop 1.47 and 0.93 (the side to the
#: power 0.5, and 0.9: its audio, features and aiortc's SCTP, which is Python, all run
#: there).
VIDEO_CORES_EXPONENT = 0.75
VIDEO_LOOP_EXPONENT = 0.5
MOTION_CORES = 0.55
MOTION_LOOP = 0.9
#: Of a 256x256 session's cores, the share its worker's loop thread spends: the loop's
#: prior cost, before a worker has measured its own (0.045 of 0.076 on the H200 host).
LOOP_SHARE = 0.55


def session_cost(size: int, motion_only: bool = False, *, loop: bool = False) -> float:
    """One session's cost, a 256x256 video session being 1: in the server's cores, or with
    ``loop`` in its worker's event loop."""
    if motion_only:
        return MOTION_LOOP if loop else MOTION_CORES
    return (size / 256) ** (VIDEO_LOOP_EXPONENT if loop else VIDEO_CORES_EXPONENT)


def media_cost(sessions: dict[int, int], motion: dict[int, int], *, loop: bool = False
               ) -> float:
    """Sessions, video by frame side and motion-only, weighted by ``session_cost``."""
    return sum(n * session_cost(size, loop=loop) for size, n in sessions.items()) + \
        sum(n * session_cost(size, motion_only=True, loop=loop) for size, n in motion.items())
